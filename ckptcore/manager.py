"""CheckpointManager: a run's checkpoints over tiers, with retention, async saves and fallback.

The manager coordinates; the rooms it coordinates live elsewhere:

* its tiers (``_tier.Tier``): the local root, where saves land, and each backup
  (``_backup.BackupTier``: replication in a background thread) with the same listing,
  retention and manifest-first deletion;
* ``_restore.Restorer``: which step from which tier, and the fallback over damaged ones;
* ``_preempt``: the SIGTERM handler behind :meth:`save_if_preempted`;
* ``api``: the save and load of one checkpoint, and ``_dist`` the agreement of a group's ranks.

Async saves: ``save()`` takes a consistent in-memory snapshot and a single background thread
writes and commits it.  At most one save is in flight: a second ``save()`` first waits for the
previous one.  A failure in the background is raised by the next ``save()``, ``wait()`` or
``close()``; interpreter exit waits for the save in flight, and a killed process leaves the
previous checkpoint intact.

Order of steps: ``save()`` below the newest committed step raises (a run restarted without
restoring would otherwise be shadowed by the old run's newer steps); :meth:`rewind` deletes the
newer steps on purpose.  A step this manager already saved in this run is replaced (a periodic
save and a final save of the same step), never a step committed by another run.
"""

from __future__ import annotations

import atexit
import logging
import threading
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, Sequence

from . import _dist, _preempt, api, layout
from ._backup import BackupTier
from ._lock import WriterLock, _caller_level
from ._manifest import MANIFEST_NAME
from ._replica import copy_checkpoint
from ._restore import Restorer, is_damage
from ._staging import Staging
from ._steps import STEP, step_name
from ._storage import Store, check_url
from ._tier import Tier
from .errors import (CheckpointError, CheckpointExistsError, CheckpointFallbackWarning,
                     CheckpointNotFoundError, FencedError, StepOrderError)
from .group import ProcessGroup
from .options import Backup, Lease, resolve
from .policies import as_policy, check_metrics
from .state import TrainingState

__all__ = ["CheckpointManager", "SaveHandle"]

_live: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()
log = logging.getLogger("ckptcore")


class SaveHandle:
    """The future of one save: ``result()`` blocks until it is committed and returns its info."""

    def __init__(self, step: int, url: str, future: Future):
        self.step, self.url, self._future = step, url, future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> api.CheckpointInfo:
        return self._future.result(timeout)

    wait = result

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, done={self.done()})"


def _completed(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class CheckpointManager:
    """Checkpoints of one run under ``root`` (a folder or bucket prefix), and its backups.

    Args:
        root: Any fsspec URL: the local tier, where saves land.
        keep: Retention: a policy (``KeepLast(3) | KeepBest("loss")``), an int n
            (``KeepLast(n)``), a list of policies (kept if any keeps it), or None to keep all.
            The newest committed checkpoint is always kept.
        async_save: Write in a background thread after snapshotting the state.
        storage_options: Passed to fsspec for ``root``.
        lock: Hold a writer lock on each tier while writing there (recommended).  On object
            stores the lock is a lease (``lease``) taken over when not renewed, or at once when
            its holder's process on this machine is gone (docs/RELIABILITY.md, "The writer
            lock").  ``"lazy"`` (the default): the lock is taken at the first write, where a
            live holder raises ``LockedError``.  ``True``: the constructor checks first, without
            taking the lock, that no live writer holds the root (a holder whose process is gone,
            or a closed or dropped manager of this process, does not count).  ``False``: no
            lock (readers, tools).
        lease: A :class:`ckptcore.Lease` (how long an unrenewed lease stays valid, how often it
            is renewed), for every tier's lock.
        save_on_preemption: Catch SIGTERM (main thread only; the previous handler is chained,
            and put back by ``close()``), so that :meth:`save_if_preempted` saves the current
            step before the machine goes away.
        group: A :class:`ckptcore.ProcessGroup` (``ckptcore_paddle.process_group()``,
            ``ckptcore_keras.process_group(strategy)``): every rank makes a manager on the same
            root with its group and calls the same ``save``; each writes its share, rank 0
            commits, holds the writer lock, applies retention and replicates.
        backup: One or more backup tiers, each a :class:`ckptcore.Backup` (or a URL: a
            ``Backup`` with its defaults).  Each committed step is replicated to every backup in
            the background, with the same commit protocol (docs/RELIABILITY.md, "Backup
            tiers"); ``save()`` does not wait, ``wait()`` and ``close()`` do and raise what
            failed.  ``restore()`` takes the newest step that verifies in any tier, local first.
            The constructor checks once that each backup answers (within 10 s): when one does
            not, a run starting afresh raises ``StorageError`` naming it, while a resumed run
            goes on locally.

    The keywords ``lease_seconds``, ``heartbeat_seconds``, ``backup_keep``,
    ``backup_storage_options``, ``backup_dedup`` and ``keep_unreplicated`` of earlier releases
    still work, with a ``DeprecationWarning`` naming the new spelling.

    Example:
        >>> mgr = ckptcore.CheckpointManager("memory://run1", keep=3)  # doctest: +SKIP
        >>> mgr.save(100, state).result()                              # doctest: +SKIP
        >>> state = mgr.restore()                                      # doctest: +SKIP
    """

    def __init__(self, root: str, *, keep: Any = None, async_save: bool = False,
                 storage_options: Mapping[str, Any] | None = None, lock: bool | str = "lazy",
                 lease: Lease | None = None, save_on_preemption: bool = True,
                 group: ProcessGroup | None = None,
                 backup: str | Backup | Sequence[str | Backup] | None = None, **deprecated: Any):
        if lock not in (True, False, "lazy"):
            raise ValueError(f"lock must be True, False or 'lazy', got {lock!r}")
        specs, lease = resolve(backup, lease, deprecated)
        self.root = Store(check_url(root, "root"), dict(storage_options or {}))
        self.policy = as_policy(keep)
        self.async_save = async_save
        # With a group every rank saves its share of each step (save_state(group=)); only the
        # coordinator (rank 0) holds the writer lock, applies retention and replicates.
        self.group = group
        self._coordinator = group is None or int(group.rank) == 0
        self._lock = (WriterLock(self.root, lease_seconds=lease.seconds,
                                 heartbeat_seconds=lease.heartbeat)
                      if lock and self._coordinator else None)
        self.local = Tier(self.root, storage_options, lock=self._lock)
        self.backups = [BackupTier(self.root, s, lock=bool(lock), lease=lease) for s in specs]
        _check_distinct(self.backups)
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: Future | None = None
        self._error: BaseException | None = None
        self._staging = Staging()
        # Steps a successful restore() fell back over because their data failed its checksums or
        # was missing.  A frozenset, swapped whole: the background save thread reads it.
        self._skipped: frozenset[int] = frozenset()
        # Every step the last successful restore() fell back over (damaged or unreadable here):
        # none of them counts as "the newest step" a save may not go below.
        self._fell_back: frozenset[int] = frozenset()
        self._saved: set[int] = set()  # steps this manager committed: a second save replaces them
        self._closed = False
        local_steps: list[int] = []
        if lock is True or self.backups:  # before anything is installed: may raise
            # With a group, rank 0 checks and every rank gets its verdict at once (the others
            # would otherwise wait out the group timeout in the first save).
            local_steps = self._on_coordinator(lambda: self._check_at_start(lock is True))
        _live.add(self)
        self._watch = _preempt.watch(self) if save_on_preemption else None
        # A run that died before replicating: finish it now (rank 0 only: the group's root is
        # shared, it sees every rank's files).
        for b in self.backups if self._coordinator else []:
            b.resume(local_steps)

    @property
    def backup(self) -> BackupTier | None:
        """The first backup tier (None without one); :attr:`backups` holds them all."""
        return self.backups[0] if self.backups else None

    @property
    def tiers(self) -> list[Tier]:
        """Every tier, local first: where ``restore()`` looks, in that order."""
        return [self.local] + [b.tier for b in self.backups]

    def _check_at_start(self, lock: bool) -> list[int]:
        """The checks at construction: a root another live writer holds (``lock=True``, without
        taking the lock) and backups that do not answer.  Returns the local steps."""
        if lock and self._lock is not None:
            self._lock.check_free()
        local_steps = self.local.steps(missing_ok=True) if self.backups else []
        for b in self.backups:
            b.check_reachable(local_steps)
        return local_steps

    def _on_coordinator(self, work: Any) -> Any:
        """``work()`` here, or with a group on rank 0 only (it holds the writer lock), every rank
        returning its result or raising its error: one act of the job, not one per rank."""
        if self.group is None:
            return work()
        return _dist.decide(self.root, self.group, work)

    # -- listing --------------------------------------------------------------------------------
    def step_url(self, step: int) -> str:
        return self.local.step_url(step)

    def steps(self) -> list[int]:
        """Committed steps of the local tier, ascending: the steps of
        :func:`ckptcore.list_checkpoints` on this root, without reading their manifests."""
        return self.local.steps()

    def latest_step(self) -> int | None:
        """The newest committed step in any tier (what ``restore()`` starts from)."""
        steps = set(self.local.steps(missing_ok=True))
        for b in self.backups:
            try:
                steps |= set(b.steps())
            except (CheckpointError, OSError) as e:  # the bucket out of reach: the others
                log.warning("latest_step: the backup %s cannot be listed (%s); the other tiers "
                            "only", b.root.url, e)
        return max(steps) if steps else None

    # -- saving ---------------------------------------------------------------------------------
    def save(self, step: int, state: TrainingState | None = None, *,
             metrics: Mapping[str, float] | None = None, **objects: Any) -> SaveHandle:
        """Save ``state`` (or framework objects, captured now) as checkpoint ``step``.

        ``state`` is a :class:`TrainingState`; framework objects go as keywords instead
        (``save(step, model=model, optimizer=opt, cursor=cursor)``).  Anything else (a dict of
        arrays) is a ``TypeError`` saying so, raised before anything is locked or written.

        ``step`` may not be below the newest committed step (:class:`StepOrderError`: restore
        first, or :meth:`rewind` on purpose).  Saving a step this manager already saved in this
        run replaces it atomically (logged); a step committed by another run or manager is
        never replaced (``CheckpointExistsError``).
        """
        return self._save(step, state, metrics, objects, sync=not self.async_save)

    def _save(self, step, state, metrics, objects, *, sync: bool) -> SaveHandle:
        self._check_open()
        api.check_state_argument(state, f"save({step}, state)")  # before any lock or listing
        url = self.local.step_url(step)
        metrics = check_metrics(metrics)  # before anything is written or committed
        self._wait_inflight()  # at most one save in flight; raises a previous background error
        overwrite = self._on_coordinator(lambda: self._prepare(step))
        try:
            snapshot = self._staging.snapshot(step, state, metrics, objects, self.async_save)
        except Exception as e:
            if self.group is not None:
                # The other ranks are about to save: take part, so they fail at once.
                _dist.fail(self.local.step_store(step), self.group, e)
            raise
        if sync:
            return SaveHandle(step, url, _completed(self._write(step, url, snapshot, overwrite)))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptcore-save")
        self._inflight = self._pool.submit(self._write, step, url, snapshot, overwrite)
        return SaveHandle(step, url, self._inflight)

    def _prepare(self, step: int) -> bool:
        """The checks before a save (the writer lock, the step order, a damaged step in the
        way); whether ``step`` is to be replaced.  With a group, rank 0 makes them for all."""
        self._acquire()
        steps = self.local.committed()
        good = [s for s in steps if s not in self._fell_back]
        if good and step < good[-1]:
            raise StepOrderError(
                f"save({step}): step {step} is below the newest committed step {good[-1]} under "
                f"{self.root.url}, so a restore() would resume from step {good[-1]}, not from this "
                f"run. If this run started over without restoring, call mgr.restore(...) first; to "
                f"go back on purpose, call mgr.rewind({step}) before saving: it deletes every "
                f"checkpoint from step {step} on (each deletion is logged)")
        if step in self._skipped:
            self._replace_skipped(step)
        if step in self._saved and step in steps:
            log.info("save(%d): replacing checkpoint step %d (%s), which this manager saved "
                     "earlier in this run", step, step, self.step_url(step))
            return True
        return False

    def _acquire(self) -> None:
        if self._lock is not None:
            self._lock.acquire()

    def _replace_skipped(self, step: int) -> None:
        """Make room for ``step`` after a resume that fell back over a damaged checkpoint there
        (the resumed run reaches its number again).  Verified again first, since restore() took
        no lock: deleted only if its data still fails a checksum or is missing; a step that
        merely cannot be read here (a newer format) is left for the save to refuse."""
        self._skipped = self._skipped - {step}
        url = self.step_url(step)
        try:
            problems = self.local.verify(step)
        except Exception as e:  # noqa: BLE001 - classified just below
            if not is_damage(e):
                return
            problems = [e]
        if problems and all(is_damage(p) for p in problems):
            warnings.warn(f"replacing checkpoint step {step} ({url}), which does not verify "
                          f"({problems[0]}); restore() fell back over it",
                          CheckpointFallbackWarning, stacklevel=_caller_level())
            log.warning("replacing damaged checkpoint step %d (%s): %s", step, url, problems[0])
            self.local.relist()
            self.local.delete(step)

    def _write(self, step: int, url: str, state: TrainingState,
               overwrite: bool = False) -> api.CheckpointInfo:
        replicating = self.backups if self._coordinator else []
        for b in replicating:
            b.pause()
        try:
            info = self._commit(step, url, state, overwrite)
        finally:
            for b in replicating:
                b.proceed()
        self._saved.add(step)
        self.local.remember(step, info.created, state.metadata)
        try:
            if self._lock is not None:
                self._lock.refresh()
            for b in replicating:
                b.enqueue(step)
            if self._coordinator:
                self._apply_retention()
        except FencedError as e:
            # The step is committed and readers accept it; another writer took the root over
            # right after.  This save stands; this manager's next operation raises.
            log.warning("save(%d): committed (%s), but this writer was superseded right after: "
                        "no retention; its next operation raises (%s)", step, url, e)
        return info

    def _commit(self, step: int, url: str, state: TrainingState,
                overwrite: bool) -> api.CheckpointInfo:
        """``save_state`` of ``step``; a step in the way that no reader accepts (committed by a
        writer after its lease was taken over) is removed first.  With a group, rank 0 decides
        and every rank follows: a group's save is one act."""
        def save() -> api.CheckpointInfo:
            return api.save_state(url, state, storage_options=self.local.options,
                                  overwrite=overwrite, group=self.group, fence=self._lock)
        try:
            try:
                return save()
            except CheckpointExistsError:
                if not self._on_coordinator(lambda: self._clear_fenced(step)):
                    raise
                return save()
        except CheckpointExistsError as e:
            if step not in self.steps():
                raise CheckpointExistsError(
                    f"{e}. The folder of step {step} under {self.root.url} holds the leftovers of "
                    f"an interrupted save or deletion: mgr.gc() removes them once they are older "
                    f"than its grace period, mgr.rewind({step}) at once") from e
            raise CheckpointExistsError(
                f"{e}. Step {step} was committed by another run or manager under {self.root.url}, "
                f"and a manager replaces only the steps it saved itself: to resume from it, call "
                f"mgr.restore() and save the steps after it; to discard it, call mgr.rewind({step}) "
                "(deletes it and every newer checkpoint) and save again") from e

    def _clear_fenced(self, step: int) -> bool:
        """Remove a checkpoint of ``step`` that no reader accepts; whether there was one."""
        if self._lock is None or step not in {s for s, _ in layout.fenced_steps(self.root)}:
            return False
        log.warning("save(%d): removing %s, committed by a writer after its lease was taken "
                    "over (no reader accepts it), to save the step there", step,
                    self.step_url(step))
        self.local.delete(step)
        return True

    def _apply_retention(self) -> None:
        """Local retention (rank 0): a damaged step a restore fell back over is neither judged
        nor the newest; a step a backup still lacks stays (``Backup(keep_unreplicated=)``)."""
        def hold(doomed: list[int]) -> set[int]:
            held = set()
            for s in doomed:
                for b in self.backups:
                    if b.spec.keep_unreplicated and not b.replicated(s):
                        log.info("retention: keeping checkpoint step %d under %s until its "
                                 "replica in %s is committed", s, self.root.url, b.root.url)
                        held.add(s)
            return held

        self.local.retain(self.policy, skip=self._skipped, hold=hold)

    def _wait_inflight(self) -> None:
        fut, self._inflight = self._inflight, None
        if fut is not None:
            try:
                fut.result()
            except BaseException as e:  # surfaced once, here
                self._error = e
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def wait(self) -> None:
        """Block until the save in flight is committed, and until every committed step is
        replicated to every backup; re-raise what failed.  With a group and backups every rank
        calls it: rank 0 replicates, and its outcome is every rank's."""
        self._wait_inflight()
        if self.backups:
            self._on_coordinator(self._wait_backups)

    def _wait_backups(self) -> None:
        errors = []
        for b in self.backups:
            try:
                b.wait()
            except BaseException as e:  # noqa: BLE001 - every backup waited for; first raised
                errors.append(e)
        if self._saved and self._coordinator:
            # steps local retention kept for want of a replica may go now
            self._acquire()
            self._apply_retention()
        if errors:
            raise errors[0]

    # -- deleting -------------------------------------------------------------------------------
    def delete(self, step: int) -> None:
        """Remove checkpoint ``step`` (manifest first, then its data).  With a group, every rank
        calls it; rank 0 deletes."""
        self._check_open()
        self._wait_inflight()

        def work() -> None:
            self._acquire()
            log.info("delete: deleting checkpoint step %d (%s)", step, self.step_url(step))
            self.local.delete(step)

        self._on_coordinator(work)
        self.local.relist()
        self._saved.discard(step)

    def rewind(self, step: int) -> list[int]:
        """Go back to before ``step``: delete every committed checkpoint at ``step`` or after.

        The explicit way to save below the newest step (``save()`` refuses it): a run that
        restarts from an older step on purpose calls ``mgr.rewind(step)`` once, then saves
        ``step`` and on.  Deletes newest first (a crash midway leaves the older steps, a prefix
        of the run), each deletion logged; returns the deleted steps, newest first.

        Example:
            >>> mgr.restore(step=500, model=model)   # go back to step 500...  # doctest: +SKIP
            >>> mgr.rewind(501)                      # ...forget what came after  # doctest: +SKIP
        """
        step_name(step)  # a non-negative int
        self._check_open()
        self._wait_inflight()
        gone = [int(s) for s in self._on_coordinator(lambda: self._rewind(step))]
        self._saved.difference_update(gone)
        self.local.relist()
        self._fell_back = self._fell_back - set(gone)
        self._skipped = self._skipped - set(gone)
        return gone

    def _rewind(self, step: int) -> list[int]:
        self._acquire()
        gone = [s for s in reversed(self.steps()) if s >= step]
        for s in gone:
            log.info("rewind(%d): deleting checkpoint step %d (%s)", step, s, self.step_url(s))
            self.local.delete(s)
        # Manifest-less step folders from there on (an interrupted deletion) would block saving
        # their steps again: they are leftovers, and the run is going back over them.
        self.root.fs.invalidate_cache()
        for e in self.root.listdir():
            m = STEP.fullmatch(e.name)
            if m and not e.is_link and int(m.group(1)) >= step:
                log.info("rewind(%d): removing leftover %s", step, self.root.child(e.name).url)
                try:
                    self.root.child(e.name).delete_tree()
                except FileNotFoundError:
                    pass  # an object store's folder vanishes with its last object
        return gone

    def gc(self, *, grace: float | None = None) -> list[str]:
        """:func:`ckptcore.gc` on this manager's root, under its writer lock: remove leftovers
        of interrupted saves older than ``grace`` seconds; return what went.  With a group,
        every rank calls it; rank 0 removes."""
        grace = layout.check_grace(grace)
        self._check_open()
        self._wait_inflight()

        def work() -> list[str]:
            self._acquire()
            return self.local.gc(grace)

        return list(self._on_coordinator(work))

    # -- restoring ------------------------------------------------------------------------------
    def restore(self, step: int | None = None, *, keys: Any = None,
                like: TrainingState | None = None, seed: bool = False,
                **objects: Any) -> TrainingState:
        """Load a checkpoint (the newest that verifies, by default) and restore ``objects`` from it.

        ``keys`` loads only some sections (``keys=["model", "optimizer"]``), as
        :func:`ckptcore.load_state` does: the way to leave a saved part (the data position, the
        optimizer) out on purpose.  ``like`` asks for this rank's blocks of sharded tensors (a
        template of ``Shard`` leaves; see :func:`ckptcore.load_state`).  Called without objects,
        it only returns the state.

        With ``step=None`` a newest checkpoint that is corrupt or incomplete is skipped with a
        :class:`CheckpointFallbackWarning` naming it; an explicit ``step`` never falls back (it
        streams: each tensor is assigned once its own batch verified).  A later ``save()`` of a
        skipped step's number replaces it (with a warning) if its data still fails to verify
        (docs/RELIABILITY.md, "Restore and fallback").

        With backups, the steps of every tier are candidates, newest first, the local copy of a
        step before its replicas: a damaged local copy falls back to a replica before an older
        step, and an empty or missing local root restores from a backup.  ``seed=True`` then
        copies the restored replica into the local root.

        With a group, every rank restores the same step: rank 0 lists the steps, every rank
        reads its part of each candidate, and a step that fails on any rank is skipped by all.
        """
        keys = api.check_keys(keys)  # a usage error, not a step to fall back over
        restorer = Restorer(self.tiers, self.group, self.root)

        def load(tier: Tier, s: int) -> TrainingState:
            return api.load_state(tier.step_url(s), storage_options=tier.options, keys=keys,
                                  like=like, group=self.group)

        if step is not None:
            return self._restore_step(restorer, step, keys, like, seed, objects)
        found = restorer.newest(load, lambda state: self._restore_into(state, objects))
        damaged = set(found.damaged)
        if found.tier > 0:
            log.info("restore: step %d restored from its replica %s", found.step,
                     self.tiers[found.tier].step_url(found.step))
            if seed:
                self._seed_all(found.tier, found.step, replace=found.step in damaged)
                damaged.discard(found.step)  # healed: the local copy is the replica's now
        # Only a run that did resume from an older step may later save over these.
        self._skipped = frozenset(damaged)
        self._fell_back = frozenset(found.passed - {found.step})
        return found.state

    def _restore_step(self, restorer: Restorer, step: int, keys: Any, like: Any, seed: bool,
                      objects: dict) -> TrainingState:
        where = restorer.where(step)
        if not where and self.local.step_store(step).exists(MANIFEST_NAME):
            raise CheckpointNotFoundError(
                f"{self.step_url(step)}: step {step} was committed by a writer after its "
                "lease was taken over, so no reader accepts it (gc() removes it)")
        tier = self.tiers[where[0] if where else 0]  # nowhere: the local error names it
        if self.group is None:  # streams: each tensor assigned once its own batch verified
            state = api.load_state(tier.step_url(step), storage_options=tier.options, keys=keys,
                                   like=like, **objects)
        else:
            state = api.load_state(tier.step_url(step), storage_options=tier.options, keys=keys,
                                   like=like, group=self.group)
            self._restore_into(state, objects)
        if where and where[0] > 0 and seed:
            self._seed_all(where[0], step)
        return state

    def _restore_into(self, state: TrainingState, objects: dict) -> None:
        """Assign a loaded state to the objects; with a group, every rank succeeds or raises."""
        if self.group is None:
            api.restore_objects(state, objects)
        elif objects:
            _dist.agree(self.root, self.group, lambda: api.restore_objects(state, objects))

    def _seed_all(self, tier: int, step: int, replace: bool = False) -> None:
        """restore(seed=True): copy the replica into the local root (rank 0 with a group)."""
        self._on_coordinator(lambda: self._seed(self.tiers[tier], step, replace))

    def _seed(self, source: Tier, step: int, replace: bool) -> None:
        """Copy ``step``'s replica into the local root; ``replace``: the local copy was found
        damaged, and the replica takes its place (checked again under the lock first: a read
        that failed once does not delete a copy that verifies now)."""
        dst = self.local.step_store(step)
        if dst.exists(MANIFEST_NAME):
            if not replace:
                log.info("restore: step %d is already under %s; not seeding it", step,
                         self.root.url)
                return
            self._acquire()
            try:
                problems: list[Exception] = list(self.local.verify(step))
            except CheckpointError as e:  # its manifest is unreadable: damaged too
                problems = [e]
            if not problems:
                log.info("restore: the local copy of step %d under %s verifies now; keeping it",
                         step, self.root.url)
                return
            log.warning("restore: replacing the damaged copy of step %d under %s (%s) with its "
                        "replica from %s", step, self.root.url, problems[0], source.url)
            self.local.delete(step)
        self._acquire()
        log.info("restore: seeding %s with step %d from %s", self.root.url, step, source.url)
        copy_checkpoint(source.step_store(step), dst, dedup=False, fence=self._lock)
        self.local.relist()

    # -- preemption -----------------------------------------------------------------------------
    @property
    def preempted(self) -> bool:
        """True once SIGTERM arrived (with ``save_on_preemption``): save and stop training."""
        if self._watch is None:
            return False
        self._watch.asked = True
        return self._watch.requested

    def save_if_preempted(self, step: int, state: TrainingState | None = None, *,
                          metrics: Mapping[str, float] | None = None, **objects: Any) -> bool:
        """The one call a training loop makes after each step to survive preemption.

        Without a SIGTERM, returns False at once and does nothing.  After one, saves ``step``
        synchronously (even with ``async_save=True``; a step already committed is not saved
        again), waits for every save in flight, and returns True: the caller then stops
        training (``break``) and exits normally within the grace period.

        Example:
            >>> for batch in batches:                                  # doctest: +SKIP
            ...     step += 1; train_step(batch)
            ...     if mgr.save_if_preempted(step, model=model, optimizer=opt, cursor=cursor):
            ...         break
        """
        if not self.preempted:
            return False
        self._check_open()
        self._wait_inflight()
        if step in self.local.committed():
            log.warning("SIGTERM: step %d is already saved (%s); stop training now",
                        step, self.step_url(step))
        else:
            self._save(step, state, metrics, objects, sync=True)
            log.warning("SIGTERM: saved step %d (%s); stop training now", step, self.step_url(step))
        self._wait_inflight()
        return True

    # -- lifetime -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this CheckpointManager is closed")

    def close(self) -> None:
        """Wait for the save in flight and the replications, release the writer locks and the
        SIGTERM handler; re-raise a background error."""
        if self._closed:
            return
        try:
            try:
                # Replicated (at most one more try per failing step: the run is ending), and
                # local retention applied after it.  With a group not collective: a rank that
                # closes early must not wait on the others; rank 0 raises.
                self._wait_inflight()
                for b in self.backups:
                    b.closing()
                if self.backups:
                    self._wait_backups()
            finally:
                for b in self.backups:
                    b.close()
        finally:
            self._closed = True
            _preempt.release(self._watch)
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            if self._lock is not None:
                self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root.url!r}, keep={self.policy!r}, async_save={self.async_save})"


def _check_distinct(backups: list[BackupTier]) -> None:
    for i, b in enumerate(backups):
        for other in backups[:i]:
            if b.root.same_place(other.root):
                raise ValueError(f"backup: {b.root.url!r} is given twice (as {other.root.url!r}); "
                                 "each backup must be another location")


def _drain() -> None:
    # Interpreter exit waits for saves in flight, so a finished script never drops its last save.
    for mgr in list(_live):
        try:
            mgr.close()
        except BaseException as e:  # noqa: BLE001 - nothing left to raise to at exit
            what = "save or replication" if mgr.backups else "save"
            log.error("closing %s at exit: a background %s failed: %r", mgr.root.url, what, e)
            warnings.warn(f"ckptcore: a background {what} failed at exit ({mgr.root.url}): {e!r}")


# A plain atexit hook runs too late: concurrent.futures refuses new thread pools once the
# interpreter starts shutting down (before atexit hooks run), and a save uses pools to write
# its shards.  threading's own exit hooks run first, in reverse order of registration, so this
# one (registered after concurrent.futures.thread's) drains saves while pools still work.
try:
    threading._register_atexit(_drain)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # pragma: no cover - other interpreters
    atexit.register(_drain)
