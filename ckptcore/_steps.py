"""Which folders under a root are committed steps: the lowest layer of a root's layout.

A root (what :class:`~ckptcore.CheckpointManager` writes) holds ``step-000000000042/`` folders,
zero-padded so names sort in step order.  A step folder is a committed checkpoint when it has a
manifest that readers accept (``_fence``: not one committed by a writer after its lease was
taken over).  Everything that lists steps (the tiers, ``ckpt ls``, the manifest reader's hints)
asks here, so they agree on what a checkpoint is.  Nothing here reads tensor data or imports
the load path: :mod:`ckptcore.layout` and the tiers stand above it.
"""

from __future__ import annotations

from typing import Any

from . import _fence
from ._commit import TMP_MARK
from ._lock import LOCK_NAME
from ._manifest import MANIFEST_NAME
from ._storage import Store

STEP = _fence.STEP  # a step folder's name (fullmatch only: "$" would admit a trailing newline)


def step_name(step: int) -> str:
    """The folder name of checkpoint ``step`` under a root (``step-000000000042``)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return f"step-{step:012d}"


def committed_steps(root: Store, fence: Any = None) -> list[tuple[int, str]]:
    """``(step, folder name)`` of every committed step folder under ``root`` that readers
    accept, ascending.

    A step folder is committed when it has a manifest; a damaged manifest still counts (restore
    falls back over it).  A step committed by a writer after its lease was taken over is not
    accepted (``_fence``; logged, and gc removes it).  Manifests are read only for steps the
    newest writer record does not name, and a folder's manifest is asked for only when that
    record does not name its step (one listing in all: a run's thousands of steps cost no
    request each).  ``fence``: the caller's writer lock, whose own view of the root saves
    reading it.
    """
    found, v = _fence.listed(root, fence.view() if fence is not None else None)
    return _fence.split(root, found, v)[0]


def is_committed(root: Store, step: int) -> bool:
    """Whether ``step`` is a committed step under ``root`` that readers accept (as
    :func:`committed_steps`, for one step)."""
    name = step_name(step)
    if not root.exists() or not root.child(name).exists(MANIFEST_NAME):
        return False
    return bool(_fence.split(root, [(step, name)])[0])


def fenced_steps(root: Store) -> list[tuple[int, str]]:
    """Step folders committed by a writer after it was superseded: ignored by every reader."""
    found, v = _fence.listed(root)
    return _fence.split(root, found, v)[1]


def is_root(store: Store) -> bool:
    """Whether ``store`` looks like a manager's root: step folders, save leftovers or its lock."""
    return any(STEP.fullmatch(e.name) or TMP_MARK in e.name or e.name in (LOCK_NAME, _fence.GEN_DIR)
               for e in store.listdir())
