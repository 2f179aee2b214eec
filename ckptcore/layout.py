"""A checkpoint root's layout: which folders are committed steps, and removing save leftovers.

A root (what :class:`~ckptcore.CheckpointManager` writes) holds ``step-000000000042/`` folders,
zero-padded so names sort in step order.  A step folder is a committed checkpoint when it has a
manifest; anything else of ours under the root (temporary folders of a save, step folders without
a manifest, shards a committed manifest does not name) is a leftover for :func:`gc`.

What a committed step is comes from ``_steps`` (below the load path); this module adds what
users call: :func:`list_checkpoints` and :func:`gc`.  The tiers of a manager (``_tier``) and the
``ckpt`` commands use these same functions on their roots, so there is one listing and one gc.
"""

from __future__ import annotations

import contextvars
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping

from . import _fence, _knobs
from ._cas import sweep
from ._commit import TMP_MARK, is_shard_file, remove_uncommitted, shard_files
from ._lock import LOCK_NAME, WriterLock
from ._manifest import MANIFEST_NAME
from ._read import CheckpointInfo, inspect, read_manifest
from ._replica import check_structure
from ._steps import STEP, committed_steps, fenced_steps, is_committed, is_root, step_name
from ._storage import CAS_DIR, Entry, Store, check_url
from .errors import CheckpointError, CheckpointNotFoundError

__all__ = ["gc", "list_checkpoints", "CheckpointListing", "recorded_backups", "step_name", "committed_steps",
           "is_committed", "fenced_steps", "is_root", "STEP"]

log = logging.getLogger("ckptcore")


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
    info: CheckpointInfo | None = None
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
    steps = committed_steps(store)

    def one(item: tuple[int, str]) -> CheckpointListing:
        step, name = item
        url = store.child(name).url
        try:
            return CheckpointListing(step, name, url,
                                     info=inspect(url, storage_options=storage_options))
        except CheckpointError as e:
            return CheckpointListing(step, name, url, problem=f"{type(e).__name__}: {e}")

    # Why a pool on an object store: each manifest is one GET of tens of milliseconds, so a
    # bucket of 1,000 steps took 1,000 round trips in a row (``ckpt ls``, ``ckpt log``,
    # ``ckpt report``); as many at once as a save's uploads.  Local reads stay in order here.
    workers = 1 if store.local else min(_knobs.remote_concurrency(), len(steps))
    if workers <= 1:
        return [one(item) for item in steps]
    ctx = contextvars.copy_context()
    with ThreadPoolExecutor(workers, thread_name_prefix="ckptcore-list") as pool:
        return list(pool.map(lambda item: ctx.copy().run(one, item), steps))


def recorded_backups(root: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None
                     ) -> list[str]:
    """The backup roots the newest writer of ``root`` named (a ``CheckpointManager`` with
    ``backup=`` records their URLs, never their storage options); ``[]`` when none did.  The
    URLs come from the root, so treat them as its data: ``ckpt ls``/``log``/``report`` only
    name them unless asked (``--backup recorded``)."""
    return _fence.recorded_backups(Store(os.fspath(root), dict(storage_options or {})))


def check_grace(grace: float | None) -> float:
    """``grace`` in seconds (the configured default for None); ``ValueError`` below 0 or NaN."""
    grace = _knobs.gc_grace() if grace is None else float(grace)
    if not grace >= 0:  # also NaN: a negative grace would take saves still being written
        raise ValueError(f"gc grace must be >= 0 seconds, got {grace}")
    return grace


def gc(root: str | os.PathLike, *, grace: float | None = None,
       storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Remove leftovers of interrupted saves under ``root`` untouched for ``grace`` seconds.

    Leftovers are temporary folders of a save, step folders without a manifest, and shard files a
    committed manifest does not name; in a backup root, also the blobs no committed replica
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
    ``fence``: that lock, asked before every deletion).

    On an object store gc may be paused past its lease (a stopped process) while another writer
    takes the root over and commits a step whose folder gc judged a leftover: each folder is
    listed first and only the objects listed go, each right after the fence is asked and the
    folder is checked still to have no manifest (``_commit.remove_uncommitted``); a fenced step
    is checked still fenced before its manifest goes.  Every deletion is logged."""
    cutoff = time.time() - grace
    removed = []
    for step, name in fenced_steps(root):  # never accepted by any reader: not a checkpoint
        if _remove_fenced(root, step, name, fence):
            removed.append(root.child(name).url)
    root.fs.invalidate_cache()  # a stale "no manifest" here would delete a committed step
    for e in root.listdir():
        if e.name in (LOCK_NAME, _fence.GEN_DIR):
            continue
        if e.is_link:  # never delete through a link, nor the link (it is not ours)
            log.warning("gc: skipping %s under %s, a symbolic link", e.name, root.url)
            continue
        child = root.child(e.name)
        if TMP_MARK in e.name or (STEP.fullmatch(e.name) and not child.exists(MANIFEST_NAME)):
            # (listed once: what is judged old is what may be deleted, and nothing else)
            listed = None if child.local else child.find()
            if not _older(child, e, cutoff, listed):
                log.info("gc: keeping %s: touched within the last %s s (a save may be writing "
                         "it)", child.url, grace)
                continue
            log.info("gc: removing leftover %s (no manifest; untouched for %s s)", child.url,
                     grace)
            m = STEP.fullmatch(e.name)
            if m and fence is not None:  # a manifest removed by hand: the record may name it
                fence.forget(int(m.group(1)))
            if remove_uncommitted(child, fence=fence, why="gc", listed=listed):
                removed.append(child.url)
        elif STEP.fullmatch(e.name):
            removed += _gc_shards(child, cutoff, fence)
        elif e.name == CAS_DIR and e.is_dir:  # a backup root: blobs no replica names any more
            removed += sweep(root, grace, fence)
    return removed


def _remove_fenced(root: Store, step: int, name: str, fence: Any) -> bool:
    """Remove the step ``name``, committed by a writer after its lease was taken over, unless
    it is no longer that (a writer that took the root over from this gc while it was paused
    removed it and committed the step again: left alone, logged); whether it was removed."""
    ckpt = root.child(name)
    listed = None if ckpt.local else ckpt.find()  # before the fence: none of a later taker's
    if fence is not None:
        fence.before_delete()
    if not ckpt.exists(MANIFEST_NAME) or not _fence.split(root, [(step, name)])[1]:
        log.warning("gc: not removing step %d (%s): it is no longer a commit of a superseded "
                    "writer (removed, or committed again meanwhile)", step, ckpt.url)
        return False
    log.info("gc: removing step %d (%s), committed by a writer after its lease was taken "
             "over", step, ckpt.url)
    ckpt.delete(MANIFEST_NAME)  # uncommit first
    return remove_uncommitted(ckpt, fence=fence, why=f"gc: fenced step {step}", listed=listed)


def _older(store: Store, entry: Entry, cutoff: float, listed: list[Entry] | None = None) -> bool:
    """Whether ``entry`` (a leftover folder or file) was last touched before ``cutoff``;
    ``listed``: every object in it (an object store's listing), which decides alone."""
    if listed is not None:
        return max((e.mtime for e in listed if e.mtime is not None), default=0.0) <= cutoff
    times = [entry.mtime] if entry.mtime is not None else []
    if entry.is_dir:
        inner = store.listdir()
        times += [e.mtime for e in inner if e.mtime is not None]
        if any(e.is_dir for e in inner):
            # Shard folders of a large group's save (3f/shard-...): an object store gives its
            # "folders" no time, so a save still writing into them would look old.
            times += [e.mtime for e in store.find() if e.mtime is not None]
    return (max(times) if times else 0.0) <= cutoff


def _gc_shards(ckpt: Store, cutoff: float, fence: Any = None) -> list[str]:
    """Shards in a committed step folder that its manifest does not name (a losing writer's),
    listed before the fence is asked (before each deletion): a taker's later shards are not
    among them."""
    try:
        named = set(read_manifest(ckpt).files())  # shards and a rows object
    except CheckpointError:
        return []
    removed = []
    for e in shard_files(ckpt):  # nested ones too (3f/shard-...)
        if is_shard_file(e.name) and e.name not in named and (e.mtime or 0.0) <= cutoff \
                and not e.is_link:
            if fence is not None:
                fence.before_delete()
            log.info("gc: removing unreferenced shard %s", ckpt.join(e.name))
            ckpt.delete(e.name)
            removed.append(ckpt.join(e.name))
    return removed
