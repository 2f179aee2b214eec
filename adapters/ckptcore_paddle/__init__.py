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

import logging
import sys
from typing import TYPE_CHECKING, Any

from ckptcore.adapter import PackageAdapter, check_keywords, lazy_attributes

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


# -- logging under Paddle ----------------------------------------------------------------------------
# Importing paddle gives the *root* logger a StreamHandler with Paddle's format and sets its level to
# INFO (paddle.distributed.utils.log_utils.get_logger(logging.INFO), name "root"), unless logging was
# set up before.  ckptcore's records propagate to the root, so they came out in Paddle's format,
# INFO ones included, and a warning that is also logged (ckptcore.adapter.warn_and_log) showed twice.
# Paddle's root handlers are given a filter that leaves the "ckptcore" records out, and the
# "ckptcore" logger (still propagating) a handler that prints them as Python does when logging is not
# set up (logging.lastResort: WARNING and above, the message alone, on stderr) whenever no handler
# but Paddle's would receive them.  A user's own handlers (basicConfig(force=True), a handler on
# "ckptcore" or the root) receive them as usual.

_PADDLE_FORMAT = "[%(asctime)-15s] [%(levelname)8s] %(filename)s:%(lineno)s - %(message)s"


def _is_ckptcore(record: logging.LogRecord) -> bool:
    return record.name == "ckptcore" or record.name.startswith("ckptcore.")


class _NotCkptcore(logging.Filter):
    """On Paddle's root handlers: ckptcore's records are not Paddle's to print."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _is_ckptcore(record)


def _is_paddles(handler: logging.Handler) -> bool:
    return any(isinstance(f, _NotCkptcore) for f in handler.filters)


class _AsIfUnconfigured(logging.Handler):
    """On the "ckptcore" logger: what Python would print if Paddle had not added a root handler."""

    def emit(self, record: logging.LogRecord) -> None:
        last = logging.lastResort
        if last is None or record.levelno < last.level or not _is_ckptcore(record):
            return
        if record.funcName == "warn_and_log" and record.module == "errors":  # ckptcore/errors.py
            return  # also a Python warning: without logging set up it is a DEBUG record (shown once)
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(h is not self and not _is_paddles(h) for h in logger.handlers):
                return  # someone set logging up: their handler has the record
            logger = logger.parent if logger.propagate else None
        last.handle(record)


def _shield_logging() -> None:
    """Keep Paddle's root handlers away from ckptcore's records (idempotent, cheap)."""
    if "paddle" not in sys.modules:
        return
    shielded = False
    for handler in list(logging.getLogger().handlers):
        formatter = handler.formatter
        if getattr(formatter, "_fmt", None) != _PADDLE_FORMAT:
            continue
        shielded = True
        if not _is_paddles(handler):
            handler.addFilter(_NotCkptcore())
    log = logging.getLogger("ckptcore")
    if shielded and not any(isinstance(h, _AsIfUnconfigured) for h in log.handlers):
        log.addHandler(_AsIfUnconfigured())


_shield_logging()  # paddle imported first (import paddle; import ckptcore_paddle)


def process_group(group: Any = None) -> Any:
    """The ranks of the current ``paddle.distributed`` job (or of its sub-group ``group``) as a
    ``ckptcore.ProcessGroup`` over the job's own collectives (see ``_group.py``); a group of one
    outside a job."""
    from ._group import process_group as _process_group
    try:
        return _process_group(group)
    finally:
        _shield_logging()


def capture(model: Any, optimizer: Any = None, *, cursor: Any = None, rng: bool = True, copy: bool = True,
            scheduler: Any = None, scaler: Any = None, step: int | None = None,
            accumulate_every: int | None = None, accumulated: int | None = None) -> TrainingState:
    """Snapshot a Paddle model, optimizer, scheduler, scaler, RNGs and cursor (see ``_capture.py``)."""
    from ._capture import capture as _capture
    _shield_logging()
    return _capture(model, optimizer, cursor=cursor, rng=rng, copy=copy, scheduler=scheduler, scaler=scaler,
                    step=step, accumulate_every=accumulate_every, accumulated=accumulated)


def restore(state: TrainingState, model: Any, optimizer: Any = None, *, cursor: Any = None,
            strict: bool = True, rng: bool = True, scheduler: Any = None, scaler: Any = None,
            warn_data: bool = True) -> RestoreReport:
    """Put a captured state back into Paddle objects, bit for bit (see ``_capture.py``)."""
    from ._capture import restore as _restore
    _shield_logging()
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


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, after=_shield_logging)


class PaddleAdapter(PackageAdapter):
    """The registry's view of this package (the :class:`ckptcore.adapter.Adapter` protocol)."""

    name = "paddle"
    capture_views = True  # capture(copy=False) returns views of the live tensors
    checks_values = True  # restore verifies each copied value as it copies it (_tensors.Copies)

    def handles(self, obj: object) -> bool:
        # Looks only at class and module names, so asking never imports Paddle.
        return any(cls.__name__ in _HANDLED and getattr(cls, "__module__", "").split(".")[0] == "paddle"
                   for cls in type(obj).__mro__)

    def capture(self, **objects: Any) -> TrainingState:
        check_keywords(__name__, "capture", objects, _CAPTURE_KEYWORDS)
        return capture(**objects)

    def restore(self, state: TrainingState, **objects: Any) -> RestoreReport:
        check_keywords(__name__, "restore", objects, _RESTORE_KEYWORDS)
        # load_state and the manager warn about a data position left unapplied themselves.
        return restore(state, warn_data=False, **objects)


ADAPTER = PaddleAdapter()
