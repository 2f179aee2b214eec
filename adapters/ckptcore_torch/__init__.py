"""ckptcore adapter for PyTorch.

Importing this package does not import PyTorch; it loads on the first call that needs it (and
``DataLoader``, a subclass of ``torch.utils.data.DataLoader``, on first access), while
:func:`import_torch_files` and :func:`import_dcp` never need it.  The registry finds
:data:`ADAPTER` through the ``ckptcore.adapters`` entry point (``torch = "ckptcore_torch:ADAPTER"``).

Module map (the same as the other adapters'): ``_tensors`` (tensor <-> NumPy, names),
``_params`` (ParamInfo), ``_optimizer`` (optimizer, LR scheduler, GradScaler), ``_rng``,
``_capture`` (capture/restore), ``_data``/``_loader`` (the cursor's DataLoader), ``_group``
(``torch.distributed`` as a ProcessGroup), ``_sharding`` (DTensor/FSDP2 shards), ``_files``
(``torch.save`` files), ``_dcp`` (``torch.distributed.checkpoint`` folders), ``_dialect``
(migration), ``_demo``.

Example:
    >>> import ckptcore, ckptcore_torch                                      # doctest: +SKIP
    >>> loader = ckptcore_torch.DataLoader(dataset, cursor, num_workers=2)   # doctest: +SKIP
    >>> ckptcore.save_state("ckpts/step-100", model=net, optimizer=opt, scheduler=sched,
    ...                     cursor=cursor)                                   # doctest: +SKIP
    >>> state = ckptcore_torch.capture(net, opt, scheduler=sched, cursor=cursor)  # doctest: +SKIP
    >>> ckptcore_torch.restore(state, new_net, new_opt, scheduler=new_sched)      # doctest: +SKIP
    >>> state = ckptcore_torch.import_torch_files("model.pt")                # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptcore.adapter import PackageAdapter, check_keywords, lazy_attributes

if TYPE_CHECKING:  # pragma: no cover
    import os

    from ckptcore.state import RestoreReport, TrainingState

    from ._loader import DataLoader

__all__ = ["ADAPTER", "capture", "restore", "import_torch_files", "export_torch_files",
           "import_dcp", "export_dcp", "DataLoader", "Checkpoint", "process_group"]

# Public classes, imported on first access (DataLoader subclasses a torch class).
_LAZY = {"DataLoader": "._loader", "Checkpoint": "._callback"}

# The framework objects capture and restore take besides model and optimizer (the contract's
# cursor, rng, copy and strict are flags); anything else passed through ADAPTER is a TypeError.
_CAPTURE_KEYWORDS = frozenset({"model", "optimizer", "cursor", "rng", "copy", "scheduler",
                               "scaler", "step", "accumulate_every", "accumulated"})
_RESTORE_KEYWORDS = frozenset({"model", "optimizer", "cursor", "strict", "rng", "scheduler",
                               "scaler"})


def capture(model: Any, optimizer: Any = None, *, cursor: Any = None, rng: bool = True,
            copy: bool = True, scheduler: Any = None, scaler: Any = None, step: int | None = None,
            accumulate_every: int | None = None, accumulated: int | None = None) -> TrainingState:
    """Snapshot a PyTorch module, optimizer, LR scheduler, GradScaler, gradients in flight, RNGs
    and a data cursor (see ``_capture.py``)."""
    from ._capture import capture as _capture
    return _capture(model, optimizer, cursor=cursor, rng=rng, copy=copy, scheduler=scheduler,
                    scaler=scaler, step=step, accumulate_every=accumulate_every,
                    accumulated=accumulated)


def restore(state: TrainingState, model: Any, optimizer: Any = None, *, cursor: Any = None,
            strict: bool = True, rng: bool = True, scheduler: Any = None, scaler: Any = None,
            warn_data: bool = True) -> RestoreReport:
    """Put a captured state back into PyTorch objects, bit for bit, each tensor on the device of
    the live one (see ``_capture.py``)."""
    from ._capture import restore as _restore
    return _restore(state, model, optimizer, cursor=cursor, strict=strict, rng=rng,
                    scheduler=scheduler, scaler=scaler, warn_data=warn_data)


def process_group(group: Any = None) -> Any:
    """The ranks of the current ``torch.distributed`` job (or of its sub-group ``group``) as a
    ``ckptcore.ProcessGroup`` over the job's own collectives (see ``_group.py``); a group of one
    outside a job."""
    from ._group import process_group as _process_group
    return _process_group(group)


def import_torch_files(path: str | os.PathLike, optimizer_path: str | os.PathLike | None = None,
                       **options: Any) -> TrainingState:
    """Read ``torch.save`` files (zip or legacy) without running code or importing PyTorch (see
    ``_files.py``)."""
    from ._files import import_torch_files as _import
    return _import(path, optimizer_path, **options)


def export_torch_files(state: TrainingState, path: str | os.PathLike, **options: Any) -> Any:
    """Write a file ``torch.load(path, weights_only=True)`` accepts (see ``_export.py``)."""
    from ._export import export_torch_files as _export
    return _export(state, path, **options)


def import_dcp(path: str | os.PathLike, **options: Any) -> TrainingState:
    """Read a ``torch.distributed.checkpoint`` folder, its pickled ``.metadata`` through the
    restricted reader (see ``_dcp.py``)."""
    from ._dcp import import_dcp as _import
    return _import(path, **options)


def export_dcp(state: TrainingState, path: str | os.PathLike, **options: Any) -> Any:
    """Write a ``torch.distributed.checkpoint`` folder that ``dcp.load`` reads (see ``_dcp.py``)."""
    from ._dcp import export_dcp as _export
    return _export(state, path, **options)


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)


class TorchAdapter(PackageAdapter):
    """The registry's view of this package (the :class:`ckptcore.adapter.Adapter` protocol)."""

    name = "torch"
    capture_views = True  # capture(copy=False) returns views of the live CPU tensors

    def handles(self, obj: object) -> bool:
        # Looks only at class and module names, so asking never imports PyTorch: any
        # torch.nn.Module (DDP, FSDP and torch.compile wrappers included), but not a Keras
        # model on Keras' PyTorch backend (a Module too): ckptcore_keras handles those.
        mro = type(obj).__mro__
        return any(cls.__name__ == "Module" and getattr(cls, "__module__", "").startswith("torch.")
                   for cls in mro) and not any(
            getattr(cls, "__module__", "").split(".")[0] == "keras" for cls in mro)

    def capture(self, **objects: Any) -> TrainingState:
        check_keywords(__name__, "capture", objects, _CAPTURE_KEYWORDS)
        return capture(**objects)

    def restore(self, state: TrainingState, **objects: Any) -> RestoreReport:
        check_keywords(__name__, "restore", objects, _RESTORE_KEYWORDS)
        # load_state and the manager warn about a data position left unapplied themselves.
        return restore(state, warn_data=False, **objects)


ADAPTER = TorchAdapter()
