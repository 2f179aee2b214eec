"""The writer lock on a manager's root.

Local disk: an OS lock (``flock``) on ``<root>/.ckptcore.lock``; the kernel
drops it when the process dies, so a crashed run never blocks its own resume.
Object stores: a lease object created with a create-only PUT, holding who took
it and until when.  A lease past its expiry is taken over (its holder is
presumed dead); a live one raises :class:`LockedError` naming the holder.  The
holder checks that the lease is still its own and extends it on every save, so a
writer whose lease lapsed and was taken over stops (``LockedError``) instead of
writing beside the new holder; it never deletes a lease that is not its own.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import time
import uuid
import weakref

from ._storage import Store, _kind
from .errors import LockedError, UnsafeCheckpointError

LOCK_NAME = ".ckptcore.lock"
_HELD: set[tuple[int, int]] = set()  # (st_dev, st_ino) of lock files this process's locks hold


def _close_held(fd: int, key: tuple[int, int]) -> None:
    _HELD.discard(key)
    os.close(fd)


class WriterLock:
    def __init__(self, store: Store, *, lease_seconds: float = 3600.0):
        self.store, self.lease_seconds = store, lease_seconds
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._closer: weakref.finalize | None = None  # closes a held flock's descriptor
        self._held = False

    def acquire(self) -> None:
        if self._held:
            self.refresh()  # a lease can lapse between saves: make sure it is still ours
            return
        if self.store.local:
            self._acquire_flock()
        else:
            self._acquire_lease(retry=True)
        self._held = True

    def _acquire_flock(self) -> None:
        import fcntl
        self.store.makedirs()
        path = self.store.join(LOCK_NAME)
        fd = self._open_lock_file(path)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a FIFO or device opens; it is no lock file either
                raise self._not_a_file(path, _kind(st.st_mode))
            key = (st.st_dev, st.st_ino)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown"
                hint = ""
                if key in _HELD:
                    hint = (" by another CheckpointManager of this process: close() it first (or "
                            "use `with`)")
                elif holder.startswith(f"{socket.gethostname()}:{os.getpid()}:"):
                    hint = " (a process forked from this one may still hold it)"
                raise LockedError(f"{self.store.url}: another writer holds the lock ({holder}){hint}; "
                                  "one CheckpointManager may write a root at a time") from None
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

    def _lease(self) -> bytes:
        return json.dumps({"holder": self.holder, "expires": time.time() + self.lease_seconds}).encode()

    def _acquire_lease(self, *, retry: bool) -> None:
        try:
            self.store.write_bytes(LOCK_NAME, self._lease(), create_only=True)
            return
        except FileExistsError:
            pass
        holder, expires = self._read_lease()
        holder = holder or "released just now"
        if retry and expires < time.time():
            self.store.delete(LOCK_NAME)  # expired: its holder stopped refreshing it
            return self._acquire_lease(retry=False)
        raise LockedError(
            f"{self.store.url}: another writer holds the lease {LOCK_NAME} ({holder}, expires "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(expires))}); delete that object "
            "if its holder is gone")

    def _read_lease(self) -> tuple[str, float]:
        try:
            lease = json.loads(self.store.read(LOCK_NAME))
            return str(lease["holder"]), float(lease["expires"])
        except FileNotFoundError:
            return "", 0.0
        except (ValueError, KeyError, TypeError):
            return "unreadable lease", 0.0

    def refresh(self) -> None:
        """Extend a held lease; ``LockedError`` if it lapsed and another writer took it over."""
        if not self._held or self.store.local:
            return
        holder, _ = self._read_lease()
        if holder == "":  # removed by hand: take it again if nobody else has
            self._held = False
            self._acquire_lease(retry=False)
            self._held = True
            return
        if holder != self.holder:
            self._held = False
            raise LockedError(f"{self.store.url}: this writer's lease {LOCK_NAME} lapsed and "
                              f"another writer took it over ({holder}); stop writing here")
        self.store.write_bytes(LOCK_NAME, self._lease())

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        if self._closer is not None:
            self._closer()  # closes the descriptor, which drops the flock (once)
            self._closer = None
        elif self._read_lease()[0] == self.holder:  # never remove a lease another writer took
            self.store.delete(LOCK_NAME)
