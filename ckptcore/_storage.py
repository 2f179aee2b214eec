"""The narrow storage layer: a handful of operations over ``fsspec.url_to_fs``.

``Store(url, storage_options)`` is a :class:`LocalStore` for a local path (``os`` directly:
fsync, rename and mmap are only reachable there; the operations themselves are in
``_localfs``) and a :class:`RemoteStore` for every other protocol (its fsspec filesystem; object
stores' concurrency in ``_remote``, their errors and listings in ``_objstore``).  Capability
flags say what a store can do, so the commit code picks a strategy up front instead of
discovering it through exceptions:

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
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

from . import _knobs, _localfs, _meter, _remote
from ._manifest import safe_shard_name
from ._localfs import (close_quietly, file_kind, fsync_close, fsync_dir, named_error,  # noqa: F401
                       open_regular, start_writeback)
from ._objstore import (RemoteWriter, as_time, bucket_missing, error_chain, listed_size,  # noqa: F401
                        mtime_of, saw_bucket)
from .errors import CheckpointError, CheckpointNotFoundError, SchemaError, StorageError

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


def tick(op: str, path: str) -> None:
    """Call the fault-injection hook (if set) before a mutating operation ``op`` on ``path``."""
    if _op_hook is not None:
        _op_hook(op, path)


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
    """One location (a directory or bucket prefix) and the operations ckptcore needs there.

    ``Store(url, storage_options)`` returns a :class:`LocalStore` or a :class:`RemoteStore`,
    whichever ``url``'s filesystem calls for; ``local`` says which.  What both do alike is here.
    """

    local: bool
    atomic_rename: bool
    atomic_create: bool

    def __new__(cls, url: str, storage_options: dict[str, Any] | None = None, *,
                _fs: Any = None, _path: str | None = None) -> Store:
        if _fs is None:
            _fs, _path = fsspec.core.url_to_fs(str(url), **(storage_options or {}))
        kind = LocalStore if isinstance(_fs, LocalFileSystem) else RemoteStore
        if cls is not Store and cls is not kind:
            raise TypeError(f"{url!r} is a {kind.__name__}, not a {cls.__name__}")
        self = object.__new__(kind)
        self.url = str(url)
        self.fs = _fs
        self._setup(_path)
        return self

    def __getnewargs_ex__(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (self.url,), {"_fs": self.fs, "_path": self.path}  # (copies and pickles)

    def _setup(self, path: str) -> None:
        raise NotImplementedError

    def url_of(self, rel: str = "") -> str:
        """The URL of ``rel`` inside this store, for messages."""
        return self.url.rstrip("/") + "/" + rel if rel else self.url

    def _bucket(self) -> str:
        split = getattr(self.fs, "split_path", None)
        if split is not None:
            with contextlib.suppress(Exception):
                return split(self.path)[0]
        return self.path.lstrip("/").split("/", 1)[0]

    @contextlib.contextmanager
    def translate_errors(self, op: str, rel: str = "", *, write: bool = False) -> Iterator[None]:
        """Translate a backend's exceptions for ``op`` on ``rel`` into ckptcore's.

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
            msg = (f"{self.url_of(rel)}: the bucket {self._bucket()!r} does not exist "
                   f"({op} failed); create it first, or check the URL")
            raise (StorageError if write else CheckpointNotFoundError)(msg) from e
        except (OSError, TypeError, AttributeError, NotImplementedError):
            raise  # programming errors are not the store failing: left as they are
        except Exception as e:
            raise StorageError(f"{self.url_of(rel)}: {op} failed: {type(e).__name__}: {e}") from e

    def same_place(self, other: Store) -> bool:
        """Whether ``other`` is this location under another spelling (``./run``, ``file://``,
        a trailing slash, a folder reached through a symbolic link)."""
        raise NotImplementedError

    # -- navigation ---------------------------------------------------------------------------
    def _join(self, *parts: str) -> str:
        raise NotImplementedError

    @property
    def _parent_path(self) -> str:
        raise NotImplementedError

    @property
    def name(self) -> str:
        raise NotImplementedError

    def child(self, name: str) -> Store:
        return Store(self.url.rstrip("/") + "/" + name, _fs=self.fs, _path=self._join(self.path, name))

    def sibling(self, name: str) -> Store:
        return self.parent().child(name)

    def parent(self) -> Store:
        """The folder (or prefix) this store is in: a checkpoint's root."""
        return Store(self.url.rstrip("/").rsplit("/", 1)[0], _fs=self.fs, _path=self._parent_path)

    def join(self, rel: str = "") -> str:
        if not rel:
            return self.path
        if rel.startswith(CAS_PREFIX):  # (the manifest admits only "cas:" + 64 hex digits)
            digest = rel[len(CAS_PREFIX):]
            return self._join(self._parent_path, CAS_DIR, digest[:2], digest)
        return self._join(self.path, rel)

    # -- reads ----------------------------------------------------------------------------------
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
        _meter.request(sum(len(ranges) for _, ranges in requests))
        if not any(ranges for _, ranges in requests):
            return [[] for _ in requests]
        return self._read_many(requests)

    def _read_many(self, requests: list[tuple[str, list[tuple[int, int]]]]
                   ) -> list[list[bytes | memoryview]]:
        return self._cat_ranges(requests, lambda blobs: blobs)

    def _cat_ranges(self, requests: list[tuple[str, list[tuple[int, int]]]],
                    shape: Callable[[list], list]) -> list[list[bytes | memoryview]]:
        """``read_many`` through the filesystem's ``cat_ranges``, file by file; ``shape`` makes
        the blobs of one file what a read returns."""
        out = []
        for rel, ranges in requests:
            if not ranges:
                out.append([])
                continue
            path = self.join(rel)
            with self.translate_errors("read", rel):
                blobs = self.fs.cat_ranges([path] * len(ranges), [r[0] for r in ranges],
                                           [r[1] for r in ranges])
                for blob in blobs:  # some filesystems hand back per-range errors instead of raising
                    if isinstance(blob, BaseException):
                        raise blob
            out.append(shape(blobs))
        return out

    @property
    def shard_size(self) -> int:
        """The bound on one shard's size for this store: the ``shard_size`` knob (see
        :attr:`RemoteStore.shard_size` for S3)."""
        return _knobs.shard_size()

    @property
    def writers(self) -> int:
        """How many shards to write at once: the ``threads`` knob (the disk's queue depth)."""
        return _knobs.threads()

    def open_file(self, rel: str) -> tuple[int, os.stat_result]:
        """A local file's descriptor and fstat (``LocalStore`` only: memory maps and ``pread``)."""
        raise NotImplementedError(f"{self.url}: not on local disk")

    # -- writes ---------------------------------------------------------------------------------
    def makedirs(self, rel: str = "") -> None:
        """Make the folder ``rel`` and its parents (object stores have no folders: nothing)."""


class LocalStore(Store):
    """A folder on local disk, through ``os`` (``_localfs``): durable writes, no links followed."""

    local = True
    atomic_rename = True
    atomic_create = True

    def _setup(self, path: str) -> None:
        self.path = os.path.abspath(path)

    def same_place(self, other: Store) -> bool:
        return other.local and os.path.realpath(self.path) == os.path.realpath(other.path)

    def _join(self, *parts: str) -> str:
        return os.path.join(*parts)

    @property
    def _parent_path(self) -> str:
        return os.path.dirname(self.path)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def exists(self, rel: str = "") -> bool:
        """Whether ``rel`` exists."""
        _meter.request()
        return os.path.exists(self.join(rel))

    def open_file(self, rel: str) -> tuple[int, os.stat_result]:
        """``rel`` opened for reading, never through a link, nor through a nested shard's folder
        (``3f/shard-...``) that is one: ``(fd, fstat of fd)``, see ``_localfs.open_regular``."""
        _meter.request()
        return open_regular(self.join(rel), in_folder=self._nested(rel))

    @staticmethod
    def _nested(rel: str) -> bool:
        """Whether ``rel`` is a shard in a shard folder, whose folder is the checkpoint's too."""
        return "/" in rel and safe_shard_name(rel)

    def size(self, rel: str) -> int:
        """Size in bytes; ``FileNotFoundError`` when absent; never through a link
        (:class:`UnsafeCheckpointError` for anything but a regular file)."""
        fd, st = self.open_file(rel)
        os.close(fd)
        return st.st_size

    def read(self, rel: str, *, max_bytes: int | None = None) -> bytes:
        """The whole file.  ``max_bytes``: a larger file raises :class:`SchemaError` before any of
        it is read.  Never through a link (:class:`UnsafeCheckpointError`)."""
        _meter.request()
        return _localfs.read_file(self.join(rel), max_bytes,
                                  lambda size: self._check_max(rel, size, max_bytes),
                                  in_folder=self._nested(rel))

    def listdir(self, rel: str = "", *, details: bool = True) -> list[Entry]:
        """Entries directly below ``rel``; empty when it does not exist.  ``details=False``: no
        mtime or size where they cost a request or a system call each (local disk)."""
        _meter.request()
        return [Entry(*e) for e in _localfs.scan(self.join(rel), details)]

    def find(self, rel: str = "") -> list[Entry]:
        """Every file below ``rel``, recursively, named by its path relative to ``rel``; empty when
        it does not exist.  Links are listed as links and never followed."""
        _meter.request()
        return [Entry(*e) for e in _localfs.walk(self.join(rel))]

    def makedirs(self, rel: str = "") -> None:
        os.makedirs(self.join(rel), exist_ok=True)

    def open_write(self, rel: str, *, stable: bool = False):
        """A binary file for streaming writes: ``fsync_close`` makes it durable and raises any
        write, flush, fsync or close error.  (``stable``: see :meth:`RemoteStore.open_write`.)"""
        _meter.request()
        tick("open_write", self.join(rel))
        return open(self.join(rel), "wb", buffering=1 << 20)

    def write_bytes(self, rel: str, data: bytes, *, create_only: bool = False) -> None:
        """Write a whole file durably (any write/fsync/close error is raised, naming the file).
        ``create_only`` raises ``FileExistsError`` if it exists (atomically)."""
        _meter.request()
        path = self.join(rel)
        tick("write_bytes", path)
        _localfs.write_file(path, data, create_only=create_only)

    def delete(self, rel: str) -> None:
        """Remove one file; nothing if absent.  A link is removed itself, never its target, and
        nothing is deleted through a link (a store whose folder is a link raises
        :class:`UnsafeCheckpointError`)."""
        _meter.request()
        path = self.join(rel)
        tick("delete", path)
        _localfs.unlink(path)

    def delete_tree(self, rel: str = "") -> None:
        """Remove a folder and everything in it; nothing if absent.  Never follows a link (a link
        at ``rel`` is removed itself and logged; links inside are removed as links); a file that
        cannot be removed is logged and left for ``gc()``."""
        _meter.request()
        path = self.join(rel)
        tick("delete_tree", path)
        _localfs.remove_tree(path, self.url)


class RemoteStore(Store):
    """A prefix of an fsspec filesystem other than local disk (object stores, memory://)."""

    local = False
    atomic_rename = False

    def _setup(self, path: str) -> None:
        self.path = path.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) \
            else (self.fs.protocol,)
        self.atomic_create = bool(_ATOMIC_CREATE & set(protocols))
        self._pool: _remote.PartPool | None = None  # part slots of this store's uploads
        self._pool_lock = threading.Lock()

    def same_place(self, other: Store) -> bool:
        return not other.local and type(self.fs) is type(other.fs) \
            and self.path.strip("/") == other.path.strip("/")

    def _join(self, *parts: str) -> str:
        return "/".join(parts)

    @property
    def _parent_path(self) -> str:
        return self.path.rsplit("/", 1)[0]

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    # -- reads ----------------------------------------------------------------------------------
    def exists(self, rel: str = "") -> bool:
        """Whether ``rel`` exists: :class:`CheckpointNotFoundError` when the bucket itself does
        not exist (s3fs answers ``False`` there, which would hide a typo)."""
        _meter.request()
        # Object-store filesystems answer exists() from cached listings, which miss other
        # processes' commits and deletions: the commit protocol needs the store's answer now.
        path = self.join(rel)
        self.fs.invalidate_cache(path)
        with self.translate_errors("exists", rel):
            bucket = self._bucket() if hasattr(self.fs, "split_path") else None
            if self.fs.exists(path):
                saw_bucket(self.fs, bucket)
                return True
            if bucket is None or "/" not in path.strip("/") \
                    or saw_bucket(self.fs, bucket, query=True):
                return False  # a bucket-less store, the bucket itself, or one known to exist
            # Absent: a missing object, or a missing bucket (s3fs answers False to both)?
            # info() tells, through the service's NoSuchBucket; asked once per bucket.
            try:
                self.fs.info(path)
            except FileNotFoundError as e:
                if bucket_missing(e):
                    raise
                saw_bucket(self.fs, bucket)
                return False
            saw_bucket(self.fs, bucket)
            return True  # it appeared meanwhile

    def size(self, rel: str) -> int:
        """Size in bytes; ``FileNotFoundError`` when absent."""
        _meter.request()
        with self.translate_errors("size", rel):
            info = self.fs.info(self.join(rel))
        if info.get("type") == "directory":
            raise FileNotFoundError(self.join(rel))
        return int(info["size"])

    def read(self, rel: str, *, max_bytes: int | None = None) -> bytes:
        """The whole file.  ``max_bytes``: a larger file raises :class:`SchemaError` before any of
        it is read."""
        _meter.request()
        path = self.join(rel)
        with self.translate_errors("read", rel):
            if max_bytes is not None:
                info = self.fs.info(path)
                if info.get("type") == "directory":
                    raise FileNotFoundError(path)
                self._check_max(rel, int(info.get("size") or 0), max_bytes)
            data = self.fs.cat_file(path)
        if max_bytes is not None:
            self._check_max(rel, len(data), max_bytes)
        return data

    def _read_many(self, requests: list[tuple[str, list[tuple[int, int]]]]
                   ) -> list[list[bytes | memoryview]]:
        if _remote.concurrent_reads(self.fs):
            rels = ", ".join(dict.fromkeys(rel for rel, _ in requests))
            with self.translate_errors("read", rels if len(requests) > 1 else requests[0][0]):
                return _remote.read_ranges(
                    self.fs, [(self.join(rel), ranges) for rel, ranges in requests],
                    part_size=_knobs.remote_part_size(),
                    concurrency=_knobs.remote_concurrency())
        # Writable, like memory-mapped local shards.
        return self._cat_ranges(requests, lambda blobs: [memoryview(bytearray(b)) for b in blobs])

    @property
    def shard_size(self) -> int:
        """The ``shard_size`` knob; on S3 at most one upload part (``remote_part_size``), so a
        shard is a single PUT (a multipart upload costs extra requests, and the service a copy of
        the object to complete it) and a save's many shards travel at once.  A tensor larger
        than a part still gets a shard of its own, uploaded in concurrent parts."""
        bound = _knobs.shard_size()
        if _remote.multipart_capable(self.fs):
            return max(1, min(bound, _knobs.remote_part_size()))
        return bound

    @property
    def writers(self) -> int:
        """The ``threads`` knob, at least ``remote_concurrency`` (writers wait on the network)."""
        return max(_knobs.threads(), _knobs.remote_concurrency())

    def listdir(self, rel: str = "", *, details: bool = True) -> list[Entry]:
        """Entries directly below ``rel``; empty when it does not exist (``details``: as for
        local disk; a listing brings them anyway here)."""
        _meter.request()
        path = self.join(rel)
        try:
            with self.translate_errors("list", rel):
                infos = self.fs.ls(path, detail=True, refresh=True)
                # Not kept: some filesystems (adlfs) answer later reads from a cached listing,
                # and this folder is about to change (a manifest published after the listing).
                self.fs.invalidate_cache(path)
        except CheckpointNotFoundError:
            raise  # the bucket is missing: not an empty folder
        except FileNotFoundError:
            return []
        return [Entry(info["name"].rstrip("/").rsplit("/", 1)[-1], info.get("type") == "directory",
                      mtime_of(info), size=listed_size(info)) for info in infos]

    def find(self, rel: str = "") -> list[Entry]:
        """Every file below ``rel``, recursively, named by its path relative to ``rel`` (one
        paginated listing); empty when it does not exist."""
        _meter.request()
        path = self.join(rel)
        try:
            with self.translate_errors("list", rel):
                infos = self.fs.find(path, detail=True, withdirs=False)
        except FileNotFoundError:
            return []
        return [Entry(full[len(path):].lstrip("/"), False, mtime_of(info), size=listed_size(info))
                for full, info in infos.items()]

    # -- writes ---------------------------------------------------------------------------------
    def open_write(self, rel: str, *, stable: bool = False):
        """A binary file for streaming writes: its ``close`` uploads and raises.  ``stable``:
        the caller leaves what it writes unchanged until ``close`` returns, so large writes may
        be uploaded from its own buffers rather than copies (S3)."""
        _meter.request()
        tick("open_write", self.join(rel))
        with self.translate_errors("write", rel, write=True):
            if _remote.multipart_capable(self.fs):
                # S3: parts uploaded concurrently while the caller writes the next ones.
                return _remote.PartWriter(self, rel, pool=self._part_pool(), stable=stable)
            return RemoteWriter(self, rel, self.fs.open(self.join(rel), "wb"))

    def _part_pool(self) -> _remote.PartPool:
        """The part slots this store's uploads share (``remote_concurrency`` parts of at most
        ``remote_part_size``): every shard of a save goes through one store, so this bounds the
        memory of a save's uploads."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = _remote.PartPool(_knobs.remote_concurrency(),
                                              max(1, _knobs.remote_part_size()))
            return self._pool

    def write_bytes(self, rel: str, data: bytes, *, create_only: bool = False) -> None:
        """Write a whole file.  ``create_only`` raises ``FileExistsError`` if it exists
        (atomically where ``atomic_create`` holds)."""
        _meter.request()
        path = self.join(rel)
        tick("write_bytes", path)
        with self.translate_errors("write", rel, write=True):
            if create_only:
                self.fs.pipe_file(path, data, mode="create")
            else:
                self.fs.pipe_file(path, data)

    def delete(self, rel: str) -> None:
        """Remove one object; nothing if absent (or if its bucket is gone)."""
        _meter.request()
        path = self.join(rel)
        tick("delete", path)
        try:
            with self.translate_errors("delete", rel):
                self.fs.rm_file(path)
        except CheckpointNotFoundError as e:  # the bucket is gone: so is the object
            log.info("%s: not deleting %s: %s", self.url, rel, e)
        except FileNotFoundError:
            pass

    def delete_tree(self, rel: str = "") -> None:
        """Remove everything under the prefix ``rel``; nothing if absent."""
        _meter.request()
        path = self.join(rel)
        tick("delete_tree", path)
        try:
            with self.translate_errors("delete", rel):
                self.fs.rm(path, recursive=True)
        except CheckpointNotFoundError as e:
            log.info("%s: not deleting %s: %s", self.url, rel or ".", e)
        except FileNotFoundError:
            pass
