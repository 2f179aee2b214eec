"""Object-store helpers of the storage layer (``_storage.RemoteStore`` uses them): reading a
backend's errors and listings, and a written file whose errors name its URL.

Errors: whatever the backend raises that is neither an ``OSError`` nor a ``CheckpointError``
(botocore, aiohttp, ...) becomes :class:`StorageError` naming the URL, with the original chained;
a missing bucket becomes :class:`CheckpointNotFoundError` (reads) or ``StorageError`` (writes)
saying so (``Store.translate_errors``).
"""

from __future__ import annotations

import weakref
from typing import Any

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


def saw_bucket(fs: Any, bucket: str | None, *, query: bool = False) -> bool:
    """Remember that ``fs`` holds ``bucket`` (True once remembered), or with ``query`` whether it
    was seen; a filesystem that cannot be weakly referenced is never remembered (False)."""
    try:
        known = _KNOWN_BUCKETS.setdefault(fs, set())
    except TypeError:  # a filesystem that cannot be weakly referenced: do not remember
        return False
    if query:
        return bucket in known
    if bucket is not None:
        known.add(bucket)
    return True


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


def listed_size(info: dict) -> int | None:
    """A listing entry's size, when it gives one."""
    size = info.get("size")
    return int(size) if isinstance(size, (int, float)) else None


class RemoteWriter:
    """A remote file from ``open_write`` whose errors name the URL (``store.translate_errors``)."""

    def __init__(self, store: Any, rel: str, f: Any):
        self._store, self._rel, self._f = store, rel, f

    @property
    def closed(self) -> bool:
        return self._f.closed

    def write(self, data: Any) -> int:
        with self._store.translate_errors("write", self._rel, write=True):
            return self._f.write(data)

    def flush(self) -> None:
        with self._store.translate_errors("write", self._rel, write=True):
            self._f.flush()

    def close(self) -> None:
        with self._store.translate_errors("write", self._rel, write=True):
            self._f.close()

    def __enter__(self) -> RemoteWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
