"""The on-disk manifest: frozen dataclasses, msgpack encoding, and validation of untrusted bytes.

``manifest.msgpack`` is a msgpack map ``{"format": "ckptcore", "version": 1,
"body": <bin>, "body_crc32c": <uint32>}``.  The body is itself msgpack (see
docs/FORMAT.md); wrapping it lets a reader reject a truncated or damaged
manifest by checksum before trusting a single field of it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import crc32c
import numpy as np

from . import _codec
from .errors import (CheckpointError, CorruptCheckpointError, SchemaError, UnsafeCheckpointError,
                     UnsupportedCheckpointError)

FORMAT_NAME = "ckptcore"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.msgpack"
CHECKSUM = "crc32c"
# Shard names are plain file names: no separators, no "..", so a manifest can never point outside
# its checkpoint directory (matched with fullmatch: "$" would admit a trailing newline).
_SHARD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
# numpy's limits, checked here so that building an array from a valid manifest cannot fail:
# at most 64 dimensions, and the product of the non-zero dimensions times the itemsize must fit
# in a signed 64-bit size.
MAX_NDIM = 64
_SIZE_MAX = 2 ** 63 - 1


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


@dataclass(frozen=True, kw_only=True)
class Manifest:
    created: float
    writer: dict[str, Any]
    library: dict[str, Any]
    framework: dict[str, Any]
    alignment: int
    shards: tuple[ShardEntry, ...]
    tensors: tuple[TensorEntry, ...]
    tree: dict[str, Any] = field(repr=False)
    version: int = FORMAT_VERSION

    def to_bytes(self) -> bytes:
        body = _codec.pack({
            "created": self.created, "writer": self.writer, "library": self.library,
            "framework": self.framework, "checksum": CHECKSUM, "alignment": self.alignment,
            "shards": [{"path": s.path, "size": s.size, "checksum": s.checksum} for s in self.shards],
            "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "shard": t.shard,
                         "offset": t.offset, "length": t.length, "checksum": t.checksum}
                        for t in self.tensors],
            "tree": self.tree,
        })
        return _codec.pack({"format": FORMAT_NAME, "version": self.version, "body": body,
                            "body_crc32c": crc32c.crc32c(body)})

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str = MANIFEST_NAME) -> Manifest:
        """Parse and validate untrusted manifest bytes; every defect is a typed error naming ``source``."""
        outer = _codec.unpack_plain(data, source)
        if not isinstance(outer, dict) or outer.get("format") != FORMAT_NAME:
            raise SchemaError(f"{source}: not a ckptcore manifest")
        version = outer.get("version")
        if type(version) is not int or version != FORMAT_VERSION:  # not True, not 1.0
            raise UnsupportedCheckpointError(f"{source}: unsupported format version {version!r} "
                              f"(this ckptcore reads version {FORMAT_VERSION}); upgrade ckptcore")
        body, crc = outer.get("body"), outer.get("body_crc32c")
        # body: a view into ``data`` (see _codec.unpack_plain), or bytes from msgpack
        if not isinstance(body, (bytes, memoryview)) or not isinstance(crc, int):
            raise SchemaError(f"{source}: manifest has no body")
        actual = crc32c.crc32c(body)
        if actual != crc:
            raise CorruptCheckpointError(
                f"{source}: manifest checksum mismatch (expected {crc:#010x}, got {actual:#010x})",
                file=source, expected=crc, actual=actual)
        try:
            # The tables are checked field by field below; only the tree has extensions.
            b = _codec.unpack_raw(body)
            if isinstance(b, dict) and "tree" in b:
                b["tree"] = _codec.resolve(b["tree"])
        except SchemaError as e:
            raise SchemaError(f"{source}: {e}") from e
        try:
            return _validate(b, source)
        except CheckpointError:
            raise
        except (RecursionError, TypeError, ValueError, OverflowError) as e:  # backstop
            raise SchemaError(f"{source}: malformed manifest ({type(e).__name__}: {e})") from e


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


def _validate(b: Any, source: str) -> Manifest:
    if not isinstance(b, dict):
        raise SchemaError(f"{source}: body is not a map")
    if b.get("checksum") != CHECKSUM:
        raise UnsupportedCheckpointError(
            f"{source}: unsupported checksum algorithm {_codec._short(b.get('checksum'))}")
    shards = []
    seen: set[str] = set()
    for i, s in enumerate(_req(b, "shards", list, source)):
        where = f"{source}: shard {i}"
        path = _req(s, "path", str, where)
        if not _SHARD_NAME.fullmatch(path) or ".." in path or path == MANIFEST_NAME:
            raise UnsafeCheckpointError(f"{where}: shard path {_codec._short(path)} is not a plain "
                                        "file name inside the checkpoint directory; refusing to read it")
        if path in seen:
            raise SchemaError(f"{where}: shard path {path!r} is listed twice")
        seen.add(path)
        shards.append(ShardEntry(path=path, size=_nonneg(s, "size", where),
                                 checksum=_uint32(s, "checksum", where)))
    tensors = []
    for i, t in enumerate(_req(b, "tensors", list, source)):
        tensors.append(_tensor(t, i, shards, source))
    if len({t.name for t in tensors}) != len(tensors):  # readers key tensors by name
        raise SchemaError(f"{source}: tensor names are not unique")
    _check_layout(tensors, shards, source)
    _check_tree(_req(b, "tree", dict, source), tensors, source)
    tree = b["tree"]
    created = _req(b, "created", (int, float), source)
    if isinstance(created, bool) or not math.isfinite(created):
        raise SchemaError(f"{source}: field 'created' is not a finite number")
    return Manifest(created=float(created),
                    writer=_req(b, "writer", dict, source), library=_req(b, "library", dict, source),
                    framework=_req(b, "framework", dict, source),
                    alignment=_nonneg(b, "alignment", source), shards=tuple(shards),
                    tensors=tuple(tensors), tree=tree)


def _uint32(d: dict, key: str, where: str) -> int:
    v = _nonneg(d, key, where)
    if v > 0xFFFFFFFF:
        raise SchemaError(f"{where}: field {key!r} is not a 32-bit checksum")
    return v


def _check_layout(tensors: list[TensorEntry], shards: list[ShardEntry], source: str) -> None:
    """No two tensors share a byte (overlapping ranges would alias the loaded arrays), and each
    shard ends where its last tensor ends (docs/FORMAT.md, section 7)."""
    ends = [0] * len(shards)
    for t in tensors:
        ends[t.shard] = max(ends[t.shard], t.offset + t.length)
    for s, end in zip(shards, ends):
        if s.size != end:
            raise SchemaError(f"{source}: shard {s.path!r} is declared {s.size} bytes, but its "
                              f"tensors end at byte {end}")
    spans = sorted((t.shard, t.offset, t.offset + t.length, i)
                   for i, t in enumerate(tensors) if t.length)
    for (s0, _, end0, i0), (s1, start1, _, i1) in zip(spans, spans[1:]):
        if s0 == s1 and start1 < end0:
            raise SchemaError(f"{source}: tensors {tensors[i0].name!r} and {tensors[i1].name!r} "
                              f"overlap in shard {shards[s0].path!r}")


_PLACEHOLDER = np.empty(0, np.uint8)


def _check_tree(tree: dict, tensors: list[TensorEntry], source: str) -> None:
    """Every reference indexes the tensor table once, and the tree decodes to a valid state."""
    seen: set[int] = set()

    def check(ref: _codec.TensorRef) -> np.ndarray:
        if ref.index >= len(tensors):
            raise SchemaError(f"{source}: the state tree refers to tensor {ref.index}, "
                              f"but only {len(tensors)} are listed")
        if ref.index in seen:  # two values would share (alias) one buffer
            raise SchemaError(f"{source}: the state tree refers to tensor "
                              f"{tensors[ref.index].name!r} twice")
        seen.add(ref.index)
        if ref.scalar and tensors[ref.index].shape:
            raise SchemaError(f"{source}: scalar reference to tensor {tensors[ref.index].name!r}, "
                              f"which has shape {list(tensors[ref.index].shape)}")
        return _PLACEHOLDER

    try:
        _codec.decode_state(_codec.substitute(tree, check))
    except SchemaError as e:
        if str(e).startswith(source):
            raise
        raise SchemaError(f"{source}: {e}") from e


def _tensor(t: Any, i: int, shards: list[ShardEntry], source: str) -> TensorEntry:
    """One tensor-table entry.  The common, valid case is checked inline (a manifest may list
    100,000 tensors); anything unusual goes through :func:`_tensor_checked` for the message."""
    if type(t) is dict:
        name, dt, shape = t.get("name"), t.get("dtype"), t.get("shape")
        shard, offset, length, crc = t.get("shard"), t.get("offset"), t.get("length"), t.get("checksum")
        # type(x) is int excludes bool
        if (type(name) is str and type(dt) is str and type(shape) is list and type(shard) is int
                and type(offset) is int and type(length) is int and type(crc) is int
                and 0 <= shard < len(shards) and offset >= 0 and 0 <= crc <= 0xFFFFFFFF
                and len(shape) <= MAX_NDIM and all(type(d) is int and d >= 0 for d in shape)):
            # (a long name is never valid; it must not sit in the cache: a hostile one is 48 MB)
            dtype = _codec._parse_known(dt) if len(dt) <= 64 else None
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
    where = f"{source}: tensor {_codec._short(name)}"
    dtype = _codec.parse_dtype(_req(t, "dtype", str, where), where=where)
    shape = _req(t, "shape", list, where)
    if len(shape) > MAX_NDIM:
        raise SchemaError(f"{where}: {len(shape)} dimensions (at most {MAX_NDIM})")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise SchemaError(f"{where}: bad shape {_codec._short(shape)}")
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
