"""The on-disk manifest: the tensor table, msgpack encoding, and validation of untrusted bytes.

``manifest.msgpack`` is a msgpack map ``{"format": "ckptcore", "version": 2,
"body": <bin>, "body_crc32c": <uint32>}``.  The body is itself msgpack (see
docs/FORMAT.md); wrapping it lets a reader reject a truncated or damaged
manifest by checksum before trusting a single field of it.

Version 2 stores the tensor table as columns (names, a dtype list, and packed little-endian
integer arrays), so that reading and validating 10,000 tensors is a few NumPy operations rather
than 10,000 msgpack maps checked one by one; version 1 (one map per tensor) is still read.  In
memory the table is a :class:`TensorTable` of columns either way, which also behaves as a tuple
of :class:`TensorEntry` built on demand.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import crc32c
import numpy as np

from . import _codec
from ._chunkrules import element_counts, check_chunks
from .lineage import parse as parse_lineage
from .errors import (CheckpointError, CorruptCheckpointError, SchemaError, UnsafeCheckpointError,
                     UnsupportedCheckpointError)

FORMAT_NAME = "ckptcore"
FORMAT_VERSION = 2
# Version 3 adds chunked tensors (global shapes, chunk offsets, per-block checksums); writers use
# it only for states holding ``ckptcore.Shard`` leaves, so plain saves stay version 2.
CHUNKED_VERSION = 3
# Version 4 moves a large chunked table's rows to a separate rows object (``_manifest4``);
# ``_commit`` writes it for tables of at least ``manifest_split_rows`` rows.
SPLIT_VERSION = 4
READ_VERSIONS = (1, 2, 3, 4)
WRITE_VERSIONS = (1, 2, 3)  # what the format_version knob may ask for (4 is chosen by size)
MANIFEST_NAME = "manifest.msgpack"
CHECKSUM = "crc32c"
# Shard names are plain file names: no separators, no "..", so a manifest can never point outside
# its checkpoint directory (matched with fullmatch: "$" would admit a trailing newline).
_SHARD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
# ... or a plain name in one folder of two lower-case hex digits ("3f/shard-..."): a large group's
# save spreads its shards over 256 key prefixes, so that no single prefix carries every PUT of
# the save (S3 scales request rates per prefix; ``_dist.shard_folder``).  One level, exactly this
# shape: nothing else a separator could reach is admitted.
SHARD_FOLDER = re.compile(r"[0-9a-f]{2}")
CAS_NAME = re.compile(r"cas:[0-9a-f]{64}")  # a deduplicated replica's chunk (_storage.CAS_PREFIX)
# numpy's limits, checked here so that building an array from a valid manifest cannot fail:
# at most 64 dimensions, and the product of the non-zero dimensions times the itemsize must fit
# in a signed 64-bit size.
MAX_NDIM = 64
_SIZE_MAX = 2 ** 63 - 1
# The integer columns of a version-2 tensor table: key -> little-endian element type.  "shape"
# holds every tensor's dimensions one after the other (ndim[i] of them for tensor i).
COLUMNS = {"dtype": "<u4", "ndim": "u1", "shape": "<u8", "shard": "<u4", "offset": "<u8",
           "length": "<u8", "checksum": "<u4"}
# The further columns of a version-3 table (docs/FORMAT.md, section 5): each row is one chunk;
# "tensor" is the logical tensor it belongs to (what the tree refers to), "gshape" and "start"
# (ndim[i] values per row, like "shape") its tensor's global shape and the chunk's place in it,
# "block_crc" the CRC-32C of every ``crc_block`` bytes of each chunk longer than ``crc_block``.
CHUNK_COLUMNS = {"tensor": "<u4", "gshape": "<u8", "start": "<u8", "block_crc": "<u4"}
CRC_BLOCK = 1 << 20  # what writers use: a partial read fetches at most this much beyond its rows
MIN_CRC_BLOCK = 4096  # what readers accept (bounds the number of block checksums a length implies)


def safe_shard_name(path: Any) -> bool:
    """Whether ``path`` may name a shard: a plain file name inside the checkpoint folder (never
    ``..`` or the manifest itself), optionally in one :data:`SHARD_FOLDER` (``3f/shard-...``;
    no other separator), or a deduplicated replica's ``cas:`` chunk."""
    if not isinstance(path, str) or ".." in path:
        return False
    if CAS_NAME.fullmatch(path):
        return True
    folder, sep, name = path.rpartition("/")
    if sep and not SHARD_FOLDER.fullmatch(folder):  # "a/b/c", "/abs", "zz/x", "ab//x"
        return False
    return name != MANIFEST_NAME and bool(_SHARD_NAME.fullmatch(name))


def shard_folder(path: str) -> str:
    """The :data:`SHARD_FOLDER` a (safe) shard path is in, or "" for a plain name."""
    return path.rpartition("/")[0]


def block_count(length: np.ndarray, crc_block: int) -> np.ndarray:
    """How many block checksums each row of ``length`` bytes has in a version-3 table: none for
    a row of at most one block (its own checksum covers it), else one per ``crc_block`` bytes."""
    b = np.uint64(crc_block)
    return np.where(length > b, (length + (b - np.uint64(1))) // b, np.uint64(0))


@dataclass(frozen=True, kw_only=True)
class ShardEntry:
    path: str
    size: int
    checksum: int


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: int
    offset: int
    length: int
    checksum: int


class TensorTable(Sequence[TensorEntry]):
    """The tensor table as columns: ``names`` (list of str), ``dtypes`` (the distinct dtype
    names) and NumPy arrays ``dtype`` (index into ``dtypes``), ``ndim``, ``dims`` (all shapes
    concatenated), ``shard``, ``offset``, ``length``, ``checksum``.

    It is also a read-only sequence of :class:`TensorEntry` (indexing, iteration, ``len`` and
    equality with a tuple of entries work), built on first use: the hot paths read the columns.

    Version 3 (``chunked``): each row is one *chunk* of a logical tensor, and the table also has
    ``tensor`` (the logical tensor of each row: what the state tree refers to), ``gdims`` (each
    row's global shape, concatenated like ``dims``), ``start`` (each chunk's offsets in it),
    ``block_crc`` (the CRC-32C of every ``crc_block`` bytes of each row longer than
    ``crc_block``, rows after rows).  Without them (versions 1 and 2) logical tensor *i* is row
    *i*, whole.
    """

    __slots__ = ("_names", "dtypes", "dtype", "ndim", "dims", "shard", "offset", "length",
                 "checksum", "tensor", "gdims", "start", "block_crc", "crc_block",
                 "_starts", "_shapes", "_lists", "_rows", "_block_pos", "firsts_cache",
                 "interned")

    def __init__(self, *, names: list[str], dtypes: list[str], dtype: np.ndarray, ndim: np.ndarray,
                 dims: np.ndarray, shard: np.ndarray, offset: np.ndarray, length: np.ndarray,
                 checksum: np.ndarray, tensor: np.ndarray | None = None,
                 gdims: np.ndarray | None = None, start: np.ndarray | None = None,
                 block_crc: np.ndarray | None = None, crc_block: int = 0,
                 interned: list[str] | None = None) -> None:
        # ``names`` may be None for a chunked table given ``interned``: the per-row list (one
        # name per chunk, millions at 1,000 ranks) is then built on first use only; rank 0's
        # merge and the version-4 writer never need it.
        if names is None and (interned is None or tensor is None):
            raise ValueError("a table without per-row names needs tensor and interned")
        self._names, self.dtypes = names, dtypes
        self.dtype, self.ndim, self.dims = dtype, ndim, dims
        self.shard, self.offset, self.length, self.checksum = shard, offset, length, checksum
        self.tensor, self.gdims, self.start = tensor, gdims, start
        self.block_crc, self.crc_block = block_crc, int(crc_block)
        self._starts: list[int] | None = None
        self._shapes: list[tuple[int, ...]] | None = None
        self._lists: dict[str, list] = {}
        self._rows: list[list[int]] | None = None
        self._block_pos: np.ndarray | None = None
        self.firsts_cache: np.ndarray | None = None
        # Version 4: the names of the logical tensors (one each), as the manifest lists them.
        self.interned: list[str] | None = interned

    @property
    def names(self) -> list[str]:
        """The name of each row (a chunk's is its logical tensor's)."""
        if self._names is None:
            self._names = np.array(list(self.interned or ()) + [""], object)[self.tensor].tolist()
        return self._names

    @names.setter
    def names(self, names: list[str]) -> None:
        self._names = names

    @classmethod
    def from_columns(cls, names: list[str], dtype_names: Sequence[str],
                     shapes: Sequence[tuple[int, ...]], shard: Sequence[int],
                     offset: Sequence[int], length: Sequence[int],
                     checksum: Sequence[int], *, tensor: Sequence[int] | None = None,
                     global_shapes: Sequence[tuple[int, ...]] | None = None,
                     starts: Sequence[tuple[int, ...]] | None = None,
                     block_crc: Sequence[int] | None = None, crc_block: int = 0) -> TensorTable:
        """A table from per-tensor Python values (what a writer has); dtype names are interned.
        With ``tensor`` (and ``global_shapes``, ``starts``, ``block_crc``, ``crc_block``), a
        chunked (version-3) table whose rows are chunks."""
        index = {d: i for i, d in enumerate(dict.fromkeys(dtype_names))}
        codes = np.fromiter(map(index.__getitem__, dtype_names), np.uint32, len(dtype_names))
        ndim = np.fromiter(map(len, shapes), np.uint8, len(shapes))
        total = int(ndim.sum(dtype=np.int64))

        def flat(seq: Sequence[tuple[int, ...]]) -> np.ndarray:
            return np.fromiter(itertools.chain.from_iterable(seq), np.uint64, total)

        chunked = tensor is not None
        table = cls(names=list(names), dtypes=list(index), dtype=codes,
                    ndim=ndim, dims=flat(shapes), shard=np.array(shard, np.uint32),
                    offset=np.array(offset, np.uint64), length=np.array(length, np.uint64),
                    checksum=np.array(checksum, np.uint32),
                    tensor=np.array(tensor, np.uint32) if chunked else None,
                    gdims=flat(global_shapes if global_shapes is not None else shapes)
                    if chunked else None,
                    start=(flat(starts) if starts is not None else np.zeros(total, np.uint64))
                    if chunked else None,
                    block_crc=np.array(block_crc or [], np.uint32) if chunked else None,
                    crc_block=crc_block if chunked else 0)
        table._shapes = [s if type(s) is tuple else tuple(s) for s in shapes]
        return table

    def with_locations(self, shard: np.ndarray, offset: np.ndarray) -> TensorTable:
        """The same rows (names, dtypes, shapes, lengths, checksums, chunk columns) at other
        places: ``shard`` and ``offset`` per row (a copy of a checkpoint laid out otherwise)."""
        return TensorTable(names=self._names, dtypes=self.dtypes, dtype=self.dtype, ndim=self.ndim,
                           dims=self.dims, shard=np.asarray(shard, np.uint32),
                           offset=np.asarray(offset, np.uint64), length=self.length,
                           checksum=self.checksum, tensor=self.tensor, gdims=self.gdims,
                           start=self.start, block_crc=self.block_crc, crc_block=self.crc_block,
                           interned=self.interned)

    @classmethod
    def from_entries(cls, entries: Sequence[TensorEntry]) -> TensorTable:
        if isinstance(entries, TensorTable):
            return entries
        return cls.from_columns([t.name for t in entries], [t.dtype for t in entries],
                                [t.shape for t in entries], [t.shard for t in entries],
                                [t.offset for t in entries], [t.length for t in entries],
                                [t.checksum for t in entries])

    # ------------------------------------------------------------------ logical tensors
    @property
    def chunked(self) -> bool:
        """Whether this is a version-3 table (rows are chunks of logical tensors)."""
        return self.tensor is not None

    def rows_of(self) -> list[list[int]]:
        """The rows of each logical tensor, in table order (cached): ``[[i]]`` per row in
        versions 1 and 2."""
        if self._rows is None:
            if self.tensor is None:
                self._rows = [[i] for i in range(len(self))]
            else:
                rows: list[list[int]] = [[] for _ in range(self.logical_count())]
                for i, k in enumerate(self.column("tensor")):
                    rows[k].append(i)
                self._rows = rows
        return self._rows

    def firsts(self) -> np.ndarray:
        """The first row of each logical tensor (cached; set when a chunked table is checked);
        -1 for one without a row (a version-4 table of some row groups)."""
        if self.firsts_cache is None:
            if self.tensor is None:
                self.firsts_cache = np.arange(len(self))
            else:
                self.firsts_cache = np.array([r[0] if r else -1 for r in self.rows_of()],
                                             np.intp)
        return self.firsts_cache

    def logical_name(self, k: int) -> str:
        if self.interned is not None:  # (version 4: a partial table may hold no row of k)
            return self.interned[k]
        return self.names[int(self.firsts()[k])]

    def logical_count(self) -> int:
        if self.interned is not None:
            return len(self.interned)
        if self.tensor is None:
            return len(self)
        return int(self.tensor.max()) + 1 if len(self.tensor) else 0

    def global_shape(self, row: int) -> tuple[int, ...]:
        """The global shape of row ``row``'s logical tensor (its own shape in versions 1, 2)."""
        if self.gdims is None:
            return self.shapes[row]
        s = self._row_starts()[row]
        return tuple(self.gdims[s:s + int(self.ndim[row])].tolist())

    def chunk_start(self, row: int) -> tuple[int, ...]:
        """Where row ``row``'s chunk starts in its tensor (zeros in versions 1, 2)."""
        if self.start is None:
            return (0,) * int(self.ndim[row])
        s = self._row_starts()[row]
        return tuple(self.start[s:s + int(self.ndim[row])].tolist())

    def _row_starts(self) -> list[int]:
        if self._starts is None:
            self._starts = (np.cumsum(self.ndim, dtype=np.int64) - self.ndim).tolist()
        return self._starts

    def blocks(self, row: int) -> list[int] | None:
        """The block checksums of ``row`` (each of ``crc_block`` bytes, the last one shorter),
        or None when the row has none (not chunked, or no longer than one block)."""
        if self.block_crc is None or not self.crc_block:
            return None
        n = block_count(self.length, self.crc_block)
        if not n[row]:
            return None
        if self._block_pos is None:
            self._block_pos = np.cumsum(n, dtype=np.int64) - n
        p = int(self._block_pos[row])
        return self.block_crc[p:p + int(n[row])].tolist()

    # ------------------------------------------------------------------ column views as lists
    def column(self, key: str) -> list[int]:
        """A column as a list of Python ints (cached): the per-tensor loops of the I/O path."""
        if key not in self._lists:
            self._lists[key] = getattr(self, key).tolist()
        return self._lists[key]

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        if self._shapes is None:
            dims, ndim = self.dims.tolist(), self.ndim.tolist()
            out, pos = [], 0
            for n in ndim:
                out.append(tuple(dims[pos:pos + n]))
                pos += n
            self._shapes = out
        return self._shapes

    def dtype_names(self) -> list[str]:
        names = self.dtypes
        return [names[i] for i in self.column("dtype")]

    def np_dtypes(self) -> list[np.dtype]:
        """The NumPy dtype of each tensor (the names were validated when the table was read)."""
        parsed = [_codec.parse_dtype(d) for d in self.dtypes]
        return [parsed[i] for i in self.column("dtype")]

    # ------------------------------------------------------------------- sequence of entries
    def entry(self, i: int) -> TensorEntry:
        return TensorEntry(name=self.names[i], dtype=self.dtypes[self.column("dtype")[i]],
                           shape=self.shapes[i], shard=self.column("shard")[i],
                           offset=self.column("offset")[i], length=self.column("length")[i],
                           checksum=self.column("checksum")[i])

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self.entry(j) for j in range(*i.indices(len(self))))
        n = len(self)
        i = int(i)
        if not -n <= i < n:
            raise IndexError("tensor index out of range")
        return self.entry(i % n if i < 0 else i)

    def __iter__(self) -> Iterator[TensorEntry]:
        return (self.entry(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TensorTable):
            return (self.names == other.names and self.dtype_names() == other.dtype_names()
                    and self.shapes == other.shapes
                    and all(self.column(k) == other.column(k)
                            for k in ("shard", "offset", "length", "checksum"))
                    and self.chunked == other.chunked
                    and (not self.chunked or (
                        self.crc_block == other.crc_block
                        and all(np.array_equal(getattr(self, k), getattr(other, k))
                                for k in ("tensor", "gdims", "start", "block_crc")))))
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TensorTable({len(self)} tensors)"

    def nbytes(self) -> int:
        return int(self.length.sum(dtype=np.uint64)) if len(self) else 0

    def to_v2(self) -> dict[str, Any]:
        cols = {"dtype": self.dtype, "ndim": self.ndim, "shape": self.dims, "shard": self.shard,
                "offset": self.offset, "length": self.length, "checksum": self.checksum}
        return {"names": list(self.names), "dtypes": list(self.dtypes),
                **{k: np.ascontiguousarray(cols[k], COLUMNS[k]).tobytes() for k in COLUMNS}}

    def to_v3(self) -> dict[str, Any]:
        if self.tensor is None:  # its rows' block checksums were never computed
            raise ValueError("a version-3 table needs chunk columns (written by "
                             "_io.write_payload(..., chunks=...))")
        cols = {"tensor": self.tensor, "gshape": self.gdims, "start": self.start,
                "block_crc": self.block_crc}
        return {**self.to_v2(), "crc_block": self.crc_block,
                **{k: np.ascontiguousarray(cols[k], CHUNK_COLUMNS[k]).tobytes()
                   for k in CHUNK_COLUMNS}}

    def to_v1(self) -> list[dict[str, Any]]:
        return [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "shard": t.shard,
                 "offset": t.offset, "length": t.length, "checksum": t.checksum} for t in self]


@dataclass(frozen=True, kw_only=True)
class Manifest:
    created: float
    writer: dict[str, Any]
    library: dict[str, Any]
    framework: dict[str, Any]
    alignment: int
    shards: tuple[ShardEntry, ...]
    tensors: TensorTable  # a tuple of TensorEntry is accepted and converted
    tree: dict[str, Any] = field(repr=False)
    version: int = FORMAT_VERSION
    # The tensor indices the tree refers to, ascending (found while the tree is validated).
    referenced: tuple[int, ...] | None = field(default=None, repr=False, compare=False)
    # Version 4: the rows object holding the tensor table (section 12 of docs/FORMAT.md), named
    # and checksummed like a shard; ``partial``: only some of its row groups were read (a load
    # of some blocks), so the table holds only their rows.
    rows: ShardEntry | None = field(default=None, repr=False, compare=False)
    partial: bool = field(default=False, repr=False, compare=False)
    # Optional: what the save knew of its own cost before the commit (docs/FORMAT.md, "stats").
    stats: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    # The optional lineage map (``ckptcore.lineage``): None in checkpoints written without one.
    lineage: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.tensors, TensorTable):
            object.__setattr__(self, "tensors", TensorTable.from_entries(tuple(self.tensors)))

    def referenced_indices(self) -> Sequence[int]:
        if self.referenced is None:
            object.__setattr__(self, "referenced",
                               tuple(sorted({r.index for r in _codec.refs(self.tree)})))
        return self.referenced  # type: ignore[return-value]

    def files(self) -> list[str]:
        """Every file of the checkpoint the manifest names: its shards and (version 4) its rows
        object; cleanup and gc keep these."""
        return [s.path for s in self.shards] + ([self.rows.path] if self.rows else [])

    def envelope(self, tensors: Any, version: int) -> bytes:
        """The manifest's bytes with ``tensors`` as the body's tensor table."""
        body = _codec.pack({
            "created": self.created, "writer": self.writer, "library": self.library,
            "framework": self.framework, "checksum": CHECKSUM, "alignment": self.alignment,
            "shards": [{"path": s.path, "size": s.size, "checksum": s.checksum} for s in self.shards],
            "tensors": tensors, "tree": self.tree,
            **({} if self.stats is None else {"stats": self.stats}),
            **({"lineage": self.lineage} if self.lineage is not None else {}),
        })
        return _codec.pack({"format": FORMAT_NAME, "version": version, "body": body,
                            "body_crc32c": crc32c.crc32c(body)})

    def to_bytes(self) -> bytes:
        if self.version == SPLIT_VERSION:
            raise ValueError("a version-4 manifest comes with its rows object: "
                             "_manifest4.encode_manifest writes both")
        if self.version not in READ_VERSIONS:
            raise ValueError(f"cannot write format version {self.version!r}; "
                             f"choose one of {READ_VERSIONS}")
        if self.tensors.chunked and self.version < CHUNKED_VERSION:
            raise ValueError(f"chunked tensors need format version {CHUNKED_VERSION}, "
                             f"not {self.version}")
        return self.envelope(self.tensors.to_v3() if self.version >= CHUNKED_VERSION
                             else self.tensors.to_v2() if self.version == 2
                             else self.tensors.to_v1(), self.version)

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str = MANIFEST_NAME, rows: Any = None
                   ) -> Manifest:
        """Parse and validate untrusted manifest bytes; every defect is a typed error naming
        ``source``.  Version 4 needs ``rows(tensors, shards, source) -> (table, rows object
        entry, partial)``, which reads its rows object (``_manifest4.reader``: this module
        builds no table from another object itself)."""
        outer = _codec.unpack_plain(data, source)
        if not isinstance(outer, dict) or outer.get("format") != FORMAT_NAME:
            raise SchemaError(f"{source}: not a ckptcore manifest")
        version = outer.get("version")
        if type(version) is not int or version not in READ_VERSIONS:  # not True, not 1.0
            raise UnsupportedCheckpointError(
                f"{source}: unsupported format version {_codec.short_repr(version)} (this ckptcore "
                f"reads versions {', '.join(map(str, READ_VERSIONS))}); upgrade ckptcore")
        body, crc = outer.get("body"), outer.get("body_crc32c")
        # body: a view into ``data`` (see _codec.unpack_plain), or bytes from msgpack
        if not isinstance(body, (bytes, memoryview)) or not isinstance(crc, int):
            raise SchemaError(f"{source}: manifest has no body")
        actual = crc32c.crc32c(body)
        if actual != crc:
            raise CorruptCheckpointError(
                f"{source}: manifest checksum mismatch (expected {crc:#010x}, got {actual:#010x})",
                file=source, expected=crc, actual=actual)
        refs: list[_codec.TensorRef] = []
        try:
            # The tables are checked field by field below; only the tree has extensions.
            b = _codec.unpack_raw(body)
            if isinstance(b, dict) and "tree" in b:
                b["tree"] = _codec.resolve(b["tree"], refs)
        except SchemaError as e:
            raise SchemaError(f"{source}: {e}") from e
        try:
            return _validate(b, version, refs, source, rows)
        except CheckpointError:
            raise
        except (RecursionError, TypeError, ValueError, OverflowError, IndexError) as e:  # backstop
            raise SchemaError(f"{source}: malformed manifest ({type(e).__name__}: {e})") from e


def encoded_tree(data: bytes) -> Any:
    """The tree of manifest bytes as stored (tensor references still msgpack extensions), for a
    copy that writes the manifest again with other shards (``_replica``); call it on bytes that
    :meth:`Manifest.from_bytes` has validated."""
    import msgpack

    outer = _codec.unpack_plain(data, MANIFEST_NAME)
    return msgpack.unpackb(outer["body"], raw=False, strict_map_key=False)["tree"]


def _req(d: Any, key: str, kind: type | tuple, where: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise SchemaError(f"{where}: missing field {key!r}")
    v = d[key]
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise SchemaError(f"{where}: field {key!r} has the wrong type ({type(v).__name__})")
    return v


def _nonneg(d: dict, key: str, where: str) -> int:
    v = _req(d, key, int, where)
    if v < 0:
        raise SchemaError(f"{where}: field {key!r} is negative")
    return v


def _validate(b: Any, version: int, refs: list, source: str, rows_reader: Any = None
              ) -> Manifest:
    if not isinstance(b, dict):
        raise SchemaError(f"{source}: body is not a map")
    if b.get("checksum") != CHECKSUM:
        raise UnsupportedCheckpointError(
            f"{source}: unsupported checksum algorithm {_codec.short_repr(b.get('checksum'))}")
    shards = []
    seen: set[str] = set()
    for i, s in enumerate(_req(b, "shards", list, source)):
        where = f"{source}: shard {i}"
        path = _req(s, "path", str, where)
        if not safe_shard_name(path):
            raise UnsafeCheckpointError(f"{where}: shard path {_codec.short_repr(path)} is not a plain "
                                        "file name inside the checkpoint directory (optionally in "
                                        "one folder of two hex digits); refusing to read it")
        if path in seen:
            raise SchemaError(f"{where}: shard path {path!r} is listed twice")
        seen.add(path)
        shards.append(ShardEntry(path=path, size=_nonneg(s, "size", where),
                                 checksum=_uint32(s, "checksum", where)))
    if version == 1:
        entries = [_tensor(t, i, shards, source)
                   for i, t in enumerate(_req(b, "tensors", list, source))]
        if len({t.name for t in entries}) != len(entries):  # readers key tensors by name
            raise SchemaError(f"{source}: tensor names are not unique")
        table = TensorTable.from_entries(entries)
    elif version == SPLIT_VERSION:
        if rows_reader is None:
            raise SchemaError(f"{source}: a format-4 manifest is read with its rows object, "
                              "from its checkpoint's store (read_manifest)")
        table, rows, partial = rows_reader(b.get("tensors"), shards, source)
    else:
        table = _table_v2(_req(b, "tensors", dict, source), shards, source,
                          chunked=version >= CHUNKED_VERSION)
    if version != SPLIT_VERSION:
        rows, partial = None, False
    # (a partial table holds some rows only: the shards' ends are not all known)
    _check_layout(table, shards, source, ends=not partial)
    tree = _req(b, "tree", dict, source)
    referenced = _check_tree(tree, refs, table, source, partial)
    created = _req(b, "created", (int, float), source)
    if isinstance(created, bool) or not math.isfinite(created):
        raise SchemaError(f"{source}: field 'created' is not a finite number")
    lineage = parse_lineage(b["lineage"], source) if b.get("lineage") is not None else None
    return Manifest(created=float(created), lineage=lineage,
                    writer=_req(b, "writer", dict, source), library=_req(b, "library", dict, source),
                    framework=_req(b, "framework", dict, source),
                    alignment=_nonneg(b, "alignment", source), shards=tuple(shards),
                    tensors=table, tree=tree, version=version, referenced=referenced, rows=rows,
                    partial=partial, stats=_stats(b, source))


# The optional ``stats`` map of a manifest body and the type of each of its known fields.
STATS_FIELDS = {"bytes": int, "bytes_written": int, "shards": int, "seconds": float,
                "seconds_blocked": float, "asynchronous": bool}


def _stats(b: dict, source: str) -> dict[str, Any] | None:
    """The body's optional ``stats`` (None when absent: older writers): a map whose known
    fields are checked (counts non-negative integers, seconds finite and non-negative, the flag
    a bool; else ``SchemaError``) and whose unknown ones are dropped (a later writer's)."""
    if "stats" not in b:
        return None
    raw = b["stats"]
    if not isinstance(raw, dict):
        raise SchemaError(f"{source}: field 'stats' is a {type(raw).__name__}, not a map")
    out: dict[str, Any] = {}
    for key, kind in STATS_FIELDS.items():
        if key not in raw:
            continue
        v = raw[key]
        if kind is bool:
            ok = isinstance(v, bool)
        elif kind is int:
            ok = type(v) is int and v >= 0
        else:
            ok = type(v) in (int, float) and math.isfinite(v) and v >= 0
        if not ok:
            raise SchemaError(f"{source}: stats field {key!r} is {_codec.short_repr(v)}, not a "
                              + ("bool" if kind is bool else "non-negative "
                                 + ("integer" if kind is int else "finite number")))
        out[key] = float(v) if kind is float else v
    return out


def _uint32(d: dict, key: str, where: str) -> int:
    v = _nonneg(d, key, where)
    if v > 0xFFFFFFFF:
        raise SchemaError(f"{where}: field {key!r} is not a 32-bit checksum")
    return v


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _table_v2(t: dict, shards: list[ShardEntry], source: str, *, chunked: bool = False,
              partial: bool = False) -> TensorTable:
    """A version-2 tensor table, validated column by column with NumPy (docs/FORMAT.md, section
    5): as strict as version 1's entry-by-entry checks, in a few array operations.  Keys not
    listed here are ignored (a later version may add optional columns).  ``chunked``: a
    version-3 table, whose rows are chunks (see :func:`_chunk_columns`)."""
    where = f"{source}: tensor table"
    names = _req(t, "names", list, where)
    dtypes = _req(t, "dtypes", list, where)
    n = len(names)
    cols = _v2_columns(t, n, where)
    _check_v2_names(names, source, unique=not chunked)
    parsed = []
    for j, d in enumerate(dtypes):
        if not isinstance(d, str):
            raise SchemaError(f"{where}: dtype {j} is a {type(d).__name__}, not a string")
        # (a long name is never valid; it must not sit in the cache: a hostile one is 48 MB)
        known = _codec.parse_known(d) if len(d) <= 64 else None
        parsed.append(known if known is not None
                      else _codec.parse_dtype(d, where=f"{where}: dtype {j}"))
    code, ndim, dims = cols["dtype"], cols["ndim"], cols["shape"]
    shard, offset, length = cols["shard"], cols["offset"], cols["length"]

    def fail(mask: np.ndarray, what: str) -> None:
        if mask.any():
            i = _first(mask)
            raise SchemaError(f"{source}: tensor {_codec.short_repr(names[i])}: {what(i)}")

    fail(code >= len(parsed), lambda i: f"dtype index {int(code[i])}, but only {len(parsed)} "
         "dtypes are listed")
    fail(ndim > MAX_NDIM, lambda i: f"{int(ndim[i])} dimensions (at most {MAX_NDIM})")
    total = int(ndim.sum(dtype=np.int64))
    if total != len(dims):
        raise SchemaError(f"{where}: column 'shape' holds {len(dims)} dimensions; 'ndim' adds "
                          f"up to {total}")
    itemsize = np.array([d.itemsize for d in parsed] or [0], np.uint64)[code if n else []]
    starts = np.cumsum(ndim, dtype=np.int64) - ndim
    nonzero, empty, over = element_counts(ndim, dims, starts, itemsize)
    fail(over, lambda i: f"shape {list(dims[starts[i]:starts[i] + ndim[i]].tolist())} of "
         f"{parsed[code[i]]} is too large for any array")
    expected = np.where(empty, np.uint64(0), nonzero) * itemsize
    fail(length != expected, lambda i: f"length {int(length[i])} does not match shape "
         f"{dims[starts[i]:starts[i] + ndim[i]].tolist()} of {parsed[code[i]]}")
    fail(shard >= len(shards), lambda i: f"refers to shard {int(shard[i])}, but only "
         f"{len(shards)} are listed")
    sizes = np.array([s.size for s in shards] or [0], np.uint64)[shard if n else []]
    fail((offset > sizes) | (length > sizes - np.minimum(offset, sizes)),
         lambda i: f"bytes {int(offset[i])}..{int(offset[i]) + int(length[i])} lie beyond the "
         f"end of shard {shards[int(shard[i])].path!r} ({shards[int(shard[i])].size} bytes)")
    table = TensorTable(names=names, dtypes=list(dtypes), dtype=code, ndim=ndim, dims=dims,
                        shard=shard, offset=offset, length=length, checksum=cols["checksum"])
    if chunked:
        _chunk_columns(t, table, starts, itemsize, parsed, source, partial)
    return table


def _v2_columns(t: dict, n: int, where: str) -> dict[str, np.ndarray]:
    """The version-2 columns of ``t`` as arrays over the msgpack bytes (no copy), each checked
    to hold ``n`` values (``shape``: a whole number of them; its total is checked against
    ``ndim`` later)."""
    cols: dict[str, np.ndarray] = {}
    for key, code in COLUMNS.items():
        raw = _req(t, key, bytes, where)  # msgpack bin; a str or list here is the wrong type
        width = np.dtype(code).itemsize
        if key != "shape" and len(raw) != n * width:
            raise SchemaError(f"{where}: column {key!r} holds {len(raw)} bytes; {n} tensors need "
                              f"{n * width}")
        if len(raw) % width:
            raise SchemaError(f"{where}: column {key!r} holds {len(raw)} bytes, not a whole "
                              f"number of {width}-byte values")
        cols[key] = np.frombuffer(raw, code)
    return cols


def _check_v2_names(names: list, source: str, *, unique: bool) -> None:
    """Every name is a str and, if ``unique`` (an unchunked table: readers key tensors by name),
    no two are the same."""
    bad = [] if all(map(str.__instancecheck__, names)) else \
        [i for i, x in enumerate(names) if type(x) is not str]
    if bad:
        raise SchemaError(f"{source}: tensor {bad[0]}: field 'name' has the wrong type "
                          f"({type(names[bad[0]]).__name__})")
    if unique and len(set(names)) != len(names):  # readers key tensors by name
        raise SchemaError(f"{source}: tensor names are not unique")


def _chunk_columns(t: dict, table: TensorTable, starts: np.ndarray, itemsize: np.ndarray,
                   parsed: list[np.dtype], source: str, partial: bool = False) -> None:
    """Read and check the version-3 columns of ``t`` into ``table`` (docs/FORMAT.md, section 5)."""
    where = f"{source}: tensor table"
    cols: dict[str, np.ndarray] = {}
    for key, code in CHUNK_COLUMNS.items():
        raw = _req(t, key, bytes, where)
        width = np.dtype(code).itemsize
        if len(raw) % width:
            raise SchemaError(f"{where}: column {key!r} holds {len(raw)} bytes, not a whole "
                              f"number of {width}-byte values")
        cols[key] = np.frombuffer(raw, code)
    crc_block = _nonneg(t, "crc_block", where)
    if crc_block < MIN_CRC_BLOCK:
        raise SchemaError(f"{where}: crc_block {crc_block} is below {MIN_CRC_BLOCK} bytes")
    n, total = len(table), len(table.dims)
    if len(cols["tensor"]) != n:
        raise SchemaError(f"{where}: column 'tensor' holds {len(cols['tensor'])} values; "
                          f"the table has {n} rows")
    for key in ("gshape", "start"):
        if len(cols[key]) != total:
            raise SchemaError(f"{where}: column {key!r} holds {len(cols[key])} dimensions; "
                              f"'ndim' adds up to {total}")
    table.tensor, table.gdims, table.start = cols["tensor"], cols["gshape"], cols["start"]
    table.crc_block = crc_block
    blocks = block_count(table.length, crc_block)
    # (lengths are below 2^63 and crc_block at least 4096: the sum cannot wrap)
    need = int(blocks.sum(dtype=np.uint64)) if n else 0
    if len(cols["block_crc"]) != need:
        raise SchemaError(f"{where}: column 'block_crc' holds {len(cols['block_crc'])} "
                          f"checksums; the chunks' lengths need {need}")
    table.block_crc = cols["block_crc"]
    if not partial:  # one rank's rows: merge_tables checks the rules on the merged table once
        check_chunks(table, source, starts=starts, itemsize=itemsize, parsed=parsed)


def read_table(columns: Any, shards: Sequence[ShardEntry], *, source: str,
               partial: bool = False) -> TensorTable:
    """A chunked table from its version-3 columns (``TensorTable.to_v3()``, e.g. as a rank sent
    it through the group, msgpack-packed), validated as strictly as a manifest's against
    ``shards`` (that rank's shard entries); ``SchemaError`` naming ``source`` otherwise.
    ``partial``: one rank's rows of a group save, chunks of only some of the logical tensors:
    its columns and byte ranges are checked here, the chunk rules (names, global shapes,
    overlaps) once on the merged table by :func:`merge_tables`."""
    if not isinstance(columns, dict):
        raise SchemaError(f"{source}: a tensor table is a map, not a {type(columns).__name__}")
    try:
        return _table_v2(columns, list(shards), source, chunked=True, partial=partial)
    except CheckpointError:
        raise
    except (TypeError, ValueError, OverflowError, IndexError) as e:  # backstop
        raise SchemaError(f"{source}: malformed tensor table ({type(e).__name__}: {e})") from e


def merge_tables(tables: Sequence[TensorTable], shard_offsets: Sequence[int], *,
                 source: str = "merged tensor table") -> TensorTable:
    """The tensor table of one save written by several ranks: ``tables[r]`` is rank r's own
    chunked table (``_io.write_payload(..., chunks=...)``: one row per chunk that rank wrote,
    ``shard`` indexing that rank's shard list) and ``shard_offsets[r]`` where rank r's shards
    start in the merged shard list (the number of shards of the ranks before it).

    Every rank encodes the same tree (``_codec.encode_state``), so a logical tensor has the
    same index (the ``tensor`` column) and name on every rank, and the merge is a
    concatenation of the ranks' rows, rank after rank, with shard indices shifted and dtype
    indices re-interned.  A logical tensor may have rows from any number of ranks (a
    ``Shard`` leaf on each, or a replicated array written by one); every index up to the
    largest must have at least one.  The result is checked like a manifest read from disk
    (:func:`check_chunks`: names, dtypes and global shapes agree, chunks inside the global
    shape, none overlapping), raising ``SchemaError`` naming ``source`` and the tensor.
    Whether each tensor is *complete* is not checked here: a reader asks for that when it
    loads without a template."""
    if len(tables) != len(shard_offsets):
        raise ValueError(f"{len(tables)} tables but {len(shard_offsets)} shard offsets")
    if not all(t.chunked for t in tables):
        raise ValueError("merge_tables takes chunked tables (_io.write_payload(..., chunks=...))")
    blocks = {t.crc_block for t in tables if len(t.block_crc)}
    if len(blocks) > 1:
        raise ValueError(f"the tables use different crc_block sizes {sorted(blocks)}")
    dtypes = list(dict.fromkeys(d for t in tables for d in t.dtypes))
    index = {d: i for i, d in enumerate(dtypes)}
    cat = np.concatenate
    merged = TensorTable(
        names=[x for t in tables for x in t.names], dtypes=dtypes,
        dtype=cat([np.array([index[d] for d in t.dtypes] or [0], np.uint32)[t.dtype]
                   for t in tables] or [np.zeros(0, np.uint32)]).astype(np.uint32),
        ndim=cat([t.ndim for t in tables] or [np.zeros(0, np.uint8)]).astype(np.uint8),
        dims=cat([t.dims for t in tables] or [np.zeros(0, np.uint64)]).astype(np.uint64),
        shard=cat([t.shard.astype(np.uint64) + np.uint64(o) for t, o in zip(tables, shard_offsets)]
                  or [np.zeros(0, np.uint64)]).astype(np.uint32),
        offset=cat([t.offset for t in tables] or [np.zeros(0, np.uint64)]).astype(np.uint64),
        length=cat([t.length for t in tables] or [np.zeros(0, np.uint64)]).astype(np.uint64),
        checksum=cat([t.checksum for t in tables] or [np.zeros(0, np.uint32)]).astype(np.uint32),
        tensor=cat([t.tensor for t in tables] or [np.zeros(0, np.uint32)]).astype(np.uint32),
        gdims=cat([t.gdims for t in tables] or [np.zeros(0, np.uint64)]).astype(np.uint64),
        start=cat([t.start for t in tables] or [np.zeros(0, np.uint64)]).astype(np.uint64),
        block_crc=cat([t.block_crc for t in tables] or [np.zeros(0, np.uint32)]).astype(np.uint32),
        crc_block=blocks.pop() if blocks else (tables[0].crc_block if tables else CRC_BLOCK))
    check_chunks(merged, source)
    return merged


def _check_layout(table: TensorTable, shards: list[ShardEntry], source: str, *,
                  ends: bool = True) -> None:
    """No two tensors share a byte (overlapping ranges would alias the loaded arrays), and each
    shard ends where its last tensor ends (docs/FORMAT.md, section 7; not with ``ends`` False:
    some rows only).  Offsets and lengths are already known to lie inside their shards, so
    ``offset + length`` cannot overflow."""
    shard, start = table.shard.astype(np.intp), table.offset
    end = start + table.length
    last = np.zeros(len(shards), np.uint64)
    np.maximum.at(last, shard, end)
    for s, e in zip(shards, last.tolist() if ends else ()):
        if s.size != e:
            raise SchemaError(f"{source}: shard {s.path!r} is declared {s.size} bytes, but its "
                              f"tensors end at byte {e}")
    live = np.flatnonzero(table.length)
    order = live[np.lexsort((start[live], shard[live]))]
    clash = (shard[order[1:]] == shard[order[:-1]]) & (start[order[1:]] < end[order[:-1]])
    if clash.any():
        k = _first(clash)
        i0, i1 = int(order[k]), int(order[k + 1])
        raise SchemaError(f"{source}: tensors {table.names[i0]!r} and {table.names[i1]!r} "
                          f"overlap in shard {shards[int(shard[i0])].path!r}")


def _check_tree(tree: dict, refs: list, table: TensorTable, source: str,
                partial: bool = False) -> tuple[int, ...]:
    """Every reference indexes the tensor table once, scalar references name 0-d tensors, and
    the tree decodes to a valid state (with the references standing in for the tensors).
    Returns the referenced indices, ascending.  ``partial`` (a version-4 table of some row
    groups): the references are checked against the tensors' names, as the rows are not all
    there (the loader refuses a tensor whose rows it did not read)."""
    n = len(table.interned or ()) if partial else table.logical_count()
    indices = [r.index for r in refs]
    if indices and max(indices) >= n:
        bad = next(i for i in indices if i >= n)
        raise SchemaError(f"{source}: the state tree refers to tensor {bad}, "
                          f"but only {n} are listed")
    unique = sorted(set(indices))
    if len(unique) != len(indices):  # two values would share (alias) one buffer
        seen: set[int] = set()
        dup = next(i for i in indices if i in seen or seen.add(i))
        raise SchemaError(f"{source}: the state tree refers to tensor "
                          f"{table.logical_name(dup)!r} twice")
    scalars = [r.index for r in refs if r.scalar]
    if scalars:  # (partial: of the tensors with a row read; the loader reads the others whole)
        rows = table.firsts()[np.array(scalars, np.intp)]
        rows = rows[rows >= 0]
        nd = table.ndim[rows]
        if nd.any():
            i = int(rows[_first(nd != 0)])
            raise SchemaError(f"{source}: scalar reference to tensor {table.names[i]!r}, "
                              f"which has shape {list(table.global_shape(i))}")
    try:
        _codec.decode_state(tree, refs=True)
    except SchemaError as e:
        if str(e).startswith(source):
            raise
        raise SchemaError(f"{source}: {e}") from e
    return tuple(unique)


def _tensor(t: Any, i: int, shards: list[ShardEntry], source: str) -> TensorEntry:
    """One version-1 tensor-table entry.  The common, valid case is checked inline (a manifest may
    list 100,000 tensors); anything unusual goes through :func:`_tensor_checked` for the message."""
    if type(t) is dict:
        name, dt, shape = t.get("name"), t.get("dtype"), t.get("shape")
        shard, offset, length, crc = t.get("shard"), t.get("offset"), t.get("length"), t.get("checksum")
        # type(x) is int excludes bool
        if (type(name) is str and type(dt) is str and type(shape) is list and type(shard) is int
                and type(offset) is int and type(length) is int and type(crc) is int
                and 0 <= shard < len(shards) and offset >= 0 and 0 <= crc <= 0xFFFFFFFF
                and len(shape) <= MAX_NDIM and all(type(d) is int and d >= 0 for d in shape)):
            # (a long name is never valid; it must not sit in the cache: a hostile one is 48 MB)
            dtype = _codec.parse_known(dt) if len(dt) <= 64 else None
            if dtype is not None and offset + length <= shards[shard].size:
                count = math.prod(shape)
                nonzero = count if count else math.prod(d for d in shape if d)
                if length == count * dtype.itemsize and nonzero * max(dtype.itemsize, 1) <= _SIZE_MAX:
                    return TensorEntry(name=name, dtype=dt, shape=tuple(shape), shard=shard,
                                       offset=offset, length=length, checksum=crc)
    return _tensor_checked(t, i, shards, source)


def _tensor_checked(t: Any, i: int, shards: list[ShardEntry], source: str) -> TensorEntry:
    where = f"{source}: tensor {i}"
    name = _req(t, "name", str, where)
    where = f"{source}: tensor {_codec.short_repr(name)}"
    dtype = _codec.parse_dtype(_req(t, "dtype", str, where), where=where)
    shape = _req(t, "shape", list, where)
    if len(shape) > MAX_NDIM:
        raise SchemaError(f"{where}: {len(shape)} dimensions (at most {MAX_NDIM})")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise SchemaError(f"{where}: bad shape {_codec.short_repr(shape)}")
    if math.prod(d for d in shape if d) * max(dtype.itemsize, 1) > _SIZE_MAX:  # Python ints
        raise SchemaError(f"{where}: shape {shape} of {dtype} is too large for any array")
    shard, offset, length = (_nonneg(t, k, where) for k in ("shard", "offset", "length"))
    if length != math.prod(shape) * dtype.itemsize:
        raise SchemaError(f"{where}: length {length} does not match shape {shape} of {dtype}")
    if shard >= len(shards):
        raise SchemaError(f"{where}: refers to shard {shard}, but only {len(shards)} are listed")
    if offset + length > shards[shard].size:
        raise SchemaError(f"{where}: bytes {offset}..{offset + length} lie beyond the end of "
                          f"shard {shards[shard].path!r} ({shards[shard].size} bytes)")
    return TensorEntry(name=name, dtype=t["dtype"], shape=tuple(shape), shard=shard, offset=offset,
                       length=length, checksum=_uint32(t, "checksum", where))
