"""A checkpoint root's layout: which folders are committed steps, and removing save leftovers.

A root (what :class:`~ckptcore.CheckpointManager` writes) holds ``step-000000000042/`` folders,
zero-padded so names sort in step order.  A step folder is a committed checkpoint when it has a
manifest; anything else of ours under the root (temporary folders of a save, step folders without
a manifest, shards a committed manifest does not name) is a leftover for :func:`gc`.

The manager, ``ckpt ls`` and ``ckpt gc`` all read the layout through this module, so they agree on
what a checkpoint is.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Mapping

from . import _fence, _knobs, api
from ._commit import TMP_MARK
from ._lock import LOCK_NAME, WriterLock
from ._manifest import MANIFEST_NAME
from ._replica import check_structure
from ._storage import CAS_DIR, Entry, Store, check_url
from .errors import CheckpointError, CheckpointNotFoundError

__all__ = ["gc", "list_checkpoints", "CheckpointListing", "step_name"]

STEP = _fence.STEP  # a step folder's name (fullmatch only: "$" would admit a trailing newline)
log = logging.getLogger("ckptcore")


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
    accepted (``_fence``; logged, and :func:`gc` removes it).  Manifests are read only for steps
    the newest writer record does not name.  ``fence``: the caller's writer lock, whose own
    view of the root saves reading it.
    """
    known = fence.view() if fence is not None else None
    return _fence.split(root, _fence.step_folders(root), known)[0]


def is_committed(root: Store, step: int) -> bool:
    """Whether ``step`` is a committed step under ``root`` that readers accept (as
    :func:`committed_steps`, for one step)."""
    name = step_name(step)
    if not root.exists() or not root.child(name).exists(MANIFEST_NAME):
        return False
    return bool(_fence.split(root, [(step, name)])[0])


def fenced_steps(root: Store) -> list[tuple[int, str]]:
    """Step folders committed by a writer after it was superseded: ignored by every reader."""
    return _fence.split(root, _fence.step_folders(root))[1]


@dataclass(frozen=True)
class CheckpointListing:
    """One committed checkpoint under a root, as :func:`list_checkpoints` found it.

    Attributes:
        step: The step of the folder's name.
        name: The folder's name (``step-000000000042``).
        url: The checkpoint's URL.
        info: What its manifest says, or None when the manifest cannot be read (see ``problem``).
        problem: Why the manifest cannot be read (``"CorruptCheckpointError: ..."``), else None.
    """

    step: int
    name: str
    url: str
    info: api.CheckpointInfo | None = None
    problem: str | None = None


def list_checkpoints(root: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None
                     ) -> list[CheckpointListing]:
    """The committed checkpoints under ``root`` (a manager's root), ascending by step.

    Reads each manifest (never tensor data); a step whose manifest cannot be read is listed with
    ``info=None`` and the reason in ``problem``.  A root that does not exist has none.

    Example:
        >>> for c in ckptcore.list_checkpoints("memory://run1"):         # doctest: +SKIP
        ...     print(c.step, c.info.nbytes)
    """
    store = Store(os.fspath(root), dict(storage_options or {}))
    if not store.exists():
        return []
    out = []
    for step, name in committed_steps(store):
        url = store.child(name).url
        try:
            out.append(CheckpointListing(step, name, url,
                                         info=api.inspect(url, storage_options=storage_options)))
        except CheckpointError as e:
            out.append(CheckpointListing(step, name, url, problem=f"{type(e).__name__}: {e}"))
    return out


def is_root(store: Store) -> bool:
    """Whether ``store`` looks like a manager's root: step folders, save leftovers or its lock."""
    return any(STEP.fullmatch(e.name) or TMP_MARK in e.name or e.name in (LOCK_NAME, _fence.GEN_DIR)
               for e in store.listdir())


def check_grace(grace: float | None) -> float:
    """``grace`` in seconds (the configured default for None); ``ValueError`` below 0 or NaN."""
    grace = float(_knobs.get("gc_grace")) if grace is None else float(grace)
    if not grace >= 0:  # also NaN: a negative grace would take saves still being written
        raise ValueError(f"gc grace must be >= 0 seconds, got {grace}")
    return grace


def gc(root: str | os.PathLike, *, grace: float | None = None,
       storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Remove leftovers of interrupted saves under ``root`` untouched for ``grace`` seconds.

    Leftovers are temporary folders of a save, step folders without a manifest, and shard files a
    committed manifest does not name; in a backup root, also the chunks no committed replica
    names.  Committed checkpoints are never touched.  Takes the root's writer lock, so it is
    refused while a run writes there.  Returns the URLs removed.

    Example:
        >>> removed = ckptcore.gc("s3://runs/exp1", grace=3600)            # doctest: +SKIP

    Raises:
        CheckpointNotFoundError: (a ``FileNotFoundError``) ``root`` is not a checkpoint root (no step folders, leftovers or lock).
        LockedError: a writer holds the root.
        ValueError: ``grace`` is negative.
    """
    grace = check_grace(grace)
    store = Store(check_url(root, "root"), dict(storage_options or {}))
    if not store.exists() or not is_root(store):
        # A typo or a single checkpoint's folder: refuse before the lock file would be created.
        raise CheckpointNotFoundError(f"{store.url}: no checkpoint root here (no step-* folders "
                                      "or leftovers of saves)")
    lock = WriterLock(store)
    lock.acquire()
    try:
        return remove_leftovers(store, grace, lock)
    finally:
        lock.release()


def structure_problem(ckpt: Store) -> str:
    """Why the committed checkpoint ``ckpt`` would not restore, as far as its structure shows
    (its manifest does not decode or validate, a shard is missing or of another size); "" when
    it passes.  Reads the manifest and one listing, never tensor data: what retention asks of
    the step that supersedes the ones it deletes."""
    try:
        problems = check_structure(ckpt)[1]
    except (CheckpointError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    return f"{type(problems[0]).__name__}: {problems[0]}" if problems else ""


def remove_leftovers(root: Store, grace: float, fence: Any = None) -> list[str]:
    """The work of :func:`gc`, for a caller that holds ``root``'s writer lock (the manager;
    ``fence``: that lock, checked before chunks are swept)."""
    cutoff = time.time() - grace
    removed = []
    for step, name in fenced_steps(root):  # never accepted by any reader: not a checkpoint
        log.info("gc: removing step %d (%s), committed by a writer after its lease was taken "
                 "over", step, root.child(name).url)
        ckpt = root.child(name)
        ckpt.delete(MANIFEST_NAME)  # uncommit first
        ckpt.delete_tree()
        removed.append(ckpt.url)
    root.fs.invalidate_cache()  # a stale "no manifest" here would delete a committed step
    for e in root.listdir():
        if e.name in (LOCK_NAME, _fence.GEN_DIR):
            continue
        if e.is_link:  # never delete through a link, nor the link (it is not ours)
            log.warning("gc: skipping %s under %s, a symbolic link", e.name, root.url)
            continue
        child = root.child(e.name)
        if TMP_MARK in e.name or (STEP.fullmatch(e.name) and not child.exists(MANIFEST_NAME)):
            if _older(child, e, cutoff):
                log.info("gc: removing leftover %s", child.url)
                child.delete_tree()
                removed.append(child.url)
        elif STEP.fullmatch(e.name):
            removed += _gc_shards(child, cutoff)
        elif e.name == CAS_DIR and e.is_dir:  # a backup root: chunks no replica names any more
            from ._backup import sweep
            removed += sweep(root, grace, fence)
    return removed


def _older(store: Store, entry: Entry, cutoff: float) -> bool:
    """Whether ``entry`` (a leftover folder or file) was last touched before ``cutoff``."""
    times = [entry.mtime] if entry.mtime is not None else []
    if entry.is_dir:
        times += [e.mtime for e in store.listdir() if e.mtime is not None]
    return (max(times) if times else 0.0) <= cutoff


def _gc_shards(ckpt: Store, cutoff: float) -> list[str]:
    """Shards in a committed step folder that its manifest does not name (a losing writer's)."""
    try:
        named = {s.path for s in api.read_manifest(ckpt).shards}
    except CheckpointError:
        return []
    removed = []
    for e in ckpt.listdir():
        if e.name.startswith("shard-") and e.name not in named and (e.mtime or 0.0) <= cutoff \
                and not e.is_link:
            log.info("gc: removing unreferenced shard %s", ckpt.join(e.name))
            ckpt.delete(e.name)
            removed.append(ckpt.join(e.name))
    return removed
