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
import functools
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import crc32c
import numpy as np

from . import _codec, _knobs
from ._manifest import Manifest, ShardEntry, TensorEntry
from ._storage import Store, _close_quietly, _named, fsync_close, open_regular, start_writeback
from .errors import CorruptCheckpointError, IncompleteCheckpointError

# Callback for progress display (the CLI sets it): called with a number of bytes done.
progress: contextvars.ContextVar[Callable[[int], None] | None] = contextvars.ContextVar(
    "ckptcore_progress", default=None)
_ZEROS = bytes(4096)
_COMBINE_MIN = 1 << 18  # below this, re-running the CRC over the bytes is cheaper than combining (~12 us)
_VERIFY_BATCH = 1 << 22


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


# Per-dtype memos: numpy's dtype.name is slow Python, and 10,000 small tensors share a few dtypes.
_dtype_name = functools.lru_cache(maxsize=256)(_codec.dtype_name)
_parse_dtype = functools.lru_cache(maxsize=256)(_codec.parse_dtype)


# ------------------------------------------------------------------------------------- writing
def _chunks(buf: memoryview, size: int) -> Iterator[memoryview]:
    for start in range(0, len(buf), size):
        yield buf[start:start + size]


def _as_bytes(arr: np.ndarray) -> memoryview:
    return memoryview(arr.reshape(-1).view(np.uint8))


def plan_shards(sizes: Sequence[int], shard_size: int, alignment: int) -> list[list[tuple[int, int]]]:
    """Group tensors (by index) into shards of at most ``shard_size`` bytes: ``[[(index, offset)]]``."""
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


@dataclass
class _Written:
    shard: ShardEntry
    tensors: list[tuple[int, int, int]]  # (index, offset, crc)


def _write_one(store: Store, path: str, arrays: Sequence[np.ndarray],
               layout: list[tuple[int, int]]) -> _Written:
    f = store.open_write(path)
    chunk = max(1, int(_knobs.get("write_chunk")))
    kick = int(_knobs.get("writeback_bytes")) if store.local else 0
    try:
        pos, kicked, shard_crc, out = 0, 0, 0, []
        report = progress.get()
        for idx, offset in layout:
            while pos < offset:
                pad = _ZEROS[: offset - pos]
                f.write(pad)
                shard_crc = crc32c.crc32c(pad, shard_crc)
                pos += len(pad)
            buf = _as_bytes(arrays[idx])
            crc = 0
            for part in _chunks(buf, chunk):
                # Checksum a piece, then write it while it is still in the CPU cache.
                crc = crc32c.crc32c(part, crc)
                f.write(part)
                pos += len(part)
                if kick and pos - kicked >= kick:
                    start_writeback(f, kicked, pos - kicked)
                    kicked = pos
                if report:
                    report(len(part))
            n = len(buf)
            shard_crc = (crc32c_combine(shard_crc, crc, n) if n >= _COMBINE_MIN
                         else crc32c.crc32c(buf, shard_crc))
            out.append((idx, offset, crc))
    except OSError as e:  # a failed write (ENOSPC, EIO): the save fails, naming the shard
        _close_quietly(f, store.join(path))
        raise _named(e, "write", store.join(path)) from e
    except BaseException:
        _close_quietly(f, store.join(path))
        raise
    fsync_close(f)  # raises a failed flush, fsync or close; the file is closed either way
    return _Written(ShardEntry(path=path, size=pos, checksum=shard_crc), out)


def write_payload(store: Store, arrays: Sequence[np.ndarray], names: Sequence[str],
                  token: str) -> tuple[list[ShardEntry], list[TensorEntry]]:
    """Write ``arrays`` (little-endian, C-contiguous) into shards under ``store``."""
    alignment = int(_knobs.get("alignment"))
    layout = plan_shards([a.nbytes for a in arrays], int(_knobs.get("shard_size")), alignment)
    paths = [f"shard-{i:05d}-{token}.bin" for i in range(len(layout))]
    ctx = contextvars.copy_context()
    with ThreadPoolExecutor(max(1, min(int(_knobs.get("threads")), len(layout)))) as pool:
        written = list(pool.map(lambda j: ctx.copy().run(_write_one, store, paths[j], arrays, layout[j]),
                                range(len(layout))))
    tensors: list[TensorEntry | None] = [None] * len(arrays)
    for j, w in enumerate(written):
        for idx, offset, crc in w.tensors:
            a = arrays[idx]
            tensors[idx] = TensorEntry(name=names[idx], dtype=_dtype_name(a.dtype),
                                       shape=tuple(a.shape), shard=j, offset=offset,
                                       length=a.nbytes, checksum=crc)
    return [w.shard for w in written], tensors  # type: ignore[return-value]


# ------------------------------------------------------------------------------------- reading
def _check_size(store: Store, shard: ShardEntry) -> None:
    """Compare a remote shard's real size with the manifest before allocating anything for it
    (local shards: ``_map_local`` checks the descriptor it maps)."""
    try:
        real = store.size(shard.path)
    except FileNotFoundError as e:
        raise IncompleteCheckpointError(f"{store.join(shard.path)}: shard file is missing") from e
    _compare_size(store, shard, real)


def _compare_size(store: Store, shard: ShardEntry, real: int) -> None:
    if real < shard.size:
        raise IncompleteCheckpointError(
            f"{store.join(shard.path)}: shard is truncated ({real} of {shard.size} bytes)")
    if real > shard.size:
        raise CorruptCheckpointError(
            f"{store.join(shard.path)}: shard has {real} bytes, the manifest says {shard.size}",
            file=store.join(shard.path))


def _map_local(store: Store, shard: ShardEntry) -> memoryview:
    """Map a local shard: one open (never through a link: ``UnsafeCheckpointError`` for a link,
    FIFO, directory, ...), its size checked on that descriptor, then mapped from it."""
    path = store.join(shard.path)
    try:
        fd, st = open_regular(path)
    except FileNotFoundError as e:
        raise IncompleteCheckpointError(f"{path}: shard file is missing") from e
    try:
        _compare_size(store, shard, st.st_size)
        if shard.size == 0:
            return memoryview(b"")
        # ACCESS_COPY: private pages, so arrays are writable and writes never reach the file.
        mm = mmap.mmap(fd, shard.size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    if hasattr(mm, "madvise"):
        mm.madvise(mmap.MADV_WILLNEED)
    return memoryview(mm)


def _fetch_remote(store: Store, shard: ShardEntry, entries: list[TensorEntry]) -> dict[str, memoryview]:
    """Read the byte ranges of ``entries`` from one remote shard, merging neighbours."""
    spans: list[list] = []
    out: dict[str, memoryview] = {t.name: memoryview(b"") for t in entries if t.length == 0}
    # Empty tensors need no bytes; a zero-length range is an error (or the whole object) on S3.
    for t in sorted((t for t in entries if t.length), key=lambda t: t.offset):
        if spans and t.offset - spans[-1][1] <= (1 << 20):
            spans[-1][1] = max(spans[-1][1], t.offset + t.length)
            spans[-1][2].append(t)
        else:
            spans.append([t.offset, t.offset + t.length, [t]])
    if not spans:
        return out
    try:
        blobs = store.read_ranges(shard.path, [(s[0], s[1]) for s in spans])
    except FileNotFoundError as e:  # removed after its size was checked
        raise IncompleteCheckpointError(f"{store.join(shard.path)}: shard file is missing") from e
    for (start, end, ts), blob in zip(spans, blobs):
        if len(blob) != end - start:
            raise IncompleteCheckpointError(f"{store.join(shard.path)}: short read "
                                            f"({len(blob)} of {end - start} bytes)")
        view = memoryview(bytearray(blob))  # writable arrays, like the local path
        for t in ts:
            out[t.name] = view[t.offset - start: t.offset - start + t.length]
    return out


def _verify(store: Store, shard: ShardEntry, t: TensorEntry, buf: memoryview) -> None:
    actual = crc32c.crc32c(buf)
    report = progress.get()
    if report:
        report(len(buf))
    if actual != t.checksum:
        raise CorruptCheckpointError(
            f"{store.join(shard.path)}: tensor {t.name!r} is corrupt (crc32c expected "
            f"{t.checksum:#010x}, got {actual:#010x})",
            file=store.join(shard.path), tensor=t.name, expected=t.checksum, actual=actual)


def read_tensors(store: Store, manifest: Manifest, indices: Sequence[int], *,
                 verify: bool = True, errors: list | None = None) -> dict[int, np.ndarray]:
    """Load the tensors at ``indices``.  With ``errors`` given, damage is collected there
    (one entry per bad shard or tensor) instead of raised."""
    by_shard: dict[int, list[int]] = {}
    for i in indices:
        by_shard.setdefault(manifest.tensors[i].shard, []).append(i)
    bufs: dict[int, memoryview] = {}
    checks = []
    for s, idxs in by_shard.items():
        shard = manifest.shards[s]
        try:
            entries = [manifest.tensors[i] for i in idxs]
            if store.local:
                whole = _map_local(store, shard)
                views = {t.name: whole[t.offset:t.offset + t.length] for t in entries}
            else:
                _check_size(store, shard)
                views = _fetch_remote(store, shard, entries)
        except (IncompleteCheckpointError, CorruptCheckpointError) as e:
            if errors is None:
                raise
            errors.append(e)
            continue
        for i in idxs:
            bufs[i] = views[manifest.tensors[i].name]
            checks.append((i, shard, manifest.tensors[i], bufs[i]))
    if verify:
        _run_checks(store, checks, errors, bufs)
    return {i: _to_array(manifest.tensors[i], buf) for i, buf in bufs.items()}


def _run_checks(store: Store, checks: list, errors: list | None, bufs: dict) -> None:
    # One pool task per ~4 MiB of tensors, not per tensor: for 10,000 small tensors the futures
    # alone cost more (~0.2 s) than checksumming them.
    batches, size = [[]], 0
    for check in checks:
        if size >= _VERIFY_BATCH:
            batches.append([])
            size = 0
        batches[-1].append(check)
        size += len(check[3])
    ctx = contextvars.copy_context()
    with ThreadPoolExecutor(int(_knobs.get("threads"))) as pool:
        futures = [pool.submit(ctx.copy().run, _verify_batch, store, b) for b in batches if b]
        for fut in futures:
            for i, e in fut.result():
                if errors is None:
                    raise e
                errors.append(e)
                bufs.pop(i, None)


def _verify_batch(store: Store, batch: list) -> list[tuple[int, CorruptCheckpointError]]:
    bad = []
    for i, shard, t, buf in batch:
        try:
            _verify(store, shard, t, buf)
        except CorruptCheckpointError as e:
            bad.append((i, e))
    return bad


def _to_array(t: TensorEntry, buf: memoryview) -> np.ndarray:
    dtype = _parse_dtype(t.dtype)
    if t.length == 0:
        return np.empty(t.shape, dtype)
    return np.frombuffer(buf, dtype=dtype).reshape(t.shape)


def verify_shards(store: Store, manifest: Manifest, errors: list) -> None:
    """Check each shard's whole-file checksum (covers padding too); append damage to ``errors``."""
    for shard in manifest.shards:
        try:
            if store.local:
                data = _map_local(store, shard)
            else:
                _check_size(store, shard)
                data = memoryview(store.read(shard.path))
        except (IncompleteCheckpointError, CorruptCheckpointError) as e:
            errors.append(e)
            continue
        actual = crc32c.crc32c(data)
        if actual != shard.checksum:
            errors.append(CorruptCheckpointError(
                f"{store.join(shard.path)}: shard checksum mismatch (expected {shard.checksum:#010x}, "
                f"got {actual:#010x})", file=store.join(shard.path), expected=shard.checksum,
                actual=actual))
