"""Shard planning, parallel streaming writes, range reads and checksums: the hot path.

Each array's own buffer is written and checksummed in place (``memoryview`` of
the array, no ``tobytes``).  Many small tensors share one shard, so per-tensor
cost is a table entry, not a syscall; shards are bounded in size so several
threads can write or verify them at once (``crc32c`` and file I/O release the
GIL).  Local shards are read through a private memory map, so loaded arrays
are writable views of the page cache with no copy.
"""

from __future__ import annotations

import contextvars
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import crc32c
import numpy as np

from . import _codec, _handoff, _knobs, _meter
from ._manifest import CRC_BLOCK, Manifest, ShardEntry, TensorEntry, TensorTable
from ._storage import Store, close_quietly, named_error, fsync_close, start_writeback
from .errors import CorruptCheckpointError, IncompleteCheckpointError

# Callback for progress display (the CLI sets it): called with a number of bytes done.
progress: contextvars.ContextVar[Callable[[int], None] | None] = contextvars.ContextVar(
    "ckptcore_progress", default=None)
_ZEROS = bytes(4096)
_COMBINE_MIN = 1 << 18  # below this, re-running the CRC over the bytes is cheaper than combining (~12 us)


# -------------------------------------------------------------------------------- crc32c combine
# zlib's crc32_combine, for the Castagnoli polynomial: crc(A + B) from crc(A), crc(B), len(B).
_POLY = 0x82F63B78


def _mulmod(a: int, b: int) -> int:
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) mod P, reflected
for _ in range(31):
    _X2N.append(_mulmod(_X2N[-1], _X2N[-1]))


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    p, k, n = 1 << 31, 3, len2
    while n:
        if n & 1:
            p = _mulmod(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _mulmod(p, crc1) ^ crc2


_dtype_name = _codec.dtype_name  # memoized per dtype there


# ------------------------------------------------------------------------------------- writing
def _chunks(buf: np.ndarray, size: int) -> Iterator[np.ndarray]:
    for start in range(0, len(buf), size):
        yield buf[start:start + size]


def _as_bytes(arr: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array, as a flat uint8 array (crc32c and file writes take any
    buffer; a memoryview on top would only cost another object per tensor)."""
    return arr.reshape(-1).view(np.uint8)


def plan_shards(sizes: Sequence[int], shard_size: int, alignment: int) -> list[list[tuple[int, int]]]:
    """Group tensors (by index) into shards of at most ``shard_size`` bytes: ``[[(index, offset)]]``."""
    if sizes:
        # Most states fit one shard: their offsets are a cumulative sum of the aligned sizes.
        arr = np.asarray(sizes, np.int64)
        offsets = np.zeros(len(arr), np.int64)
        np.cumsum(-(-arr[:-1] // alignment) * alignment, out=offsets[1:])
        if int(offsets[-1]) + int(arr[-1]) <= shard_size:
            return [list(zip(range(len(sizes)), offsets.tolist()))]
    shards: list[list[tuple[int, int]]] = []
    end = 0
    for i, size in enumerate(sizes):
        offset = -(-end // alignment) * alignment
        if not shards or (offset + size > shard_size and shards[-1]):
            shards.append([])
            offset = 0
        shards[-1].append((i, offset))
        end = offset + size
    return shards


class Syncs:
    """Shard files being made durable in the background: ``write_payload(..., syncs=)`` hands
    each local shard's ``fsync_close`` to a thread of its own as soon as the shard is written,
    instead of waiting for it there.  Why: the fsync waits for the disk (most of a large shard is
    still being written back when its last byte is copied), and the save has CPU work left that
    does not need it durable (building and validating the manifest); the two overlap.

    :meth:`wait` must return before the checkpoint is committed: it joins every thread and
    raises the first failure (``commit(..., durable=syncs.wait)`` calls it before the rename or
    publish).  :meth:`join` is for a save that failed anyway: it joins, raising nothing."""

    LIMIT = 8  # fsyncs in flight at most (each holds a thread and an open file)

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []
        self._slots = threading.BoundedSemaphore(self.LIMIT)

    def start(self, f: Any) -> None:
        """``fsync_close(f)`` in a new thread (its failure kept for :meth:`wait`); here, at once,
        when :data:`LIMIT` are in flight already or no thread can be started (a save of
        thousands of shards must not hold thousands of threads and files open)."""
        if not self._slots.acquire(blocking=False):
            fsync_close(f)  # raises a failed flush, fsync or close; the file is closed either way
            return

        def run() -> None:
            try:
                fsync_close(f)
            except BaseException as e:  # noqa: BLE001 - raised by wait(), in the saving thread
                self._errors.append(e)
            finally:
                self._slots.release()

        thread = threading.Thread(target=contextvars.copy_context().run, args=(run,),
                                  name="ckptcore-fsync", daemon=True)
        try:
            thread.start()
        except BaseException:  # (RuntimeError: no thread to be had) the file is synced here
            self._slots.release()
            fsync_close(f)
            return
        self._threads.append(thread)  # list.append is atomic: pool threads may call start()

    def wait(self) -> None:
        """Return once every shard started here is durable; raise the first failure."""
        self.join()
        if self._errors:
            raise self._errors[0]

    def join(self) -> None:
        # joined before it is dropped: an interrupted join leaves the thread for the next one
        while self._threads:
            self._threads[-1].join()
            self._threads.pop()


@dataclass
class _Written:
    shard: ShardEntry
    tensors: list[tuple[int, int, int]]  # (index, offset, crc)
    blocks: dict[int, list[int]]  # index -> block checksums (with ``block``, for longer arrays)


def _write_one(store: Store, path: str, arrays: Sequence[np.ndarray],
               layout: list[tuple[int, int]], block: int = 0, syncs: Syncs | None = None) -> _Written:
    # ``stable``: the arrays stay unchanged until the shard is closed (the save holds them), so
    # an object store may upload them from their own memory instead of copies.
    f = store.open_write(path, stable=True)
    chunk = max(1, _knobs.write_chunk())
    kick = _knobs.writeback_bytes() if store.local else 0
    if block:  # the write pieces must not straddle checksum blocks
        chunk = min(chunk, block)
    try:
        pos, kicked, shard_crc, out = 0, 0, 0, []
        blocks: dict[int, list[int]] = {}
        report = progress.get()
        sink = _Gathered(f, chunk) if store.local else _Buffered(f)
        write, crc32 = sink.write, crc32c.crc32c
        for idx, offset in layout:
            if pos < offset:  # alignment padding (less than one alignment unit)
                pad = _ZEROS[: offset - pos]
                write(pad, len(pad))
                shard_crc = crc32(pad, shard_crc)
                pos = offset
            arr = arrays[idx]
            n = arr.nbytes
            # Plain numeric arrays are buffers of their bytes already; other dtypes (datetimes,
            # ml_dtypes) export no buffer, and large ones are written in slices of bytes.
            buf = arr if n <= chunk and arr.dtype.kind in "biufc" else _as_bytes(arr)
            if n <= chunk:
                # The common case (10,000 small tensors): one checksum, one buffered write.
                crc = crc32(buf)
                write(buf, n)
                pos += n
                if report:
                    report(n)
            else:
                # (with ``block``, each block's own CRC, combined into the array's)
                own: list[int] | None = None
                if block and n > block:
                    own = blocks[idx] = []
                crc, pos, kicked = _write_pieces(sink, buf, n, offset, pos, kicked, chunk, block,
                                                 own, kick, report)
            if kick and pos - kicked >= kick:
                sink.flush()
                start_writeback(f, kicked, pos - kicked)
                kicked = pos
            shard_crc = crc32c_combine(shard_crc, crc, n) if n >= _COMBINE_MIN else crc32(buf, shard_crc)
            out.append((idx, offset, crc))
        sink.flush()
        background = syncs is not None and store.local
        if background:
            f.flush()  # the last bytes reach the kernel here: a failure names the shard below
    except OSError as e:  # a failed write (ENOSPC, EIO): the save fails, naming the shard
        close_quietly(f, store.join(path))
        raise named_error(e, "write", store.join(path)) from e
    except BaseException:
        close_quietly(f, store.join(path))
        raise
    if background:
        syncs.start(f)  # type: ignore[union-attr]  # durable by syncs.wait(), before the commit
    else:
        fsync_close(f)  # raises a failed flush, fsync or close; the file is closed either way
    return _Written(ShardEntry(path=path, size=pos, checksum=shard_crc), out, blocks)


def _write_pieces(sink: Any, buf: np.ndarray, n: int, offset: int, pos: int, kicked: int,
                  chunk: int, block: int, own: list[int] | None, kick: int,
                  report: Callable[[int], None] | None) -> tuple[int, int, int]:
    """``_write_one``'s path for an array of more than one write piece (``chunk`` bytes), apart
    from the small tensors' loop so that loop stays short; called once per large array, so the
    call costs nothing next to its bytes.  With ``own``, each ``block``'s CRC is appended to it
    and combined into the array's.  Returns the array's CRC and the new ``pos`` and ``kicked``."""
    write, crc32 = sink.write, crc32c.crc32c
    crc = 0
    bcrc, bfill = 0, 0
    for part in _chunks(buf, chunk):
        # Checksum a piece, then write it while it is still in the CPU cache.
        if own is None:
            crc = crc32(part, crc)
        else:
            bcrc, bfill = crc32(part, bcrc), bfill + len(part)
            if bfill == block or pos + len(part) - offset == n:
                own.append(bcrc)
                crc = bcrc if len(own) == 1 else crc32c_combine(crc, bcrc, bfill)
                bcrc, bfill = 0, 0
        write(part, len(part))
        pos += len(part)
        if kick and pos - kicked >= kick:
            sink.flush()
            start_writeback(sink.file, kicked, pos - kicked)
            kicked = pos
        if report:
            report(len(part))
    return crc, pos, kicked


class _Buffered:
    """A shard's writes through its file object (a remote store's: its own buffering and parts)."""

    def __init__(self, f: Any) -> None:
        self.file = f

    def write(self, buf: Any, n: int) -> None:
        self.file.write(buf)

    def flush(self) -> None:
        return None


class _Gathered:
    """A local shard's writes gathered into ``os.writev`` calls of about ``limit`` bytes (or
    :data:`_IOV` buffers).  Why: the buffered file copied every small tensor into its buffer
    before the kernel copied it again, and made a call per tensor; a tensor is now copied once,
    by the kernel, from the array itself.  ``flush`` writes what is gathered (before a
    writeback kick, and at the end); ``file`` is the file object, never written through."""

    def __init__(self, f: Any, limit: int) -> None:
        self.file, self._fd, self._limit = f, f.fileno(), limit
        self._bufs: list[Any] = []
        self._sizes: list[int] = []
        self._n = 0

    def write(self, buf: Any, n: int) -> None:
        if n:
            self._bufs.append(buf)
            self._sizes.append(n)
            self._n += n
            if self._n >= self._limit or len(self._bufs) >= _IOV:
                self.flush()

    def flush(self) -> None:
        if self._bufs:
            bufs, sizes, total = self._bufs, self._sizes, self._n
            self._bufs, self._sizes, self._n = [], [], 0
            _writev_all(self._fd, bufs, sizes, total)


_IOV = 512  # buffers per writev (Linux takes up to 1024)


def _writev_all(fd: int, bufs: list[Any], sizes: list[int], total: int) -> None:
    """``os.writev`` until every byte is written: a short write (a signal, say) goes on from
    where it stopped; an error raises (``OSError``: the caller names the shard)."""
    done = os.writev(fd, bufs)
    k = 0
    while done < total:
        while done >= sizes[k]:  # buffers written whole
            done, total, k = done - sizes[k], total - sizes[k], k + 1
        rest = [memoryview(bufs[k]).cast("B")[done:]] + bufs[k + 1:]
        bufs, sizes, total, k = rest, [sizes[k] - done] + sizes[k + 1:], total - done, 0
        done = os.writev(fd, bufs)


def _plan(sizes: Sequence[int], first: Sequence[int], shard_size: int, alignment: int
          ) -> tuple[list[list[tuple[int, int]]], int]:
    """:func:`plan_shards`, with the arrays at ``first`` in shards of their own, planned first;
    and how many shards those are."""
    if not first:
        return plan_shards(sizes, shard_size, alignment), 0
    chosen = set(first)
    out: list[list[tuple[int, int]]] = []
    cut = 0
    for group in (list(first), [i for i in range(len(sizes)) if i not in chosen]):
        for shard in plan_shards([sizes[i] for i in group], shard_size, alignment):
            out.append([(group[k], offset) for k, offset in shard])
        cut = cut or len(out)
    return out, cut


def _write_shards(store: Store, paths: Sequence[str], arrays: Sequence[np.ndarray],
                  layout: Sequence[list[tuple[int, int]]], block: int,
                  syncs: Syncs | None) -> list[_Written]:
    """Write each ``layout[j]`` to ``paths[j]``, ``store.writers`` shards at once."""
    ctx = contextvars.copy_context()
    if len(layout) <= 1:  # no pool for one shard: its thread would only add a hand-over
        return [ctx.copy().run(_write_one, store, paths[j], arrays, layout[j], block, syncs)
                for j in range(len(layout))]
    with ThreadPoolExecutor(max(1, min(store.writers, len(layout)))) as pool:
        return list(pool.map(lambda j: ctx.copy().run(_write_one, store, paths[j], arrays,
                                                      layout[j], block, syncs),
                             range(len(layout))))


def write_payload(store: Store, arrays: Sequence[np.ndarray], names: Sequence[str],
                  token: str, dtypes: Sequence[str] | None = None, *,
                  chunks: _codec.Chunking | None = None,
                  folder: str = "", syncs: Syncs | None = None
                  ) -> tuple[list[ShardEntry], TensorTable]:
    """Write ``arrays`` (little-endian, C-contiguous) into shards under ``store``; ``dtypes`` are
    their format names when the caller has them already (see ``_codec.Encoded``).  ``folder``: a
    shard folder (``_manifest.SHARD_FOLDER``) to put them in, made here, instead of the top.  With
    ``syncs``, local shards are left to become durable in the background (see :class:`Syncs`):
    the caller waits for them before it commits.

    With ``chunks`` (``_codec.Encoded.chunks``, or ``Chunking.whole(arrays)``), the table is a
    chunked (version-3) one: the arrays' logical tensors, global shapes and starts, and the
    CRC-32C of every ``CRC_BLOCK`` bytes of each array longer than that, so that a load can
    read and verify part of a chunk (docs/FORMAT.md, section 5)."""
    alignment = _knobs.alignment()
    sizes = [a.nbytes for a in arrays]
    handoff = _handoff.current()
    first = _handoff.first_writes(handoff, arrays)
    layout, cut = _plan(sizes, first, store.shard_size, alignment)
    base = f"{folder}/" if folder else ""
    paths = [f"{base}shard-{i:05d}-{token}.bin" for i in range(len(layout))]
    if folder and layout:
        store.makedirs(folder)
    block = CRC_BLOCK if chunks is not None else 0
    # The caller's own arrays (an async save's beyond its staging budget) go first, in shards of
    # their own; then the caller may go on, and the save's copies follow.
    written = _write_shards(store, paths[:cut], arrays, layout[:cut], block, syncs)
    if handoff is not None:
        handoff.release()
    written += _write_shards(store, paths[cut:], arrays, layout[cut:], block, syncs)
    n = len(arrays)
    shard, offset, crc = [0] * n, [0] * n, [0] * n
    for j, w in enumerate(written):
        for idx, off, c in w.tensors:
            shard[idx], offset[idx], crc[idx] = j, off, c
    if dtypes is None:
        dtypes = [_dtype_name(a.dtype) for a in arrays]
    if chunks is None:
        table = TensorTable.from_columns(list(names), dtypes, [a.shape for a in arrays], shard,
                                         offset, sizes, crc)
    else:
        by_index = {i: b for w in written for i, b in w.blocks.items()}
        table = TensorTable.from_columns(
            list(names), dtypes, [a.shape for a in arrays], shard, offset, sizes, crc,
            tensor=chunks.tensor, global_shapes=chunks.global_shapes, starts=chunks.starts,
            block_crc=[c for i in sorted(by_index) for c in by_index[i]], crc_block=block)
    _meter.wrote(len(written), sum(w.shard.size for w in written))
    return [w.shard for w in written], table


# ------------------------------------------------------------------------------------- reading
def check_size(store: Store, shard: ShardEntry) -> None:
    """Compare a remote shard's real size with the manifest before allocating anything for it
    (local shards: ``map_local`` checks the descriptor it maps)."""
    try:
        real = store.size(shard.path)
    except FileNotFoundError as e:
        raise IncompleteCheckpointError(f"{store.join(shard.path)}: shard file is missing"
                                        f"{_of(store, shard)}") from e
    compare_size(store, shard, real)


def _of(store: Store, shard: ShardEntry) -> str:
    """For a deduplicated replica's chunk (outside the checkpoint's folder): whose it is."""
    return f" (chunk {shard.path} of {store.url})" if shard.path.startswith("cas:") else ""


def compare_size(store: Store, shard: ShardEntry, real: int) -> None:
    if real < shard.size:
        raise IncompleteCheckpointError(
            f"{store.join(shard.path)}: shard is truncated ({real} of {shard.size} bytes)"
            f"{_of(store, shard)}")
    if real > shard.size:
        raise CorruptCheckpointError(
            f"{store.join(shard.path)}: shard has {real} bytes, the manifest says {shard.size}",
            file=store.join(shard.path))


def map_local(store: Store, shard: ShardEntry) -> memoryview:
    """Map a local shard: one open (never through a link: ``UnsafeCheckpointError`` for a link,
    FIFO, directory, ...), its size checked on that descriptor, then mapped from it."""
    path = store.join(shard.path)
    try:
        fd, st = store.open_file(shard.path)
    except FileNotFoundError as e:
        raise IncompleteCheckpointError(f"{path}: shard file is missing{_of(store, shard)}") from e
    try:
        compare_size(store, shard, st.st_size)
        if shard.size == 0:
            return memoryview(b"")
        # ACCESS_COPY: private pages, so arrays are writable and writes never reach the file.
        mm = mmap.mmap(fd, shard.size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    if hasattr(mm, "madvise"):
        mm.madvise(mmap.MADV_WILLNEED)
    return memoryview(mm)


def _spans(entries: Sequence[TensorEntry]) -> list[list]:
    """The byte ranges to fetch for ``entries`` of one shard, neighbours (gaps up to 1 MiB)
    merged: ``[[start, end, [k...]]]``.  Empty tensors need no bytes (a zero-length range is an
    error, or the whole object, on S3)."""
    spans: list[list] = []
    for k in sorted((k for k, t in enumerate(entries) if t.length), key=lambda k: entries[k].offset):
        t = entries[k]
        if spans and t.offset - spans[-1][1] <= (1 << 20):
            spans[-1][1] = max(spans[-1][1], t.offset + t.length)
            spans[-1][2].append(k)
        else:
            spans.append([t.offset, t.offset + t.length, [k]])
    return spans


def _fetch_remote_many(store: Store, items: Sequence[tuple[ShardEntry, Sequence[TensorEntry]]],
                       errors: list | None = None) -> list[list[memoryview] | None]:
    """Read the byte ranges of each ``(shard, entries)`` from a remote store in one
    ``Store.read_many`` (every shard's pieces in flight together, up to ``remote_concurrency``);
    per item, the views in the order of its ``entries``.  With ``errors`` given, a short shard
    is reported there and its item is None instead of raising."""
    plans = [_spans(entries) for _, entries in items]
    try:
        blobs = store.read_many([(shard.path, [(s[0], s[1]) for s in spans])
                                 for (shard, _), spans in zip(items, plans)])
    except FileNotFoundError as e:  # removed after its size was checked
        names = ", ".join(store.join(shard.path) for shard, _ in items)
        raise IncompleteCheckpointError(f"{e.filename or names}: shard file is missing") from e
    out = []
    for (shard, entries), spans, shard_blobs in zip(items, plans, blobs):
        views: list[memoryview] | None = [memoryview(b"")] * len(entries)
        for (start, end, ks), blob in zip(spans, shard_blobs):
            if len(blob) != end - start:
                e = IncompleteCheckpointError(f"{store.join(shard.path)}: short read "
                                              f"({len(blob)} of {end - start} bytes)")
                if errors is None:
                    raise e
                errors.append(e)
                views = None
                break
            # Writable arrays, like the local path; a buffer the store filled is ours already.
            view = blob if isinstance(blob, memoryview) and not blob.readonly else \
                memoryview(bytearray(blob))
            for k in ks:
                t = entries[k]
                views[k] = view[t.offset - start: t.offset - start + t.length]
        out.append(views)
    return out


def _fetch_remote(store: Store, shard: ShardEntry, entries: Sequence[TensorEntry]) -> list[memoryview]:
    """:func:`_fetch_remote_many` of one shard."""
    views = _fetch_remote_many(store, [(shard, entries)])[0]
    assert views is not None  # raised otherwise
    return views


def corrupt_error(store: Store, shard: ShardEntry, name: str, expected: int, actual: int
             ) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{store.join(shard.path)}: tensor {name!r} is corrupt (crc32c expected "
        f"{expected:#010x}, got {actual:#010x})",
        file=store.join(shard.path), tensor=name, expected=expected, actual=actual)


def read_tensors(store: Store, manifest: Manifest, indices: Sequence[int], *,
                 verify: bool = True, errors: list | None = None) -> dict[int, np.ndarray]:
    """Load the tensors at ``indices``.  With ``errors`` given, damage is collected there
    (one entry per bad shard or tensor) instead of raised."""
    reading = Reading(store, manifest, indices, verify=verify, errors=errors)
    try:
        return reading.result()
    finally:
        reading.close()


class Reading:
    """The tensors of one load: their arrays at once (views of the mapped or fetched shards), and
    their checksums verified in the background, in batches of about ``verify_batch`` bytes
    submitted in shard order to a pool (``crc32c`` releases the GIL; on a cold local read the
    checksum is also what faults the pages in).

    :meth:`result` waits for every batch; :meth:`wait_for` only for one tensor's, which lets a
    restore assign early tensors while later ones are still being read (see
    ``ckptcore.adapter.RestorePlan.apply``).  :meth:`close` always ends the pool.

    ``lazy``: nothing is verified ahead.  :meth:`check` verifies one tensor in the calling
    thread, as a restore that copies it is about to read it (its bytes then come from memory
    warm from the checksum), and the batches above start only at the first :meth:`wait_for` or
    :meth:`result`, for what no :meth:`check` took.  Why: verification threads started ahead
    hardly run alongside a restore's planning (both need the GIL: the planning holds it), yet
    starting them costs more than a warm load's checksums.
    """

    def __init__(self, store: Store, manifest: Manifest, indices: Sequence[int], *,
                 verify: bool = True, errors: list | None = None, lazy: bool = False) -> None:
        self.store, self.manifest, self.errors = store, manifest, errors
        self.arrays: dict[int, np.ndarray] = {}
        self._batch_of: dict[int, int] = {}
        self._futures: list[Future] = []
        self._clean: list[bool] = []
        self._pool: ThreadPoolExecutor | None = None
        self._lazy: dict[int, tuple] | None = None  # lazy, not started: tensor -> its check
        self._checked: set[int] = set()  # verified one by one (check)
        self._begun = threading.Lock()  # one thread starts the batches; the others wait for it
        table = manifest.tensors
        shard_col = table.column("shard")
        by_shard: dict[int, list[int]] = {}
        for i in indices:
            by_shard.setdefault(shard_col[i], []).append(i)
        # (tensor, shard, buffer, offset in it, length): arrays are views of the buffers.
        checks: list[tuple[int, int, memoryview, int, int]] = []
        if store.local:
            for s in sorted(by_shard):
                try:
                    checks += self._locate(s, by_shard[s])
                except (IncompleteCheckpointError, CorruptCheckpointError) as e:
                    if errors is None:
                        raise
                    errors.append(e)
        elif by_shard:
            checks = self._locate_remote(by_shard)
        dtypes, shapes = table.np_dtypes(), table.shapes
        arrays, ndarray, empty = self.arrays, np.ndarray, np.empty
        for i, _, buf, offset, n in checks:
            # positional arguments: ndarray's keyword parsing costs more than the view itself
            arrays[i] = ndarray(shapes[i], dtypes[i], buf, offset) if n else empty(shapes[i], dtypes[i])
        if verify and checks:
            if lazy:
                self._lazy = {c[0]: c for c in checks}
            else:
                self._start(checks)

    def _locate(self, s: int, idxs: list[int]) -> list[tuple[int, int, memoryview, int, int]]:
        """A local shard: mapped whole, its tensors located by offset."""
        table = self.manifest.tensors
        offset, length = table.column("offset"), table.column("length")
        whole = map_local(self.store, self.manifest.shards[s])
        return [(i, s, whole, offset[i], length[i]) for i in idxs]

    def _locate_remote(self, by_shard: dict[int, list[int]]
                       ) -> list[tuple[int, int, memoryview, int, int]]:
        """Remote shards: every size checked first (concurrent HEADs, before any buffer is
        allocated), then the tensors of all of them fetched in one concurrent read.  Shards are
        bounded to one upload part on S3 (``Store.shard_size``), so a load has many: fetching them
        one after the other would leave the store's parallelism unused."""
        store, shards, table = self.store, self.manifest.shards, self.manifest.tensors
        order = sorted(by_shard)

        def check(s: int) -> Exception | None:
            try:
                check_size(store, shards[s])
            except (IncompleteCheckpointError, CorruptCheckpointError) as e:
                return e
            return None

        ctx = contextvars.copy_context()
        if len(order) == 1:
            problems = [check(order[0])]
        else:
            with ThreadPoolExecutor(min(store.writers, len(order))) as pool:
                problems = list(pool.map(lambda s: ctx.copy().run(check, s), order))
        good = []
        for s, problem in zip(order, problems):
            if problem is None:
                good.append(s)
            elif self.errors is None:
                raise problem
            else:
                self.errors.append(problem)
        items = [(shards[s], [table.entry(i) for i in by_shard[s]]) for s in good]
        try:
            fetched = _fetch_remote_many(store, items, self.errors)
        except IncompleteCheckpointError as e:  # a shard removed after its size was checked
            if self.errors is None:
                raise
            self.errors.append(e)
            return []
        return [(i, s, v, 0, len(v)) for s, views in zip(good, fetched) if views is not None
                for i, v in zip(by_shard[s], views)]

    def _start(self, checks: list[tuple[int, int, memoryview, int, int]]) -> None:
        # One pool task per ~4 MiB of tensors, not per tensor: for 10,000 small tensors the
        # futures alone would cost more than checksumming them.
        limit = max(1, _knobs.verify_batch())
        batches: list[list] = [[]]
        size = 0
        batch_of = self._batch_of
        for check in checks:
            if size >= limit:
                batches.append([])
                size = 0
            batches[-1].append(check)
            batch_of[check[0]] = len(batches) - 1
            size += check[4]
        self._clean = [False] * len(batches)
        if len(batches) == 1 and size < limit // 16:
            # A small load (a few hundred KiB at most): checksummed here, at once; a pool's
            # thread would cost more than the checksum.
            done: Future = Future()
            try:
                done.set_result(self._verify_batch(batches[0]))
            except Exception as e:  # noqa: BLE001 - raised where the batch's result is asked for
                done.set_exception(e)
            self._futures = [done]
            return
        ctx = contextvars.copy_context()
        self._pool = ThreadPoolExecutor(max(1, min(_knobs.threads(), len(batches))),
                                        thread_name_prefix="ckptcore-verify")
        self._futures = [self._pool.submit(ctx.copy().run, self._verify_batch, b) for b in batches]

    def _verify_batch(self, batch: list) -> dict[int, CorruptCheckpointError]:
        table, shards = self.manifest.tensors, self.manifest.shards
        expected = table.column("checksum")
        report = progress.get()
        crc = crc32c.crc32c
        bad = {}
        for i, s, buf, offset, n in batch:
            actual = crc(buf[offset:offset + n])
            if report:
                report(n)
            if actual != expected[i]:
                bad[i] = corrupt_error(self.store, shards[s], table.names[i], expected[i], actual)
        return bad

    def check(self, i: int) -> None:
        """Verify tensor ``i`` now, in the calling thread (lazy and not started yet; threads may
        check different tensors at once), else as :meth:`wait_for`.  Raises its
        ``CorruptCheckpointError`` if it is bad."""
        lazy = self._lazy
        if lazy is None:
            self.wait_for(i)
            return
        entry = lazy.get(i)
        if entry is None or i in self._checked:
            return
        _, s, buf, offset, n = entry
        actual = crc32c.crc32c(buf[offset:offset + n])
        report = progress.get()
        if report:
            report(n)
        expected = self.manifest.tensors.column("checksum")[i]
        if actual != expected:
            raise corrupt_error(self.store, self.manifest.shards[s], self.manifest.tensors.names[i],
                                expected, actual)
        self._checked.add(i)

    def _begin(self) -> None:
        """A lazy reading's batches, for every tensor :meth:`check` has not verified.  The
        batches are in place before ``_lazy`` is cleared: a thread that sees it cleared finds
        them, and one that does not waits here for the thread that starts them."""
        with self._begun:
            lazy = self._lazy
            if lazy is None:
                return
            todo = [c for i, c in lazy.items() if i not in self._checked]
            if todo:
                self._start(todo)
            self._lazy = None

    def wait_for(self, i: int) -> None:
        """Return once tensor ``i`` is verified; raise its ``CorruptCheckpointError`` if it is bad."""
        if self._lazy is not None:
            self._begin()
        b = self._batch_of.get(i)
        if b is None or self._clean[b]:
            return
        bad = self._futures[b].result()
        if not bad:
            self._clean[b] = True  # the next tensors of this batch need no future at all
        elif i in bad:
            raise bad[i]

    def result(self) -> dict[int, np.ndarray]:
        """Every array, once every batch is verified: the first damage found (in tensor order) is
        raised, or with ``errors`` given, collected there and its tensor left out."""
        if self._lazy is not None:
            self._begin()
        for fut in self._futures:
            for i, e in fut.result().items():
                if self.errors is None:
                    raise e
                self.errors.append(e)
                self.arrays.pop(i, None)
        return self.arrays

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def verify_shards(store: Store, manifest: Manifest, errors: list) -> None:
    """Check each shard's whole-file checksum (covers padding too); append damage to ``errors``."""
    for shard in manifest.shards:
        try:
            if store.local:
                actual = crc32c.crc32c(map_local(store, shard))
            else:
                check_size(store, shard)
                actual = _remote_crc(store, shard)
        except (IncompleteCheckpointError, CorruptCheckpointError) as e:
            errors.append(e)
            continue
        if actual != shard.checksum:
            errors.append(CorruptCheckpointError(
                f"{store.join(shard.path)}: shard checksum mismatch (expected {shard.checksum:#010x}, "
                f"got {actual:#010x})", file=store.join(shard.path), expected=shard.checksum,
                actual=actual))


def _remote_crc(store: Store, shard: ShardEntry) -> int:
    """A remote shard's CRC-32C, read ``remote_concurrency`` parts at a time: a shard holding one
    large tensor is never held whole (one ranged read, in concurrent pieces, per window)."""
    window = max(1, _knobs.remote_part_size()) * max(1, _knobs.remote_concurrency())
    crc = 0
    for lo in range(0, shard.size, window):
        hi = min(shard.size, lo + window)
        blob = store.read_ranges(shard.path, [(lo, hi)])[0]
        if len(blob) != hi - lo:  # shrank since its size was checked
            raise IncompleteCheckpointError(f"{store.join(shard.path)}: short read ({lo + len(blob)}"
                                            f" of {shard.size} bytes){_of(store, shard)}")
        crc = crc32c.crc32c(blob, crc)
    return crc
