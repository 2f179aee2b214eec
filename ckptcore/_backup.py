"""The backup tier of a CheckpointManager: committed steps replicated to a second root.

``CheckpointManager(root, backup=URL)`` saves to ``root`` (fast: local disk, tmpfs) and hands
each committed step to a :class:`BackupTier`, whose one background thread copies it to the
backup root with ``_replica.copy_checkpoint`` (verified source bytes, deduplicated chunks, the
manifest last with the commit protocol), then applies the backup's own retention and sweeps the
chunks no committed replica refers to.  ``save()`` never waits for it; ``wait()`` and
``close()`` do, and raise what failed.

Crashes.  A replica is visible only once its manifest is: a process killed mid-upload leaves
chunks and no manifest, never a half replica.  At the next start every local step the backup
lacks is queued again (in step order), and chunks already uploaded are found and not sent twice.

Deletion safety.  The backup root has its own writer lock (a lease on object stores), held by
the replicating thread: no other manager or ``ckpt sync`` replicates or sweeps there meanwhile.
Within the tier, replication, retention and sweeping run one after another on one thread.  The
sweep lists the chunks first, then reads every committed manifest, and removes only chunks that
no manifest refers to and that are older than the grace period (``gc_grace``): a chunk written
for a replica whose manifest is not committed yet is young, and a chunk that a committed manifest
names is never removed.  An unreadable manifest stops the sweep (its references are unknown).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import logging
import threading
import time
import uuid
from typing import Any, Iterator, Mapping

from . import _fence, _knobs, layout
from ._lock import WriterLock
from ._manifest import MANIFEST_NAME
from ._replica import (CopyStats, check_structure, chunk_rel, copy_checkpoint, list_chunks,
                       references)
from ._storage import Store, bucket_missing, check_url, error_chain
from .errors import CheckpointError, CheckpointExistsError, FencedError, LockedError, StorageError
from .policies import CheckpointEntry, as_policy

log = logging.getLogger("ckptcore")
_PAUSE_LIMIT = 60  # seconds a replication waits for one save before going on alongside it
_REACH_SECONDS = 10.0  # how long the check at construction waits for the backup root to answer


INTENT_DIR = ".ckptcore.intents"
_INTENT_MAX_AGE = 24 * 3600.0  # an unlocked uploader's intent is honoured this long
_INTENT_SLACK = 60.0  # seconds of clock skew between an uploader and the store


@contextlib.contextmanager
def intent(root: Store, generation: int | None, holder: str) -> Iterator[str]:
    """Record, while the block runs, that chunks are being uploaded under ``root`` (a sweep keeps
    every chunk written since, unless ``generation`` was fenced meanwhile: its replica can then
    never be accepted).  Removed after; one left by a killed uploader is fenced by the next
    holder's generation (or, unlocked, expires after a day) and removed by the next sweep."""
    name = f"{INTENT_DIR}/{uuid.uuid4().hex}.json"
    root.makedirs(INTENT_DIR)
    root.write_bytes(name, json.dumps({"generation": generation, "holder": holder,
                                       "started": time.time()}).encode())
    try:
        yield name
    finally:
        try:
            root.delete(name)
        except Exception as e:  # noqa: BLE001 - a leftover intent only delays the sweep
            log.warning("backup: could not remove the upload intent %s (%s: %s)",
                        root.join(name), type(e).__name__, e)


def live_intents(root: Store, own: tuple[str, ...] = ()) -> tuple[float | None, list[str]]:
    """The start of the oldest upload in progress under ``root`` that a sweep must honour (None:
    none; the sweeper's ``own`` intents aside), and the stale intents (fenced generations,
    expired) a sweep may remove."""
    newest = max(_fence.generations(root), default=0)
    oldest, stale = None, []
    for e in root.listdir(INTENT_DIR):
        rel = f"{INTENT_DIR}/{e.name}"
        if rel in own:
            continue
        try:
            body = json.loads(root.read(rel, max_bytes=1 << 16))
            started, g = float(body["started"]), body.get("generation")
        except (ValueError, KeyError, TypeError, OSError, CheckpointError):
            started, g = (e.mtime or time.time()), None  # unreadable: honoured by its age
        fenced = isinstance(g, int) and g < newest
        if fenced or time.time() - started > _INTENT_MAX_AGE:
            stale.append(rel)
        else:
            oldest = started if oldest is None else min(oldest, started)
    return oldest, stale


def sweep(root: Store, grace: float, fence: Any = None, own: tuple[str, ...] = ()) -> list[str]:
    """Remove chunks under ``root`` that no committed manifest refers to, that are older than
    ``grace`` seconds and that no upload in progress may name (``intent``); returns their URLs.
    The caller holds ``root``'s writer lock (``fence``: checked before deleting)."""
    from .api import read_manifest

    chunks = list_chunks(root)  # first: a chunk listed here and referenced later is kept below
    referenced: set[str] = set()
    for _, name in layout.committed_steps(root):
        try:
            referenced |= references(read_manifest(root.child(name)))
        except CheckpointError as e:
            log.warning("backup: not sweeping chunks under %s: the manifest of %s cannot be read "
                        "(%s), so what it refers to is unknown", root.url, name, e)
            return []
    uploading, stale = live_intents(root, own)
    cutoff = time.time() - grace
    if uploading is not None:
        log.info("backup: an upload to %s is in progress since %s: keeping every chunk written "
                 "since", root.url, time.strftime("%H:%M:%S", time.localtime(uploading)))
        cutoff = min(cutoff, uploading - _INTENT_SLACK)
    doomed = [n for n, (_, mtime) in sorted(chunks.items())
              if n not in referenced and mtime is not None and mtime <= cutoff]
    # (a store that gives no time: a chunk's age is unknown, so it is kept)
    if (doomed or stale) and fence is not None:
        fence.before_delete()
    removed = []
    for name in doomed:
        url = root.join(chunk_rel(name))
        log.info("backup: removing chunk %s, which no committed replica refers to", url)
        root.delete(chunk_rel(name))
        removed.append(url)
    for rel in stale:
        log.info("backup: removing the stale upload intent %s (its uploader was superseded or "
                 "is long gone)", root.join(rel))
        root.delete(rel)
    return removed


def retain(root: Store, policy: Any, options: Mapping[str, Any], *,
           dry_run: bool = False, fence: Any = None) -> list[int]:
    """Apply ``policy`` to the committed steps under ``root`` (the newest, and any whose manifest
    cannot be read, always kept): delete the others, manifest first; return them.  Nothing is
    deleted unless the newest step passes the reader's structural checks
    (``layout.structure_problem``).  ``dry_run``: only say which.  ``fence``: the writer lock,
    checked before each deletion."""
    from . import api
    from .manager import saved_metrics

    steps = [s for s, _ in layout.committed_steps(root)] if root.exists() else []
    if len(steps) < 2:
        return []
    entries = []
    for s in steps:
        try:
            info = api.inspect(root.child(layout.step_name(s)).url, storage_options=options)
        except CheckpointError:
            continue  # unreadable: kept (a policy cannot judge it)
        entries.append(CheckpointEntry(s, info.created, saved_metrics(s, info.metadata)))
    keep = set(as_policy(policy).keep(entries)) | {steps[-1]}
    keep |= set(steps) - {e.step for e in entries}
    gone = [s for s in steps[:-1] if s not in keep]
    if gone and not dry_run:
        problem = layout.structure_problem(root.child(layout.step_name(steps[-1])))
        if problem:
            log.warning("retention: not deleting steps %s under %s: the newest step %d, which "
                        "supersedes them, does not pass the reader's checks (%s)", gone,
                        root.url, steps[-1], problem)
            return []
    for s in gone:
        if dry_run:
            continue
        if fence is not None:
            fence.before_delete()
        log.info("retention: deleting replica step %d under %s", s, root.url)
        ckpt = root.child(layout.step_name(s))
        ckpt.delete(MANIFEST_NAME)  # uncommit first
        ckpt.delete_tree()
    return gone


# Store answers worth another try (throttling, a server's own failure) and those that are not
# (credentials, permissions, a missing bucket), as S3, GCS and Azure spell them.
_TRANSIENT_CODES = frozenset({"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout",
                              "Throttling", "ThrottlingException", "TooManyRequests",
                              "RequestLimitExceeded", "ServerBusy", "OperationTimedOut",
                              "500", "502", "503", "504"})
_PERMANENT_CODES = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                              "NoSuchBucket", "AllAccessDisabled", "InvalidBucketName",
                              "AccountProblem", "AuthenticationFailed", "AuthorizationFailure",
                              "ContainerNotFound", "403", "404"})
_PERMANENT_CLASSES = frozenset({"NoCredentialsError", "PartialCredentialsError",
                                "CredentialRetrievalError", "ClientAuthenticationError",
                                "DefaultCredentialsError", "RefreshError"})
# errno values of a network or a server failing for now (s3fs maps SlowDown and
# ServiceUnavailable to EBUSY, InternalError to EREMOTEIO).
_TRANSIENT_ERRNOS = frozenset(getattr(errno, n) for n in (
    "EBUSY", "EAGAIN", "ETIMEDOUT", "ECONNRESET", "ECONNREFUSED", "ECONNABORTED", "EPIPE",
    "EREMOTEIO", "ENETUNREACH", "EHOSTUNREACH", "ENETDOWN") if hasattr(errno, n))


def _code(e: BaseException) -> str:
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        return str((response.get("Error") or {}).get("Code", ""))
    return str(getattr(e, "error_code", "") or getattr(e, "code", "") or "")


def transient(e: BaseException) -> bool:
    """Whether a failed replication may succeed if tried again: the store or the network failing
    for now (an outage, a reset connection, throttling, a server error) or another writer's
    lock; not a missing bucket, missing or refused credentials, a permission, a damaged source
    or a bug."""
    chain = error_chain(e)
    if any(type(x).__name__ in _PERMANENT_CLASSES or _code(x) in _PERMANENT_CODES
           or isinstance(x, PermissionError) for x in chain) or bucket_missing(e):
        return False
    if isinstance(e, FencedError):
        return False  # another writer took this root over: for good
    if isinstance(e, LockedError):
        return True
    if isinstance(e, CheckpointError) and not isinstance(e, StorageError):
        return False  # damaged or incomplete source, schema, usage
    if any(_code(x) in _TRANSIENT_CODES for x in chain):
        return True
    if isinstance(e, StorageError):
        return True  # the store failing: what ckptcore's storage layer wraps is network trouble
    if isinstance(e, (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    return isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS


class BackupTier:
    """Replication of one manager's committed steps to ``url`` (see the module docstring)."""

    def __init__(self, local: Store, url: str, *, keep: Any = None,
                 storage_options: Mapping[str, Any] | None = None, dedup: bool = True,
                 lock: bool = True, lease_seconds: float | None = None,
                 heartbeat_seconds: float | None = None) -> None:
        self.local = local
        self.root = Store(check_url(url, "backup"), dict(storage_options or {}))
        if self.root.same_place(local):
            raise ValueError(f"backup={url!r} is the manager's own root {local.url!r} (spelled "
                             "another way); a backup must be another location")
        self.options = dict(storage_options or {})
        self.policy = as_policy(keep)
        self.dedup = dedup
        self._lock = (WriterLock(self.root, lease_seconds=lease_seconds,
                                 heartbeat_seconds=heartbeat_seconds) if lock else None)
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
        # Steps whose replica this tier saw committed, including those its retention removed
        # since: the local tier need not keep them for the backup's sake.
        self._done: set[int] = set()
        self.last: CopyStats | None = None  # what the last replication moved
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

    def steps(self) -> list[int]:
        """Steps committed in the backup root, ascending (listed now)."""
        steps = [s for s, _ in layout.committed_steps(self.root)] if self.root.exists() else []
        with self._cond:
            self._committed = set(steps)
            self._done |= self._committed
        return steps

    def replicated(self, step: int) -> bool:
        """Whether ``step``'s replica was committed (as of this tier's last listing or copy;
        the backup's own retention may have removed it since)."""
        with self._cond:
            if self._committed is not None:
                return step in self._done
        return step in self.steps() or step in self._done

    def pending(self) -> list[int]:
        with self._cond:
            return list(self._queue)

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
            try:
                error = self._attempts(step)
            except BaseException as e:  # noqa: BLE001 - this thread must not die: wait() would hang
                error = e
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
                    self._busy = False
                    self._cond.notify_all()

    def _schedule(self, step: int) -> tuple[int, int, float, str]:
        """How many tries ``step`` gets, how many the knobs' full schedule has, the first wait
        between them, and why it gets fewer ("" when it does not): the full schedule for a new
        step; one try while the backup is known to be down, for a step retried after it came
        back, and once close() started (at most two then: the run is ending)."""
        retries, delay = _knobs.get("backup_retries"), _knobs.get("backup_retry_seconds")
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
        from .api import read_manifest

        name = layout.step_name(step)
        if self._lock is not None:
            self._lock.acquire()
        dst = self.root.child(name)
        src = self.local.child(name)
        if dst.exists(MANIFEST_NAME) and not layout.is_committed(self.root, step):
            # Committed by a replicator after its lease was taken over: no reader accepts it.
            log.warning("backup: removing %s, committed by a writer after its lease was taken "
                        "over, to replicate step %d again", dst.url, step)
            self._uncommit(dst)
        if dst.exists(MANIFEST_NAME):
            there = read_manifest(dst)
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
                self._uncommit(dst)
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
                self._uncommit(dst)
        if not src.exists(MANIFEST_NAME):
            log.warning("backup: step %d is no longer under %s (deleted before it was "
                        "replicated); skipping it", step, self.local.url)
            return False
        if self._known is None and self.dedup:
            self._known = {}  # chunks this tier uploaded or verified; each copy lists the root
        log.info("backup: replicating step %d to %s", step, self.root.url)
        _, self.last = copy_checkpoint(src, dst, dedup=self.dedup, known=self._known,
                                       gate=self._gate, fence=self._lock)
        self._committed_now(step)
        return True

    def _uncommit(self, dst: Store) -> None:
        if self._lock is not None:
            self._lock.before_delete()
        dst.delete(MANIFEST_NAME)  # uncommit first
        dst.delete_tree()

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
        gone = retain(self.root, self.policy, self.options, fence=self._lock)
        with self._cond:
            if self._committed is not None:
                self._committed -= set(gone)
        if gone and self.dedup:
            for url in sweep(self.root, float(_knobs.get("gc_grace")), fence=self._lock,
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
