"""Chunked tensors at load time: which bytes of which chunks a requested block needs, reading
exactly those (ranged reads on object stores), verifying every byte read, and assembling.

A request is a box ``[lo, hi)`` of a logical tensor: the whole tensor (no template, or a plain
array in it), or the block of a ``Shard`` leaf of the template (one box per part of a
``Chunks`` leaf).  Chunks are stored in C order, so the part of a chunk that a box needs is
held by a contiguous range of the chunk's rows along its first dimension: that range is read,
then sliced.  Checksums: a read covering a whole chunk is checked against the chunk's CRC-32C;
a partial read is rounded out to the chunk's checksum blocks (``crc_block`` bytes, version 3)
and each block is checked, so no byte reaches the caller unverified (docs/FORMAT.md, section
5).  A chunk without block checksums (formats 1 and 2, or a chunk of at most one block) is
read whole.

:func:`plan` is pure (the table and the requests in, the reads and the copies out): tests
assert on the byte ranges it plans.
"""

from __future__ import annotations

import contextvars
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import crc32c
import numpy as np

from . import _codec, _io, _knobs
from ._manifest import Manifest, TensorTable
from ._storage import Store, named_error
from .errors import CorruptCheckpointError, IncompleteCheckpointError, SchemaError
from .sharding import Chunks, Shard
from .state import TrainingState

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (lo, hi), hi exclusive
_GAP = 1 << 20  # remote reads of one shard this close are fetched as one range


@dataclass(frozen=True)
class Request:
    """Block ``[lo, hi)`` of logical tensor ``tensor``."""

    tensor: int
    lo: tuple[int, ...]
    hi: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(h - l for l, h in zip(self.lo, self.hi))


@dataclass(frozen=True)
class Read:
    """Bytes ``[start, end)`` of chunk (table row) ``row``, relative to the chunk's first byte;
    ``whole``: the whole chunk (checked against its CRC), else whole checksum blocks."""

    row: int
    start: int
    end: int
    whole: bool


@dataclass(frozen=True)
class Copy:
    """Copy the chunk-local box ``src`` into request ``request`` at box ``dst``; the chunk's
    row ``src[0][0]`` starts ``skip`` bytes into read ``read``."""

    request: int
    read: int
    skip: int
    src: Box
    dst: Box


@dataclass
class Plan:
    reads: list[Read] = field(default_factory=list)
    copies: list[Copy] = field(default_factory=list)
    covered: list[int] = field(default_factory=list)  # elements of each request found in chunks

    def nbytes(self) -> int:
        return sum(r.end - r.start for r in self.reads)


def _volume(lo: Sequence[int], hi: Sequence[int]) -> int:
    return math.prod(max(0, h - l) for l, h in zip(lo, hi))


def plan(table: TensorTable, requests: Sequence[Request]) -> Plan:
    """The reads and copies that fill ``requests`` from the chunks of ``table``."""
    out = Plan()
    rows_of = table.rows_of()
    dtypes = table.np_dtypes()
    length = table.column("length")
    crc_block = table.crc_block
    wanted: dict[int, list[tuple[int, int]]] = {}  # row -> byte ranges needed
    # request, row, first byte needed, first byte read, src, dst
    pending: list[tuple[int, int, int, int, Box, Box]] = []
    for q, req in enumerate(requests):
        covered = 0
        for row in rows_of[req.tensor]:
            shape, start = table.shapes[row], table.chunk_start(row)
            lo = tuple(max(a, s) for a, s in zip(req.lo, start))
            hi = tuple(min(b, s + n) for b, s, n in zip(req.hi, start, shape))
            inter = _volume(lo, hi)  # (1 for a 0-d chunk: the empty product)
            if not inter:
                continue
            covered += inter
            if not length[row]:  # elements of 0 bytes (V0): nothing to read or copy
                continue
            row_bytes = math.prod(shape[1:]) * dtypes[row].itemsize
            r0, r1 = (lo[0] - start[0], hi[0] - start[0]) if shape else (0, 1)
            need = (r0 * row_bytes, r1 * row_bytes) if shape else (0, length[row])
            blocks = crc_block if table.blocks(row) is not None else 0
            if blocks:
                need = (need[0] // blocks * blocks, min(-(-need[1] // blocks) * blocks, length[row]))
            else:
                need = (0, length[row])
            wanted.setdefault(row, []).append(need)
            src = (tuple(l - s for l, s in zip(lo, start)), tuple(h - s for h, s in zip(hi, start)))
            dst = (tuple(l - a for l, a in zip(lo, req.lo)), tuple(h - a for h, a in zip(hi, req.lo)))
            pending.append((q, row, r0 * row_bytes, need[0], src, dst))
        out.covered.append(covered)
    # One read per run of overlapping or touching ranges of a chunk.
    index: dict[int, list[tuple[int, int, int]]] = {}  # row -> [(start, end, read index)]
    for row in sorted(wanted):
        merged: list[list[int]] = []
        for a, b in sorted(wanted[row]):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        for a, b in merged:
            index.setdefault(row, []).append((a, b, len(out.reads)))
            out.reads.append(Read(row, a, b, a == 0 and b == length[row]))
    for q, row, first, byte0, src, dst in pending:
        a, _, j = next(x for x in index[row] if x[0] <= byte0 < x[1] or x[0] == byte0)
        out.copies.append(Copy(q, j, first - a, src, dst))
    return out


def _fetch(store: Store, manifest: Manifest, reads: Sequence[Read]) -> list[memoryview]:
    """The bytes of every read (local: views of the mapped shards; remote: one concurrent
    ``Store.read_many``), each shard's size checked against the manifest first."""
    table, shards = manifest.tensors, manifest.shards
    shard_of, offset = table.column("shard"), table.column("offset")
    by_shard: dict[int, list[int]] = {}
    for j, r in enumerate(reads):
        by_shard.setdefault(shard_of[r.row], []).append(j)
    out: list[memoryview] = [memoryview(b"")] * len(reads)
    if store.local:
        for s, js in by_shard.items():
            wanted = sum(reads[j].end - reads[j].start for j in js)
            if 2 * wanted >= shards[s].size:  # most of it: mapped (no copy; arrays are views)
                whole = _io.map_local(store, shards[s])
                for j in js:
                    r = reads[j]
                    out[j] = whole[offset[r.row] + r.start: offset[r.row] + r.end]
            else:  # a few ranges: read just those (a mapping would read ahead through the rest)
                for j, buf in zip(js, _pread(store, shards[s], [(offset[reads[j].row] + reads[j].start,
                                                                 offset[reads[j].row] + reads[j].end)
                                                                for j in js])):
                    out[j] = buf
        return out
    for s in by_shard:
        _io.check_size(store, shards[s])
    order = sorted(by_shard)
    # Neighbouring reads of a shard (gaps up to 1 MiB, as for whole tensors) share one ranged
    # request: a state of many small tensors must not cost a request each.
    spans: dict[int, list[list]] = {}  # shard -> [[start, end, [read indices]]]
    for s in order:
        merged: list[list] = []
        for j in sorted(by_shard[s], key=lambda j: offset[reads[j].row] + reads[j].start):
            a = offset[reads[j].row] + reads[j].start
            b = offset[reads[j].row] + reads[j].end
            if merged and a - merged[-1][1] <= _GAP:
                merged[-1][1] = max(merged[-1][1], b)
                merged[-1][2].append(j)
            else:
                merged.append([a, b, [j]])
        spans[s] = merged
    try:
        blobs = store.read_many([(shards[s].path, [(a, b) for a, b, _ in spans[s]])
                                 for s in order])
    except FileNotFoundError as e:  # removed after its size was checked
        raise IncompleteCheckpointError(f"{e.filename}: shard file is missing") from e
    for s, shard_blobs in zip(order, blobs):
        for (a, b, js), blob in zip(spans[s], shard_blobs):
            if len(blob) != b - a:
                raise IncompleteCheckpointError(f"{store.join(shards[s].path)}: short read "
                                                f"({len(blob)} of {b - a} bytes)")
            # Writable arrays, like the local path; a buffer the store filled is ours already.
            view = blob if isinstance(blob, memoryview) and not blob.readonly else \
                memoryview(bytearray(blob))
            for j in js:
                r = reads[j]
                first = offset[r.row] + r.start - a
                out[j] = view[first:first + r.end - r.start]
    return out


def _pread(store: Store, shard: Any, ranges: list[tuple[int, int]]) -> list[memoryview]:
    """Byte ranges of a local shard, opened like every shard (no links, regular file, the size
    the manifest says) and read with ``pread`` into buffers of our own."""
    path = store.join(shard.path)
    try:
        fd, st = store.open_file(shard.path)
    except FileNotFoundError as e:
        raise IncompleteCheckpointError(f"{path}: shard file is missing") from e
    try:
        _io.compare_size(store, shard, st.st_size)
        out = []
        for a, b in ranges:
            buf = bytearray(b - a)
            view, pos = memoryview(buf), 0
            while pos < len(buf):
                n = os.preadv(fd, [view[pos:]], a + pos)
                if n <= 0:
                    raise IncompleteCheckpointError(f"{path}: short read ({pos} of {len(buf)} "
                                                    "bytes)")
                pos += n
            out.append(view)
        return out
    except OSError as e:
        raise named_error(e, "read", path) from e
    finally:
        os.close(fd)


def check(store: Store, manifest: Manifest, read: Read, data: memoryview) -> None:
    """``CorruptCheckpointError`` unless ``data`` (the bytes of ``read``) matches its checksums."""
    table = manifest.tensors
    row = read.row
    shard = manifest.shards[table.column("shard")[row]]
    if read.whole:
        expected, actual = table.column("checksum")[row], crc32c.crc32c(data)
        if actual != expected:
            raise _io.corrupt_error(store, shard, table.names[row], expected, actual)
        return
    blocks, size = table.blocks(row), table.crc_block
    assert blocks is not None and read.start % size == 0
    first = read.start // size
    for k in range(0, read.end - read.start, size):
        expected = blocks[first + k // size]
        actual = crc32c.crc32c(data[k:k + size])
        if actual != expected:
            raise CorruptCheckpointError(
                f"{store.join(shard.path)}: tensor {table.names[row]!r} is corrupt (block "
                f"{first + k // size} of a chunk: crc32c expected {expected:#010x}, got "
                f"{actual:#010x})", file=store.join(shard.path), tensor=table.names[row],
                expected=expected, actual=actual)


def _check_all(store: Store, manifest: Manifest, reads: Sequence[Read],
               data: Sequence[memoryview]) -> None:
    """:func:`check` every read, on the ``threads`` knob's threads when there is enough to do
    (``crc32c`` releases the GIL); the first damage, in read order, is raised."""
    total = sum(r.end - r.start for r in reads)
    threads = max(1, _knobs.threads())
    if threads == 1 or len(reads) < 2 or total < (8 << 20):
        for r, d in zip(reads, data):
            check(store, manifest, r, d)
        return
    ctx = contextvars.copy_context()
    with ThreadPoolExecutor(min(threads, len(reads)), thread_name_prefix="ckptcore-verify") as pool:
        futures = [pool.submit(ctx.copy().run, check, store, manifest, r, d)
                   for r, d in zip(reads, data)]
        for f in futures:
            f.result()


def read_requests(store: Store, manifest: Manifest, requests: Sequence[Request], *,
                  verify: bool = True, what: Sequence[str] | None = None) -> list[np.ndarray]:
    """The arrays of ``requests`` (each fully covered by chunks, else ``SchemaError``)."""
    table = manifest.tensors
    p = plan(table, requests)
    for q, req in enumerate(requests):
        if p.covered[q] != _volume(req.lo, req.hi):
            name = table.logical_name(req.tensor)
            whole = table.global_shape(int(table.firsts()[req.tensor]))
            asked = ("its whole global shape " + str(list(whole)) if req.hi == whole and not any(req.lo)
                     else f"the block {list(req.lo)}..{list(req.hi)}")
            raise SchemaError(
                f"{store.url}: tensor {name!r}: its chunks cover {p.covered[q]} of the "
                f"{_volume(req.lo, req.hi)} elements of {asked} (a partial save); load it with "
                "like=... whose Shard leaves ask for blocks the checkpoint holds")
    data = _fetch(store, manifest, p.reads)
    if verify:
        _check_all(store, manifest, p.reads, data)
    dtypes = table.np_dtypes()
    out: list[np.ndarray | None] = [None] * len(requests)
    copies_of: dict[int, list[Copy]] = {}
    for c in p.copies:
        copies_of.setdefault(c.request, []).append(c)
    for q, req in enumerate(requests):
        dtype = dtypes[int(table.firsts()[req.tensor])]
        cs = copies_of.get(q, [])
        if len(cs) == 1 and p.reads[cs[0].read].whole and cs[0].dst == ((0,) * len(req.lo), req.shape) \
                and table.shapes[p.reads[cs[0].read].row] == req.shape:
            out[q] = np.ndarray(req.shape, dtype, data[cs[0].read])  # the chunk itself, no copy
            continue
        arr = np.empty(req.shape, dtype)
        for c in cs:
            r = p.reads[c.read]
            shape = table.shapes[r.row]
            if not shape:
                arr[()] = np.ndarray((), dtype, data[c.read])
                continue
            (slo, shi), (dlo, dhi) = c.src, c.dst
            src = np.ndarray((shi[0] - slo[0], *shape[1:]), dtype, data[c.read], c.skip)
            arr[tuple(slice(a, b) for a, b in zip(dlo, dhi))] = src[
                (slice(None),) + tuple(slice(a, b) for a, b in zip(slo[1:], shi[1:]))]
        out[q] = arr
    return out  # type: ignore[return-value]


def _template(like: TrainingState | None) -> tuple[dict[str, Any], dict[str, tuple]]:
    """The ``Shard``/``Chunks`` leaves of ``like`` by name, and its plain arrays' shapes and
    dtypes by name."""
    if like is None:
        return {}, {}
    if not isinstance(like, TrainingState):
        raise TypeError(f"like= takes a ckptcore.TrainingState, got {type(like).__name__}")
    enc = _codec.encode_state(like)
    plain = {name: (arr.shape, arr.dtype) for name, arr in zip(enc.names, enc.arrays)
             if name not in enc.leaves}
    return enc.leaves, plain


def _requests(store: Store, table: TensorTable, refs: Sequence[Any], leaves: dict,
              plain: dict) -> tuple[list[Request], dict[int, tuple[Any, list[int]]]]:
    """The requests of the tensors ``refs`` refers to (a template's blocks, else whole), and
    for each logical tensor its template leaf and requests; the template checked against the
    checkpoint's global shapes and dtypes."""
    requests: list[Request] = []
    slots: dict[int, tuple[Any, list[int]]] = {}  # logical tensor -> (template leaf, requests)
    dtypes = table.np_dtypes()
    for ref in refs:
        k = ref.index
        row = int(table.firsts()[k])
        name, gshape, dtype = table.names[row], table.global_shape(row), dtypes[row]
        leaf = leaves.get(name)
        parts = leaf.parts if isinstance(leaf, Chunks) else (leaf,) if leaf is not None else ()
        for part in parts:
            if part.global_shape != gshape or not _same_dtype(part.dtype, dtype):
                raise SchemaError(f"{store.url}: tensor {name!r}: the template asks for a block "
                                  f"of a {part.dtype}{list(part.global_shape)} array; the "
                                  f"checkpoint holds {dtype}{list(gshape)}")
        if name in plain and (plain[name][0] != gshape or not _same_dtype(plain[name][1], dtype)):
            raise SchemaError(f"{store.url}: tensor {name!r}: the template has a "
                              f"{plain[name][1]}{list(plain[name][0])} array; the checkpoint "
                              f"holds {dtype}{list(gshape)}")
        boxes = ([(p.offsets, tuple(o + n for o, n in zip(p.offsets, p.shape))) for p in parts]
                 or [((0,) * len(gshape), gshape)])
        slots[k] = (leaf, list(range(len(requests), len(requests) + len(boxes))))
        requests += [Request(k, lo, hi) for lo, hi in boxes]
    return requests, slots


def load_tree(store: Store, manifest: Manifest, tree: dict, like: TrainingState | None, *,
              verify: bool = True) -> dict:
    """``tree`` with every reference replaced: by the whole tensor, or, for a template leaf
    that is a ``Shard`` (``Chunks``), by a new one holding the requested block(s)."""
    leaves, plain = _template(like)
    requests, slots = _requests(store, manifest.tensors, _codec.refs(tree), leaves, plain)
    arrays = read_requests(store, manifest, requests, verify=verify)

    def fetch(ref: _codec.TensorRef) -> Any:
        leaf, qs = slots[ref.index]
        if isinstance(leaf, Shard):
            return Shard(arrays[qs[0]], leaf.global_shape, leaf.offsets)
        if isinstance(leaf, Chunks):
            return Chunks([Shard(arrays[q], p.global_shape, p.offsets)
                           for q, p in zip(qs, leaf.parts)])
        return arrays[qs[0]][()] if ref.scalar else arrays[qs[0]]

    return _codec.substitute(tree, fetch)


def covers(store: Store, manifest: Manifest, tree: dict, like: TrainingState | None) -> bool:
    """Whether the rows of ``manifest`` (a version-4 one read for some row groups only) cover
    whole every block that :func:`load_tree` of ``tree`` and ``like`` asks for."""
    table = manifest.tensors
    refs = _codec.refs(tree)
    if not manifest.partial:
        return True
    if any(table.firsts()[r.index] < 0 for r in refs):
        return False  # a tensor none of whose rows was read
    requests, _ = _requests(store, table, refs, *_template(like))
    covered = plan(table, requests).covered
    return all(c == _volume(q.lo, q.hi) for c, q in zip(covered, requests))


# A tensor of more elements than this: its blocks' spans (float64 fractions) may not tell
# neighbouring elements apart, so a load asking for it reads every row group.
_EXACT = 1 << 50


def selector(like: TrainingState | None) -> Callable[[dict], np.ndarray] | None:
    """For a version-4 manifest, which of its row groups (``index``: each group's ``lo``,
    ``hi``, docs/FORMAT.md, section 12) can hold a chunk meeting a block ``like`` asks for;
    None (read them all) when ``like`` has plain arrays (whole tensors) or no blocks.  A chunk
    meets a block iff chunk first <= block last and block first <= chunk last (elements in C
    order): a group is kept iff ``lo <= last / total`` and ``hi > next(first / total)``
    (``lo``, ``hi`` are rounded outwards by one ulp, and 1 / total is many ulps)."""
    leaves, plain = _template(like)
    if plain or not leaves:
        return None
    spans = set()
    for leaf in leaves.values():
        for p in (leaf.parts if isinstance(leaf, Chunks) else (leaf,)):
            total = math.prod(p.global_shape)
            if total > _EXACT:
                return None
            if not math.prod(p.shape):
                continue  # nothing asked (the tensor still needs a row read: see covers)
            strides = [math.prod(p.global_shape[d + 1:]) for d in range(len(p.global_shape))]
            first = sum(o * s for o, s in zip(p.offsets, strides))
            last = sum((o + n - 1) * s for o, n, s in zip(p.offsets, p.shape, strides))
            spans.add((first / total, last / total))
    if not spans:
        return None
    firsts, lasts = (np.array(x, np.float64) for x in zip(*sorted(spans)))
    after = np.nextafter(firsts, np.inf)

    def select(index: dict) -> np.ndarray:
        lo, hi = index["lo"], index["hi"]
        pick = np.zeros(len(lo), bool)
        for a, z in zip(after.tolist(), lasts.tolist()):
            pick |= (lo <= z) & (hi > a)
        return pick
    return select


def _same_dtype(a: np.dtype, b: np.dtype) -> bool:
    """The same element type, whatever the byte order (arrays are stored little-endian)."""
    try:
        return _codec.dtype_name(a) == _codec.dtype_name(b)
    except TypeError:
        return False


def verify_blocks(store: Store, manifest: Manifest, errors: list) -> None:
    """Check the block checksums of every chunk that has them (its whole CRC is checked with
    the other tensors'); damage is appended to ``errors``."""
    table = manifest.tensors
    if not table.chunked:
        return
    length = table.column("length")
    reads = [Read(i, 0, length[i], False) for i in range(len(table)) if table.blocks(i)]
    for r in reads:
        try:
            check(store, manifest, r, _fetch(store, manifest, [r])[0])
        except (CorruptCheckpointError, IncompleteCheckpointError) as e:
            errors.append(e)
