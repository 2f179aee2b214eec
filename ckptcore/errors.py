"""One error hierarchy for everything ckptcore raises on purpose.

Every class derives from :class:`CheckpointError`, and where a caller would
naturally catch a builtin (``FileNotFoundError`` around a load, ``ValueError``
around bad input) the class derives from that builtin too, so existing
``except`` clauses keep working.
"""

from __future__ import annotations

import logging
import sys
import warnings

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointExistsError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "SchemaError",
    "UnsupportedCheckpointError",
    "UnsafeCheckpointError",
    "StorageError",
    "LockedError",
    "FencedError",
    "StepOrderError",
    "GroupError",
    "GroupTimeoutError",
    "RestoreError",
    "CaptureError",
    "MigrationError",
    "AdapterNotFoundError",
    "MigrationWarning",
    "CheckpointFallbackWarning",
    "LockTakeoverWarning",
    "UnappliedStateWarning",
]


class CheckpointError(Exception):
    """Base class of every error ckptcore raises deliberately."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint at the given location."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint (or another writer's) already occupies the location."""


class IncompleteCheckpointError(CheckpointError, OSError):
    """Data a manifest names is missing or shorter than declared (an interrupted or partial copy)."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """Bytes on storage do not match their recorded checksum.

    Attributes name the shard file, the tensor (if any) and both checksums so a
    caller can report exactly what is damaged.
    """

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None,
                 expected: int | None = None, actual: int | None = None):
        super().__init__(message)
        self.file = file
        self.tensor = tensor
        self.expected = expected
        self.actual = actual


class SchemaError(CheckpointError, ValueError):
    """A manifest or state tree is malformed, unsupported or inconsistent."""


class UnsupportedCheckpointError(SchemaError):
    """A checkpoint this install cannot read but that may well be intact: a newer format version,
    an unknown checksum algorithm, or a dtype whose package (``ml_dtypes``) lacks it here.

    Unlike other :class:`SchemaError` cases this is not damage: a manager never replaces or
    deletes such a checkpoint on its own.
    """


class StorageError(CheckpointError, OSError):
    """The storage backend failed (network, permissions, a missing bucket); names the URL.

    The backend's own exception (botocore, aiohttp, ...) is chained as ``__cause__``.
    """


class UnsafeCheckpointError(CheckpointError, ValueError):
    """A foreign file (e.g. a pickle) asks for something that could run code; it was refused."""


class LockedError(CheckpointError, BlockingIOError):
    """Another writer holds the lock on a checkpoint root."""


class FencedError(LockedError):
    """This writer's lease was taken over by a newer generation: what it commits from now on is
    ignored by every reader, and it must stop writing (docs/RELIABILITY.md, "Fencing")."""


class RestoreError(CheckpointError, ValueError):
    """A state does not fit the objects it is restored into (missing names, shape or dtype mismatch)."""


class CaptureError(CheckpointError, ValueError):
    """Framework objects are inconsistent and cannot be captured (e.g. an optimizer over foreign parameters)."""


class MigrationError(CheckpointError, ValueError):
    """A state cannot be converted to another framework's layout exactly."""


class AdapterNotFoundError(CheckpointError, LookupError):
    """No installed adapter handles the given framework objects."""


class StepOrderError(CheckpointError, ValueError):
    """``save(step)`` below the newest committed step of the root (a run restarted without
    ``restore()``, or another writer committed newer steps since this run restored)."""


class GroupError(CheckpointError, RuntimeError):
    """A process group failed during a distributed save or load (a peer's error, a broken engine)."""


class GroupTimeoutError(GroupError, TimeoutError):
    """A peer did not reach a collective of a distributed save or load in time (dead or hung)."""


class MigrationWarning(UserWarning):
    """A converted state continues the run, but not exactly; the message says how far off.

    A warning, not an error: it lives here so that ``import ckptcore`` need not load the
    migration package to offer it."""


class UnappliedStateWarning(UserWarning):
    """A restore left part of the saved training state unapplied (the data cursor, optimizer slots,
    accumulation buffers, the schedule...) because no target for it was given: the run would
    continue, but not where it stopped.  The message names the part and how to apply it; load with
    ``keys=[...]`` leaving that section out to skip it on purpose."""


class CheckpointFallbackWarning(UserWarning):
    """The newest checkpoint did not verify, and an older one (or its replica) was restored
    instead; or a damaged step restore() fell back over is being replaced by a save."""


class LockTakeoverWarning(UserWarning):
    """A writer lock or lease whose holder is gone (killed, preempted) was taken over."""


_log = logging.getLogger("ckptcore")


def warn_and_log(message: str, category: type[Warning], *, stacklevel: int,
                 logger: logging.Logger = _log) -> None:
    """Warn ``message`` and put it on the ``ckptcore`` log trail, so that it shows once.

    The log record is a WARNING when logging is set up to receive it (a handler on the
    ``ckptcore`` logger or an ancestor: a log file, pytest's ``caplog``); with logging not set
    up at all it is a DEBUG record, because Python's last-resort handler would print a WARNING
    one to stderr right beside the warning itself (the same message twice on the console).
    """
    logger.log(logging.WARNING if logger.hasHandlers() else logging.DEBUG, "%s", message)
    warnings.warn(message, category, stacklevel=stacklevel + 1)


def caller_level() -> int:
    """The ``stacklevel`` that makes a warning issued in the function calling this one point at
    the first frame outside ckptcore and its adapters: the user's ``save``/``restore``/``gc``
    line, or their framework's ``fit``, however deep in the library the warning arose.  (A
    helper that warns on its caller's behalf, like ``warn_unapplied``, takes one more.)"""
    frame, level = sys._getframe(2), 2
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("ckptcore"):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2

