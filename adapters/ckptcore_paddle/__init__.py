"""ckptcore adapter for PaddlePaddle (dynamic graph).

Importing this package does not import Paddle; it loads on the first call that needs it (and
``DataLoader`` and ``Checkpoint``, subclasses of Paddle classes, on first access), while :func:`import_paddle_files`,
:func:`export_paddle_files` and :class:`ResumableBatchSampler` never need it.  The registry finds
:data:`ADAPTER` through the ``ckptcore.adapters`` entry point (``paddle = "ckptcore_paddle:ADAPTER"``).

Example:
    >>> import ckptcore_paddle                                                # doctest: +SKIP
    >>> loader = ckptcore_paddle.DataLoader(dataset, cursor, num_workers=2)   # doctest: +SKIP
    >>> for x, y in loader: ...  # the cursor moves past each batch the loop receives  # doctest: +SKIP
    >>> model.fit(loader, epochs=3, callbacks=[ckptcore_paddle.Checkpoint("ckpts", cursor=loader)])  # doctest: +SKIP
    >>> state = ckptcore_paddle.capture(net, opt, cursor=cursor)              # doctest: +SKIP
    >>> ckptcore_paddle.restore(state, new_net, new_opt, cursor=cursor)       # doctest: +SKIP
    >>> state = ckptcore_paddle.import_paddle_files("m.pdparams", "m.pdopt")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptcore.adapter import PackageAdapter

if TYPE_CHECKING:  # pragma: no cover
    import os

    from ckptcore.state import RestoreReport, TrainingState

    from ._callback import Checkpoint
    from ._data import ResumableBatchSampler
    from ._loader import DataLoader

__all__ = ["ADAPTER", "capture", "restore", "import_paddle_files", "import_paddle_dcp",
           "export_paddle_files",
           "DataLoader", "ResumableBatchSampler", "Checkpoint", "process_group"]

# Public classes, imported on first access (Checkpoint subclasses a Paddle class).
_LAZY = {"DataLoader": "._loader", "ResumableBatchSampler": "._data", "Checkpoint": "._callback"}

# Classes this adapter handles, by (top-level package, class name) anywhere in the MRO.
_HANDLED = {"Layer", "DataParallel", "Model"}

# The framework objects capture and restore take besides model and optimizer (the contract's
# cursor, rng, copy and strict are flags); anything else passed through ADAPTER is a TypeError.
_CAPTURE_KEYWORDS = frozenset({"model", "optimizer", "cursor", "rng", "copy", "scheduler", "scaler", "step",
                               "accumulate_every", "accumulated"})
_RESTORE_KEYWORDS = frozenset({"model", "optimizer", "cursor", "strict", "rng", "scheduler", "scaler"})


def process_group(group: Any = None) -> Any:
    """The ranks of the current ``paddle.distributed`` job (or of its sub-group ``group``) as a
    ``ckptcore.ProcessGroup`` over the job's own collectives (see ``_group.py``); a group of one
    outside a job."""
    from ._group import process_group as _process_group
    return _process_group(group)


def capture(model: Any, optimizer: Any = None, *, cursor: Any = None, rng: bool = True, copy: bool = True,
            scheduler: Any = None, scaler: Any = None, step: int | None = None,
            accumulate_every: int | None = None, accumulated: int | None = None) -> TrainingState:
    """Snapshot a Paddle model, optimizer, scheduler, scaler, RNGs and cursor (see ``_capture.py``)."""
    from ._capture import capture as _capture
    return _capture(model, optimizer, cursor=cursor, rng=rng, copy=copy, scheduler=scheduler, scaler=scaler,
                    step=step, accumulate_every=accumulate_every, accumulated=accumulated)


def restore(state: TrainingState, model: Any, optimizer: Any = None, *, cursor: Any = None,
            strict: bool = True, rng: bool = True, scheduler: Any = None, scaler: Any = None,
            warn_data: bool = True) -> RestoreReport:
    """Put a captured state back into Paddle objects, bit for bit (see ``_capture.py``)."""
    from ._capture import restore as _restore
    return _restore(state, model, optimizer, cursor=cursor, strict=strict, rng=rng, scheduler=scheduler,
                    scaler=scaler, warn_data=warn_data)


def import_paddle_files(pdparams: str | os.PathLike, pdopt: str | os.PathLike | None = None) -> TrainingState:
    """Read ``paddle.save`` files without running code or importing Paddle (see ``_files.py``)."""
    from ._files import import_paddle_files as _import
    return _import(pdparams, pdopt)


def import_paddle_dcp(path: str | os.PathLike, *, unique_id: int | None = None,
                      model_key: str | None = None, optimizer_key: str | None = None) -> TrainingState:
    """Read a ``paddle.distributed.save_state_dict`` folder without running code or importing
    Paddle: every tensor assembled whole from the ranks' chunks (see ``_dcp.py``)."""
    from ._dcp import import_paddle_dcp as _import
    return _import(path, unique_id=unique_id, model_key=model_key, optimizer_key=optimizer_key)


def export_paddle_files(state: TrainingState, prefix: str | os.PathLike, *,
                        param_names: dict[str, str] | None = None) -> tuple[str, str | None]:
    """Write ``prefix.pdparams`` (and ``prefix.pdopt``) for ``paddle.load`` (see ``_files.py``)."""
    from ._files import export_paddle_files as _export
    return _export(state, prefix, param_names=param_names)


def _check_keywords(verb: str, objects: dict[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(set(objects) - known)
    if unknown:
        raise TypeError(f"ckptcore_paddle.{verb} does not take {', '.join(unknown)} "
                        f"(it takes {', '.join(sorted(known))})")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class PaddleAdapter(PackageAdapter):
    """The registry's view of this package (the :class:`ckptcore.adapter.Adapter` protocol)."""

    name = "paddle"
    capture_views = True  # capture(copy=False) returns views of the live tensors

    def handles(self, obj: object) -> bool:
        # Looks only at class and module names, so asking never imports Paddle.
        return any(cls.__name__ in _HANDLED and getattr(cls, "__module__", "").split(".")[0] == "paddle"
                   for cls in type(obj).__mro__)

    def capture(self, **objects: Any) -> TrainingState:
        _check_keywords("capture", objects, _CAPTURE_KEYWORDS)
        return capture(**objects)

    def restore(self, state: TrainingState, **objects: Any) -> RestoreReport:
        _check_keywords("restore", objects, _RESTORE_KEYWORDS)
        # load_state and the manager warn about a data position left unapplied themselves.
        return restore(state, warn_data=False, **objects)


ADAPTER = PaddleAdapter()
