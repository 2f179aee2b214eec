"""CheckpointManager: a run's checkpoints over tiers, with retention, async saves and fallback.

The manager coordinates rooms that live elsewhere: its tiers (``_tier``: the local root and,
through ``_backup``, each backup, with one listing, retention and deletion), the restore and its
fallback (``_restore``), the snapshot and the save in flight (``_staging``), SIGTERM and exit
(``_preempt``), one checkpoint's save and load (``api``) and a group's agreement (``_dist``).

A second ``save()`` waits for the one in flight, whose failure the next ``save()``, ``wait()``
or ``close()`` raises.  ``save()`` below the newest committed step raises (:meth:`rewind`);
a step this manager saved in this run may be replaced, never one another run committed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Any, Mapping, Sequence

from . import _dist, _meter, _preempt, api, events, layout, lineage
from ._backup import BackupTier
from ._backups import Backups
from .adapter import unapplied_parts
from ._lock import WriterLock
from ._restore import Restorer, resumed_run
from ._staging import InFlight, SaveHandle, Staging, completed
from ._steps import step_name
from ._storage import Store, check_url
from ._tier import Tier
from .errors import CheckpointFallbackWarning, FencedError, StepOrderError, caller_level
from .group import ProcessGroup
from .options import Backup, Lease, resolve
from .policies import as_policy, check_metrics
from .state import TrainingState

__all__ = ["CheckpointManager", "SaveHandle"]

log = logging.getLogger("ckptcore")


class CheckpointManager:
    """Checkpoints of one run under ``root`` (a folder or bucket prefix), and its backups.

    Args:
        root: Any fsspec URL: the local tier, where saves land.
        keep: Retention: a policy (``KeepLast(3) | KeepBest("loss")``), an int n
            (``KeepLast(n)``), a list of policies (kept if any keeps it), or None to keep all.
            The newest committed checkpoint is always kept.
        async_save: ``save()`` copies the arrays into staging buffers and returns; writing,
            commit, retention and replication follow in a background thread.  Below the
            ``staging_bytes`` budget, ``save()`` first writes what does not fit, straight from
            the caller's arrays (docs/RELIABILITY.md, "Async saves").
        storage_options: Passed to fsspec for ``root``.
        lock: Hold each tier's writer lock while writing there (on object stores a lease,
            taken over once its holder is gone: docs/RELIABILITY.md, "The writer lock").
            ``"lazy"`` (default): taken at the first write (a live holder: ``LockedError``).
            ``True``: the constructor also checks, without taking it, that no live writer holds
            the root.  ``False``: no lock (readers, tools).
        lease: A :class:`ckptcore.Lease` for every tier's lock (period and heartbeat).
        save_on_preemption: Catch SIGTERM (main thread only; the previous handler is chained,
            and put back by ``close()``) for :meth:`save_if_preempted`.
        group: A :class:`ckptcore.ProcessGroup`: every rank makes a manager on the same root
            and calls the same methods; each writes its share, rank 0 commits, holds the lock,
            applies retention and replicates.
        backup: One or more backup tiers, each a :class:`ckptcore.Backup` (or a URL): every
            committed step is replicated to each in the background, with the same commit
            protocol (docs/RELIABILITY.md, "Backup tiers"); ``wait()`` and ``close()`` wait and
            raise what failed, and ``restore()`` takes the newest step that verifies in any
            tier, local first.  The constructor checks that each answers (within 10 s): a run
            starting afresh raises ``StorageError`` naming one that does not.
        tags: Your own labels (``{str: str}``, e.g. ``{"experiment": "lr-sweep"}``), recorded
            in every checkpoint's lineage (``ckpt log``) and kept across resumes.

    Every save records the run's lineage (``CheckpointInfo.lineage``): a run id drawn by a
    fresh manager, or taken from the step a :meth:`restore` restored, with one resume more
    and what that restore put back (``ckptcore.lineage``; ``ckpt log ROOT`` shows the tree).

    Every save, restore and replication is reported as a :mod:`ckptcore.events` event
    (:func:`ckptcore.on_event`); ``last_save`` is the :class:`ckptcore.SaveEvent` of the last
    save that committed (an async one's once it did).

    ``lease_seconds``, ``heartbeat_seconds``, ``backup_keep``, ``backup_storage_options``,
    ``backup_dedup`` and ``keep_unreplicated`` (earlier spellings) still work, with a
    ``DeprecationWarning`` naming the new one.

    Example:
        >>> mgr = ckptcore.CheckpointManager("memory://run1", keep=3)  # doctest: +SKIP
        >>> mgr.save(100, state).result()                              # doctest: +SKIP
        >>> state = mgr.restore()                                      # doctest: +SKIP
    """

    def __init__(self, root: str, *, keep: Any = None, async_save: bool = False,
                 storage_options: Mapping[str, Any] | None = None, lock: bool | str = "lazy",
                 lease: Lease | None = None, save_on_preemption: bool = True,
                 group: ProcessGroup | None = None,
                 backup: str | Backup | Sequence[str | Backup] | None = None,
                 tags: Mapping[str, str] | None = None, **deprecated: Any):
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
        self.local = Tier(self.root, storage_options, lock=self._lock, tracked=True)
        self.backups = Backups(self.root, specs, lock=bool(lock), lease=lease)
        if self._lock is not None:  # named in the root's writer records: `ckpt ls` can say where
            # (a local one as the absolute path written to: "~" and relative paths resolved)
            self._lock.backups = [os.path.abspath(t.root.path) if t.root.local else t.root.url
                                  for t in self.backups]
        self._inflight, self._staging = InFlight(), Staging()
        # The steps the last restore() fell back over: damaged ones (a save may replace them;
        # frozensets, swapped whole: the save thread reads them) and all (none is "the newest").
        self._skipped: frozenset[int] = frozenset()
        self._fell_back: frozenset[int] = frozenset()
        self._saved: set[int] = set()  # steps this manager committed: a second save replaces them
        self._closed = False
        # The event of the last save that committed (an async one: once it did); the callbacks
        # put its figures in the training logs.
        self.last_save: events.SaveEvent | None = None
        self._run = lineage.Run(tags=lineage.check_tags(tags))  # a restore() continues another
        # The last restore's resume (the run before it, tier, step, newest step, keys, seconds,
        # bytes), so that restored_into() can record it again with the objects it went into.
        self._resume: tuple | None = None
        local_steps: list[int] = []
        if lock is True or self.backups:  # before anything is installed: may raise (rank 0's
            # verdict for every rank: the others would wait out the group timeout otherwise)
            local_steps = self._on_coordinator(lambda: self._check_at_start(lock is True))
        _preempt.drain_at_exit(self)
        self._watch = _preempt.watch(self) if save_on_preemption else None
        if self._coordinator:  # a run that died before replicating: finish it (rank 0: it sees all)
            self.backups.resume(local_steps)

    @property
    def backup(self) -> BackupTier | None:
        """The first backup tier (None without one); :attr:`backups` has them all."""
        return self.backups.tiers[0] if self.backups else None

    @property
    def tiers(self) -> list[Tier]:
        """Every tier, local first: where ``restore()`` looks, in that order."""
        return [self.local] + [b.tier for b in self.backups]

    def _check_at_start(self, lock: bool) -> list[int]:
        """A live writer holding the root (``lock=True``) or a backup that does not answer
        raise now; returns the local steps (for the backups' resume)."""
        if lock and self._lock is not None:
            self._lock.check_free()
        local_steps = self.local.steps(missing_ok=True) if self.backups else []
        self.backups.check(local_steps)
        return local_steps

    def _on_coordinator(self, work: Any) -> Any:
        """``work()`` here, or with a group on rank 0 (the lock holder), every rank returning its
        result or raising its error: one act of the job, not one per rank."""
        if self.group is None:
            return work()
        return _dist.decide(self.root, self.group, work)

    def step_url(self, step: int) -> str:
        return self.local.step_url(step)

    def steps(self) -> list[int]:
        """Committed steps of the local tier, ascending: the steps of
        :func:`ckptcore.list_checkpoints` on this root, without reading their manifests."""
        return self.local.steps()

    def latest_step(self) -> int | None:
        """The newest committed step in any tier (what ``restore()`` starts from)."""
        steps = set(self.local.steps(missing_ok=True)) | self.backups.reachable_steps()
        return max(steps) if steps else None

    def save(self, step: int, state: TrainingState | None = None, *,
             metrics: Mapping[str, float] | None = None, **objects: Any) -> SaveHandle:
        """Save ``state`` (a :class:`TrainingState`) or framework objects (``model=model,
        optimizer=opt, cursor=cursor``, captured now) as checkpoint ``step``; anything else is
        a ``TypeError`` before anything is locked or written.  ``step`` may not be below the
        newest committed step (:class:`StepOrderError`).  A step this manager saved in this run
        is replaced atomically (logged); one another run committed never is
        (``CheckpointExistsError``)."""
        return self._save(step, state, metrics, objects, sync=not self.async_save)

    def _save(self, step, state, metrics, objects, *, sync: bool) -> SaveHandle:
        self._check_open()
        api.check_state_argument(state, f"save({step}, state)")  # before any lock or listing
        url = self.local.step_url(step)
        metrics = check_metrics(metrics)  # before anything is written or committed
        # The caller's wait starts now (the save in flight's too); the event is emitted once
        # the step is committed (an async save: by the save thread) or the save failed.
        meter = _meter.Meter(background=not sync)
        with _meter.measuring(meter):
            self._wait_inflight()  # at most one in flight; raises a previous save's error
            try:
                overwrite = self._on_coordinator(lambda: self._prepare(step))
                try:  # (a synchronous save is written before it returns: nothing to copy)
                    snapshot, handoff = self._staging.snapshot(step, state, metrics, objects,
                                                               not sync)
                except Exception as e:
                    if self.group is not None:
                        # The other ranks are about to save: take part, so they fail at once.
                        _dist.fail(self.local.step_store(step), self.group, e)
                    raise
                if sync:
                    info = self._write(step, url, snapshot, overwrite)
            except Exception as e:
                self._report(meter, step, url, None, e)
                raise
            if sync:
                self._report(meter, step, url, info, None)
                return SaveHandle(step, url, completed(info))
            # The caller's wait ends here, recorded before the save thread starts: a small
            # state's manifest (whose stats carry it) could otherwise be built first.
            with meter.guard:
                meter.blocked = meter.elapsed()
            future = self._inflight.submit(self._write_measured, meter, step, url, snapshot,
                                           overwrite, handoff=handoff)
        return SaveHandle(step, url, future)

    def _write_measured(self, meter: _meter.Meter, step: int, url: str, state: TrainingState,
                        overwrite: bool) -> api.CheckpointInfo:
        """An async save's write in the save thread, counted into its ``meter`` and reported
        once committed (or failed)."""
        with _meter.measuring(meter):
            try:
                info = self._write(step, url, state, overwrite)
            except Exception as e:
                self._report(meter, step, url, None, e)
                raise
        self._report(meter, step, url, info, None)
        return info

    def _report(self, meter: _meter.Meter, step: int, url: str, info: Any,
                error: BaseException | None) -> None:
        """The :class:`ckptcore.SaveEvent` of a save, with every backup tier's lag."""
        lag = tuple(b.lag() for b in self.backups) if self._coordinator else ()
        event = events.SaveEvent(
            url=url, root=self.root.url, step=step, bytes=0 if info is None else info.nbytes,
            replication_lag=lag, error=None if error is None else type(error).__name__,
            **_meter.figures(meter))
        if error is None:
            self.last_save = event
        events.emit(event)

    def _prepare(self, step: int) -> bool:
        """The checks before a save (the writer lock, the step order, a damaged step in the
        way); whether ``step`` is to be replaced.  With a group, rank 0 makes them for all."""
        self._acquire()
        steps = self.local.committed()
        good = [s for s in steps if s not in self._fell_back]
        if good and step < good[-1]:
            self.local.check_current(f"save({step}) was refused")  # a stale view, if superseded
            raise StepOrderError(
                f"save({step}): step {step} is below the newest committed step {good[-1]} under "
                f"{self.root.url}, so a restore() would resume from step {good[-1]}, not from this "
                f"run. If this run started over without restoring, call mgr.restore(...) first; to "
                f"go back on purpose, mgr.rewind({step}) deletes every step from {step} on (logged)")
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

    def _locked(self, work: Any, *args: Any) -> Any:
        self._acquire()
        return work(*args)

    def _replace_skipped(self, step: int) -> None:
        """A resume fell back over a damaged ``step`` and reaches its number again: delete it if
        it is still damaged (restore() took no lock); one unreadable here the save refuses."""
        self._skipped = self._skipped - {step}
        problems = self.local.damage(step)
        if problems:
            url = self.step_url(step)
            warnings.warn(f"replacing checkpoint step {step} ({url}), which does not verify "
                          f"({problems[0]}); restore() fell back over it",
                          CheckpointFallbackWarning, stacklevel=caller_level())
            log.warning("replacing damaged checkpoint step %d (%s): %s", step, url, problems[0])
            self.local.relist()
            self.local.delete(step)

    def _write(self, step: int, url: str, state: TrainingState,
               overwrite: bool = False) -> api.CheckpointInfo:
        replicating = self._coordinator and bool(self.backups)
        with self.backups.paused() if replicating else contextlib.nullcontext():
            info = self.local.commit(step, state, overwrite=overwrite, group=self.group,
                                     decide=self._on_coordinator, lineage=self._run)
        self._saved.add(step)
        self.local.remember(step, info.created, state.metadata)
        try:
            if self._lock is not None:
                self._lock.refresh()
            if replicating:
                self.backups.enqueue(step)
            if self._coordinator:
                self._apply_retention()
        except FencedError as e:
            # The step is committed and readers accept it; another writer took the root over
            # right after.  This save stands; this manager's next operation raises.
            log.warning("save(%d): committed (%s), but this writer was superseded right after: "
                        "no retention; its next operation raises (%s)", step, url, e)
        return info

    def _apply_retention(self) -> None:
        """Local retention (rank 0): a damaged step a restore fell back over is neither judged
        nor the newest; a step a backup still lacks stays (``Backup(keep_unreplicated=)``)."""
        self.local.retain(self.policy, skip=self._skipped, hold=self.backups.unreplicated)

    def _wait_inflight(self) -> None:
        self._inflight.wait()  # raises a background save's error, once

    def wait(self) -> None:
        """Block until the save in flight is committed and every step replicated; re-raise what
        failed (with a group every rank calls it, and rank 0's outcome is every rank's)."""
        self._wait_inflight()
        if self.backups:
            self._on_coordinator(self._wait_backups)

    def _wait_backups(self) -> None:
        try:
            self.backups.wait()
        finally:  # (also after a backup failed: the others' steps kept for it may go now)
            if self._saved and self._coordinator:
                self._acquire()
                self._apply_retention()

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

        The explicit way to save below the newest step (``save()`` refuses it), e.g. after
        ``mgr.restore(step=500, ...)``, ``mgr.rewind(501)``.  Deletes newest first (a crash
        midway leaves a prefix of the run), each deletion logged; returns the deleted steps.
        """
        step_name(step)  # a non-negative int
        self._check_open()
        self._wait_inflight()
        gone = [int(s) for s in self._on_coordinator(lambda: self._locked(self.local.rewind, step))]
        self._saved.difference_update(gone)
        self.local.relist()
        self._fell_back = self._fell_back - set(gone)
        self._skipped = self._skipped - set(gone)
        return gone

    def gc(self, *, grace: float | None = None) -> list[str]:
        """:func:`ckptcore.gc` on this manager's root, under its writer lock: remove leftovers
        of interrupted saves older than ``grace`` seconds; return what went.  With a group,
        every rank calls it; rank 0 removes."""
        grace = layout.check_grace(grace)
        self._check_open()
        self._wait_inflight()
        return list(self._on_coordinator(lambda: self._locked(self.local.gc, grace)))

    def restore(self, step: int | None = None, *, keys: Any = None,
                like: TrainingState | None = None, seed: bool = False,
                **objects: Any) -> TrainingState:
        """Load a checkpoint (the newest that verifies, by default) and restore ``objects`` from it.

        ``keys`` and ``like`` are :func:`ckptcore.load_state`'s (some sections only; this rank's
        blocks of sharded tensors); without objects it only returns the state.  With
        ``step=None`` a checkpoint that is corrupt or incomplete is skipped with a
        :class:`CheckpointFallbackWarning` naming it, in every tier, newest step first and a
        step's local copy before its replicas; an explicit ``step`` never falls back (it
        streams: each tensor assigned once its own batch verified).  A later ``save()`` of a
        skipped step replaces it if it still fails to verify (docs/RELIABILITY.md, "Restore and
        fallback").  ``seed=True`` copies a restored replica into the local root.  With a group
        every rank restores the same step, and a step that fails on any rank is skipped by all.
        """
        restorer = Restorer(self.tiers, self.group, self.root)
        meter = _meter.Meter()
        with _meter.measuring(meter), unapplied_parts() as unapplied:  # (the next saves' lineage)
            try:
                state, found = restorer.restore(step, keys=keys, like=like, seed=seed,
                                                objects=objects)
            except Exception as e:
                self._report_restore(meter, restorer, e)
                raise
        if found is not None:  # only a run that did resume from an older step may save over these
            self._skipped = frozenset(found.damaged)
            self._fell_back = frozenset(found.passed - {found.step})
        figures = self._restore_figures(meter)
        if self._coordinator and restorer.restored is not None:  # rank 0 writes the lineage
            tier, restored_step, newest = restorer.restored
            self._resume = (self._run, tier, restored_step, newest, keys,
                            figures["seconds_total"], figures["bytes"])
            self._record_resume(state, objects, unapplied)
        self._report_restore(meter, restorer, None, figures)
        return state

    def restored_into(self, state: TrainingState, *, unapplied: Any = frozenset(),
                      **objects: Any) -> None:
        """Tell the manager which objects the state its last :meth:`restore` returned went into,
        for a caller that applies it itself (``ckptcore.restore_objects``, a framework callback):
        the run's lineage then records what was put back, part by part (``ckpt log`` judges
        the resume exact or flags it), instead of "returned".  ``unapplied``: the parts the
        caller's restore warned it left unapplied (``ckptcore.adapter.unapplied_parts``).  A
        no-op on ranks other than 0 and before any restore."""
        if self._coordinator and self._resume is not None:
            self._record_resume(state, objects, frozenset(unapplied))

    def _record_resume(self, state: TrainingState, objects: dict, unapplied: Any) -> None:
        before, tier, step, newest, keys, seconds, nbytes = self._resume
        try:
            self._run = resumed_run(before, self.tiers, tier, step, newest, state, objects, keys,
                                    unapplied, seconds=seconds, nbytes=nbytes)
        except Exception as e:  # noqa: BLE001 - bookkeeping never fails a restore
            log.warning("restore: step %d restored, but its resume is not recorded in the "
                        "lineage (%s: %s)", step, type(e).__name__, e)

    @staticmethod
    def _restore_figures(meter: _meter.Meter) -> dict:
        figures = _meter.figures(meter)
        figures["bytes"], figures["shards"] = meter.loaded
        return figures

    def _report_restore(self, meter: _meter.Meter, restorer: Restorer,
                        error: BaseException | None, figures: dict | None = None) -> None:
        """The :class:`ckptcore.RestoreEvent` of a restore: which step, from which tier, and
        every candidate it fell back over (``figures``: measured already, else now)."""
        figures = figures if figures is not None else self._restore_figures(meter)
        chosen = restorer.chosen
        tier = self.tiers[chosen[1]] if chosen is not None else self.local
        lag = tuple(b.lag() for b in self.backups) if self._coordinator else ()
        events.emit(events.RestoreEvent(
            url=tier.step_url(chosen[0]) if chosen is not None else self.root.url,
            root=self.root.url, step=None if chosen is None else chosen[0],
            tier="local" if chosen is None or chosen[1] == 0 else tier.url,
            fallbacks=tuple(restorer.fallbacks), replication_lag=lag,
            error=None if error is None else type(error).__name__, **figures))

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

        Without a SIGTERM, returns False at once.  After one, saves ``step`` synchronously
        (unless already committed), waits for every save in flight, and returns True: the
        caller then stops training (``break``) and exits within the grace period, e.g.
        ``if mgr.save_if_preempted(step, model=model, optimizer=opt, cursor=cursor): break``.
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
                self.backups.closing()
                if self.backups:
                    self._wait_backups()
            finally:
                self.backups.close()
        finally:
            self._closed = True
            _preempt.release(self._watch)
            self._inflight.shutdown()
            if self._lock is not None:
                self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root.url!r}, keep={self.policy!r}, async_save={self.async_save})"
