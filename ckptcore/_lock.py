"""The writer lock on a manager's root, and taking over the lock of a writer that is gone.

Local disk: an OS lock (``flock``) on ``<root>/.ckptcore.lock``; the kernel drops it when the
process dies, so a crashed run never blocks its own resume.  The file also records the holder;
a clean release empties it, so a holder recorded in a file whose flock is free is a writer that
died holding it, and its successor says so (:class:`LockTakeoverWarning`).

Object stores: a lease object created with a create-only PUT, recording its holder (host, pid,
the pid namespace and boot of its machine, the process's start time) and when it was last
renewed.  A daemon thread renews it every ``heartbeat_seconds`` while the writer lives (a
thread, not the saves: a run may train far longer than a lease lasts between two saves).  The
lease is taken over, with a warning naming the old holder, when its holder is provably gone:

* it was not renewed within ``lease_seconds`` (its host died, was preempted, or hangs), or
* it was taken on this machine by a process that no longer exists (a SIGKILLed run resumed on
  the same machine does not wait at all), or by a manager of this process that is gone.

A live holder is never taken over.  The holder checks that the lease is still its own on every
save; a writer whose lease lapsed and was taken over stops (``LockedError``) instead of writing
beside the new holder, and it never deletes a lease that is not its own.

Fencing (``_fence``): every acquisition, local or remote, also claims a new *generation* of the
root with a create-only write, and every manifest the holder commits records it.  The lock is the
``fence`` of its saves: ``before_commit()`` raises :class:`FencedError` once a newer generation
exists, and a writer whose own renewal is overdue (a pause, a heartbeat starved of the GIL) first
claims a new generation, the one step a taker would race it for, instead of renewing a lease that
may be being taken over.  ``after_commit()`` catches the commit that landed after a takeover
anyway (a pause between the check and the PUT): readers ignore it, and the writer is told.  A
superseded writer never re-creates the lease and never deletes anything.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
import threading
import time
import uuid
import weakref
from typing import Any, Sequence

from . import _fence, _knobs, _meter
from ._storage import Store, file_kind
from .errors import (CheckpointError, FencedError, LockedError, LockTakeoverWarning, UnsafeCheckpointError,
                     caller_level, warn_and_log)

__all__ = ["WriterLock", "LockTakeoverWarning", "LOCK_NAME"]

LOCK_NAME = ".ckptcore.lock"
_HELD: set[tuple[int, int]] = set()  # (st_dev, st_ino) of lock files this process's locks hold
# The finalizers of the flocks this process holds.  A forked child (a data-loader worker, a pool)
# inherits their descriptors, and a flock lives while any descriptor of it is open: after the
# parent is SIGKILLed, orphaned children would keep the root locked.  So a child closes its copies
# at once (the parent's lock is unaffected) and forgets them.
_FLOCK_FDS: dict[int, weakref.finalize] = {}


def _forget_in_child() -> None:
    for fd, closer in list(_FLOCK_FDS.items()):
        closer.detach()  # never truncate the parent's holder record, nor close a reused number
        try:
            os.close(fd)
        except OSError:
            pass
    _FLOCK_FDS.clear()
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
# Leases held by this process, by token: a lease naming this pid whose token is not here belongs
# to a manager that was dropped or closed without releasing it (its holder is provably gone).
_LIVE: weakref.WeakValueDictionary[str, WriterLock] = weakref.WeakValueDictionary()
log = logging.getLogger("ckptcore")


def _close_held(fd: int, key: tuple[int, int]) -> None:
    _HELD.discard(key)
    _FLOCK_FDS.pop(fd, None)
    try:
        os.ftruncate(fd, 0)  # an empty file: released cleanly, nobody to warn about
    except OSError:
        pass
    os.close(fd)


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    """The start time of process ``pid`` (clock ticks since boot; "" where unknown): with the pid
    it names one process, even after the pid is reused."""
    stat_line = _read_text(f"/proc/{pid}/stat")
    fields = stat_line.rpartition(")")[2].split()
    return fields[19] if len(fields) > 19 else ""


def _machine() -> str:
    """This machine's boot and pid namespace: where a recorded pid means this same process table.

    Two containers may share a host name; their pid namespaces differ, so a pid is compared only
    when both are equal.  "" where unknown (then only expiry takes a lease over)."""
    boot = _read_text("/proc/sys/kernel/random/boot_id")
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}/{ns}" if boot else ""


def _pid_alive(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    # Alive, unless the pid now names another process (reused since the holder died).
    return not start or _start_time(pid) in ("", start)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def check_lease_times(lease_seconds: float | None, heartbeat_seconds: float | None
                      ) -> tuple[float, float]:
    """The lease and heartbeat periods (the knobs' defaults for None; with only the lease given,
    the heartbeat is at most a third of it); ``ValueError`` unless
    ``0 < heartbeat_seconds < lease_seconds`` (a lease must be renewed before it expires)."""
    lease = float(_knobs.lease_seconds() if lease_seconds is None else lease_seconds)
    beat = float(_knobs.heartbeat_seconds() if heartbeat_seconds is None else heartbeat_seconds)
    if heartbeat_seconds is None and lease_seconds is not None and lease > 0:
        beat = min(beat, lease / 3)  # only the lease given: renew it three times per period
    if not lease > 0 or not beat > 0 or not beat < lease:  # also NaN
        raise ValueError(f"need 0 < heartbeat_seconds < lease_seconds, got heartbeat_seconds="
                         f"{beat} and lease_seconds={lease} (renew a lease well before it expires, "
                         "e.g. heartbeat_seconds=10, lease_seconds=30)")
    if beat > lease / 2:
        log.warning("heartbeat_seconds=%s is more than half of lease_seconds=%s: one slow renewal "
                    "can let the lease expire and be taken over", beat, lease)
    return lease, beat


class WriterLock:
    def __init__(self, store: Store, *, lease_seconds: float | None = None,
                 heartbeat_seconds: float | None = None, backups: Sequence[str] | None = None):
        self.store = store
        # The holder's backup roots, named in its records (_fence); None: carry forward those
        # the root's newest record names (gc, ckpt sync: they must not erase them).
        self.backups = None if backups is None else list(backups)
        self.lease_seconds, self.heartbeat_seconds = check_lease_times(lease_seconds, heartbeat_seconds)
        self.token = uuid.uuid4().hex[:8]
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{self.token}"
        self._closer: weakref.finalize | None = None  # closes a held flock's descriptor
        self._held = False
        self._mutex = threading.Lock()  # the heartbeat thread and the saves both renew the lease
        self._stop: threading.Event | None = None
        self._lost = ""  # who took the lease over, as the heartbeat found out
        self._renewed = 0.0  # monotonic time taken *before* the last successful renewal
        self.generation: int | None = None  # this holder's generation of the root (_fence)
        self._accepted: set[int] = set()  # the steps of its claim's record
        self._committed: set[int] = set()  # steps committed under this generation
        # What retention knows of the named steps, (created, metrics): the retention index.
        self._entries: dict[int, tuple[float, Any]] = {}
        self._unwritten = False  # entries learned since the index was last written
        self._claimed: list[int] | None = None
        self._indexed = 0.0  # monotonic time of the last index write

    def acquire(self) -> None:
        if self._lost:  # superseded: for good (its run's view of the root is stale)
            raise self._fenced(self._lost, "stop writing here")
        if self._held:
            self.refresh()  # a lease can lapse between saves: make sure it is still ours
            return
        if self.store.local:
            self._acquire_flock()
        else:
            with self._mutex:
                self._acquire_lease(retry=True)
        try:
            with self._mutex:
                self._claim()
        except BaseException:
            self._held = True  # so that release() gives back what was taken
            self.release()
            raise
        if not self.store.local:
            self._start_heartbeat()
        self._held = True
        _LIVE[self.token] = self

    def check_free(self) -> None:
        """Raise :class:`LockedError` if a live writer holds the root now, without taking the
        lock (``CheckpointManager`` asks at construction).  Free: no holder, this lock itself, a
        holder released cleanly, or one that ``acquire`` would take over (its process is gone,
        its manager in this process was closed or dropped, its lease expired or unreadable)."""
        if self._held or self._lost:
            return
        if self.store.local:
            self._check_flock()
            return
        lease = self._read_lease()
        if lease is None or lease.get("holder") == self.holder or self._gone(lease):
            return
        holder = str(lease.get("holder", "unknown"))
        expires, beat = _float(lease.get("expires")), _float(lease.get("heartbeat"))
        renewed = f"last renewed {_when(beat)}, " if beat else ""
        raise LockedError(
            f"{self.store.url}: another writer holds the lease {LOCK_NAME} ({holder}, {renewed}"
            f"expires {_when(expires)} unless renewed); one CheckpointManager may write a root at "
            "a time. To read this root meanwhile, pass lock=False")

    def _check_flock(self) -> None:
        """``check_free`` on local disk: a lock file naming a holder is probed with a
        non-blocking flock, released at once; an absent or empty file (released cleanly) is
        not even opened."""
        import fcntl
        path = self.store.join(LOCK_NAME)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                         | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return  # none (or not a file: acquire() says what is wrong with it)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip()
            if not holder:
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                hint = (" by another CheckpointManager of this process: close() it first (or use "
                        "`with`)") if (st.st_dev, st.st_ino) in _HELD else ""
                raise LockedError(
                    f"{self.store.url}: another writer holds the lock ({holder}){hint}; one "
                    "CheckpointManager may write a root at a time. To read this root meanwhile, "
                    "pass lock=False") from None
        finally:
            os.close(fd)  # drops the probe's shared flock, if it got one

    # -- fencing --------------------------------------------------------------------------------
    def _claim(self, extra: tuple[int, ...] = ()) -> None:
        """Claim the root's next generation (the caller holds the flock or the lease)."""
        g, accepted, entries, self.backups = _fence.claim(self.store, self.holder, extra=extra,
                                                           backups=self.backups)
        if self.generation is not None:
            log.warning("%s: this writer's lease renewal was overdue (%.1f s since the last one, "
                        "lease %s s), so it may have been taken over meanwhile; nobody had: "
                        "claimed the root again as writer generation %d", self.store.url,
                        time.monotonic() - self._renewed, self.lease_seconds, g)
        self.generation = g
        self._accepted = set(accepted)  # what the claim wrote, not read back (see claim)
        self._committed = set()
        self._claimed: list[int] | None = sorted(accepted)  # a listing as fresh as any
        self._entries = {s: e for s, e in {**entries, **self._entries}.items() if s in self._accepted}
        if self._entries:  # this generation's own index, at once: a run that dies before its
            self._write_index()  # first write would leave its successor no index to read

    def _overdue(self) -> bool:
        """Whether this holder's lease may have expired in another writer's eyes (its last
        renewal began more than ``lease_seconds`` minus a margin for clock skew ago)."""
        margin = min(self.heartbeat_seconds, self.lease_seconds / 4)
        return time.monotonic() - self._renewed > self.lease_seconds - margin

    def _superseded(self) -> str:
        """Who superseded this holder's generation ("" while none did)."""
        newer = [g for g in _fence.generations(self.store) if g > (self.generation or 0)]
        if not newer:
            return ""
        record = _fence.read_record(self.store, newer[0]) or {}
        return f"{record.get('holder', 'another writer')} (writer generation {newer[0]})"

    def _fenced(self, who: str, what: str) -> FencedError:
        self._held, self._lost = False, who
        _LIVE.pop(self.token, None)
        if self._stop is not None:
            self._stop.set()
        log.warning("%s: %s: this writer (generation %s) was superseded by %s", self.store.url,
                    what, self.generation, who)
        return FencedError(f"{self.store.url}: this writer's lease lapsed and another writer "
                           f"took it over ({who}); {what}. The new holder owns the root: stop "
                           "writing here (a new CheckpointManager restores what it committed)")

    def before_commit(self, what: str = "nothing was committed") -> None:
        """Raise :class:`FencedError` if this holder may no longer commit (called right before
        a manifest is published); an overdue renewal claims a new generation first."""
        if not self._held and self._lost:
            raise self._fenced(self._lost, what)
        if self.store.local or self.generation is None:
            return  # the flock cannot lapse while this process lives
        with self._mutex:
            who = self._lost or self._superseded()
            if who:
                raise self._fenced(who, what)
            if self._overdue():
                self._reclaim()

    def check_current(self, what: str) -> None:
        """Raise :class:`FencedError` if another writer superseded this holder, without renewing
        anything: called before an error that a stale view of the root would explain (a step
        below the newest, a step already there), so that a writer that lost the root is told
        so rather than given a misleading reason.  A store that cannot be asked leaves the
        caller's own error standing."""
        if not self._held and self._lost:
            raise self._fenced(self._lost, what)
        if self.store.local or self.generation is None:
            return
        try:
            with self._mutex:
                who = self._lost or self._superseded()
        except (CheckpointError, OSError) as e:
            log.debug("%s: could not ask whether this writer was superseded: %s", self.store.url, e)
            return
        if who:
            raise self._fenced(who, what)

    def before_delete(self) -> None:
        """As :meth:`before_commit`, right before a step is deleted: a superseded writer deletes
        nothing."""
        self.before_commit("nothing was deleted")

    def after_commit(self, ckpt: Store) -> None:
        """Once ``ckpt``'s manifest is in place: make sure readers accept it (a pause between
        ``before_commit`` and the PUT may have let a taker in); ``FencedError`` if not.

        On an object store the holder records the step, then lists the generations (one LIST
        per commit): a lease renewed in time is not enough, since a taker that judged the lease
        expired earlier (a pause between its check and its delete) may have listed the steps
        for its claim before this PUT.  Either this listing finds the taker's generation and the
        commit is judged as readers judge it, or the claim was created after it and reads this
        holder's record again once created (``_fence.claim``), finding the step there."""
        m = _fence.STEP.fullmatch(ckpt.name)
        if self.generation is None or m is None:
            return
        step = int(m.group(1))
        with self._mutex:
            overdue = not self.store.local and self._overdue()
            if not overdue:
                self._committed.add(step)
                try:
                    self._write_record()
                except Exception as e:  # noqa: BLE001 - readers then read the manifest instead
                    log.warning("%s: could not record step %d in the writer record (%s: %s); "
                                "readers check its manifest instead", self.store.url, step,
                                type(e).__name__, e)
            if not self.store.local:
                self._judge_remote(step, ckpt, overdue)

    def _judge_remote(self, step: int, ckpt: Store, overdue: bool) -> None:
        """``after_commit`` on an object store, once the step is recorded (unless ``overdue``):
        returns while the root is still this writer's, or the commit was claimed into a new
        generation of its own, or it stands though a taker superseded the writer (fenced from
        its next operation); ``FencedError`` when readers ignore it."""
        try:
            who = self._superseded()
        except (CheckpointError, OSError) as e:
            if overdue:
                raise
            log.warning("%s: could not list the writer generations after committing step %d "
                        "(%s: %s); the lease was renewed in time, so the commit is taken to "
                        "stand", self.store.url, step, type(e).__name__, e)
            return
        if not who and not overdue:
            return
        if not who:
            try:
                self._claim(extra=(step,))  # it is in the new claim's accepted list
                self._renewed = time.monotonic()
                return
            except LockedError:
                who = self._superseded()
        # Whether the commit stands is what readers make of it now (a takeover's claim lists
        # the steps readers accepted, so a step accepted once stays accepted).
        if _fence.split(self.store, [(step, ckpt.name)])[0]:
            log.warning("%s: step %d stands (readers accept it), but %s superseded this writer "
                        "(generation %s): its next operation raises FencedError", self.store.url,
                        step, who or "another writer", self.generation)
            self._lost = who or "another writer"  # committed in time; the next operation raises
            return
        raise self._fenced(who or "another writer",
                           f"its commit of {ckpt.url} landed after that, and readers ignore it")

    def _write_record(self) -> None:
        _fence.record(self.store, self.generation, self.holder, self._accepted, self._committed,
                      self.backups)

    def _write_index(self) -> None:
        """The retention index (``_fence``): a cache of the manifests, so a failure is only
        logged (the next writer reads those steps' manifests instead)."""
        try:
            _fence.write_index(self.store, self.generation, self._entries)
            self._unwritten, self._indexed = False, time.monotonic()
        except Exception as e:  # noqa: BLE001
            log.warning("%s: could not write the retention index (%s: %s); the next writer "
                        "reads those steps' manifests", self.store.url, type(e).__name__, e)

    def _flush_entries(self) -> None:
        """At release, the entries learned since the last rewrite (the newest step's, mostly),
        while the root is still this holder's; a failure only costs the next manager a read."""
        if not self._unwritten or self._lost or self.generation is None:
            return
        try:
            with self._mutex:
                superseded = not self.store.local and self._superseded()
        except Exception as e:  # noqa: BLE001 - the index is a cache of the manifests
            log.warning("%s: not writing the retention index (%s: %s)", self.store.url,
                        type(e).__name__, e)
            return
        if not superseded:
            self._write_index()

    def view(self) -> _fence.View | None:
        """The holder's own view of its root (no request): its generation and the steps its
        record names; None while it holds none (or was superseded: readers then read)."""
        if self.generation is None or self._lost or not self._held:
            return None
        return _fence.View(self.generation, frozenset(self._accepted | self._committed),
                           self.holder)

    def claimed_steps(self) -> list[int] | None:
        """The steps readers accepted at this holder's claim, once (then None): the listing the
        claim just made, which the holder's tier takes instead of listing the root again."""
        steps, self._claimed = self._claimed, None
        return steps

    def entry(self, step: int) -> tuple[float, Any] | None:
        """What the retention index says of ``step`` (created, metrics), if anything."""
        return self._entries.get(step)

    def remember(self, step: int, created: float, metrics: Any) -> None:
        """Keep ``step``'s retention entry; the index is rewritten at most every
        ``_fence.INDEX_SECONDS`` (its size grows with the steps kept) and at release."""
        if step in self._accepted or step in self._committed:
            self._entries[step] = (float(created), dict(metrics) if metrics else None)
            self._unwritten = True
            if time.monotonic() - self._indexed >= _fence.INDEX_SECONDS and self._current():
                self._write_index()

    def _current(self) -> bool:
        return self.generation is not None and self._held and not self._lost

    def forget(self, step: int) -> None:
        """``step`` is about to be deleted: the record stops naming it first (readers trust a
        named step's folder to hold a manifest, and do not ask), then the caller deletes."""
        named = step in self._accepted or step in self._committed
        self._accepted.discard(step)
        self._committed.discard(step)
        self._entries.pop(step, None)
        if named and self._current():
            with self._mutex:
                self._write_record()

    def _reclaim(self) -> None:
        """An overdue holder nobody superseded (yet): take the root again under a new generation,
        or learn that a taker got there first."""
        lease = self._read_lease()
        if lease is not None and lease.get("holder") != self.holder:
            raise self._fenced(str(lease.get("holder")), "nothing was committed")
        t0 = time.monotonic()
        try:
            self._claim()
        except LockedError:
            raise self._fenced(self._superseded() or "another writer", "nothing was committed")
        try:
            self.store.write_bytes(LOCK_NAME, self._lease(), create_only=lease is None)
        except FileExistsError:
            # A taker deleted the expired lease and created its own between the read above and
            # this create.  Its claim may come after this one (then it supersedes this
            # generation, with a list of accepted steps made before this writer's next commit)
            # or may have lost to it (then it gives the root up): this writer cannot tell, so it
            # stops, as the loser of the race (nothing committed readers would not accept).
            other = self._read_lease() or {}
            log.warning("%s: reclaiming the root as writer generation %d, this writer found "
                        "another writer's lease object in place (%s): it stops", self.store.url,
                        self.generation, other.get("holder", "a writer that took it just now"))
            raise self._fenced(str(other.get("holder", "another writer")),
                               "nothing was committed") from None
        self._renewed = t0

    # -- local disk: flock ----------------------------------------------------------------------
    def _acquire_flock(self) -> None:
        import fcntl
        self.store.makedirs()
        path = self.store.join(LOCK_NAME)
        fd = self._open_lock_file(path)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a FIFO or device opens; it is no lock file either
                raise self._not_a_file(path, file_kind(st.st_mode))
            key = (st.st_dev, st.st_ino)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown"
                hint = ""
                if key in _HELD:
                    hint = (" by another CheckpointManager of this process: close() it first (or "
                            "use `with`)")
                raise LockedError(f"{self.store.url}: another writer holds the lock ({holder}){hint}; "
                                  "one CheckpointManager may write a root at a time") from None
            previous = os.pread(fd, 512, 0).decode(errors="replace").strip()
            if previous:
                # The kernel dropped the flock with its process, which never released it cleanly.
                self._took_over(previous, "its process ended without releasing the lock (the "
                                          "kernel dropped its flock)")
            os.ftruncate(fd, 0)
            os.pwrite(fd, self.holder.encode(), 0)
        except BaseException:
            os.close(fd)  # closing drops the flock if we got it
            raise
        _HELD.add(key)
        # A manager dropped without close() (a notebook cell run again) must not keep its root
        # locked until the process ends: collecting it closes the descriptor, dropping the
        # flock.  Not at exit: the kernel drops it then anyway, and a save may still be draining.
        self._closer = weakref.finalize(self, _close_held, fd, key)
        self._closer.atexit = False
        _FLOCK_FDS[fd] = self._closer

    def _open_lock_file(self, path: str) -> int:
        """Open (creating) the lock file, never through a link and never blocking on a FIFO."""
        flags = (os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                 | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0))
        try:
            return os.open(path, flags, 0o644)
        except OSError as e:
            if os.path.islink(path):
                raise self._not_a_file(path, "a symbolic link") from e
            if e.errno == errno.EISDIR or os.path.isdir(path):
                raise self._not_a_file(path, "a directory") from e
            raise

    @staticmethod
    def _not_a_file(path: str, kind: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(
            f"{path}: the writer lock file is {kind}, not a regular file, so the lock cannot be "
            f"taken; remove it (ckptcore creates the file itself) or pass lock=False")

    def _took_over(self, holder: str, why: str) -> None:
        message = (f"{self.store.url}: taking over the writer lock of {holder}: {why}; "
                   "its last committed checkpoint stands, an unfinished save is a leftover for gc()")
        # Logged too, but not printed twice on a console without logging set up (warn_and_log).
        warn_and_log(message, LockTakeoverWarning, stacklevel=caller_level())
        _meter.took_over(f"{self.store.url}: {holder}: {why}")  # the event of the save

    # -- object stores: a lease -----------------------------------------------------------------
    def _lease(self) -> bytes:
        now = time.time()
        return json.dumps({
            "holder": self.holder, "host": socket.gethostname(), "pid": os.getpid(),
            "token": self.token, "machine": _machine(), "start": _start_time(os.getpid()),
            "heartbeat": now, "expires": now + self.lease_seconds,
            "lease_seconds": self.lease_seconds}).encode()

    def _acquire_lease(self, *, retry: bool) -> None:
        try:
            t0 = time.monotonic()
            self.store.write_bytes(LOCK_NAME, self._lease(), create_only=True)
            self._renewed = t0
            return
        except FileExistsError:
            pass
        lease = self._read_lease()
        if lease is None:  # released between our create and our read
            if retry:
                return self._acquire_lease(retry=False)
            lease = {"holder": "a writer that took it just now", "expires": time.time() + self.lease_seconds}
        holder = str(lease.get("holder", "unknown"))
        why = self._gone(lease)
        if why and retry:
            # Check-then-delete (no conditional delete through fsspec): read once more, so that a
            # lease renewed or retaken since we judged it is left alone.
            if self._read_lease() == lease:
                self._took_over(holder, why)
                self.store.delete(LOCK_NAME)
            return self._acquire_lease(retry=False)
        expires = _float(lease.get("expires"))
        beat = _float(lease.get("heartbeat"))
        renewed = f"last renewed {_when(beat)}, " if beat else ""
        raise LockedError(
            f"{self.store.url}: another writer holds the lease {LOCK_NAME} ({holder}, {renewed}"
            f"expires {_when(expires)} unless renewed); a live writer renews it every few seconds "
            "and is never taken over; one that is gone is taken over once its lease expires (or at "
            "once on its own machine). If you know its writer is gone, delete that object")

    def _gone(self, lease: dict[str, Any]) -> str:
        """Why the lease's holder is provably gone, or "" when it may be alive."""
        if "unreadable" in lease:
            return "the lease object is unreadable"
        expires = _float(lease.get("expires"))
        if expires < time.time():
            return f"its lease was not renewed and expired at {_when(expires)}"
        same_machine = (lease.get("host") == socket.gethostname() and _machine()
                        and lease.get("machine") == _machine())
        pid = lease.get("pid")
        if not same_machine or not isinstance(pid, int):
            return ""
        if pid == os.getpid():
            live = _LIVE.get(str(lease.get("token")))
            if live is None or not live._held:
                return "its manager in this process was closed or dropped without releasing it"
            return ""
        if not _pid_alive(pid, str(lease.get("start") or "")):
            return f"its process {pid} on this machine no longer exists"
        return ""

    def _read_lease(self) -> dict[str, Any] | None:
        """The lease object's content; None when there is none; ``{"unreadable": ...}`` if garbage."""
        try:
            lease = json.loads(self.store.read(LOCK_NAME))
        except FileNotFoundError:
            return None
        except ValueError:
            return {"holder": "unreadable lease", "unreadable": True}
        if not isinstance(lease, dict) or "holder" not in lease:
            return {"holder": "unreadable lease", "unreadable": True}
        return lease

    def refresh(self) -> None:
        """Extend a held lease; :class:`FencedError` (a ``LockedError``) if it lapsed and
        another writer took the root over."""
        if not self._held:
            if self._lost:
                raise self._fenced(self._lost, "stop writing here")
            return
        if self.store.local:
            return
        with self._mutex:
            if not self._lost and time.monotonic() - self._renewed < self.heartbeat_seconds / 2:
                return  # renewed just now (each commit checks the fence anyway)
            other = self._renew()
            if other:
                raise self._fenced(other, "stop writing here")

    def _renew(self) -> str:
        """Extend the lease if it is still ours; else return who took the root over.  A
        superseded holder never re-creates the lease; an overdue one claims a new generation
        rather than renew a lease a taker may be acting on."""
        if self._lost:
            return self._lost
        who = self._superseded()
        if who:
            return who
        if self._overdue():
            try:
                self._reclaim()
                return ""
            except FencedError:
                return self._lost or "another writer"
        lease = self._read_lease()
        if lease is None:  # removed by hand, nobody superseded us: take it again
            try:
                self._acquire_lease(retry=False)
                return ""
            except LockedError:
                return str((self._read_lease() or {}).get("holder", "unknown"))
        if lease.get("holder") != self.holder:
            return str(lease.get("holder"))
        t0 = time.monotonic()
        self.store.write_bytes(LOCK_NAME, self._lease())
        self._renewed = t0
        return ""

    def _start_heartbeat(self) -> None:
        stop = threading.Event()
        self._stop = stop
        # The thread holds the lock weakly: a manager dropped without close() stops renewing.
        threading.Thread(target=_heartbeat, args=(weakref.ref(self), stop, self.heartbeat_seconds),
                         name="ckptcore-lease-heartbeat", daemon=True).start()
        weakref.finalize(self, stop.set)

    def _beat(self) -> None:
        with self._mutex:
            if not self._held or self._lost:
                return
            if time.monotonic() - self._renewed < self.heartbeat_seconds / 2:
                return  # a save renewed it just now
            try:
                other = self._renew()
            except Exception as e:  # noqa: BLE001 - a store hiccup: try again next beat
                log.warning("%s: renewing the writer lease failed (%s: %s); retrying in %ss",
                            self.store.url, type(e).__name__, e, self.heartbeat_seconds)
                return
            if other:
                # Raised to the writer at its next save (refresh), before it writes anything.
                self._lost = other
                log.warning("%s: this writer's lease %s lapsed and %s took it over; the next "
                            "save raises LockedError", self.store.url, LOCK_NAME, other)

    def release(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if not self._held:
            return
        self._flush_entries()
        self._held = False
        _LIVE.pop(self.token, None)
        if self._closer is not None:
            self._closer()  # empties the file, closes the descriptor, which drops the flock (once)
            self._closer = None
            return
        with self._mutex:
            if self._lost:
                return  # superseded: nothing here is this writer's to remove
            lease = self._read_lease()
            if lease is not None and lease.get("holder") == self.holder:  # never remove another's
                self.store.delete(LOCK_NAME)


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _heartbeat(ref: weakref.ref, stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        lock = ref()
        if lock is None:
            return
        lock._beat()
        del lock
