"""CheckpointManager: a run's checkpoints under one root, with retention, async saves and fallback.

Layout (:mod:`ckptcore.layout`): ``<root>/step-000000000042/`` holds the checkpoint of
step 42, written through :func:`ckptcore.save_state` and therefore committed
atomically.  Only a step folder with a manifest is a checkpoint; anything else
under the root is a leftover for :meth:`gc`.

Async saves: ``save()`` takes a consistent in-memory snapshot (a copy of every
array; framework captures are copies already) and a single background thread
writes and commits it.  At most one save is in flight: a second ``save()`` first
waits for the previous one.  A failure in the background is raised by the next
``save()``, ``wait()`` or ``close()``; interpreter exit waits for the save in
flight, and a killed process leaves the previous checkpoint intact.

Preemption (``save_on_preemption``, on by default): a SIGTERM handler sets :attr:`preempted`;
the loop calls :meth:`save_if_preempted` after each step, which saves that step synchronously and
tells the loop to stop.  Until a loop has asked once (``preempted`` or ``save_if_preempted``),
SIGTERM keeps its usual effect, so a loop that never checks still terminates on it.

Order of steps: ``save()`` below the newest committed step raises (a run restarted without
restoring would otherwise be shadowed by the old run's newer steps); :meth:`rewind` deletes the
newer steps on purpose.  A step this manager already saved in this run is replaced (a periodic
save and a final save of the same step), never a step committed by another run.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import logging
import math
import numbers
import os
import signal
import threading
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping

import numpy as np

from . import _backup, _codec, _dist, _knobs, api, layout
from ._lock import LockTakeoverWarning, WriterLock, caller_level
from ._manifest import MANIFEST_NAME
from ._storage import Store, bucket_missing, check_url
from .errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError,
                     CorruptCheckpointError, FencedError, GroupError,
                     LockedError, StepOrderError, StorageError, UnsafeCheckpointError,
                     UnsupportedCheckpointError)
from .policies import CheckpointEntry, as_policy
from .state import TrainingState

__all__ = ["CheckpointManager", "SaveHandle", "CheckpointFallbackWarning", "LockTakeoverWarning"]

_live: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()
_RELISTS = 3  # restore(): listings made again when every listed step vanished while read
log = logging.getLogger("ckptcore")


def _is_damage(e: BaseException) -> bool:
    """Whether a step that failed to load is damaged (bad, missing or malformed bytes), as opposed
    to intact but unreadable here (a newer format), gone, or out of reach (network, lock)."""
    return isinstance(e, CheckpointError) and not isinstance(
        e, (UnsupportedCheckpointError, CheckpointNotFoundError, StorageError, LockedError))


def check_metrics(metrics: Any) -> dict[str, float] | None:
    """``metrics`` as ``{name: float}``; ``TypeError``/``ValueError`` for anything else (None passes)."""
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a mapping of names to numbers, got {type(metrics).__name__}")
    out = {}
    for k, v in metrics.items():
        if not isinstance(k, str):
            raise TypeError(f"metrics: names must be str, got {type(k).__name__} {k!r:.40}")
        if isinstance(v, bool) or not isinstance(v, (numbers.Real, np.ndarray)) or np.ndim(v) != 0:
            raise TypeError(f"metrics[{k!r}] must be a number, got {type(v).__name__}")
        f = float(v)
        if not math.isfinite(f):
            raise ValueError(f"metrics[{k!r}] is {f}; metrics must be finite (a NaN loss usually "
                             "means the run diverged; leave it out of metrics= to save anyway)")
        out[k] = f
    return out


def saved_metrics(step: int, metadata: Any) -> dict[str, float] | None:
    """The metrics a checkpoint carries, for retention; None (logged) when they are unusable.

    A user may have put anything under ``state.metadata["metrics"]``: a policy must not fail on
    it after the step is committed, it just cannot rank that step.
    """
    value = metadata.get("metrics") if isinstance(metadata, Mapping) else None
    if value is None:
        return None
    try:
        return check_metrics(value)
    except (TypeError, ValueError) as e:
        log.warning("checkpoint step %d: metadata['metrics'] is not usable for retention (%s); "
                    "metric-based policies ignore this step", step, e)
        return None


class CheckpointFallbackWarning(UserWarning):
    """The newest checkpoint did not verify, and an older one was restored instead."""


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
    """Checkpoints of one run under ``root`` (a folder or bucket prefix).

    Args:
        root: Any fsspec URL.
        keep: Retention: a policy (``KeepLast(3) | KeepBest("loss")``), an int n
            (``KeepLast(n)``), a list of policies (kept if any keeps it), or None to keep all.
            The newest committed checkpoint is always kept.
        async_save: Write in a background thread after snapshotting the state.
        storage_options: Passed to fsspec.
        lock: Hold a writer lock on the root while saving (recommended).  On object stores the
            lock is a lease renewed by a daemon thread every ``heartbeat_seconds`` and taken
            over when not renewed within ``lease_seconds``, or at once when its holder's process
            on this machine is gone (docs/RELIABILITY.md, "The writer lock").  The lock is
            taken at the first write.  ``"lazy"`` (the default): a live holder is found then
            (``LockedError``).  ``True``: the constructor checks first, without taking the lock,
            that no live writer holds the root, and raises ``LockedError`` naming the holder at
            once (a holder whose process is gone, or a closed or dropped manager of this
            process, would be taken over and does not count).  ``False``: no lock (readers,
            tools).
        lease_seconds: How long an unrenewed lease stays valid (default 30 s,
            ``CKPTCORE_LEASE_SECONDS``).
        heartbeat_seconds: How often the lease is renewed (default 10 s,
            ``CKPTCORE_HEARTBEAT_SECONDS``, at most a third of a ``lease_seconds`` given alone);
            must be below ``lease_seconds``.
        save_on_preemption: Catch SIGTERM (main thread only; the previous handler is chained,
            and restored by ``close()``), so that :meth:`save_if_preempted` saves the current
            step before the machine goes away.
        group: A :class:`ckptcore.ProcessGroup` (``ckptcore_paddle.process_group()``,
            ``ckptcore_keras.process_group(strategy)``): every rank makes a manager on the same
            root with its group and calls the same ``save``; each writes its share, rank 0
            commits, holds the writer lock and applies retention.  Every rank restores alike.
        backup: A second root (any fsspec URL, e.g. a bucket) each committed step is replicated
            to, in the background, with the same commit protocol (docs/RELIABILITY.md, "Backup
            tiers"); ``save()`` does not wait for it, ``wait()`` and ``close()`` do and raise its
            errors.  ``restore()`` takes the newest step that verifies in either tier, local
            first.  Unchanged tensors are not uploaded again (``backup_dedup``).  With a group,
            rank 0 replicates the group's steps (every rank passes the same ``backup``).
            The constructor checks once that the backup root answers (within 10 s): when it
            does not, a run starting afresh raises ``StorageError`` naming it (a wrong URL,
            endpoint or credentials), while a resumed run (local steps) whose bucket is down
            for now goes on locally.  A bucket that does not exist is logged at construction
            and raised by ``wait()``/``close()``.
        backup_keep: The backup's own retention (as ``keep``); None keeps every replica.
        backup_storage_options: Passed to fsspec for ``backup``.
        backup_dedup: Store replicas as content-addressed chunks shared between steps (default);
            False writes plain copies.
        keep_unreplicated: Local retention never deletes a step whose replica is not committed
            yet (default); False lets it (a slow or failing bucket then loses those steps).

    Example:
        >>> mgr = ckptcore.CheckpointManager("memory://run1", keep=3)  # doctest: +SKIP
        >>> mgr.save(100, state).result()                              # doctest: +SKIP
        >>> state = mgr.restore()                                      # doctest: +SKIP
    """

    def __init__(self, root: str, *, keep: Any = None, async_save: bool = False,
                 storage_options: Mapping[str, Any] | None = None, lock: bool | str = "lazy",
                 lease_seconds: float | None = None, heartbeat_seconds: float | None = None,
                 save_on_preemption: bool = True, group: Any = None, backup: str | None = None,
                 backup_keep: Any = None, backup_storage_options: Mapping[str, Any] | None = None,
                 backup_dedup: bool = True, keep_unreplicated: bool = True):
        self.root = Store(check_url(root, "root"), dict(storage_options or {}))
        if lock not in (True, False, "lazy"):
            raise ValueError(f"lock must be True, False or 'lazy', got {lock!r}")
        if backup is None and (backup_keep is not None or backup_storage_options):
            raise ValueError("backup_keep and backup_storage_options need backup=URL")
        self.backup = (None if backup is None else _backup.BackupTier(
            self.root, backup, keep=backup_keep, storage_options=backup_storage_options,
            dedup=backup_dedup, lock=lock, lease_seconds=lease_seconds,
            heartbeat_seconds=heartbeat_seconds))
        self.keep_unreplicated = keep_unreplicated
        self.policy = as_policy(keep)
        self.async_save = async_save
        self._options = dict(storage_options or {})
        # With a group every rank saves its share of each step (save_state(group=)); only the
        # coordinator (rank 0) holds the writer lock and applies retention.
        self.group = group
        self._coordinator = group is None or int(group.rank) == 0
        self._lock = (WriterLock(self.root, lease_seconds=lease_seconds,
                                 heartbeat_seconds=heartbeat_seconds)
                      if lock and self._coordinator else None)
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: Future | None = None
        self._error: BaseException | None = None
        self._entries: dict[int, CheckpointEntry] = {}
        self._staging: dict[str, np.ndarray] = {}
        # Steps a successful restore() fell back over because their data failed its checksums or
        # was missing.  A frozenset, swapped whole: the background save thread reads it.
        self._skipped: frozenset[int] = frozenset()
        # Every step the last successful restore() fell back over (damaged or unreadable here):
        # none of them counts as "the newest step" a save may not go below.
        self._fell_back: frozenset[int] = frozenset()
        self._saved: set[int] = set()  # steps this manager committed: a second save replaces them
        self._listed: list[int] | None = None  # committed steps, as of this manager's last write
        self._preempted = False
        self._asked = False  # whether the loop ever checked for preemption (see _on_sigterm)
        self._closed = False
        local_steps: list[int] = []
        if lock is True or self.backup is not None:  # before anything is installed: may raise
            # With a group, rank 0 checks and every rank gets its verdict at once (the others
            # would otherwise wait out the group timeout in the first save).
            local_steps = self._on_coordinator(lambda: self._check_at_start(lock is True))
        _live.add(self)
        if save_on_preemption:
            _catch_sigterm(self)
        # A run that died before replicating: finish it now.  With a group only rank 0
        # replicates (the group's root is shared: it sees every rank's files); the other ranks'
        # tier only lists and reads the backup.
        if self.backup is not None and self._coordinator:
            self.backup.resume(local_steps)

    def _check_at_start(self, lock: bool) -> list[int]:
        """The checks at construction: a root another live writer holds (``lock=True``; without
        taking the lock, which the first write takes as with ``lock="lazy"``) and a backup root
        that does not answer.  Returns the local steps (for the backup's resume)."""
        if lock and self._lock is not None:
            self._lock.check_free()
        local_steps: list[int] = []
        if self.backup is not None:
            local_steps = self.steps() if self.root.exists() else []
            self._check_backup(local_steps)
        return local_steps

    def _check_backup(self, local_steps: list[int]) -> None:
        """The backup root answers (one quick check): else raise now, naming its URL, when the
        run starts afresh (no local step: most likely a wrong URL, endpoint or credentials) or
        the answer is one retries cannot change (refused credentials, a permission).  A resumed
        run whose bucket is down for now goes on locally (logged): its steps are replicated once
        the bucket answers, and ``wait()``/``close()`` report what failed.  A bucket that does
        not exist (the store answered) is logged at once by ``BackupTier.resume`` and raised by
        ``wait()``/``close()``: saves go on locally meanwhile, and a later start replicates
        them once it is created."""
        assert self.backup is not None
        error = self.backup.reach()
        if error is None or bucket_missing(error):
            return
        url = self.backup.root.url
        if local_steps and _backup.transient(error):
            log.warning("backup: %s does not answer now (%s: %s); training goes on with the "
                        "local tier, and its steps are replicated once it does", url,
                        type(error).__name__, error)
            return
        cls = CheckpointNotFoundError if isinstance(error, FileNotFoundError) else StorageError
        raise cls(f"backup={url!r} cannot be reached ({type(error).__name__}: {error}); check "
                  "its URL, endpoint and credentials (backup_storage_options). Nothing was "
                  "saved; a bucket that goes down later, during the run, is ridden out with "
                  "retries") from error

    # -- listing --------------------------------------------------------------------------------
    def step_url(self, step: int) -> str:
        return self.root.child(self._name(step)).url

    _name = staticmethod(layout.step_name)

    def steps(self) -> list[int]:
        """Committed steps (those with a manifest), ascending."""
        return [step for step, _ in layout.committed_steps(self.root, self._lock)]

    def latest_step(self) -> int | None:
        """The newest committed step; with a backup, the newest in either tier (what
        ``restore()`` starts from)."""
        steps = self.steps() if self.root.exists() else []
        if self.backup is not None:
            try:
                steps = sorted(set(steps) | set(self.backup.steps()))
            except (CheckpointError, OSError) as e:  # the bucket out of reach: the local tier
                log.warning("latest_step: the backup %s cannot be listed (%s); the local tier "
                            "only", self.backup.root.url, e)
        return steps[-1] if steps else None

    # -- saving ---------------------------------------------------------------------------------
    def save(self, step: int, state: TrainingState | None = None, *,
             metrics: Mapping[str, float] | None = None, **objects: Any) -> SaveHandle:
        """Save ``state`` (or framework objects, captured now) as checkpoint ``step``.

        ``state`` is a :class:`TrainingState`; framework objects go as keywords instead
        (``save(step, model=model, optimizer=opt, cursor=cursor)``).  Anything else (a dict of
        arrays) is a ``TypeError`` saying so, raised before anything is locked or written.

        ``step`` may not be below the newest committed step (``ValueError``: restore first, or
        :meth:`rewind` on purpose).  Saving a step this manager already saved in this run
        replaces it atomically (logged); a step committed by another run or manager is never
        replaced (``CheckpointExistsError``).
        """
        return self._save(step, state, metrics, objects, sync=not self.async_save)

    def _save(self, step, state, metrics, objects, *, sync: bool) -> SaveHandle:
        self._check_open()
        api.check_state_argument(state, f"save({step}, state)")  # before any lock or listing
        name = self._name(step)
        metrics = check_metrics(metrics)  # before anything is written or committed
        self._wait_inflight()  # at most one save in flight; raises a previous background error
        if self.group is None:
            overwrite = self._prepare(step)
        else:
            overwrite = _dist.decide(self.root, self.group, lambda: self._prepare(step))
        try:
            snapshot = self._snapshot(step, state, metrics, objects)
        except Exception as e:
            if self.group is None:
                raise
            # The other ranks are about to save: take part, so they fail at once, then raise.
            _dist.fail(self.root.child(name), self.group, e)
            raise
        url = self.root.child(name).url
        if sync:
            return SaveHandle(step, url, _completed(self._write(step, url, snapshot, overwrite)))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptcore-save")
        fut = self._pool.submit(self._write, step, url, snapshot, overwrite)
        self._inflight = fut
        return SaveHandle(step, url, fut)

    def _prepare(self, step: int) -> bool:
        """The checks before a save (the writer lock, the step order, a damaged step in the
        way); whether ``step`` is to be replaced.  With a group, rank 0 makes them for all."""
        self._acquire()
        overwrite = self._check_order(step)
        if step in self._skipped:
            self._replace_skipped(step)
        return overwrite

    def _clear_fenced(self, step: int) -> bool:
        """After a save of ``step`` met a checkpoint already there: remove it if no reader
        accepts it (committed by a writer after its lease was taken over); whether it did."""
        if self._lock is None or step not in {s for s, _ in layout.fenced_steps(self.root)}:
            return False
        log.warning("save(%d): removing %s, committed by a writer after its lease was taken "
                    "over (no reader accepts it), to save the step there", step,
                    self.step_url(step))
        self._delete(step)
        return True

    def _committed(self) -> list[int]:
        """Committed steps; from this manager's last listing while its lock keeps others out."""
        if self._listed is None or self._lock is None:
            self._listed = self.steps()
        return self._listed

    def _check_order(self, step: int) -> bool:
        """Refuse a step below the newest committed one; whether ``step`` is to be replaced."""
        steps = self._committed()
        good = [s for s in steps if s not in self._fell_back]
        if good and step < good[-1]:
            raise StepOrderError(
                f"save({step}): step {step} is below the newest committed step {good[-1]} under "
                f"{self.root.url}, so a restore() would resume from step {good[-1]}, not from this "
                f"run. If this run started over without restoring, call mgr.restore(...) first; to "
                f"go back on purpose, call mgr.rewind({step}) before saving: it deletes every "
                f"checkpoint from step {step} on (each deletion is logged)")
        if step in self._saved and step in steps:
            log.info("save(%d): replacing checkpoint step %d (%s), which this manager saved "
                     "earlier in this run", step, step, self.step_url(step))
            return True
        return False

    def _acquire(self) -> None:
        if self._lock is not None:
            self._lock.acquire()

    def _replace_skipped(self, step: int) -> None:
        """Make room for ``step`` after a resume that fell back over a corrupt checkpoint ``step``.

        A run resumed from an older step reaches the corrupt step's number again; saving there
        must not fail with :class:`CheckpointExistsError` over a checkpoint that cannot be
        loaded.  The step is verified again first (it may have been replaced since restore()
        looked, which took no lock): it is deleted only if its data still fails a checksum or
        is missing.  A step that merely cannot be read here (a newer format, a dtype this
        install lacks) is never replaced; the save then raises ``CheckpointExistsError``.
        """
        self._skipped = self._skipped - {step}
        url = self.step_url(step)
        try:
            problems = api.verify(url, storage_options=self._options)
        except Exception as e:  # noqa: BLE001 - classified just below
            if not _is_damage(e):
                return  # gone, or unreadable here but perhaps intact: leave it to the save to refuse
            problems = [e]
        if problems and all(_is_damage(p) for p in problems):
            warnings.warn(f"replacing checkpoint step {step} ({url}), which does not verify "
                          f"({problems[0]}); restore() fell back over it",
                          CheckpointFallbackWarning, stacklevel=caller_level())
            log.warning("replacing damaged checkpoint step %d (%s): %s", step, url, problems[0])
            self._listed = None
            self._delete(step)

    def _snapshot(self, step, state, metrics, objects) -> TrainingState:
        state, borrowed = api.capture_state(state, dict(objects))
        if borrowed and self.async_save:
            # The caller keeps training on these buffers; other captures are copies already.
            state = self._copy_state(state)
        metadata = dict(state.metadata)
        if metrics is not None:
            metadata["metrics"] = metrics
        return dataclasses.replace(state, metadata=metadata, step=state.step or step)

    def _copy_state(self, state: TrainingState) -> TrainingState:
        """A deep copy whose arrays land in staging buffers kept from the previous async save.

        Reusing the buffers avoids faulting in fresh pages on every save, which costs more than
        the copy itself; they are free to reuse because at most one save is in flight.
        """
        enc = _codec.encode_state(state)

        def copy_one(i: int) -> np.ndarray:
            src, buf = enc.arrays[i], self._staging.get(enc.names[i])
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = np.empty(src.shape, src.dtype)
            np.copyto(buf, src)
            return buf

        with ThreadPoolExecutor(int(_knobs.get("threads"))) as pool:
            copies = list(pool.map(copy_one, range(len(enc.arrays))))
        self._staging = dict(zip(enc.names, copies))
        # deepcopy's memo maps id(original) -> copy, so the tree is rebuilt around these copies.
        return copy.deepcopy(state, {id(a): c for a, c in zip(enc.arrays, copies)})

    def _write(self, step: int, url: str, state: TrainingState,
               overwrite: bool = False) -> api.CheckpointInfo:
        replicating = self.backup is not None and self._coordinator
        if replicating:
            self.backup.pause()
        try:
            try:
                info = api.save_state(url, state, storage_options=self._options,
                                      overwrite=overwrite, group=self.group, fence=self._lock)
            except CheckpointExistsError:
                # (rank 0 decides, every rank follows: a group's save is one act)
                if not (self._on_coordinator(lambda: self._clear_fenced(step))):
                    raise
                info = api.save_state(url, state, storage_options=self._options,
                                      overwrite=overwrite, group=self.group, fence=self._lock)
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
        finally:
            if replicating:
                self.backup.proceed()
        self._saved.add(step)
        self._entries[step] = CheckpointEntry(step, info.created,
                                              saved_metrics(step, state.metadata))
        try:
            if self._lock is not None:
                self._lock.refresh()
            if replicating:
                self.backup.enqueue(step)
            if self._coordinator:
                self._apply_retention()
        except FencedError as e:
            # The step is committed and readers accept it; another writer took the root over
            # right after.  This save stands; this manager's next operation raises.
            log.warning("save(%d): committed (%s), but this writer was superseded right after: "
                        "no retention; its next operation raises (%s)", step, url, e)
        return info

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
        """Block until the save in flight is committed, and with a backup until every committed
        step is replicated; re-raise what failed.  With a group and a backup every rank calls
        it: rank 0 replicates, and its outcome is every rank's."""
        self._wait_inflight()
        if self.backup is not None:
            if self.group is None:
                self._wait_backup()
            else:
                _dist.decide(self.root, self.group, self._wait_backup)

    def _wait_backup(self) -> None:
        assert self.backup is not None
        self.backup.wait()
        if self._saved and self._coordinator:
            # steps local retention kept for want of a replica may go now
            self._acquire()
            self._apply_retention()

    # -- retention and gc -----------------------------------------------------------------------
    def _entry(self, step: int) -> CheckpointEntry | None:
        if step not in self._entries:
            try:
                info = api.inspect(self.step_url(step), storage_options=self._options)
            except CheckpointError:
                return None
            self._entries[step] = CheckpointEntry(step, info.created,
                                                  saved_metrics(step, info.metadata))
        return self._entries[step]

    def _apply_retention(self) -> None:
        steps = self._listed = self.steps()
        if not steps:
            return
        # A damaged step restore() fell back over is neither judged nor "the newest": else it
        # would hold the newest slot, and the resumed run's own saves below it would go.
        skipped = self._skipped
        good = [s for s in steps if s not in skipped]
        if not good:
            return
        read = {s: self._entry(s) for s in good}
        keep = set(self.policy.keep([e for e in read.values() if e is not None]))
        keep.add(good[-1])  # the newest committed good one, always
        keep.update(s for s, e in read.items() if e is None)  # unreadable: a policy cannot judge it
        if self.backup is not None and self.keep_unreplicated:
            waiting = {s for s in good[:-1] if s not in keep and not self.backup.replicated(s)}
            for s in sorted(waiting):
                log.info("retention: keeping checkpoint step %d under %s until its replica in %s "
                         "is committed", s, self.root.url, self.backup.root.url)
            keep |= waiting
        doomed = [s for s in good[:-1] if s not in keep]
        problem = doomed and layout.structure_problem(self.root.child(self._name(good[-1])))
        if problem:
            log.warning("retention: not deleting steps %s under %s: the newest step %d, which "
                        "supersedes them, does not pass the reader's checks (%s)", doomed,
                        self.root.url, good[-1], problem)
            return
        for s in good[:-1]:  # every step below the newest good one has a committed successor
            if s not in keep:
                log.info("retention: deleting checkpoint step %d under %s", s, self.root.url)
                self._delete(s)
                steps.remove(s)

    def _delete(self, step: int) -> None:
        name = self._name(step)
        if self.root.local and os.path.islink(self.root.join(name)):
            # Deleting "its manifest" would delete a file wherever the link points.
            raise UnsafeCheckpointError(f"{self.root.join(name)} is a symbolic link, not a checkpoint "
                                        "folder of this root; refusing to delete through it")
        if self._lock is not None:
            self._lock.before_delete()  # a superseded writer deletes nothing
            self._lock.forget(step)
        ckpt = self.root.child(name)
        ckpt.delete(MANIFEST_NAME)  # uncommit first: a half-deleted step is never "committed"
        ckpt.delete_tree()
        self._entries.pop(step, None)
        self._saved.discard(step)

    def _on_coordinator(self, work: Any) -> Any:
        """``work()`` here, or with a group on rank 0 only (it holds the writer lock), every rank
        returning its result or raising its error: a deletion is one act of the job, not one
        per rank racing the others."""
        if self.group is None:
            return work()
        return _dist.decide(self.root, self.group, work)

    def delete(self, step: int) -> None:
        """Remove checkpoint ``step`` (manifest first, then its data).  With a group, every rank
        calls it; rank 0 deletes."""
        self._check_open()
        self._wait_inflight()

        def work() -> None:
            self._acquire()
            log.info("delete: deleting checkpoint step %d (%s)", step, self.step_url(step))
            self._delete(step)

        self._on_coordinator(work)
        self._listed = None
        self._entries.pop(step, None)
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
        self._name(step)  # a non-negative int
        self._check_open()
        self._wait_inflight()

        def work() -> list[int]:
            self._acquire()
            gone = [s for s in reversed(self.steps()) if s >= step]
            for s in gone:
                log.info("rewind(%d): deleting checkpoint step %d (%s)", step, s, self.step_url(s))
                self._delete(s)
            # Manifest-less step folders from there on (an interrupted deletion) would block
            # saving their steps again: they are leftovers, and the run is going back over them.
            self.root.fs.invalidate_cache()
            for e in self.root.listdir():
                m = layout.STEP.fullmatch(e.name)
                if m and not e.is_link and int(m.group(1)) >= step:
                    log.info("rewind(%d): removing leftover %s", step, self.root.child(e.name).url)
                    try:
                        self.root.child(e.name).delete_tree()
                    except FileNotFoundError:
                        pass  # an object store's folder vanishes with its last object
            return gone

        gone = [int(s) for s in self._on_coordinator(work)]
        for s in gone:
            self._entries.pop(s, None)
            self._saved.discard(s)
        self._listed = None
        self._fell_back = self._fell_back - set(gone)
        self._skipped = self._skipped - set(gone)
        return gone

    def gc(self, *, grace: float | None = None) -> list[str]:
        """Remove leftovers of interrupted saves older than ``grace`` seconds; return what went.

        Leftovers are temporary directories, step folders without a manifest, and shard files a
        committed manifest does not name.  Committed checkpoints are never touched.  The same as
        :func:`ckptcore.gc`, under this manager's writer lock.  With a group, every rank calls
        it; rank 0 removes.
        """
        grace = layout.check_grace(grace)
        self._check_open()
        self._wait_inflight()

        def work() -> list[str]:
            self._acquire()
            return layout.remove_leftovers(self.root, grace, self._lock)

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
        :class:`CheckpointFallbackWarning` naming it; an explicit ``step`` never falls back.  A
        later ``save()`` of a skipped step's number replaces it (with a warning) if its data
        still fails to verify, so the resumed run can save where the corrupt checkpoint was
        (docs/RELIABILITY.md, "Restore and fallback").

        With a backup, the steps of both tiers are candidates, newest first, the local copy of a
        step before its replica: a damaged local copy falls back to its replica before an older
        step, and an empty or missing local root restores from the backup.  ``seed=True`` then
        copies the restored replica into the local root, so that the run goes on from a local
        tier that holds it.

        With a group, every rank restores the same step: rank 0 lists the steps, every rank
        reads its part of each candidate, and a step that fails on any rank is skipped by all.
        """
        if keys is not None:  # a usage error, not a step to fall back over
            wanted = [keys] if isinstance(keys, str) else list(keys)
            unknown = [k for k in wanted if k not in TrainingState.SECTIONS]
            if unknown:
                raise ValueError(f"unknown section(s) {unknown}; choose from {TrainingState.SECTIONS}")
            keys = wanted
        group = self.group

        def load(url: str, options: Mapping[str, Any]) -> TrainingState:
            return api.load_state(url, storage_options=options, keys=keys, like=like, group=group)

        if step is not None:
            where = self._where(step)
            if not where and self.root.child(self._name(step)).exists(MANIFEST_NAME):
                raise CheckpointNotFoundError(
                    f"{self.step_url(step)}: step {step} was committed by a writer after its "
                    "lease was taken over, so no reader accepts it (gc() removes it)")
            if not where:
                where = [("local", self.step_url(step), self._options)]  # its error names it
            tier, url, options = where[0]
            if group is None:  # streams: each tensor assigned once its own batch verified
                state = api.load_state(url, storage_options=options, keys=keys, like=like,
                                       **objects)
            else:
                state = load(url, options)
                self._restore_into(state, objects)
            if tier == "backup" and seed:
                self._seed_all(step)
            return state
        # Rank 0 of a group lists both tiers, and every rank tries the same steps in the same
        # tiers.  Without a group, the same listing here (a bucket out of reach: local only).
        # A listing whose every step is deleted while it is read (another writer's retention)
        # is made again, a few times: those steps were not damaged, just gone.
        for attempt in range(_RELISTS):
            plan = dict(self._plan() if group is None
                        else _dist.decide(self.root, group, self._plan))
            steps = sorted(plan)
            if not steps:
                where = self.root.url + (f" or {self.backup.root.url}" if self.backup else "")
                raise CheckpointNotFoundError(f"{where}: no committed checkpoints")
            last: Exception | None = None
            damaged: set[int] = set()
            passed: set[int] = set()
            gone = 0
            for s in reversed(steps):
                candidates = self._at(s, plan[s])
                for i, (tier, url, options) in enumerate(candidates):
                    try:
                        state = load(url, options)
                    except Exception as e:  # noqa: BLE001 - judged by _verdict
                        replica_next = any(t == "backup" for t, _, _ in candidates[i + 1:])
                        if self._verdict(s, tier, url, e, replica_next) == "raise":
                            raise
                        if tier == "local":
                            passed.add(s)
                            if _is_damage(e):
                                damaged.add(s)
                        gone += isinstance(e, CheckpointNotFoundError)
                        last = e
                        continue
                    self._restore_into(state, objects)
                    if tier == "backup":
                        log.info("restore: step %d restored from its replica %s", s, url)
                        if seed:
                            self._seed_all(s, replace=s in damaged)
                            damaged.discard(s)  # healed: the local copy is the replica's now
                    # Only a run that did resume from an older step may later save over these.
                    self._skipped = frozenset(damaged)
                    self._fell_back = frozenset(passed - {s})
                    return state
            if not gone or attempt + 1 == _RELISTS:
                break
            log.warning("restore: %d of the checkpoints listed under %s were deleted while they "
                        "were read (another writer's retention); listing again", gone,
                        self.root.url)
        raise CorruptCheckpointError(f"{self.root.url}: none of the {len(steps)} checkpoints "
                                     f"verifies; the last error was: {last}") from last

    def _verdict(self, step: int, tier: str, url: str, e: Exception, replica_next: bool) -> str:
        """After a candidate failed to load: ``"raise"`` or ``"next"`` (the step's replica, or an
        older step), warned and logged.  With a group every rank failed alike (the load agrees)
        and every rank follows rank 0's verdict, so that none falls back while another raises;
        no storage is touched here (ranks must not split over a listing that fails on one)."""
        if isinstance(e, GroupError):
            verdict = ["raise", "group"]  # a peer is gone: no other step loads without it
        elif isinstance(e, StorageError):
            # The store is out of reach: an older step would be no better.  A bucket out of
            # reach only means there is no replica to fall back on.
            verdict = ["next" if tier == "backup" else "raise", "unreachable"]
        else:  # any step that fails to decode or verify
            verdict = ["next", "invalid"]
        if self.group is not None:
            mine = verdict
            verdict = list(_dist.decide(self.root, self.group, lambda: mine))
        if verdict[0] == "raise":
            return "raise"
        if verdict[1] == "unreachable":
            log.warning("restore: the replica of step %d (%s) cannot be read (%s); the backup "
                        "is out of reach", step, url, e)
            return "next"
        fallback = "its replica" if replica_next else "an older one"
        warnings.warn(f"checkpoint step {step} ({url}) does not verify: {e}; falling back to "
                      + fallback, CheckpointFallbackWarning, stacklevel=3)
        log.warning("restore: checkpoint step %d (%s) does not load (%s: %s); falling back to %s",
                    step, url, type(e).__name__, e, fallback)
        return "next"

    def _plan(self) -> list[list[Any]]:
        """Rank 0 of a group: ``[step, [tier, ...]]`` for every committed step of either tier,
        from one listing of each (a backup out of reach: the local tier only, logged)."""
        local = set(self.steps() if self.root.exists() else [])
        remote: set[int] = set()
        if self.backup is not None:
            try:
                remote = set(self.backup.steps())
            except (CheckpointError, OSError) as e:
                log.warning("restore: the backup %s cannot be listed (%s); the local tier only",
                            self.backup.root.url, e)
        return [[s, [t for t, held in (("local", s in local), ("backup", s in remote)) if held]]
                for s in sorted(local | remote)]

    def _at(self, step: int, tiers: list[str]) -> list[tuple[str, str, Mapping[str, Any]]]:
        """``_tiers`` for the tiers rank 0 named."""
        out: list[tuple[str, str, Mapping[str, Any]]] = []
        for tier in tiers:
            if tier == "local":
                out.append(("local", self.step_url(step), self._options))
            elif tier == "backup" and self.backup is not None:
                out.append(("backup", self.backup.root.child(self._name(step)).url,
                            self.backup.options))
        return out

    def _where(self, step: int) -> list[tuple[str, str, Mapping[str, Any]]]:
        """Where ``step`` is, local first: asked here, or with a group of rank 0."""
        if self.group is None:
            return self._tiers(step)
        return self._at(step, _dist.decide(self.root, self.group,
                                           lambda: [t for t, _, _ in self._tiers(step)]))

    def _tiers(self, step: int) -> list[tuple[str, str, Mapping[str, Any]]]:
        """Where ``step`` is committed: ``(tier, url, storage options)``, local first."""
        out: list[tuple[str, str, Mapping[str, Any]]] = []
        name = self._name(step)
        if layout.is_committed(self.root, step):
            out.append(("local", self.step_url(step), self._options))
        if self.backup is not None and layout.is_committed(self.backup.root, step):
            out.append(("backup", self.backup.root.child(name).url, self.backup.options))
        return out

    def _seed_all(self, step: int, replace: bool = False) -> None:
        """restore(seed=True): copy the replica into the local root; with a group rank 0 does,
        and every rank learns whether it did."""
        if self.group is None:
            self._seed(step, replace)
        else:
            _dist.decide(self.root, self.group, lambda: self._seed(step, replace))

    def _seed(self, step: int, replace: bool = False) -> None:
        """Copy ``step``'s replica into the local root (restore(seed=True)); ``replace``: the
        local copy was found damaged, and the replica takes its place."""
        from ._replica import copy_checkpoint

        assert self.backup is not None
        name = self._name(step)
        dst = self.root.child(name)
        if dst.exists(MANIFEST_NAME):
            if not replace:
                log.info("restore: step %d is already under %s; not seeding it", step,
                         self.root.url)
                return
            self._acquire()
            # Checked again under the lock: a read that failed once (a flaky disk, another
            # writer's replacement meanwhile) does not delete a copy that verifies now.
            try:
                problems: list[Exception] = list(api.verify(dst.url,
                                                            storage_options=self._options))
            except CheckpointError as e:  # its manifest is unreadable: damaged too
                problems = [e]
            if not problems:
                log.info("restore: the local copy of step %d under %s verifies now; keeping it",
                         step, self.root.url)
                return
            log.warning("restore: replacing the damaged copy of step %d under %s (%s) with its "
                        "replica from %s", step, self.root.url, problems[0],
                        self.backup.root.url)
            self._delete(step)
        self._acquire()
        log.info("restore: seeding %s with step %d from %s", self.root.url, step,
                 self.backup.root.url)
        copy_checkpoint(self.backup.root.child(name), dst, dedup=False, fence=self._lock)
        self._listed = None

    def _restore_into(self, state: TrainingState, objects: dict) -> None:
        """Assign a loaded state to the objects; with a group, every rank succeeds or raises."""
        if self.group is None:
            api.restore_objects(state, objects)
        elif objects:
            _dist.agree(self.root, self.group, lambda: api.restore_objects(state, objects))

    # -- preemption -----------------------------------------------------------------------------
    @property
    def preempted(self) -> bool:
        """True once SIGTERM arrived (with ``save_on_preemption``): save and stop training."""
        self._asked = True
        return self._preempted

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
        self._asked = True
        if not self._preempted:
            return False
        self._check_open()
        self._wait_inflight()
        if step in self._committed():
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
        """Wait for the save in flight, release the writer lock; re-raise a background error."""
        if self._closed:
            return
        try:
            try:
                # With a backup: replicated (at most one more try per failing step, the run is
                # ending), and local retention applied after it.  With a group not collective:
                # a rank that closes early must not wait on the others; rank 0 raises.
                self._wait_inflight()
                if self.backup is not None:
                    self.backup.closing()
                    self._wait_backup()
            finally:
                if self.backup is not None:
                    self.backup.close()
        finally:
            self._closed = True
            _release_sigterm(self)
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


# -- SIGTERM ----------------------------------------------------------------------------------------
# One handler for the process, shared by every manager that wants it: installed by the first,
# restored to what it replaced when the last one closes (managers may close in any order).
_preemptible: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()
_previous: Any = None  # the handler ours replaced
_owner = 0  # the pid that installed it: a forked child (a data-loader worker) is not the trainer
_in_handler = False


def _on_sigterm(signum: int, frame: Any) -> None:
    # Runs in the main thread between two bytecodes: it only sets flags (no I/O, no locks).
    global _in_handler
    if _in_handler:  # a chained handler that chains back to us
        return
    _in_handler = True
    try:
        if os.getpid() != _owner:
            # A forked child (a data-loader worker) inherited the handler but trains nothing: its
            # parent stops it with SIGTERM, which must keep its previous effect here.
            previous = _previous if _previous is not None else signal.SIG_DFL
            signal.signal(signal.SIGTERM, previous)
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGTERM)
            return
        managers = list(_preemptible)
        for mgr in managers:
            mgr._preempted = True
        previous = _previous
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL and not any(m._asked for m in managers):
            # No loop ever checks for preemption: nobody would save and stop, so keep SIGTERM's
            # usual effect (the process ends, as it would without ckptcore).
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        _in_handler = False


def _catch_sigterm(mgr: CheckpointManager) -> None:
    global _previous, _owner
    current = signal.getsignal(signal.SIGTERM)
    if current is not _on_sigterm:
        if threading.current_thread() is not threading.main_thread():
            log.info("save_on_preemption: %r was created outside the main thread, where no "
                     "SIGTERM handler can be installed; SIGTERM is not caught", mgr)
            return
        if current is None:  # a handler installed from C: it could not be put back
            log.info("save_on_preemption: SIGTERM has a handler not installed from Python; "
                     "leaving it alone, SIGTERM is not caught")
            return
        _previous, _owner = current, os.getpid()
        signal.signal(signal.SIGTERM, _on_sigterm)
    _preemptible.add(mgr)


def _release_sigterm(mgr: CheckpointManager) -> None:
    global _previous
    _preemptible.discard(mgr)
    if (not _preemptible and signal.getsignal(signal.SIGTERM) is _on_sigterm
            and threading.current_thread() is threading.main_thread()):
        signal.signal(signal.SIGTERM, _previous if _previous is not None else signal.SIG_DFL)
        _previous = None


def _drain() -> None:
    # Interpreter exit waits for saves in flight, so a finished script never drops its last save.
    for mgr in list(_live):
        try:
            mgr.close()
        except BaseException as e:  # noqa: BLE001 - nothing left to raise to at exit
            what = "save or replication" if mgr.backup is not None else "save"
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
