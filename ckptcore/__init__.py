"""ckptcore: framework-agnostic training-state checkpoints.

One schema for the whole training state, a pickle-free checksummed format and
an atomic commit that works the same on local disk and in buckets.
"""

from __future__ import annotations

from ._version import __version__

from . import errors, events, lineage, metrics, report
from .api import CheckpointInfo, TensorInfo, convert, inspect, load_state, save_state, verify
from .errors import (AdapterNotFoundError, CaptureError, CheckpointError, CheckpointExistsError,
                     CheckpointFallbackWarning, CheckpointNotFoundError, CorruptCheckpointError, FencedError, GroupError,
                     GroupTimeoutError, IncompleteCheckpointError, LockedError, LockTakeoverWarning,
                     MigrationError,
                     MigrationWarning, RestoreError, SchemaError, StepOrderError, StorageError,
                     UnappliedStateWarning, UnsafeCheckpointError, UnsupportedCheckpointError)
from .group import ProcessGroup, SingleProcessGroup, ThreadGroup
from .sharding import Chunks, Shard
from .cursor import DataCursor
from .events import BackupEvent, Event, RestoreEvent, SaveEvent, on_event
from ._diff import CheckpointDiff, TensorDiff, diff
from ._scrub import ScrubReport, scrub
from .layout import CheckpointListing, gc, list_checkpoints
from ._runlog import run_log
from .manager import CheckpointManager, SaveHandle
from .options import Backup, Lease
from .policies import KeepAll, KeepAny, KeepBest, KeepEvery, KeepEveryDuration, KeepLast
from .rng import capture_rng, restore_rng
from .state import (AccumulationState, OptimizerState, ParamInfo, RestoreReport, ScheduleState,
                    TrainingState)

__all__ = [
    "__version__",
    "errors", "events", "lineage", "metrics", "report",
    "save_state", "load_state", "inspect", "verify", "convert", "MigrationWarning",
    "CheckpointInfo", "TensorInfo",
    "CheckpointManager", "SaveHandle", "Backup", "Lease", "CheckpointFallbackWarning",
    "LockTakeoverWarning",
    "gc", "list_checkpoints", "CheckpointListing", "run_log", "diff", "CheckpointDiff", "TensorDiff",
    "scrub", "ScrubReport",
    "KeepLast", "KeepEvery", "KeepBest", "KeepEveryDuration", "KeepAll", "KeepAny",
    "DataCursor", "capture_rng", "restore_rng",
    "on_event", "Event", "SaveEvent", "RestoreEvent", "BackupEvent",
    "TrainingState", "OptimizerState", "ScheduleState", "AccumulationState", "ParamInfo",
    "RestoreReport", "Shard", "Chunks", "ProcessGroup", "SingleProcessGroup", "ThreadGroup",
    "CheckpointError", "CheckpointNotFoundError", "CheckpointExistsError",
    "IncompleteCheckpointError", "CorruptCheckpointError", "SchemaError", "UnsafeCheckpointError",
    "LockedError", "FencedError", "StepOrderError", "MigrationError", "UnappliedStateWarning", "GroupError", "GroupTimeoutError",
    "StorageError", "RestoreError", "CaptureError", "AdapterNotFoundError",
    "UnsupportedCheckpointError",
]
