"""Format 4: a large chunked tensor table split out of the manifest (docs/FORMAT.md, section 12).

A sharded state of 1,000 ranks x 2,000 tensors has 2 million chunk rows; in format 3 they sit
in the manifest with one name per row (149 MiB), and every reader parses all of them.  Format 4
keeps the manifest the commit point (written last, create-only) but moves the rows to a *rows
object* (``shard-rows-<token>.bin``) written before it, in *groups* of consecutive rows, each a
msgpack map of the format-3 columns for its rows.  The manifest keeps one name per logical
tensor (not one per row), the dtype names, and an index: each group's row count, byte range and
CRC-32C, and the span of its chunks (as fractions of their tensors, in C order) so that a load
of some blocks reads only the groups that can hold them.

Only tables of at least ``manifest_split_rows`` rows are written this way (``_commit``); smaller
ones stay format 3, byte for byte.  Every check of format 3 is made on the rows read: a full
read rebuilds the format-3 columns and goes through :func:`_manifest.read_table` itself.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import crc32c
import numpy as np

from . import _codec, _knobs
from ._chunkrules import check_chunks
from ._manifest import (CHUNK_COLUMNS, COLUMNS, ShardEntry, TensorTable, block_count, read_table,
                        safe_shard_name)
from .errors import (CorruptCheckpointError, IncompleteCheckpointError,
                     SchemaError)

# Rows are grouped by the shards they point into (in a group save, one rank's shards are
# consecutive, so a group is one rank's rows: what that rank loads back); a group closes at the
# first change of shard after GROUP_MIN rows, or at GROUP_MAX rows whatever the shards.
GROUP_MIN = 1024
GROUP_MAX = 65536
# The fewest bytes a row takes in a group (the per-row integer columns, 0-d, no block CRCs): a
# declared row count beyond size / this is refused before anything is allocated for it.
MIN_ROW_BYTES = sum(np.dtype(COLUMNS[k]).itemsize for k in COLUMNS if k != "shape") + 4
INDEX = {"rows": "<u4", "offset": "<u8", "length": "<u8", "checksum": "<u4", "lo": "<f8",
         "hi": "<f8"}
# fetch(entry, ranges) -> the bytes of each [start, end) of the rows object ``entry``
Fetch = Callable[[ShardEntry, list[tuple[int, int]]], list[Any]]


def groups(table: TensorTable) -> list[tuple[int, int]]:
    """The row ranges ``[a, b)`` of the groups a writer cuts ``table`` into (see GROUP_MIN)."""
    n = len(table)
    change = np.flatnonzero(table.shard[1:] != table.shard[:-1]) + 1 if n else np.zeros(0, int)
    out, a = [], 0
    for c in change.tolist() + [n]:
        while c - a > GROUP_MAX:
            out.append((a, a + GROUP_MAX))
            a += GROUP_MAX
        if c - a >= GROUP_MIN or c == n:
            if c > a:
                out.append((a, c))
            a = c
    return out


def spans(table: TensorTable) -> tuple[np.ndarray, np.ndarray]:
    """Each row's first and last-plus-one element in its tensor (C order), as fractions of the
    tensor's element count, rounded outwards; (1, 0) for an empty chunk (it holds nothing)."""
    n = len(table)
    ndim = table.ndim.astype(np.intp)
    pos = np.cumsum(ndim) - ndim
    g, s, sh = (x.astype(np.float64) for x in (table.gdims, table.start, table.dims))
    # strides of each dimension: the product of the later global dimensions (per row)
    later = np.ones(len(g))
    for d in range(int(ndim.max()) if n else 0):
        for e in range(d + 1, int(ndim.max())):
            rows = np.flatnonzero(ndim > e)
            later[pos[rows] + d] *= g[pos[rows] + e]
    first = np.add.reduceat(s * later, pos) if len(g) else np.zeros(n)
    last = np.add.reduceat((s + np.maximum(sh, 1) - 1) * later, pos) if len(g) else np.zeros(n)
    total = np.multiply.reduceat(g, pos) if len(g) else np.ones(n)
    first, last, total = (np.where(ndim > 0, x, y) for x, y in
                          ((first, 0.0), (last, 0.0), (total, 1.0)))
    empty = table.length == 0
    lo = np.where(empty, 1.0, np.nextafter(first / np.maximum(total, 1), -np.inf))
    hi = np.where(empty, 0.0, np.nextafter((last + 1) / np.maximum(total, 1), np.inf))
    return lo, hi


def encode(table: TensorTable, rows_path: str) -> tuple[dict, bytes, ShardEntry]:
    """The manifest's ``tensors`` map, the rows object's bytes and its entry, for ``table`` (a
    checked chunked table whose rows of one tensor share its name)."""
    n = len(table)
    uniq, first = np.unique(table.tensor, return_index=True)
    if n and len(uniq) != int(uniq[-1]) + 1:
        raise ValueError("every logical tensor up to the largest needs a row")
    names = (list(table.interned) if table.interned is not None and len(table.interned) == len(uniq)
             else [table.names[i] for i in first.tolist()])
    dpos = np.concatenate([[0], np.cumsum(table.ndim, dtype=np.int64)])
    nb = block_count(table.length, table.crc_block) if n else np.zeros(0, np.uint64)
    bpos = np.concatenate([[0], np.cumsum(nb, dtype=np.int64)])
    per_row = {"dtype": table.dtype, "ndim": table.ndim, "shard": table.shard,
               "offset": table.offset, "length": table.length, "checksum": table.checksum,
               "tensor": table.tensor}
    per_dim = {"shape": table.dims, "gshape": table.gdims, "start": table.start}
    lo, hi = spans(table)
    parts, index = [], {k: [] for k in INDEX}
    at = 0
    for a, b in groups(table):
        cols = {k: np.ascontiguousarray(v[a:b], (COLUMNS | CHUNK_COLUMNS)[k]).tobytes()
                for k, v in per_row.items()}
        cols.update({k: np.ascontiguousarray(v[dpos[a]:dpos[b]], "<u8").tobytes()
                     for k, v in per_dim.items()})
        cols["block_crc"] = np.ascontiguousarray(table.block_crc[bpos[a]:bpos[b]], "<u4").tobytes()
        raw = _codec.pack(cols)
        for k, v in (("rows", b - a), ("offset", at), ("length", len(raw)),
                     ("checksum", crc32c.crc32c(raw)), ("lo", float(lo[a:b].min())),
                     ("hi", float(hi[a:b].max()))):
            index[k].append(v)
        parts.append(raw)
        at += len(raw)
    data = b"".join(parts)
    entry = ShardEntry(path=rows_path, size=len(data), checksum=crc32c.crc32c(data))
    t = {"names": names, "dtypes": list(table.dtypes), "crc_block": table.crc_block, "rows": n,
         "object": {"path": entry.path, "size": entry.size, "checksum": entry.checksum},
         "index": {k: np.array(index[k], INDEX[k]).tobytes() for k in INDEX}}
    return t, data, entry


def _col(d: Any, key: str, code: str, where: str) -> np.ndarray:
    raw = d.get(key) if isinstance(d, dict) else None
    if not isinstance(raw, (bytes, memoryview)):
        raise SchemaError(f"{where}: missing or non-bin column {key!r}")
    width = np.dtype(code).itemsize
    if len(raw) % width:
        raise SchemaError(f"{where}: column {key!r} holds {len(raw)} bytes, not a whole number "
                          f"of {width}-byte values")
    return np.frombuffer(raw, code)


def _int(d: dict, key: str, where: str, top: int = 2 ** 64 - 1) -> int:
    v = d.get(key)
    if type(v) is not int or not 0 <= v <= top:
        raise SchemaError(f"{where}: field {key!r} is missing or not an int in 0..{top}")
    return v


def _head(t: Any, shards: Sequence[ShardEntry], where: str) -> tuple[list, ShardEntry, int, dict]:
    """The names, rows object, row count and index of a format-4 ``tensors`` map, checked."""
    if not isinstance(t, dict):
        raise SchemaError(f"{where} is not a map")
    names = t.get("names")
    if not isinstance(names, list) or not all(map(str.__instancecheck__, names)):
        raise SchemaError(f"{where}: 'names' is not an array of str")
    if len(set(names)) != len(names):
        raise SchemaError(f"{where}: tensor names are not unique")
    o = t.get("object")
    if not isinstance(o, dict) or not safe_shard_name(o.get("path")) \
            or o["path"] in {s.path for s in shards}:
        raise SchemaError(f"{where}: the rows object is not named by a safe path of its own")
    entry = ShardEntry(path=o["path"], size=_int(o, "size", where),
                       checksum=_int(o, "checksum", where, 0xFFFFFFFF))
    limit = _knobs.max_manifest_bytes()
    if entry.size > limit:  # it is read into memory like the manifest: the same bound
        raise SchemaError(f"{where}: the rows object is declared {entry.size} bytes, over the "
                          f"{limit}-byte limit (max_manifest_bytes)")
    n = _int(t, "rows", where)
    if n * MIN_ROW_BYTES > entry.size:
        raise SchemaError(f"{where}: {n} rows cannot fit in a rows object of {entry.size} bytes")
    idx = {k: _col(t.get("index"), k, c, f"{where}: index") for k, c in INDEX.items()}
    if len({len(v) for v in idx.values()}) != 1:
        raise SchemaError(f"{where}: the index's columns have different lengths")
    length, offset = idx["length"], idx["offset"]
    if (length == 0).any() or (length > entry.size).any() or (idx["rows"] == 0).any():
        raise SchemaError(f"{where}: an index entry is empty or longer than the rows object")
    ends = np.cumsum(length, dtype=np.uint64)  # each <= size <= 512 MiB: no wrap
    if len(length) and (int(offset[0]) or not np.array_equal(offset[1:], ends[:-1])):
        raise SchemaError(f"{where}: the index's byte ranges do not follow one another from 0 "
                          "(a gap or an overlap)")
    if (int(ends[-1]) if len(ends) else 0) != entry.size:
        raise SchemaError(f"{where}: the index's byte ranges end at "
                          f"{int(ends[-1]) if len(ends) else 0}, the rows object at {entry.size}")
    if int(idx["rows"].sum(dtype=np.uint64)) != n:
        raise SchemaError(f"{where}: the index's groups hold {int(idx['rows'].sum())} rows; "
                          f"the table declares {n}")
    return names, entry, n, idx


def _group(raw: Any, g: int, idx: dict, source: str) -> dict:
    """Group ``g``'s columns from its bytes, checked against its CRC-32C and row count."""
    actual, want = crc32c.crc32c(raw), int(idx["checksum"][g])
    if actual != want:
        raise CorruptCheckpointError(
            f"{source}: rows group {g}: checksum mismatch (expected {want:#010x}, got "
            f"{actual:#010x})", file=source, expected=want, actual=actual)
    cols = _codec.unpack_raw(bytes(raw))
    where = f"{source}: rows group {g}"
    if not isinstance(cols, dict):
        raise SchemaError(f"{where} is not a map")
    rows = len(_col(cols, "tensor", "<u4", where))
    if rows != int(idx["rows"][g]):
        raise SchemaError(f"{where}: holds {rows} rows; the index says {int(idx['rows'][g])}")
    return cols


def read_tensors(t: Any, shards: Sequence[ShardEntry], source: str, fetch: Fetch | None,
                 select: Callable[[dict], np.ndarray] | None = None
                 ) -> tuple[TensorTable, ShardEntry, bool]:
    """A format-4 table: all its rows (``select`` None), checked like format 3's, or only the
    groups ``select(index)`` picks (a boolean mask), checked for their own columns and byte
    ranges (``partial``, the third value: then the chunk rules across groups are not checked).
    The rows object is read with ``fetch``."""
    where = f"{source}: tensor table"
    names, entry, n, idx = _head(t, shards, where)
    if fetch is None:
        raise SchemaError(f"{source}: a format-4 manifest needs its rows object "
                          f"{entry.path!r}; read it with its checkpoint's store")
    where = f"{source}: rows object {entry.path!r}"
    pick = np.ones(len(idx["rows"]), bool) if select is None else select(idx)
    partial = not pick.all()
    try:
        if partial:
            ranges = [(int(idx["offset"][g]), int(idx["offset"][g] + idx["length"][g]))
                      for g in np.flatnonzero(pick)]
            blobs = list(zip(np.flatnonzero(pick).tolist(), fetch(entry, ranges)))
        else:
            data = fetch(entry, [(0, entry.size)])[0]
            _whole(data, entry, where)
            offs = idx["offset"].tolist()
            blobs = [(g, memoryview(data)[a:a + int(idx["length"][g])])
                     for g, a in enumerate(offs)]
    except FileNotFoundError as e:
        raise IncompleteCheckpointError(f"{where} is missing") from e
    for g, raw in blobs:
        if len(raw) != int(idx["length"][g]):
            raise IncompleteCheckpointError(f"{where}: group {g} is cut short")
    groups_ = [_group(raw, g, idx, where) for g, raw in blobs]
    return _table(groups_, names, t, shards, source, partial), entry, partial


def _whole(data: Any, entry: ShardEntry, where: str) -> None:
    if len(data) < entry.size:
        raise IncompleteCheckpointError(f"{where} is {len(data)} bytes, {entry.size} declared")
    if len(data) > entry.size:
        raise CorruptCheckpointError(f"{where} is {len(data)} bytes, {entry.size} declared",
                                     file=entry.path)
    actual = crc32c.crc32c(data)
    if actual != entry.checksum:
        raise CorruptCheckpointError(
            f"{where}: checksum mismatch (expected {entry.checksum:#010x}, got {actual:#010x})",
            file=entry.path, expected=entry.checksum, actual=actual)


def _table(groups_: list[dict], names: list, t: dict, shards: Sequence[ShardEntry], source: str,
           partial: bool) -> TensorTable:
    """The format-3 columns of the groups, concatenated, with each row's name from its tensor,
    read (and checked) by :func:`read_table`."""
    keys = list(COLUMNS) + list(CHUNK_COLUMNS)
    cols: dict[str, Any] = {}
    for k in keys:
        parts = [g.get(k) for g in groups_]
        if not all(isinstance(p, (bytes, memoryview)) for p in parts):
            raise SchemaError(f"{source}: rows object: a group lacks the bin column {k!r}")
        cols[k] = b"".join(parts)
    tensor = np.frombuffer(cols["tensor"], "<u4")[: len(cols["tensor"]) // 4]
    if len(tensor) and int(tensor.max()) >= len(names):
        raise SchemaError(f"{source}: a row names tensor {int(tensor.max())}, but only "
                          f"{len(names)} names are listed")
    if not partial and len(names) != (int(tensor.max()) + 1 if len(tensor) else 0):
        raise SchemaError(f"{source}: {len(names)} names are listed, but the rows have "
                          f"{int(tensor.max()) + 1 if len(tensor) else 0} tensors")
    cols["names"] = np.array(names + [""], object)[tensor].tolist() if len(tensor) else []
    cols["dtypes"], cols["crc_block"] = t.get("dtypes"), t.get("crc_block")
    table = read_table(cols, list(shards), source=source, partial=partial)
    if partial:
        _check_partial(table, source)
    table.interned = names
    return table


def _check_partial(table: TensorTable, source: str) -> None:
    """The chunk rules (``check_chunks``: dtypes, ranks, global shapes, bounds, no overlap) on
    the rows of some groups: their tensors renumbered densely on a copy, so that a tensor
    without a row read is not taken for a hole."""
    _, dense = np.unique(table.tensor, return_inverse=True)
    copy = TensorTable(names=table.names, dtypes=table.dtypes, dtype=table.dtype,
                       ndim=table.ndim, dims=table.dims, shard=table.shard, offset=table.offset,
                       length=table.length, checksum=table.checksum,
                       tensor=dense.astype(np.uint32).reshape(-1), gdims=table.gdims,
                       start=table.start, block_crc=table.block_crc, crc_block=table.crc_block)
    check_chunks(copy, source)


def encode_manifest(manifest: Any, token: str) -> tuple[Any, bytes, list[tuple[str, bytes]]]:
    """What a commit writes for ``manifest``: the manifest as it is committed (version 4 with its
    rows object when its chunked table has at least ``manifest_split_rows`` rows, else version
    3 for a table read from a version-4 one), its bytes, and the other objects to write first
    (the rows object, ``shard-rows-<token>.bin``, so that a failed save's cleanup finds it)."""
    import dataclasses

    from ._manifest import CHUNKED_VERSION, SPLIT_VERSION

    if manifest.partial:
        raise ValueError("a manifest read for some blocks only cannot be written again")
    table = manifest.tensors
    if manifest.version >= CHUNKED_VERSION and table.chunked \
            and len(table) >= _knobs.manifest_split_rows():
        tensors, rows, entry = encode(table, f"shard-rows-{token}.bin")
        manifest = dataclasses.replace(manifest, version=SPLIT_VERSION, rows=entry)
        return manifest, manifest.envelope(tensors, SPLIT_VERSION), [(entry.path, rows)]
    if manifest.version == SPLIT_VERSION:
        manifest = dataclasses.replace(manifest, version=CHUNKED_VERSION, rows=None)
    return manifest, manifest.to_bytes(), []


def memory_fetch(objects: dict[str, bytes]) -> Fetch:
    """A ``fetch`` over rows objects held in memory (a commit checks what it will write)."""
    def fetch(entry: ShardEntry, ranges: list[tuple[int, int]]) -> list[Any]:
        if entry.path not in objects:
            raise FileNotFoundError(entry.path)
        return [memoryview(objects[entry.path])[a:b] for a, b in ranges]
    return fetch


def reader(fetch: Fetch, select: Callable[[dict], np.ndarray] | None = None) -> Callable:
    """What :meth:`Manifest.from_bytes` takes as ``rows=``: :func:`read_tensors` with ``fetch``
    (and ``select``)."""
    return lambda t, shards, source: read_tensors(t, shards, source, fetch, select)
