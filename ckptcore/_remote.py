"""Object-store transfers that use the store's parallelism: concurrent part uploads and ranged reads.

Why: an object store's bandwidth comes from many requests in flight, not from one connection.
s3fs's buffered file (``fs.open(path, "wb")``) uploads its parts one after the other, each while
the writer waits, and one ranged GET of a shard is one connection.  Here:

* :class:`PartWriter` (S3 through s3fs): the caller's writes fill a part; each full part is
  handed to s3fs's event loop as an ``upload_part`` and the caller goes on checksumming and
  filling the next part while it travels.  An object that fits in one part is a single PUT (no
  multipart round trips).  Any failure aborts the multipart upload, so no part is left behind
  (and says so in the log); errors are mapped by ``Store.translate_errors`` like every other
  operation.
* :func:`read_ranges`: each requested range is split into part-sized pieces fetched
  concurrently (any async fsspec filesystem: S3, GCS, Azure, HTTP) straight into one
  preallocated buffer per range.

Memory is bounded.  A store's writers share ``remote_concurrency`` part slots (a part being
filled or uploading holds one, until S3 acknowledges it), and a part holds at most
``remote_part_size`` bytes of its own: large writes of a caller that keeps its buffers unchanged
(a save's arrays) are views, small ones are gathered into one buffer.  The body goes to the
socket a chunk at a time (:class:`PartBody`), so the HTTP client holds no copy of a part.  A
save's uploads therefore hold at most ``remote_concurrency x remote_part_size`` above its state
(measured: 4 MiB for a 1 GiB state of large tensors; benchmarks/bench_memory.py).  A read holds
its result buffers (the loaded arrays) plus what is in flight (``remote_concurrency`` pieces'
chunks).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import mmap
import threading
from typing import Any, Iterator

import crc32c
import numpy as np
from fsspec.asyn import sync

from .errors import CheckpointError, StorageError

log = logging.getLogger("ckptcore")

# S3 allows at most 10,000 parts per object: parts double in size every this many, so an object
# of any size S3 accepts (5 TB) fits whatever the part-size knob (the bound on memory then grows
# with it, but only for single objects of more than 1,000 parts).
_PARTS_PER_SIZE = 1000


def _loop(fs: Any) -> Any:
    """The event loop ``fs`` runs its requests on, in fsspec's IO thread; None where it cannot be
    driven from this thread (a filesystem made with ``asynchronous=True`` belongs to the
    caller's own loop; a forked child must not use its parent's loop)."""
    if not getattr(fs, "async_impl", False) or getattr(fs, "asynchronous", False):
        return None
    try:
        loop = fs.loop
    except RuntimeError:  # fsspec refuses a loop inherited through fork
        return None
    return loop if loop is not None and not loop.is_closed() else None


def multipart_capable(fs: Any) -> bool:
    """Whether ``fs`` is S3 through s3fs (its ``_call_s3`` reaches the multipart API)."""
    return (callable(getattr(fs, "_call_s3", None)) and callable(getattr(fs, "split_path", None))
            and _loop(fs) is not None)


def concurrent_reads(fs: Any) -> bool:
    """Whether ``fs`` can fetch byte ranges concurrently (an async fsspec filesystem)."""
    return callable(getattr(fs, "_cat_file", None)) and _loop(fs) is not None


# Bytes of a part handed to the socket at a time.  The HTTP client sends a body given as one
# buffer with one write, and on Python < 3.12.9 joins it with the headers first (a copy of the
# whole part) and asyncio keeps a second copy of what the socket did not take at once: 256 MiB
# above the part buffers in flight on a 256 MiB save (measured: 517 MiB above the state).
# Written a chunk at a time, the client waits for the socket between chunks and holds at most
# about one chunk per connection.
_SEND_CHUNK = 256 * 1024
# Writes at least this large from a caller that keeps its buffers unchanged until close
# (``stable``) go into a part as views, not copies; smaller ones are gathered into one buffer
# (thousands of small tensors as thousands of socket writes would cost more than the copy).
_BORROW_MIN = 256 * 1024


class PartBody:
    """One part as the request body: its segments (views of the caller's arrays, or buffers of
    gathered small writes), sent a chunk at a time (see ``_SEND_CHUNK``).

    Two readers see it.  botocore reads it as a file (``read``/``seek``/``tell``, ``len``):
    it signs the payload's SHA-256 on plain-HTTP endpoints and rewinds it before a retry.
    aiohttp sends it as an async iterable (no ``io.IOBase``, so neither aiobotocore nor aiohttp
    wraps it in a reader that copies it through a thread): every request from the first byte.
    """

    def __init__(self, segments: list[memoryview]):
        self._segments = segments
        self._size = sum(len(s) for s in segments)
        self._pos = 0

    def __len__(self) -> int:
        return self._size

    def crc32c(self) -> int:
        crc = 0
        for seg in self._segments:
            crc = crc32c.crc32c(seg, crc)
        return crc

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._pos, self._size)[whence]
        self._pos = min(max(0, base + offset), self._size)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (all that is left when negative) from the position, as a copy."""
        end = self._size if n is None or n < 0 else min(self._size, self._pos + n)
        out, at = bytearray(), 0
        for seg in self._segments:
            lo, hi = max(self._pos, at), min(end, at + len(seg))
            if lo < hi:
                out += seg[lo - at:hi - at]
            at += len(seg)
        self._pos = max(self._pos, end)
        return bytes(out)

    def __aiter__(self) -> Any:
        return self._chunks()

    async def _chunks(self) -> Any:
        for seg in self._segments:
            for lo in range(0, len(seg), _SEND_CHUNK):
                yield seg[lo:lo + _SEND_CHUNK]


class PartPool:
    """The part slots one store's uploads share: at most ``count`` parts alive at once (being
    filled or travelling), which bounds upload memory; ``size`` is the part size."""

    def __init__(self, count: int, size: int):
        self.size = size
        self._sem = threading.Semaphore(max(1, count))

    def take(self) -> None:
        self._sem.acquire()  # waits while the store's other parts hold every slot

    def give(self) -> None:
        self._sem.release()


class PartWriter:
    """A write-only object on S3 uploaded in concurrent parts (see the module docstring).

    Used by one thread at a time, like a file.  ``close`` publishes the object (single PUT, or
    completes the multipart upload) and raises on failure; ``abort`` (and any failed ``write`` or
    ``close``) discards everything uploaded so far.  With ``stable`` the caller promises that
    what it writes stays unchanged until ``close`` returns: large writes then travel as views.
    """

    def __init__(self, store: Any, rel: str, *, pool: PartPool, stable: bool = False):
        self._store, self._rel = store, rel
        self._fs = store.fs
        self._loop = _loop(self._fs)
        self._bucket, self._key, _ = self._fs.split_path(store.join(rel))
        self._pool, self._stable = pool, stable
        self._slot = False  # whether the part being filled holds one of the pool's slots
        self._segments: list[memoryview] = []  # the part being filled
        self._gather: bytearray | None = None  # its small writes, copied
        self._fill = 0
        self._cap = 0  # the size of the part being filled
        self._upload_id: str | None = None
        self._parts: list[Any] = []  # one concurrent.futures.Future per shipped part, in order
        self._checksums: bool | None = None  # whether uploads carry our CRC32C (see _checksum)
        self.closed = False

    # -- the file interface ---------------------------------------------------------------------
    def write(self, data: Any) -> int:
        if self.closed:
            raise ValueError(f"{self._store.join(self._rel)}: write to a closed upload")
        mv = _byte_view(data)
        n, pos = len(mv), 0
        with self._guard():
            while pos < n:
                if not self._slot:
                    self._new_part()
                elif self._fill == self._cap:  # full, and more is coming: not the last part
                    self._ship()
                    continue
                take = min(n - pos, self._cap - self._fill)
                self._add(mv[pos:pos + take])
                pos += take
        return n

    def flush(self) -> None:
        """Nothing to do: full parts are already on their way, the last one goes at ``close``."""

    def close(self) -> None:
        if self.closed:
            return
        with self._guard():
            if self._upload_id is None:
                self._put_whole()
            else:
                self._ship()  # the last part (never empty: a part ships only when more follows)
                parts = [f.result() for f in self._parts]
                self._call("complete_multipart_upload", Bucket=self._bucket, Key=self._key,
                           UploadId=self._upload_id, MultipartUpload={"Parts": parts})
            self.closed = True
        self._fs.invalidate_cache(self._store.join(self._rel))

    def abort(self, why: str = "abandoned") -> None:
        """Discard the object: wait for parts in flight, then abort the multipart upload."""
        if self.closed:
            return
        self.closed = True
        for f in self._parts:
            # Wait rather than cancel: a part still travelling when the upload is aborted may
            # land afterwards and stay behind (S3 documents this), invisible and billed.
            with contextlib.suppress(BaseException):
                f.result()
        self._take_part()
        self._drop_slot()
        if self._upload_id is None:
            return
        url = self._store.url_of(self._rel)
        try:
            self._call("abort_multipart_upload", Bucket=self._bucket, Key=self._key,
                       UploadId=self._upload_id)
        except Exception as e:
            log.warning("%s: upload failed (%s) and aborting its multipart upload %s failed too "
                        "(%s: %s); its parts stay in the bucket, invisible, until a lifecycle rule "
                        "for incomplete multipart uploads removes them", url, why,
                        self._upload_id, type(e).__name__, e)
        else:
            log.warning("%s: upload failed (%s); its multipart upload was aborted, no part is "
                        "left behind", url, why)

    def __enter__(self) -> PartWriter:
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if kind is None:
            self.close()
        else:
            self.abort(f"{kind.__name__}: {exc}")

    # -- internals ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Map errors as every store operation does; on any failure, abort the upload."""
        try:
            with self._store.translate_errors("write", self._rel, write=True):
                yield
        except BaseException as e:
            self.abort(f"{type(e).__name__}: {e}")
            url = self._store.url_of(self._rel)
            if isinstance(e, OSError) and not isinstance(e, CheckpointError) and url not in str(e):
                named = _with_url(e, url)  # s3fs's messages name no object
                if named is not e:
                    raise named from e
            raise

    def _checksum(self, body: PartBody | None) -> dict:
        """The part's CRC32C, computed in this writer's thread (hardware CRC32C, GIL released):
        S3 checks the bytes it received against it.  Without it, botocore computes a CRC32 of
        every body itself (its default since 1.36), in software, on the one event-loop thread
        all of a save's transfers share, which then became what bounded an upload.  A client
        configured with ``request_checksum_calculation="when_required"`` (S3-compatible stores
        that refuse checksum headers) gets none from us either."""
        if not self._algorithm():
            return {}
        value = (body.crc32c() if body is not None else 0).to_bytes(4, "big")
        return {"ChecksumCRC32C": base64.b64encode(value).decode("ascii")}

    def _call(self, method: str, **kwargs: Any) -> Any:
        return sync(self._loop, self._fs._call_s3, method, **kwargs)

    def _new_part(self) -> None:
        # Part n+1's size; doubling every _PARTS_PER_SIZE parts keeps within S3's 10,000 parts.
        self._cap = self._pool.size << (len(self._parts) // _PARTS_PER_SIZE)
        self._pool.take()
        self._slot = True
        self._fill = 0

    def _add(self, piece: memoryview) -> None:
        """Put ``piece`` in the part being filled: as a view when the caller keeps it unchanged
        and it is large, else copied into the part's gathering buffer."""
        if self._stable and len(piece) >= _BORROW_MIN:
            self._end_gather()
            self._segments.append(piece)
        elif self._gather is None:
            self._gather = bytearray(piece)
        else:
            self._gather += piece
        self._fill += len(piece)

    def _end_gather(self) -> None:
        if self._gather is not None:
            self._segments.append(memoryview(self._gather))
            self._gather = None

    def _take_part(self) -> PartBody:
        """The filled part as a request body; the writer starts afresh (its slot goes with the
        body: back to the pool once the part has travelled)."""
        self._end_gather()
        body = PartBody(self._segments)
        self._segments, self._fill = [], 0
        return body

    def _drop_slot(self) -> None:
        if self._slot:
            self._slot = False
            self._pool.give()

    def _ship(self) -> None:
        for f in self._parts:  # a part that already failed stops the writer now, not at close
            if f.done() and f.exception() is not None:
                raise f.exception()
        if self._upload_id is None:
            self._upload_id = self._call("create_multipart_upload", Bucket=self._bucket,
                                         Key=self._key, **self._algorithm())["UploadId"]
        number = len(self._parts) + 1
        body = self._take_part()
        self._slot = False  # from here the slot is the upload's
        try:
            fut = asyncio.run_coroutine_threadsafe(
                self._upload_part(number, body, self._checksum(body)), self._loop)
        except BaseException:
            self._pool.give()
            raise
        fut.add_done_callback(lambda _: self._pool.give())  # back once it has travelled
        self._parts.append(fut)

    def _algorithm(self) -> dict:
        """Checksums with every upload, computed here, or none: see :func:`_checksum`."""
        if self._checksums is None:
            client = sync(self._loop, self._fs.set_session)
            config = getattr(getattr(client, "meta", None), "config", None)
            self._checksums = getattr(config, "request_checksum_calculation",
                                      None) == "when_supported"
        return {"ChecksumAlgorithm": "CRC32C"} if self._checksums else {}

    async def _upload_part(self, number: int, body: PartBody, checksum: dict) -> dict:
        out = await self._fs._call_s3("upload_part", Bucket=self._bucket, Key=self._key,
                                      UploadId=self._upload_id, PartNumber=number, Body=body,
                                      **checksum)
        return {"PartNumber": number, "ETag": out["ETag"], **checksum}

    def _put_whole(self) -> None:
        """The whole object in one PUT: it fitted in the first part (or is empty)."""
        body = self._take_part() if self._slot else None
        try:
            self._call("put_object", Bucket=self._bucket, Key=self._key,
                       Body=body if body is not None and len(body) else b"",
                       **self._checksum(body))
        finally:
            self._drop_slot()


def _byte_view(data: Any) -> memoryview:
    """``data`` as a flat memoryview of bytes (no copy for anything that exports a buffer)."""
    try:
        mv = memoryview(data)
    except ValueError:
        # NumPy refuses a typed view of some dtypes (long double with an explicit byte
        # order) that a file's write takes as plain bytes: take them as bytes too.
        mv = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    if mv.nbytes == 0:  # an empty tensor (a zero in its shape cannot be cast to bytes)
        return memoryview(b"")
    if mv.ndim != 1 or mv.format not in ("B", "b", "c"):
        mv = mv.cast("B")
    return mv


def _with_url(e: OSError, url: str) -> OSError:
    """``e``, of the same class (callers catch ``FileNotFoundError``, ``PermissionError``...),
    with ``url`` in its message."""
    try:
        if e.errno is not None:
            return type(e)(e.errno, f"{e.strerror or e} (upload)", url)
        return type(e)(f"{url}: upload failed: {e}")
    except Exception:  # an exotic subclass with another constructor: keep it as it is
        return e


# --------------------------------------------------------------------------------------- reading
def _invalid_range(e: BaseException) -> bool:
    """S3's answer to a range starting at or past the end of the object (416 InvalidRange)."""
    response = getattr(e.__cause__, "response", None) or getattr(e, "response", None)
    return isinstance(response, dict) and (response.get("Error") or {}).get("Code") == "InvalidRange"


async def _s3_read_into(fs: Any, path: str, start: int, dest: memoryview) -> int:
    """S3 through s3fs: one ranged GET streamed straight into ``dest`` (the body's chunks copied
    as they arrive, never joined into one ``bytes`` first); the number of bytes it held (fewer
    when the object ends inside the range)."""
    bucket, key, version = fs.split_path(path)
    extra = {"VersionId": version} if version else {}
    resp = await fs._call_s3("get_object", Bucket=bucket, Key=key,
                             Range=f"bytes={start}-{start + len(dest) - 1}", **extra)
    body = resp["Body"]
    try:
        return await _stream_into(body, dest)
    except CheckpointError:
        raise
    except Exception as e:  # the body broke off mid-transfer (reset, timeout, payload error)
        raise _BrokenBody(e) from e
    finally:
        body.close()


class _BrokenBody(Exception):
    """A response body that broke off after its request succeeded: worth fetching again."""


async def _stream_into(body: Any, dest: memoryview) -> int:
    """Copy an aiobotocore body into ``dest`` chunk by chunk (aiohttp's ``readchunk`` hands over
    each received chunk as it is, where ``read()`` would join them all into one more copy)."""
    content = getattr(getattr(body, "raw_stream", None), "content", None)
    if content is None or not callable(getattr(content, "readchunk", None)):
        data = await body.read()  # another HTTP backend: its own read, then one copy
        n = min(len(data), len(dest))
        dest[:n] = memoryview(data)[:n]
        return n
    n = 0
    while n < len(dest):
        chunk, end_of_http_chunk = await content.readchunk()
        if not chunk:
            if end_of_http_chunk:  # a chunked-encoding boundary, more may follow
                continue
            break
        k = min(len(chunk), len(dest) - n)
        dest[n:n + k] = memoryview(chunk)[:k]
        n += k
    return n


def _buffer(n: int) -> memoryview:
    """A writable buffer of ``n`` bytes about to be overwritten.  Large ones are anonymous maps:
    not zero-filled (``bytearray`` writes every byte once more), and not in transparent huge
    pages (NumPy advises those for its large arrays; on a small machine the kernel then compacts
    memory on the first touch, which stalled reads of 256 MB by up to half a second)."""
    if n >= (1 << 20):
        return memoryview(mmap.mmap(-1, n))
    return memoryview(bytearray(n))


_STREAM_ATTEMPTS = 3  # a body cut off mid-transfer is fetched again (the request itself is s3fs's)


async def _fetch_piece(fs: Any, streaming: bool, path: str, first: int, dest: memoryview) -> int:
    """One piece of ``read_ranges``: bytes from ``first`` into ``dest``, streamed from S3 when
    ``streaming`` (a body cut off mid-transfer is fetched again), else through ``_cat_file`` and
    one copy; the number of bytes the store had."""
    if streaming:
        for attempt in range(_STREAM_ATTEMPTS):
            try:
                return await _s3_read_into(fs, path, first, dest)
            except _BrokenBody as broken:  # (s3fs's own answers, already retried, go up)
                e = broken.__cause__
                if attempt + 1 == _STREAM_ATTEMPTS:
                    raise StorageError(
                        f"{path}: reading bytes {first}-{first + len(dest)} broke off "
                        f"{_STREAM_ATTEMPTS} times; last: {type(e).__name__}: {e}") from e
                log.warning("ckptcore: %s: read of bytes %d-%d broke off (%s: %s); "
                            "fetching it again", path, first, first + len(dest),
                            type(e).__name__, e)
    data = await fs._cat_file(path, start=first, end=first + len(dest))
    n = min(len(data), len(dest))
    dest[:n] = memoryview(data)[:n]
    return n


def read_ranges(fs: Any, requests: list[tuple[str, list[tuple[int, int]]]], *, part_size: int,
                concurrency: int) -> list[list[memoryview]]:
    """For each ``(path, ranges)``, bytes ``[start, end)`` of each range as one writable
    ``memoryview`` (see :func:`_buffer`).

    Each range is split into pieces of at most ``part_size`` bytes, fetched with up to
    ``concurrency`` requests in flight (over every path at once), each piece written into its
    range's buffer as it arrives: on S3 streamed from the response body, elsewhere through the
    filesystem's async ``_cat_file``.  A short answer (the object shrank since its size was
    checked) leaves that range shorter, up to its first missing byte: the caller compares
    lengths, as with any short read.  Anything else raises.
    """
    part = max(1, int(part_size))
    out = [[_buffer(end - start) for start, end in ranges] for _, ranges in requests]
    pieces = [(k, i, lo, min(lo + part, end - start))
              for k, (_, ranges) in enumerate(requests)
              for i, (start, end) in enumerate(ranges) for lo in range(0, end - start, part)]
    got: dict[tuple[int, int, int], int] = {}
    streaming = multipart_capable(fs)

    async def fetch(sem: asyncio.Semaphore, k: int, i: int, lo: int, hi: int) -> None:
        path, start = requests[k][0], requests[k][1][i][0]
        async with sem:
            try:
                n = await _fetch_piece(fs, streaming, path, start + lo, out[k][i][lo:hi])
            except OSError as e:
                if not _invalid_range(e):
                    raise
                n = 0
        got[k, i, lo] = n

    async def fetch_all() -> None:
        sem = asyncio.Semaphore(max(1, int(concurrency)))
        results = await asyncio.gather(*(fetch(sem, *p) for p in pieces), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    if pieces:
        sync(_loop(fs), fetch_all)
    for k, i, lo, hi in pieces:  # a short piece ends its range's valid bytes
        n = got.get((k, i, lo), 0)
        if n < hi - lo and len(out[k][i]) > lo + n:
            out[k][i] = out[k][i][:lo + n]
    return out
