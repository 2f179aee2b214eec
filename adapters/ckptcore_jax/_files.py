"""Native checkpoint files of JAX: Orbax (``StandardCheckpointer``/``CheckpointManager`` steps,
OCDBT and zarr3).  Not built yet (issue 26, point 3): :data:`FORMATS` is empty, so ``ckpt
import``/``ckpt export`` offer nothing for JAX, and the functions raise
:class:`~ckptcore_jax.NotYetImplementedError`."""

from __future__ import annotations

from typing import Any

__all__ = ["FORMATS", "import_orbax", "export_orbax"]

FORMATS: tuple[Any, ...] = ()


def _not_yet(what: str) -> Exception:
    from ckptcore_jax import NotYetImplementedError

    return NotYetImplementedError(
        f"ckptcore_jax.{what} is not implemented yet (issue 26, point 3: Orbax interop); "
        "meanwhile restore the Orbax checkpoint with Orbax into live objects and capture those "
        "with ckptcore_jax.capture")


def import_orbax(path: Any, **options: Any) -> Any:
    raise _not_yet("import_orbax")


def export_orbax(state: Any, path: Any, **options: Any) -> Any:
    raise _not_yet("export_orbax")
