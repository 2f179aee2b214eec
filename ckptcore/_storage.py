"""The narrow storage layer: a handful of operations over ``fsspec.url_to_fs``.

Local paths use ``os`` directly (fsync, rename and mmap are only reachable
there); every other protocol goes through its fsspec filesystem.  Capability
flags say what a store can do, so the commit code picks a strategy up front
instead of discovering it through exceptions:

* ``atomic_rename``: a directory can be renamed into place atomically (local disk).
* ``atomic_create``: a file can be created only if absent, atomically
  (S3's ``If-None-Match: *`` through s3fs ``pipe(mode="create")``, the in-memory
  filesystem).  Elsewhere "create only" is a check followed by a write, which is
  racy between writers; docs/RELIABILITY.md says so.

Containment (local disk): every file read from a checkpoint is opened with ``O_NOFOLLOW`` and
checked with ``fstat`` on that same descriptor to be a regular file, so a symbolic link, FIFO,
device, socket or directory where a file belongs raises :class:`UnsafeCheckpointError` instead of
reading something outside the checkpoint (or blocking on a pipe).  Deleting never follows links.

Errors (object stores): whatever the backend raises that is neither an ``OSError`` nor a
``CheckpointError`` (botocore, aiohttp, ...) becomes :class:`StorageError` naming the URL, with the
original chained; a missing bucket becomes :class:`CheckpointNotFoundError` (reads) or
``StorageError`` (writes) saying so.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import shutil
import stat
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

from . import _knobs, _remote
from .errors import (CheckpointError, CheckpointNotFoundError, SchemaError, StorageError,
                     UnsafeCheckpointError)

log = logging.getLogger("ckptcore")

# Create-only PUTs the server checks (fsspec's pipe_file(mode="create")): S3 If-None-Match: *,
# GCS ifGenerationMatch=0 (gcsfs), Azure If-None-Match: * (adlfs, overwrite=False).
_ATOMIC_CREATE = {"s3", "s3a", "memory", "gcs", "gs", "az", "abfs", "abfss"}
# A shard of a replica in a deduplicating backup root (ckptcore/_replica.py) is a content-addressed
# object shared by every step that holds the same bytes: its manifest names it "cas:<BLAKE2b-256
# hex>", which resolves to "<root>/chunks/<first two hex digits>/<hex>" (the step folder's parent).
CAS_PREFIX = "cas:"
CAS_DIR = "chunks"
# Hook for fault-injection tests: called with an operation name before every mutating operation.
_op_hook: Any = None


# Reading a checkpoint's file: never through a link; a FIFO must not block the open; no
# controlling terminal from a tty; not inherited by children.
_READ_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0))
_DIR_FLAGS = (os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
              | getattr(os, "O_CLOEXEC", 0))


def tick(op: str, path: str) -> None:
    if _op_hook is not None:
        _op_hook(op, path)


def file_kind(mode: int) -> str:
    """What a non-regular file is, for messages."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return f"a special file (mode {mode:#o})"


def _link_error(path: str) -> UnsafeCheckpointError:
    try:
        target = f" to {os.readlink(path)!r}"
    except OSError:
        target = ""
    return UnsafeCheckpointError(
        f"{path}: is a symbolic link{target}, not a regular file; ckptcore never follows links "
        "inside a checkpoint (one could lead outside it). Replace the link with the file itself")


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """Open a local file for reading without following a link: ``(fd, fstat of fd)``.

    Raises ``FileNotFoundError`` when absent and :class:`UnsafeCheckpointError` (naming the path
    and what is there) for anything but a regular file.  The caller closes ``fd``; sizes must come
    from the returned stat, and data from this descriptor, so nothing can be swapped in between.
    """
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as e:
        # O_NOFOLLOW on a link gives ELOOP (EMLINK on FreeBSD, EFTYPE on NetBSD).
        if e.errno in (errno.ELOOP, errno.EMLINK, getattr(errno, "EFTYPE", -1)) \
                and os.path.islink(path):
            raise _link_error(path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCheckpointError(
                f"{path}: is {file_kind(st.st_mode)}, not a regular file; a checkpoint holds only "
                "regular files (remove it, or restore the file from a good copy)")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


# Buckets each object-store filesystem has been seen to hold (so ``exists`` asks why only once).
_KNOWN_BUCKETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def error_chain(e: BaseException | None) -> list[BaseException]:
    """``e`` and what it chains (causes, then contexts), at most 8 deep: where a backend's own
    answer sits under the errors ckptcore and fsspec wrapped it in."""
    out: list[BaseException] = []
    while e is not None and len(out) < 8 and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def bucket_missing(e: BaseException) -> bool:
    """Whether ``e`` (or what it chains) is an object store's "no such bucket" answer."""
    for x in error_chain(e):
        response = getattr(x, "response", None)
        if isinstance(response, dict) and (response.get("Error") or {}).get("Code") == "NoSuchBucket":
            return True
        if "bucket does not exist" in str(x).lower():
            return True
    return False


@dataclass(frozen=True)
class Entry:
    """One name in a listing.  ``is_link``: a symbolic link (local disk only); such an entry is
    never a directory here (``is_dir`` is False), so nothing walks or deletes through it."""

    name: str
    is_dir: bool
    mtime: float | None
    is_link: bool = False
    size: int | None = None


def check_url(url: Any, what: str = "url") -> str:
    """``url`` as a non-empty string, else ``TypeError``/``ValueError`` naming ``what``.

    Why: ``""`` resolves to the working directory on some paths and to ``/`` on others, and
    ``None`` becomes a folder named "None"; neither is ever what the caller meant.
    """
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if isinstance(url, bytes) or not isinstance(url, str):
        raise TypeError(f"{what} must be a str or path-like, got {type(url).__name__}")
    if not url.strip():
        raise ValueError(f"{what} must not be empty: give a folder or an fsspec URL")
    if "::" in url:
        # fsspec would read "a::b" as a chain of filesystems (caches, archives): none of them
        # keeps the commit protocol's guarantees (an atomic rename or a create-only PUT).
        raise ValueError(f"{what}={url!r} is a chained fsspec URL ('::'), which a checkpoint root "
                         "cannot be: give one filesystem's URL (a folder, s3://, gs://, az://, "
                         "memory://)")
    return url


class Store:
    """One location (a directory or bucket prefix) and the operations ckptcore needs there."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 _fs: Any = None, _path: str | None = None):
        if _fs is None:
            _fs, _path = fsspec.core.url_to_fs(str(url), **(storage_options or {}))
        self.url = str(url)
        self.fs = _fs
        self.local = isinstance(_fs, LocalFileSystem)
        self.path = os.path.abspath(_path) if self.local else _path.rstrip("/")
        protocols = _fs.protocol if isinstance(_fs.protocol, (tuple, list)) else (_fs.protocol,)
        self.atomic_rename = self.local
        self.atomic_create = self.local or bool(_ATOMIC_CREATE & set(protocols))
        self._pool: _remote.PartPool | None = None  # part buffers of this store's uploads
        self._pool_lock = threading.Lock()

    def _url(self, rel: str = "") -> str:
        return self.url.rstrip("/") + "/" + rel if rel else self.url

    def _bucket(self) -> str:
        split = getattr(self.fs, "split_path", None)
        if split is not None:
            with contextlib.suppress(Exception):
                return split(self.path)[0]
        return self.path.lstrip("/").split("/", 1)[0]

    @contextlib.contextmanager
    def _remote(self, op: str, rel: str = "", *, write: bool = False) -> Iterator[None]:
        """Translate a remote backend's exceptions for ``op`` on ``rel`` into ckptcore's.

        A missing bucket: :class:`CheckpointNotFoundError` (a ``FileNotFoundError``) for reads,
        :class:`StorageError` for writes, saying which bucket.  Anything that is neither an
        ``OSError`` nor a ``CheckpointError`` (botocore's ``EndpointConnectionError``, aiohttp's
        errors, ...): :class:`StorageError` naming the URL, the original chained.  Other
        ``OSError`` (a missing object's ``FileNotFoundError``, ``FileExistsError`` of a
        create-only PUT, ``PermissionError``) pass unchanged: callers depend on them; so do
        ``TypeError``, ``AttributeError`` and ``NotImplementedError`` (bugs, not outages).
        """
        try:
            yield
        except CheckpointError:
            raise
        except FileNotFoundError as e:
            if not bucket_missing(e):
                raise
            msg = (f"{self._url(rel)}: the bucket {self._bucket()!r} does not exist "
                   f"({op} failed); create it first, or check the URL")
            raise (StorageError if write else CheckpointNotFoundError)(msg) from e
        except (OSError, TypeError, AttributeError, NotImplementedError):
            raise  # programming errors are not the store failing: left as they are
        except Exception as e:
            raise StorageError(f"{self._url(rel)}: {op} failed: {type(e).__name__}: {e}") from e

    def same_place(self, other: Store) -> bool:
        """Whether ``other`` is this location under another spelling (``./run``, ``file://``,
        a trailing slash, a folder reached through a symbolic link)."""
        if self.local or other.local:
            return self.local and other.local and \
                os.path.realpath(self.path) == os.path.realpath(other.path)
        return type(self.fs) is type(other.fs) and self.path.strip("/") == other.path.strip("/")

    # -- navigation ---------------------------------------------------------------------------
    def child(self, name: str) -> Store:
        sep = os.sep if self.local else "/"
        return Store(self.url.rstrip("/") + "/" + name, _fs=self.fs, _path=self.path + sep + name)

    def sibling(self, name: str) -> Store:
        return self.parent().child(name)

    def parent(self) -> Store:
        """The folder (or prefix) this store is in: a checkpoint's root."""
        return Store(self.url.rstrip("/").rsplit("/", 1)[0], _fs=self.fs, _path=self._parent_path)

    @property
    def _parent_path(self) -> str:
        return os.path.dirname(self.path) if self.local else self.path.rsplit("/", 1)[0]

    @property
    def name(self) -> str:
        return os.path.basename(self.path) if self.local else self.path.rsplit("/", 1)[-1]

    def join(self, rel: str = "") -> str:
        if not rel:
            return self.path
        if rel.startswith(CAS_PREFIX):  # (the manifest admits only "cas:" + 64 hex digits)
            digest = rel[len(CAS_PREFIX):]
            if self.local:
                return os.path.join(self._parent_path, CAS_DIR, digest[:2], digest)
            return f"{self._parent_path}/{CAS_DIR}/{digest[:2]}/{digest}"
        return os.path.join(self.path, rel) if self.local else f"{self.path}/{rel}"

    # -- reads ----------------------------------------------------------------------------------
    def exists(self, rel: str = "") -> bool:
        """Whether ``rel`` exists.  Object stores: :class:`CheckpointNotFoundError` when the
        bucket itself does not exist (s3fs answers ``False`` there, which would hide a typo)."""
        if self.local:
            return os.path.exists(self.join(rel))
        # Object-store filesystems answer exists() from cached listings, which miss other
        # processes' commits and deletions: the commit protocol needs the store's answer now.
        path = self.join(rel)
        self.fs.invalidate_cache(path)
        with self._remote("exists", rel):
            bucket = self._bucket() if hasattr(self.fs, "split_path") else None
            if self.fs.exists(path):
                self._saw_bucket(bucket)
                return True
            if bucket is None or "/" not in path.strip("/") or self._saw_bucket(bucket, query=True):
                return False  # a bucket-less store, the bucket itself, or one known to exist
            # Absent: a missing object, or a missing bucket (s3fs answers False to both)?
            # info() tells, through the service's NoSuchBucket; asked once per bucket.
            try:
                self.fs.info(path)
            except FileNotFoundError as e:
                if bucket_missing(e):
                    raise
                self._saw_bucket(bucket)
                return False
            self._saw_bucket(bucket)
            return True  # it appeared meanwhile

    def _saw_bucket(self, bucket: str | None, *, query: bool = False) -> bool:
        try:
            known = _KNOWN_BUCKETS.setdefault(self.fs, set())
        except TypeError:  # a filesystem that cannot be weakly referenced: do not remember
            return False
        if query:
            return bucket in known
        if bucket is not None:
            known.add(bucket)
        return True

    def size(self, rel: str) -> int:
        """Size in bytes; ``FileNotFoundError`` when absent; local: never through a link
        (:class:`UnsafeCheckpointError` for anything but a regular file)."""
        if self.local:
            fd, st = open_regular(self.join(rel))
            os.close(fd)
            return st.st_size
        with self._remote("size", rel):
            info = self.fs.info(self.join(rel))
        if info.get("type") == "directory":
            raise FileNotFoundError(self.join(rel))
        return int(info["size"])

    def read(self, rel: str, *, max_bytes: int | None = None) -> bytes:
        """The whole file.  ``max_bytes``: a larger file raises :class:`SchemaError` before any of
        it is read.  Local: never through a link (:class:`UnsafeCheckpointError`)."""
        path = self.join(rel)
        if self.local:
            fd, st = open_regular(path)
            with open(fd, "rb", closefd=True) as f:
                self._check_max(rel, st.st_size, max_bytes)
                if max_bytes is None:
                    return f.read()
                # Ask for what fstat said (a read's buffer is allocated at the size asked for),
                # then for the rest up to the limit in case it grew since.
                data = f.read(st.st_size + 1)
                if len(data) > st.st_size:
                    data += f.read(max_bytes + 1 - len(data))
                self._check_max(rel, len(data), max_bytes)
                return data
        with self._remote("read", rel):
            if max_bytes is not None:
                info = self.fs.info(path)
                if info.get("type") == "directory":
                    raise FileNotFoundError(path)
                self._check_max(rel, int(info.get("size") or 0), max_bytes)
            data = self.fs.cat_file(path)
        if max_bytes is not None:
            self._check_max(rel, len(data), max_bytes)
        return data

    def _check_max(self, rel: str, size: int, max_bytes: int | None) -> None:
        if max_bytes is not None and size > max_bytes:
            raise SchemaError(f"{self.join(rel)}: {size} bytes, more than the limit of {max_bytes} "
                              "bytes for this file; refused without reading it")

    def read_ranges(self, rel: str, ranges: list[tuple[int, int]]) -> list[bytes | memoryview]:
        """Bytes ``[start, end)`` of each range; a range the file does not fully hold comes back
        short (the caller compares lengths).  Object stores: one writable ``memoryview`` per range
        (see :meth:`read_many`)."""
        return self.read_many([(rel, ranges)])[0]

    def read_many(self, requests: list[tuple[str, list[tuple[int, int]]]]
                  ) -> list[list[bytes | memoryview]]:
        """:meth:`read_ranges` of several files at once: ``[(rel, ranges)] -> [[blob]]``.

        Async filesystems (S3, GCS, Azure): every range split into ``remote_part_size`` pieces,
        up to ``remote_concurrency`` of them in flight across all the files, written straight
        into one preallocated buffer per range.  Others: ``cat_ranges``, per file.
        """
        requests = [(rel, list(ranges)) for rel, ranges in requests]
        if not any(ranges for _, ranges in requests):
            return [[] for _ in requests]
        rels = ", ".join(dict.fromkeys(rel for rel, _ in requests))
        if not self.local and _remote.concurrent_reads(self.fs):
            with self._remote("read", rels if len(requests) > 1 else requests[0][0]):
                return _remote.read_ranges(
                    self.fs, [(self.join(rel), ranges) for rel, ranges in requests],
                    part_size=_knobs.remote_part_size(),
                    concurrency=_knobs.remote_concurrency())
        out = []
        for rel, ranges in requests:
            if not ranges:
                out.append([])
                continue
            path = self.join(rel)
            with self._remote("read", rel):
                blobs = self.fs.cat_ranges([path] * len(ranges), [r[0] for r in ranges],
                                           [r[1] for r in ranges])
                for blob in blobs:  # some filesystems hand back per-range errors instead of raising
                    if isinstance(blob, BaseException):
                        raise blob
            # Writable, like memory-mapped local shards (local reads go through maps, not here).
            out.append(blobs if self.local else [memoryview(bytearray(b)) for b in blobs])
        return out

    @property
    def shard_size(self) -> int:
        """The bound on one shard's size for this store: the ``shard_size`` knob; on S3 at most
        one upload part (``remote_part_size``), so a shard is a single PUT (a multipart upload
        costs extra requests, and the service a copy of the object to complete it) and a save's
        many shards travel at once.  A tensor larger than a part still gets a shard of its own,
        uploaded in concurrent parts."""
        bound = _knobs.shard_size()
        if not self.local and _remote.multipart_capable(self.fs):
            return max(1, min(bound, _knobs.remote_part_size()))
        return bound

    @property
    def writers(self) -> int:
        """How many shards to write at once: the ``threads`` knob (the disk's queue depth);
        object stores at least ``remote_concurrency`` (their writers wait on the network)."""
        threads = _knobs.threads()
        return threads if self.local else max(threads, _knobs.remote_concurrency())

    def listdir(self, rel: str = "") -> list[Entry]:
        """Entries directly below ``rel``; empty when it does not exist."""
        path = self.join(rel)
        if self.local:
            try:
                with os.scandir(path) as it:
                    out = []
                    for e in it:
                        st = e.stat(follow_symlinks=False)
                        out.append(Entry(e.name, e.is_dir(follow_symlinks=False), st.st_mtime,
                                         e.is_symlink(), st.st_size))
                    return out
            except (FileNotFoundError, NotADirectoryError):
                return []
        try:
            with self._remote("list", rel):
                infos = self.fs.ls(path, detail=True, refresh=True)
                # Not kept: some filesystems (adlfs) answer later reads from a cached listing,
                # and this folder is about to change (a manifest published after the listing).
                self.fs.invalidate_cache(path)
        except CheckpointNotFoundError:
            raise  # the bucket is missing: not an empty folder
        except FileNotFoundError:
            return []
        out = []
        for info in infos:
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            mtime = mtime_of(info)
            size = info.get("size")
            out.append(Entry(name, info.get("type") == "directory", as_time(mtime),
                             size=int(size) if isinstance(size, (int, float)) else None))
        return out

    def find(self, rel: str = "") -> list[Entry]:
        """Every file below ``rel``, recursively, named by its path relative to ``rel`` (one
        paginated listing on object stores); empty when it does not exist.  Local: links are
        listed as links and never followed."""
        path = self.join(rel)
        if self.local:
            out = []
            for top, dirs, files in os.walk(path, followlinks=False):
                for name in files + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
                    full = os.path.join(top, name)
                    st = os.lstat(full)
                    out.append(Entry(os.path.relpath(full, path).replace(os.sep, "/"), False,
                                     st.st_mtime, stat.S_ISLNK(st.st_mode), st.st_size))
            return out
        try:
            with self._remote("list", rel):
                infos = self.fs.find(path, detail=True, withdirs=False)
        except FileNotFoundError:
            return []
        out = []
        for full, info in infos.items():
            mtime = mtime_of(info)
            size = info.get("size")
            out.append(Entry(full[len(path):].lstrip("/"), False, as_time(mtime),
                             size=int(size) if isinstance(size, (int, float)) else None))
        return out

    # -- writes ---------------------------------------------------------------------------------
    def makedirs(self, rel: str = "") -> None:
        if self.local:
            os.makedirs(self.join(rel), exist_ok=True)

    def open_write(self, rel: str):
        """A binary file for streaming writes (local: ``fsync_close`` makes it durable and raises
        any write, flush, fsync or close error; remote: its ``close`` uploads and raises)."""
        tick("open_write", self.join(rel))
        if self.local:
            return open(self.join(rel), "wb", buffering=1 << 20)
        with self._remote("write", rel, write=True):
            if _remote.multipart_capable(self.fs):
                # S3: parts uploaded concurrently while the caller writes the next ones.
                return _remote.PartWriter(self, rel, pool=self._part_pool())
            return _RemoteWriter(self, rel, self.fs.open(self.join(rel), "wb"))

    def _part_pool(self) -> _remote.PartPool:
        """The part buffers this store's uploads share (``remote_concurrency`` of
        ``remote_part_size``): every shard of a save goes through one store, so this bounds the
        memory of a save's uploads."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = _remote.PartPool(_knobs.remote_concurrency(),
                                              max(1, _knobs.remote_part_size()))
            return self._pool

    def write_bytes(self, rel: str, data: bytes, *, create_only: bool = False) -> None:
        """Write a whole file, durably on local disk (any write/fsync/close error is raised, naming
        the file).  ``create_only`` raises ``FileExistsError`` if it exists (atomically where
        ``atomic_create`` holds)."""
        path = self.join(rel)
        tick("write_bytes", path)
        if self.local:
            f = open(path, "xb" if create_only else "wb")
            try:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            except OSError as e:
                close_quietly(f, path)
                raise named_error(e, "write or fsync", path) from e
            except BaseException:
                close_quietly(f, path)
                raise
            try:
                f.close()
            except OSError as e:
                raise named_error(e, "close", path) from e
            return
        with self._remote("write", rel, write=True):
            if create_only:
                self.fs.pipe_file(path, data, mode="create")
            else:
                self.fs.pipe_file(path, data)

    def delete(self, rel: str) -> None:
        """Remove one file; nothing if absent.  Local: a link is removed itself, never its target,
        and nothing is deleted through a link (a store whose folder is a link raises
        :class:`UnsafeCheckpointError`)."""
        path = self.join(rel)
        tick("delete", path)
        if not self.local:
            try:
                with self._remote("delete", rel):
                    self.fs.rm_file(path)
            except CheckpointNotFoundError as e:  # the bucket is gone: so is the object
                log.info("%s: not deleting %s: %s", self.url, rel, e)
            except FileNotFoundError:
                pass
            return
        parent, name = os.path.split(path)
        try:
            dfd = os.open(parent, _DIR_FLAGS)
        except FileNotFoundError:
            return
        except OSError as e:
            if os.path.islink(parent):
                raise UnsafeCheckpointError(
                    f"{parent}: is a symbolic link; refusing to delete {name} through it "
                    "(that would delete a file wherever the link points)") from e
            if e.errno == errno.ENOTDIR:
                return  # a file where the folder was: nothing to delete under it
            raise
        try:
            try:
                st = os.lstat(name, dir_fd=dfd)
            except FileNotFoundError:
                return
            if stat.S_ISLNK(st.st_mode):
                log.warning("%s: is a symbolic link; removing the link itself, not its target",
                            path)
            os.unlink(name, dir_fd=dfd)  # unlink never follows a link
        except FileNotFoundError:
            pass
        finally:
            os.close(dfd)

    def delete_tree(self, rel: str = "") -> None:
        """Remove a folder and everything in it; nothing if absent.  Local: never follows a link
        (a link at ``rel`` is removed itself and logged; links inside are removed as links); a
        file that cannot be removed is logged and left for ``gc()``."""
        path = self.join(rel)
        tick("delete_tree", path)
        if not self.local:
            try:
                with self._remote("delete", rel):
                    self.fs.rm(path, recursive=True)
            except CheckpointNotFoundError as e:
                log.info("%s: not deleting %s: %s", self.url, rel or ".", e)
            except FileNotFoundError:
                pass
            return
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            # rmtree refuses a link and, with ignore_errors, would silently leave it.
            log.warning("%s: is %s, not a folder; removing it itself%s", path, file_kind(st.st_mode),
                        " (its target is untouched)" if stat.S_ISLNK(st.st_mode) else "")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return

        def failed(func: Any, p: str, exc: Any) -> None:
            err = exc[1] if isinstance(exc, tuple) else exc
            if not isinstance(err, FileNotFoundError):
                log.warning("%s: could not remove %s (%s: %s); left for gc()", self.url, p,
                            type(err).__name__, err)

        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=failed)
        else:
            shutil.rmtree(path, onerror=failed)


class _RemoteWriter:
    """A remote file from ``open_write`` whose errors name the URL (see ``Store._remote``)."""

    def __init__(self, store: Store, rel: str, f: Any):
        self._store, self._rel, self._f = store, rel, f

    @property
    def closed(self) -> bool:
        return self._f.closed

    def write(self, data: Any) -> int:
        with self._store._remote("write", self._rel, write=True):
            return self._f.write(data)

    def flush(self) -> None:
        with self._store._remote("write", self._rel, write=True):
            self._f.flush()

    def close(self) -> None:
        with self._store._remote("write", self._rel, write=True):
            self._f.close()

    def __enter__(self) -> _RemoteWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def named_error(e: OSError, op: str, path: str) -> OSError:
    """``e`` with ``path`` and ``op`` in its message (an fsync's EIO names no file by itself)."""
    if isinstance(e, CheckpointError) or e.errno is None or e.filename is not None:
        return e
    return OSError(e.errno, f"{e.strerror} ({op})", path)


def close_quietly(f: Any, path: str) -> None:
    """Close ``f`` after an error that is being raised; a second error is logged, not raised."""
    try:
        f.close()
    except Exception as e:  # the first error is the one to report
        log.warning("%s: close after a failed write also failed: %s", path, e)


def fsync_close(f: Any) -> None:
    """Close a file from ``open_write``, first forcing local data to disk.

    A local file's failed flush, fsync or close raises (naming the file): the save must fail,
    not report a checkpoint the disk may not hold.  Remote files (no ``fileno``) just close; their
    close uploads and raises on failure.
    """
    try:
        fd = f.fileno()
    except (AttributeError, io.UnsupportedOperation):
        f.close()
        return
    path = getattr(f, "name", None)
    path = path if isinstance(path, str) else f"descriptor {fd}"
    try:
        f.flush()
        os.fsync(fd)
    except OSError as e:
        close_quietly(f, path)
        raise named_error(e, "flush or fsync", path) from e
    except BaseException:
        close_quietly(f, path)
        raise
    try:
        f.close()
    except OSError as e:
        raise named_error(e, "close", path) from e


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = None  # libc's sync_file_range once looked up; False where there is none


def start_writeback(f: Any, start: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``start`` of a local file to disk now.

    Why: dirty pages otherwise wait in the page cache until the final fsync, so the disk idles
    while we copy and the fsync then waits for everything; starting writeback as we go overlaps
    the two (Linux ``sync_file_range``, which does not wait).  Purely advisory: ``fsync_close``
    still makes the file durable and reports any I/O error, so failures here are ignored.
    """
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = _find_sync_file_range()
    if _sync_file_range:
        _sync_file_range(f.fileno(), start, length, _SYNC_FILE_RANGE_WRITE)


def _find_sync_file_range() -> Any:
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):  # not Linux
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def fsync_dir(path: str) -> None:
    """Make a folder's entries durable; any failure raises (naming the folder)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        raise named_error(e, "fsync of the folder", path) from e
    finally:
        os.close(fd)


def mtime_of(info: dict) -> float | None:
    """When an object was last written, from a listing entry: s3fs says ``LastModified``,
    gcsfs ``mtime``/``updated``, adlfs ``last_modified`` (without it every Azure object looked
    infinitely old to gc's grace period)."""
    for key in ("LastModified", "mtime", "last_modified", "updated", "created", "creation_time"):
        value = as_time(info.get(key))
        if value is not None:
            return value
    return None


def as_time(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "timestamp"):
        return value.timestamp()
    return None
