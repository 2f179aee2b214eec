"""The backup tier of a CheckpointManager: committed steps replicated to a second root.

``CheckpointManager(root, backup=URL)`` saves to ``root`` (fast: local disk, tmpfs) and hands
each committed step to a :class:`BackupTier`, whose one background thread copies it to the
backup root with ``_replica.copy_checkpoint`` (verified source bytes, deduplicated blobs, the
manifest last with the commit protocol), then applies the backup's own retention and sweeps the
blobs no committed replica refers to.  ``save()`` never waits for it; ``wait()`` and
``close()`` do, and raise what failed.

Crashes.  A replica is visible only once its manifest is: a process killed mid-upload leaves
blobs and no manifest, never a half replica.  At the next start every local step the backup
lacks is queued again (in step order), and blobs already uploaded are found and not sent twice.

Deletion safety.  The backup root has its own writer lock (a lease on object stores), held by
the replicating thread: no other manager or ``ckpt sync`` replicates or sweeps there meanwhile.
Within the tier, replication, retention and sweeping run one after another on one thread.  The
sweep lists the blobs first, then reads every committed manifest, and removes only blobs that
no manifest refers to and that are older than the grace period (``gc_grace``): a blob written
for a replica whose manifest is not committed yet is young, and a blob that a committed manifest
names is never removed.  An unreadable manifest stops the sweep (its references are unknown).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from typing import Any, Iterator

from concurrent.futures import ThreadPoolExecutor

from . import _knobs, _meter, events
from ._cas import intent, sweep
from ._lock import WriterLock
from ._manifest import MANIFEST_NAME
from ._read import read_manifest
from ._replica import CopyStats, check_structure, copy_checkpoint, list_blob_objects
from ._steps import step_name
from ._retry import transient
from ._storage import CAS_PREFIX, Store, bucket_missing, check_url
from ._tier import Tier
from .errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError, StorageError
from .options import Backup, Lease
from .policies import as_policy

log = logging.getLogger("ckptcore")
_PAUSE_LIMIT = 60  # seconds a replication waits for one save before going on alongside it
_REACH_SECONDS = 10.0  # how long the check at construction waits for the backup root to answer


class BackupTier:
    """Replication of one manager's committed steps to ``url`` (see the module docstring)."""

    def __init__(self, local: Store, spec: Backup, *, lock: bool = True,
                 lease: Lease | None = None) -> None:
        self.local = local
        self.spec = spec
        url = check_url(spec.url, "backup")
        self.root = Store(url, dict(spec.storage_options or {}))
        if self.root.same_place(local):
            raise ValueError(f"backup={url!r} is the manager's own root {local.url!r} (spelled "
                             "another way); a backup must be another location")
        self.options = dict(spec.storage_options or {})
        self.policy = as_policy(spec.keep)
        self.dedup = spec.dedup
        lease = lease or Lease()
        self._lock = (WriterLock(self.root, lease_seconds=lease.seconds,
                                 heartbeat_seconds=lease.heartbeat) if lock else None)
        # (listed without the lock's view: the manager lists it from another thread)
        self.tier = Tier(self.root, self.options, lock=self._lock, view=False, what="replica")
        self._queue: collections.deque[int] = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        # What failed since the last wait(), by step (None: listing the backup at the start);
        # a step replicated on a later try drops its error.
        self._errors: dict[int | None, BaseException] = {}
        self._down = False  # the last step was given up on after every retry
        self._gave_up: set[int] = set()  # steps to retry once the backup answers again
        self._once: set[int] = set()  # steps queued again after an outage: one try each
        self._closing = threading.Event()  # close() started: no long waits between tries
        self._closed = False
        self._known: dict[str, Any] | None = None
        self._committed: set[int] | None = None  # replicas committed, as this tier knows them
        # Steps whose replica this tier saw committed and whole (copied and verified by it, or
        # found structurally whole: see confirmed()), including those its retention removed
        # since: the local tier need not keep them for the backup's sake.
        self._done: set[int] = set()
        # Steps a listing shows committed that nobody checked yet (a replica made by an earlier
        # run): counted as replicated only once confirmed() finds them whole.
        self._listed: set[int] = set()
        self._unlisted: str = ""  # why the backup could not be listed, while it cannot (logged once)
        self.last: CopyStats | None = None  # what the last replication moved
        self._copied: tuple[int, int] = (0, 0)  # its replica's tensor bytes and shards
        # When each step still to replicate was handed over (monotonic): the lag's seconds.
        self._handed: dict[int, float] = {}
        # Cleared while the manager saves: replication pauses between objects, so that a save
        # has the disk and the cores to itself (save() within 10% of a save without a backup).
        self._go = threading.Event()
        self._go.set()
        self._thread: threading.Thread | None = None
        self._intents: tuple[str, ...] = ()  # the upload intent of the replication in progress

    # -- what is where --------------------------------------------------------------------------
    def reach(self, timeout: float = _REACH_SECONDS) -> BaseException | None:
        """Whether the backup root answers now: one existence check (and a listing when it
        exists), given ``timeout`` seconds; returns what failed (a ``StorageError`` naming the
        URL when it took longer), or None.  ``CheckpointManager`` asks once at construction."""
        box: dict[str, BaseException | None] = {}

        def check() -> None:
            try:
                if self.root.exists():
                    self.root.listdir()
                box["error"] = None
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["error"] = e

        worker = threading.Thread(target=check, name="ckptcore-backup-check", daemon=True)
        worker.start()
        worker.join(timeout)
        if "error" not in box:  # still waiting on the store: the thread is left to finish
            return StorageError(f"{self.root.url}: the backup root did not answer within "
                                f"{timeout:g} s")
        return box["error"]

    def check_reachable(self, local_steps: list[int]) -> None:
        """The check at construction (one quick :meth:`reach`): raise now, naming the URL, when
        the run starts afresh (no local step: most likely a wrong URL, endpoint or credentials)
        or the answer is one retries cannot change (refused credentials, a permission).  A
        resumed run whose bucket is down for now goes on locally (logged): its steps are
        replicated once the bucket answers, and ``wait()``/``close()`` report what failed.  A
        bucket that does not exist (the store answered) is logged by :meth:`resume` and raised
        by ``wait()``/``close()``: saves go on locally meanwhile, and a later start replicates
        them once it is created."""
        error = self.reach()
        if error is None or bucket_missing(error):
            return
        url = self.root.url
        if local_steps and transient(error):
            log.warning("backup: %s does not answer now (%s: %s); training goes on with the "
                        "local tier, and its steps are replicated once it does", url,
                        type(error).__name__, error)
            return
        cls = CheckpointNotFoundError if isinstance(error, FileNotFoundError) else StorageError
        raise cls(f"backup={url!r} cannot be reached ({type(error).__name__}: {error}); check "
                  "its URL, endpoint and credentials (Backup(storage_options=...)). Nothing was "
                  "saved; a bucket that goes down later, during the run, is ridden out with "
                  "retries") from error

    def steps(self) -> list[int]:
        """Steps committed in the backup root, ascending (listed now)."""
        steps = self.tier.steps(missing_ok=True)
        with self._cond:
            self._committed = set(steps)
            self._listed = self._committed - self._done  # (unchecked: see confirmed())
        return steps

    def replicated(self, step: int) -> bool:
        """Whether ``step``'s replica was committed whole (as of this tier's last listing or
        copy; the backup's own retention may have removed it since): see :meth:`confirmed`."""
        return step in self.confirmed([step])

    def confirmed(self, steps: list[int]) -> set[int]:
        """Those of ``steps`` whose replica this tier copied and verified, or that a listing
        shows and that pass the structural check (the manifest decodes, every object it names
        is there with its size; not every byte's checksum).  A listed replica is checked once,
        when first asked (the local retention asks only of the steps it is about to delete, so
        a run resumed over thousands of steps pays no start-up cost); a broken one is queued to
        be replicated again (logged).  A backup that cannot be listed or read now confirms
        nothing new (logged): the local tier keeps its steps, and save() goes on."""
        with self._cond:
            unknown = self._committed is None
        if unknown:  # the listing at the start failed: try again now
            try:
                self.steps()
            except (CheckpointError, OSError) as e:
                self._unreachable(e)
                with self._cond:
                    return {s for s in steps if s in self._done}
        with self._cond:
            done = {s for s in steps if s in self._done}
            todo = sorted({s for s in steps if s in self._listed} - done)
        if todo:
            done |= self._check_listed(todo)
        return done

    def _unreachable(self, error: BaseException) -> None:
        """The backup could not be listed for :meth:`confirmed`: logged once per outage."""
        why = f"{type(error).__name__}: {error}"
        with self._cond:
            first, self._unlisted = not self._unlisted, why
        if first:
            log.warning("backup: %s cannot be listed or read (%s); its steps count as not replicated "
                        "(the local tier keeps them) until it can be", self.root.url, why)

    def _check_listed(self, steps: list[int]) -> set[int]:
        """The structural check of listed replicas (:meth:`confirmed`): their manifests read
        concurrently, the blobs listed once for all of them."""
        def read(step: int) -> Any:
            try:
                return read_manifest(self.tier.step_store(step))
            except (CheckpointError, OSError) as e:  # judged below: the store, or the replica
                return e
        with ThreadPoolExecutor(min(len(steps), max(1, self.root.writers)),
                                thread_name_prefix="ckptcore-confirm") as pool:
            read_back = dict(zip(steps, pool.map(read, steps)))
        listing = None
        good: set[int] = set()
        failed = False
        for step, got in read_back.items():
            if isinstance(got, StorageError) or (isinstance(got, OSError) and not isinstance(
                    got, (CheckpointError, FileNotFoundError))):
                self._unreachable(got)  # (EIO, EACCES of a local backup: the store, not the replica)
                failed = True
                continue
            problem: BaseException | None = None if not isinstance(got, BaseException) else got
            if problem is None:
                try:
                    if listing is None and any(s.path.startswith(CAS_PREFIX) for s in got.shards):
                        listing = list_blob_objects(self.root)
                    problems = check_structure(self.tier.step_store(step), got, listing)[1]
                except (CheckpointError, OSError) as e:
                    self._unreachable(e)
                    failed = True
                    continue
                problem = problems[0] if problems else None
            if problem is None:
                good.add(step)
            else:
                self._broken(step, problem)
        with self._cond:
            self._done |= good
            self._listed -= good
            if not failed:
                self._unlisted = ""  # reachable again: the next outage is logged anew
        return good

    def _broken(self, step: int, problem: BaseException) -> None:
        """A listed replica failed the structural check: not replicated; queued again if the
        local step is still there."""
        with self._cond:
            self._listed.discard(step)
            if self._committed is not None:
                self._committed.discard(step)
            again = not self._closed
        again = again and self.local.child(step_name(step)).exists(MANIFEST_NAME)
        log.warning("backup: the replica of step %d in %s %s (%s: %s); it does not count as "
                    "replicated%s", step, self.root.url,
                    "was deleted since it was listed" if isinstance(problem, FileNotFoundError)
                    else "is broken", type(problem).__name__, problem,
                    "; replicating it again" if again else "")
        if again:
            self.enqueue(step)

    def pending(self) -> list[int]:
        with self._cond:
            return list(self._queue)

    def lag(self) -> events.Lag:
        """How far this tier is behind the local one: the steps handed to it that it has no
        replica of yet (queued, being copied, or given up on until it answers again), and the
        seconds since the oldest of them was handed over."""
        with self._cond:
            return self._lag()

    # -- replication ----------------------------------------------------------------------------
    def resume(self, local_steps: list[int]) -> list[int]:
        """Queue every local step the backup lacks (a run that died before replicating).  A
        backup out of reach is logged and kept for ``wait()``: training goes on locally."""
        try:
            have = set(self.steps())
        except (CheckpointError, OSError) as e:
            log.error("backup: %s cannot be listed (%s: %s); the local steps are kept until it "
                      "can be", self.root.url, type(e).__name__, e)
            with self._cond:
                self._errors[None] = e
            have = set()
        missing = [s for s in local_steps if s not in have]
        for s in missing:
            log.info("backup: step %d under %s has no committed replica in %s; replicating it",
                     s, self.local.url, self.root.url)
            self.enqueue(s)
        return missing

    def enqueue(self, step: int) -> None:
        with self._cond:
            if self._closed:
                raise ValueError("this backup tier is closed")
            if step not in self._queue:
                self._queue.append(step)
                self._handed.setdefault(step, time.monotonic())
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ckptcore-backup",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                step = self._queue[0]
                self._busy = True
            meter, before = _meter.Meter(), self.last
            try:
                with _meter.measuring(meter):
                    error = self._attempts(step)
            except BaseException as e:  # noqa: BLE001 - this thread must not die: wait() would hang
                error = e
            event = None
            try:
                if error is not None:  # kept for wait()/close(); the next steps still go
                    log.error("backup: replicating step %d to %s failed: %s: %s", step,
                              self.root.url, type(error).__name__, error)
                    with self._cond:
                        self._errors[step] = error
            finally:
                with self._cond:
                    if self._queue and self._queue[0] == step:
                        self._queue.popleft()
                    if step not in self._gave_up and step not in self._queue:
                        self._handed.pop(step, None)
                    if self.last is not before or error is not None:  # a copy ran, or failed
                        event = self._event(step, meter, error)
                # Still busy: wait() returns once the event is out (callbacks run unlocked).
                self._emit(event)
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _lag(self) -> events.Lag:
        """:meth:`lag`, under ``self._cond``."""
        behind = set(self._queue) | set(self._gave_up)
        since = [self._handed[s] for s in behind if s in self._handed]
        return events.Lag(self.root.url, len(behind),
                          time.monotonic() - min(since) if since else 0.0)

    def _event(self, step: int, meter: _meter.Meter, error: BaseException | None
               ) -> events.BackupEvent:
        """The :class:`ckptcore.events.BackupEvent` of a replication that ran (or failed)."""
        figures = _meter.figures(meter)
        figures["seconds_blocked"] = 0.0  # nobody waited for it
        stats = self.last if error is None else None
        nbytes = dedup = 0
        if stats is not None:
            figures.update(bytes_written=stats.written, shards=self._copied[1])
            nbytes, dedup = self._copied[0], stats.reused_bytes
        return events.BackupEvent(
            url=self.tier.step_url(step), root=self.root.url, step=step, tier=self.root.url,
            bytes=nbytes, bytes_deduplicated=dedup, replication_lag=(self._lag(),),
            error=None if error is None else type(error).__name__, **figures)

    @staticmethod
    def _emit(event: events.BackupEvent | None) -> None:
        if event is None:
            return
        try:
            events.emit(event)
        except Exception:  # noqa: BLE001 - a broken log handler: this thread must not die
            log.exception("backup: reporting the replication of step %s failed", event.step)

    def _schedule(self, step: int) -> tuple[int, int, float, str]:
        """How many tries ``step`` gets, how many the knobs' full schedule has, the first wait
        between them, and why it gets fewer ("" when it does not): the full schedule for a new
        step; one try while the backup is known to be down, for a step retried after it came
        back, and once close() started (at most two then: the run is ending)."""
        retries, delay = _knobs.backup_retries(), _knobs.backup_retry_seconds()
        if int(retries) != retries or retries < 0 or not delay >= 0:
            raise ValueError(f"the knobs backup_retries={retries!r} (a whole number >= 0) and "
                             f"backup_retry_seconds={delay!r} (>= 0) do not make a schedule")
        tries = full = 1 + int(retries)
        why = ""
        if self._down:
            tries, why = 1, "the backup was down at the last step's tries"
        elif step in self._once:
            tries, why = 1, "a step given up on earlier, retried once the backup answered again"
        elif self._closing.is_set():
            tries, why = min(tries, 2), "close() started"
        return tries, full, float(delay), (why if tries < full else "")

    def _attempts(self, step: int) -> BaseException | None:
        """Replicate ``step``, trying again after a store failure with a doubling wait (see
        ``_schedule``).  Returns what failed last, or None.  A success also queues again the
        steps given up on while the backup was down."""
        tries, full, delay, short = self._schedule(step)
        self._once.discard(step)
        attempt = 0
        while True:
            attempt += 1
            try:
                with self._uploading():
                    done = self._replicate(step)
            except BaseException as e:  # noqa: BLE001 - judged below, raised by wait()
                if not transient(e):
                    return e
                if attempt >= tries:
                    # The count said here is the one the "try n of m" lines announced last.
                    log.warning("backup: giving up on step %d for now (%s)%s; it is kept "
                                "under %s and tried again after the next replication that "
                                "succeeds, or at the next start", step,
                                "1 try" if attempt == 1 else f"{attempt} tries",
                                f", not the {full} of the full schedule: {short}" if short else "",
                                self.local.url)
                    self._down = True
                    self._gave_up.add(step)
                    return e
                closing = self._closing.is_set()
                if closing:  # close() started: no waiting, and this next try is the last
                    delay = 0.0
                    if tries > attempt + 1:
                        tries, short = attempt + 1, "close() started"
                log.warning("backup: replicating step %d to %s failed (%s: %s); trying again "
                            "in %.3g s (try %d of %d%s)", step, self.root.url, type(e).__name__,
                            e, delay, attempt + 1, tries,
                            f", the last: {short}" if short and attempt + 1 == tries else "")
                if not closing and self._closing.wait(delay) and tries > attempt + 1:
                    tries, short = attempt + 1, "close() started"  # one last try, at once
                    log.warning("backup: close() started: step %d gets one last try now "
                                "(try %d of %d)", step, attempt + 1, tries)
                delay = min(2 * delay, 60.0)
                continue
            if not done:  # its local copy is gone: nothing learnt about the backup
                return None
            self._down = False
            with self._cond:
                self._errors.pop(step, None)
                self._errors.pop(None, None)  # the backup answers: a failed listing is stale
            self._gave_up.discard(step)
            self._requeue_given_up()
            return None

    def _requeue_given_up(self) -> None:
        with self._cond:
            again = sorted(s for s in self._gave_up if s not in self._queue)
            self._gave_up.clear()
            for s in again:
                log.info("backup: the backup %s answers again; retrying step %d", self.root.url, s)
                self._once.add(s)  # one try each: a step failing for its own reasons costs little
                self._queue.append(s)

    def _replicate(self, step: int) -> bool:
        """Copy ``step`` to the backup (False: its local copy is gone, nothing was done)."""
        name = step_name(step)
        if self._lock is not None:
            self._lock.acquire()
        dst = self.root.child(name)
        src = self.local.child(name)
        if dst.exists(MANIFEST_NAME) and not self.tier.has(step):
            # Committed by a replicator after its lease was taken over: no reader accepts it.
            log.warning("backup: removing %s, committed by a writer after its lease was taken "
                        "over, to replicate step %d again", dst.url, step)
            self.tier.delete(step)
        there = self._readable_replica(step, dst)
        if there is not None:
            here = read_manifest(src) if src.exists(MANIFEST_NAME) else None
            if here is None or here.writer.get("id") == there.writer.get("id"):
                problems = check_structure(dst, there)[1]
                if not problems:
                    log.info("backup: step %d is already in %s", step, self.root.url)
                    self._committed_now(step)
                    return True
                if here is None:
                    raise problems[0]
                log.warning("backup: the replica of step %d in %s is broken (%s); replicating "
                            "it again", step, self.root.url, problems[0])
                self.tier.delete(step)
            elif not here.created > there.created:
                raise CheckpointExistsError(
                    f"backup: {dst.url} holds another checkpoint of step {step} (writer "
                    f"{there.writer.get('id')}, saved after the local one): not replacing it; "
                    "is another run replicating to this backup root?")
            # The local step was saved again (a run resumed from before it): its replica is stale.
            else:
                log.warning("backup: replacing the replica of step %d in %s: the local step "
                            "was saved again since (writer %s, was %s)", step, self.root.url,
                            here.writer.get("id"), there.writer.get("id"))
                self.tier.delete(step)
        if not src.exists(MANIFEST_NAME):
            log.warning("backup: step %d is no longer under %s (deleted before it was "
                        "replicated); skipping it", step, self.local.url)
            return False
        if self._known is None and self.dedup:
            self._known = {}  # blobs this tier uploaded or verified; each copy lists the root
        log.info("backup: replicating step %d to %s", step, self.root.url)
        out, self.last = copy_checkpoint(src, dst, dedup=self.dedup, known=self._known,
                                         gate=self._gate, fence=self._lock)
        self._copied = (out.tensors.nbytes(), len(out.shards))
        self._committed_now(step)
        return True

    def _readable_replica(self, step: int, dst: Store) -> Any:
        """The manifest of ``step``'s replica if one is committed; one that does not decode (a
        damaged or truncated manifest) is no replica: deleted (logged), to be copied again."""
        if not dst.exists(MANIFEST_NAME):
            return None
        try:
            return read_manifest(dst)
        except (StorageError, FileNotFoundError):
            raise  # the store, or deleted meanwhile: judged by the retries
        except CheckpointError as e:
            log.warning("backup: the replica of step %d in %s cannot be read (%s: %s); "
                        "replicating it again", step, self.root.url, type(e).__name__, e)
            self.tier.delete(step)
            return None

    def _committed_now(self, step: int) -> None:
        with self._cond:
            if self._committed is not None:
                self._committed.add(step)
            self._done.add(step)
        self._retention()

    @contextlib.contextmanager
    def _uploading(self) -> Iterator[None]:
        """A replication, under the backup root's lock and with its upload intent recorded (the
        tier's own sweep, after the replica is committed, passes over its own intent)."""
        if self._lock is not None:
            self._lock.acquire()
        if not self.dedup:
            yield
            return
        lock = self._lock
        with intent(self.root, None if lock is None else lock.generation,
                    "unlocked" if lock is None else lock.holder) as name:
            self._intents = (name,)
            try:
                yield
            finally:
                self._intents = ()

    def _retention(self) -> None:
        gone = self.tier.retain(self.policy)
        with self._cond:
            if self._committed is not None:
                self._committed -= set(gone)
            # (the backup's own policy removed them: the local tier need not keep them for it)
            self._done |= set(gone) & self._listed
            self._listed -= set(gone)
        if gone and self.dedup:
            for url in sweep(self.root, _knobs.gc_grace(), fence=self._lock,
                             own=self._intents):
                if self._known is not None:
                    self._known.pop("cas:" + url.rsplit("/", 1)[-1], None)

    def _gate(self) -> None:
        if not self._go.wait(_PAUSE_LIMIT):
            log.debug("backup: a save took over %d s; replicating alongside it", _PAUSE_LIMIT)

    def pause(self) -> None:
        """The manager starts a save: replication waits at its next object."""
        self._go.clear()

    def proceed(self) -> None:
        self._go.set()

    # -- waiting --------------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> None:
        """Block until every queued step is replicated; raise the first error since the last
        wait (the others are logged)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"backup: {len(self._queue)} step(s) still to replicate "
                                       f"to {self.root.url}")
                self._cond.wait(left)
            errors, self._errors = list(self._errors.values()), {}
        if errors:
            raise errors[0]

    def closing(self) -> None:
        """The manager is closing: at most one more try per failing step, without long waits."""
        self._closing.set()

    def close(self) -> None:
        self.closing()
        try:
            self.wait()
        finally:
            with self._cond:
                self._closed = True
                self._cond.notify_all()
            if self._thread is not None:
                self._thread.join()
            if self._lock is not None:
                try:
                    self._lock.release()
                except (CheckpointError, OSError) as e:  # its lease expires by itself
                    log.warning("backup: releasing the writer lock of %s failed (%s: %s); its "
                                "lease expires by itself", self.root.url, type(e).__name__, e)
