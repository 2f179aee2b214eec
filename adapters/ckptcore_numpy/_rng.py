"""The framework's RNG states: for NumPy, the global ``random`` and ``np.random`` states and the
``numpy.random.Generator`` objects a training loop names (``generators={"aug": gen}``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from ckptcore.rng import capture_rng, restore_rng

__all__ = ["capture_framework_rng", "restore_framework_rng", "plan_rng", "GENERATORS"]

GENERATORS = "numpy_generators"  # where ckptcore.capture_rng puts named generators


def capture_framework_rng(generators: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return capture_rng(python=True, numpy=True, generators=generators)


def restore_framework_rng(rng: Mapping[str, Any], generators: Mapping[str, Any] | None = None) -> None:
    restore_rng(rng, generators=generators)


def plan_rng(rng: Mapping[str, Any], generators: Mapping[str, Any] | None
             ) -> tuple[list[str], Callable[[], None]]:
    """The generators named but not saved, and the action restoring the rest."""
    saved = rng.get(GENERATORS) if isinstance(rng.get(GENERATORS), Mapping) else {}
    generators = dict(generators or {})
    missing = [name for name in generators if name not in saved]
    present = {k: v for k, v in generators.items() if k in saved}
    return missing, lambda: restore_framework_rng(rng, present)
