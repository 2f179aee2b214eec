"""A rank's chunk table on its way to rank 0, in a group save of a state with ``Shard`` leaves.

Every rank encodes the same tree (the digest check of ``_dist`` refuses a rank that does not),
so rank 0 knows each logical tensor's name, dtype and global shape from its own state: a rank's
reply carries, per chunk row, only what differs from rank to rank (the tensor's index, the
chunk's shape and start, its shard, offset, CRC-32C and block CRCs), as raw little-endian
columns and a format version (:data:`VERSION`).  Before, each row carried its name, dtype and
global shape: at 1,000 ranks x 2,000 tensors, 2 million strings to decode and compare
(bench_scale_sim.py).

Rank 0 splits each reply on its own (:func:`split`: a version it reads, columns of consistent
lengths, tensor indices of its state), then checks every rank's rows at once, vectorised
(:func:`join`): shard indices within the rank's list, chunk sizes, block CRC counts, every row
inside its shard, no two rows sharing a byte, each shard ending where its last row ends, every
logical tensor with a row.  Each failure is a ``GroupError`` naming the rank; nothing is
committed.  The chunk rules (chunks inside the global shape, no two overlapping) run once on the
joined table (``_chunkrules.check_chunks``, told that the names come from the tensor index).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from . import _codec
from ._chunkrules import element_counts
from ._manifest import MIN_CRC_BLOCK, ShardEntry, TensorTable
from .errors import GroupError

VERSION = 1  # of a chunk reply's columns; rank 0 refuses any other
# Per row; "shape"/"start" hold ndim values per row (the logical tensor's), "block_crc" one
# CRC per crc_block bytes of each row longer than crc_block (as in a version-3 table).
COLUMNS = {"tensor": "<u4", "shard": "<u4", "offset": "<u8", "checksum": "<u4",
           "shape": "<u8", "start": "<u8", "block_crc": "<u4"}
_PER_ROW = ("tensor", "shard", "offset", "checksum")


def pack(table: TensorTable) -> dict[str, Any]:
    """A rank's own chunked table (``_io.write_payload(..., chunks=...)``) as its reply."""
    cols = {"tensor": table.tensor, "shard": table.shard, "offset": table.offset,
            "checksum": table.checksum, "shape": table.dims, "start": table.start,
            "block_crc": table.block_crc}
    return {"version": VERSION, "crc_block": table.crc_block,
            **{k: np.ascontiguousarray(v, COLUMNS[k]).tobytes() for k, v in cols.items()}}


@dataclass(frozen=True)
class Logical:
    """What rank 0 knows of each logical tensor of the state: name, dtype (``code`` into
    ``dtypes``), rank, global shape (``gdims`` concatenated, tensor k's from ``gstart[k]``) and
    itemsize."""

    names: list[str]
    dtypes: list[str]
    code: np.ndarray
    ndim: np.ndarray
    gdims: np.ndarray
    gstart: np.ndarray
    itemsize: np.ndarray

    @classmethod
    def of(cls, names: list[str], dtypes: Sequence[str],
           shapes: Sequence[Sequence[int]]) -> Logical:
        index = {d: i for i, d in enumerate(dict.fromkeys(dtypes))}
        ndim = np.array([len(s) for s in shapes], np.uint8)
        size = {d: _codec.parse_dtype(d).itemsize for d in index}
        return cls(list(names), list(index), np.array([index[d] for d in dtypes], np.uint32),
                   ndim, np.array([d for s in shapes for d in s], np.uint64),
                   np.cumsum(ndim, dtype=np.int64) - ndim,
                   np.array([size[d] for d in dtypes], np.uint64))


@dataclass
class Rows:
    """One rank's reply, split into its columns (lengths checked, nothing else yet)."""

    cols: dict[str, np.ndarray]
    crc_block: int


def split(reply: Any, rank: int, logical: Logical, where: str) -> Rows:
    """Rank ``rank``'s chunk reply as columns: a map of :data:`VERSION` whose per-row columns
    have one length, whose tensor indices are the state's and whose shape and start columns hold
    those tensors' dimensions; ``GroupError`` naming the rank otherwise."""
    def bad(what: str) -> GroupError:
        return GroupError(f"{where}: rank {rank}'s reply is malformed: {what}; nothing committed")

    if not isinstance(reply, dict):
        raise bad(f"its chunks are a {type(reply).__name__}, not a map")
    if reply.get("version") != VERSION or type(reply.get("version")) is not int:
        raise GroupError(f"{where}: rank {rank} sends its chunks in reply version "
                         f"{_codec.short_repr(reply.get('version'))}; rank 0 reads version "
                         f"{VERSION} (every rank must run the same ckptcore); nothing committed")
    cols: dict[str, np.ndarray] = {}
    for key, code in COLUMNS.items():
        raw = reply.get(key)
        if not isinstance(raw, bytes) or len(raw) % np.dtype(code).itemsize:
            raise bad(f"column {key!r} is not a whole number of {code} values")
        cols[key] = np.frombuffer(raw, code)
    n = len(cols["tensor"])
    if any(len(cols[k]) != n for k in _PER_ROW):
        raise bad("its columns have different lengths")
    crc_block = reply.get("crc_block")
    if type(crc_block) is not int or crc_block < MIN_CRC_BLOCK:
        raise bad(f"crc_block {_codec.short_repr(crc_block)} is not an integer of at least "
                  f"{MIN_CRC_BLOCK}")
    tensor = cols["tensor"]
    if n and int(tensor.max()) >= len(logical.names):
        raise GroupError(f"{where}: rank {rank} reports a chunk of tensor {int(tensor.max())}, "
                         f"but the state has {len(logical.names)} tensors; nothing committed")
    need = int(logical.ndim[tensor].sum(dtype=np.int64))
    for key in ("shape", "start"):
        if len(cols[key]) != need:
            raise bad(f"column {key!r} holds {len(cols[key])} dimensions; its chunks have {need}")
    return Rows(cols, crc_block)


class _Rows:
    """Every rank's rows joined: which rank a row comes from, its tensor's name (for errors)."""

    def __init__(self, counts: np.ndarray, tensor: np.ndarray, logical: Logical,
                 where: str) -> None:
        self.ends, self.tensor, self.logical, self.where = np.cumsum(counts), tensor, logical, where

    def rank(self, i: int) -> int:
        return int(np.searchsorted(self.ends, i, "right"))

    def name(self, i: int) -> str:
        return _codec.short_repr(self.logical.names[int(self.tensor[i])])

    def fail(self, mask: np.ndarray, what: Callable[[int], str]) -> None:
        if mask.any():
            i = int(np.flatnonzero(mask)[0])
            raise GroupError(f"{self.where}: rank {self.rank(i)} {what(i)}; nothing committed")


def join(parts: Sequence[Rows], shards: Sequence[Sequence[ShardEntry]], logical: Logical,
         where: str) -> TensorTable:
    """Every rank's rows (``parts[r]``, its shards ``shards[r]``) as one version-3 table, shard
    indices into the ranks' shard lists concatenated, checked as the module docstring says (the
    chunk rules are left to ``check_chunks``)."""
    counts = np.array([len(p.cols["tensor"]) for p in parts], np.int64)
    col = {k: np.concatenate([p.cols[k] for p in parts]) for k in COLUMNS}
    tensor = col["tensor"]
    rows = _Rows(counts, tensor, logical, where)
    missing = np.bincount(tensor, minlength=len(logical.names)) == 0
    if missing.any():
        raise GroupError(f"{where}: no rank reports a chunk of tensor "
                         f"{_codec.short_repr(logical.names[int(np.flatnonzero(missing)[0])])}; "
                         "nothing committed")
    nshards = np.array([len(s) for s in shards], np.int64)
    local = col["shard"].astype(np.int64)
    rows.fail(local >= np.repeat(nshards, counts), lambda i: f"puts a chunk of tensor "
              f"{rows.name(i)} in its shard {int(local[i])}, but lists "
              f"{int(nshards[rows.rank(i)])}")
    ndim = logical.ndim[tensor]
    starts = np.cumsum(ndim, dtype=np.int64) - ndim
    itemsize = logical.itemsize[tensor]
    nonzero, empty, over = element_counts(ndim, col["shape"], starts, itemsize)
    rows.fail(over, lambda i: f"reports a chunk of tensor {rows.name(i)} too large for any array")
    length = np.where(empty, np.uint64(0), nonzero * itemsize)
    crc_block = _block_checksums(parts, counts, length, col["block_crc"], where)
    flat = [s for ss in shards for s in ss]
    shard = local + np.repeat(np.cumsum(nshards) - nshards, counts)
    _check_bytes(rows, flat, np.cumsum(nshards), shard, col["offset"], length)
    gpos = np.repeat(logical.gstart[tensor] - starts, ndim) + np.arange(len(col["shape"]))
    return TensorTable(
        names=None, interned=list(logical.names), dtypes=logical.dtypes,
        dtype=logical.code[tensor], ndim=ndim, dims=col["shape"], shard=shard.astype(np.uint32),
        offset=col["offset"], length=length, checksum=col["checksum"], tensor=tensor,
        gdims=logical.gdims[gpos], start=col["start"], block_crc=col["block_crc"],
        crc_block=crc_block)


def _block_checksums(parts: Sequence[Rows], counts: np.ndarray, length: np.ndarray,
                     block_crc: np.ndarray, where: str) -> int:
    """Each rank sent one block CRC per ``crc_block`` bytes of its rows longer than that, and
    the ranks that sent any agree on ``crc_block``; returns it."""
    size = np.repeat(np.array([p.crc_block for p in parts], np.uint64), counts)
    blocks = np.where(length > size, (length + (size - np.uint64(1))) // size, np.uint64(0))
    total = np.r_[np.uint64(0), np.cumsum(blocks, dtype=np.uint64)]
    ends = np.cumsum(counts)
    need = total[ends] - total[ends - counts]
    for r, (p, k) in enumerate(zip(parts, need.tolist())):
        if len(p.cols["block_crc"]) != k:
            raise GroupError(f"{where}: rank {r}'s reply holds {len(p.cols['block_crc'])} block "
                             f"checksums; its chunks' lengths need {k}; nothing committed")
    used = {p.crc_block for p in parts if len(p.cols["block_crc"])}
    if len(used) > 1:
        raise GroupError(f"{where}: the ranks use different crc_block sizes {sorted(used)}; "
                         "nothing committed")
    assert len(block_crc) == int(total[-1])
    return used.pop() if used else parts[0].crc_block


def _check_bytes(rows: _Rows, shards: list[ShardEntry], ends: np.ndarray, shard: np.ndarray,
                 offset: np.ndarray, length: np.ndarray) -> None:
    """Every row inside its shard, each shard ending where its last row ends, no two rows of a
    shard sharing a byte (docs/FORMAT.md, section 7).  Rows come in shard and offset order from
    honest ranks (``_io.plan_shards``): that order is checked in one pass, sorted only if not."""
    sizes = np.array([s.size for s in shards], np.uint64)
    size = sizes[shard]
    rows.fail((offset > size) | (length > size - np.minimum(offset, size)), lambda i: (
        f"puts a chunk of tensor {rows.name(i)} at bytes {int(offset[i])}.."
        f"{int(offset[i]) + int(length[i])}, beyond the end of its shard "
        f"{shards[int(shard[i])].path!r} ({shards[int(shard[i])].size} bytes)"))
    end = offset + length  # cannot overflow: within the sizes, checked above
    last = np.zeros(len(shards), np.uint64)
    if len(shard) and (shard[1:] >= shard[:-1]).all():
        heads = np.flatnonzero(np.r_[True, shard[1:] != shard[:-1]])
        last[shard[heads]] = np.maximum.reduceat(end, heads)
    else:
        np.maximum.at(last, shard, end)
    wrong = np.flatnonzero(last != sizes)
    if len(wrong):
        s = int(wrong[0])
        raise GroupError(f"{rows.where}: rank {int(np.searchsorted(ends, s, 'right'))} declares "
                         f"shard {shards[s].path!r} {shards[s].size} bytes, but its chunks end at "
                         f"byte {int(last[s])}; nothing committed")
    live = np.flatnonzero(length)
    g, o, e = ((shard, offset, end) if len(live) == len(shard) else
               (shard[live], offset[live], end[live]))
    if not ((g[1:] > g[:-1]) | ((g[1:] == g[:-1]) & (o[1:] >= o[:-1]))).all():
        order = np.lexsort((o, g))
        g, o, e, live = g[order], o[order], e[order], live[order]
    clash = np.flatnonzero((g[1:] == g[:-1]) & (o[1:] < e[:-1]))
    if len(clash):
        a, b = int(live[clash[0]]), int(live[clash[0] + 1])
        raise GroupError(f"{rows.where}: rank {rows.rank(b)} puts chunks of tensor {rows.name(a)} "
                         f"and tensor {rows.name(b)} on the same bytes of shard "
                         f"{shards[int(shard[b])].path!r}; nothing committed")
