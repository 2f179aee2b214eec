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
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

_ATOMIC_CREATE = {"s3", "s3a", "memory"}
# Hook for fault-injection tests: called with an operation name before every mutating operation.
_op_hook: Any = None


def _tick(op: str, path: str) -> None:
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

    # -- navigation ---------------------------------------------------------------------------
    def child(self, name: str) -> Store:
        sep = os.sep if self.local else "/"
        return Store(self.url.rstrip("/") + "/" + name, _fs=self.fs, _path=self.path + sep + name)

    def sibling(self, name: str) -> Store:
        parent = os.path.dirname(self.path) if self.local else self.path.rsplit("/", 1)[0]
        sep = os.sep if self.local else "/"
        base = self.url.rstrip("/").rsplit("/", 1)[0]
        return Store(base + "/" + name, _fs=self.fs, _path=parent + sep + name)

    @property
    def name(self) -> str:
        return os.path.basename(self.path) if self.local else self.path.rsplit("/", 1)[-1]

    def join(self, rel: str = "") -> str:
        if not rel:
            return self.path
        return os.path.join(self.path, rel) if self.local else f"{self.path}/{rel}"

    # -- reads ----------------------------------------------------------------------------------
    def exists(self, rel: str = "") -> bool:
        if self.local:
            return os.path.exists(self.join(rel))
        # Object-store filesystems answer exists() from cached listings, which miss other
        # processes' commits and deletions: the commit protocol needs the store's answer now.
        self.fs.invalidate_cache(self.join(rel))
        return self.fs.exists(self.join(rel))

    def size(self, rel: str) -> int:
        """Size in bytes; ``FileNotFoundError`` when absent."""
        if self.local:
            return os.stat(self.join(rel)).st_size
        info = self.fs.info(self.join(rel))
        if info.get("type") == "directory":
            raise FileNotFoundError(self.join(rel))
        return int(info["size"])

    def read(self, rel: str) -> bytes:
        if self.local:
            with open(self.join(rel), "rb") as f:
                return f.read()
        return self.fs.cat_file(self.join(rel))

    def read_ranges(self, rel: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Bytes ``[start, end)`` of each range, fetched concurrently where the backend can."""
        if not ranges:
            return []
        path = self.join(rel)
        blobs = self.fs.cat_ranges([path] * len(ranges), [r[0] for r in ranges],
                                   [r[1] for r in ranges])
        for blob in blobs:  # async filesystems hand back per-range errors instead of raising
            if isinstance(blob, BaseException):
                raise blob
        return blobs

    def listdir(self, rel: str = "") -> list[Entry]:
        """Entries directly below ``rel``; empty when it does not exist."""
        path = self.join(rel)
        if self.local:
            try:
                with os.scandir(path) as it:
                    return [Entry(e.name, e.is_dir(follow_symlinks=False),
                                  e.stat(follow_symlinks=False).st_mtime, e.is_symlink()) for e in it]
            except (FileNotFoundError, NotADirectoryError):
                return []
        try:
            infos = self.fs.ls(path, detail=True, refresh=True)
        except FileNotFoundError:
            return []
        out = []
        for info in infos:
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            mtime = info.get("LastModified") or info.get("mtime") or info.get("created")
            out.append(Entry(name, info.get("type") == "directory", _as_time(mtime)))
        return out

    # -- writes ---------------------------------------------------------------------------------
    def makedirs(self, rel: str = "") -> None:
        if self.local:
            os.makedirs(self.join(rel), exist_ok=True)

    def open_write(self, rel: str):
        """A binary file for streaming writes (local: ``fsync_close`` makes it durable)."""
        _tick("open_write", self.join(rel))
        if self.local:
            return open(self.join(rel), "wb", buffering=1 << 20)
        return self.fs.open(self.join(rel), "wb")

    def write_bytes(self, rel: str, data: bytes, *, create_only: bool = False) -> None:
        """Write a whole file.  ``create_only`` raises ``FileExistsError`` if it exists (atomically
        where ``atomic_create`` holds)."""
        _tick("write_bytes", self.join(rel))
        if self.local:
            with open(self.join(rel), "xb" if create_only else "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            return
        if create_only:
            self.fs.pipe_file(self.join(rel), data, mode="create")
        else:
            self.fs.pipe_file(self.join(rel), data)

    def delete(self, rel: str) -> None:
        _tick("delete", self.join(rel))
        try:
            if self.local:
                os.unlink(self.join(rel))
            else:
                self.fs.rm_file(self.join(rel))
        except FileNotFoundError:
            pass

    def delete_tree(self, rel: str = "") -> None:
        _tick("delete_tree", self.join(rel))
        path = self.join(rel)
        if self.local:
            shutil.rmtree(path, ignore_errors=True)
            return
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass


def fsync_close(f: Any) -> None:
    """Close a file from ``open_write``, first forcing local data to disk."""
    try:
        f.flush()
        os.fsync(f.fileno())
    except (OSError, AttributeError, ValueError):  # remote files have no descriptor
        pass
    f.close()


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
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _as_time(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "timestamp"):
        return value.timestamp()
    return None
