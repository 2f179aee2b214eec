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

from . import _codec
from .errors import CorruptCheckpointError, SchemaError, UnsafeCheckpointError

FORMAT_NAME = "ckptcore"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.msgpack"
CHECKSUM = "crc32c"
# Shard names are plain file names: no separators, no "..", so a manifest can never point outside
# its checkpoint directory.
_SHARD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$")


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
        if version != FORMAT_VERSION:
            raise SchemaError(f"{source}: unsupported format version {version!r} "
                              f"(this ckptcore reads version {FORMAT_VERSION}); upgrade ckptcore")
        body, crc = outer.get("body"), outer.get("body_crc32c")
        if not isinstance(body, bytes) or not isinstance(crc, int):
            raise SchemaError(f"{source}: manifest has no body")
        actual = crc32c.crc32c(body)
        if actual != crc:
            raise CorruptCheckpointError(
                f"{source}: manifest checksum mismatch (expected {crc:#010x}, got {actual:#010x})",
                file=source, expected=crc, actual=actual)
        try:
            b = _codec.unpack(body)
        except SchemaError as e:
            raise SchemaError(f"{source}: {e}") from e
        try:
            return _validate(b, source)
        except RecursionError as e:  # the tree walk is recursive; a hostile body can nest deeply
            raise SchemaError(f"{source}: the state tree is nested too deeply") from e


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
        raise SchemaError(f"{source}: unsupported checksum algorithm {b.get('checksum')!r}")
    shards = []
    for i, s in enumerate(_req(b, "shards", list, source)):
        where = f"{source}: shard {i}"
        path = _req(s, "path", str, where)
        if not _SHARD_NAME.match(path) or ".." in path:
            raise UnsafeCheckpointError(f"{where}: shard path {path!r} is not a plain file name "
                                        "inside the checkpoint directory; refusing to read it")
        shards.append(ShardEntry(path=path, size=_nonneg(s, "size", where),
                                 checksum=_nonneg(s, "checksum", where)))
    tensors = []
    for i, t in enumerate(_req(b, "tensors", list, source)):
        tensors.append(_tensor(t, i, shards, source))
    if len({t.name for t in tensors}) != len(tensors):  # readers key tensors by name
        raise SchemaError(f"{source}: tensor names are not unique")
    tree = _req(b, "tree", dict, source)
    for ref in _codec.refs(tree):
        if ref.index >= len(tensors):
            raise SchemaError(f"{source}: the state tree refers to tensor {ref.index}, "
                              f"but only {len(tensors)} are listed")
    return Manifest(created=float(_req(b, "created", (int, float), source)),
                    writer=_req(b, "writer", dict, source), library=_req(b, "library", dict, source),
                    framework=_req(b, "framework", dict, source),
                    alignment=_nonneg(b, "alignment", source), shards=tuple(shards),
                    tensors=tuple(tensors), tree=tree)


def _tensor(t: Any, i: int, shards: list[ShardEntry], source: str) -> TensorEntry:
    where = f"{source}: tensor {i}"
    name = _req(t, "name", str, where)
    where = f"{source}: tensor {name!r}"
    dtype = _codec.parse_dtype(_req(t, "dtype", str, where), where=where)
    shape = _req(t, "shape", list, where)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise SchemaError(f"{where}: bad shape {shape!r}")
    shard, offset, length = (_nonneg(t, k, where) for k in ("shard", "offset", "length"))
    if length != math.prod(shape) * dtype.itemsize:  # Python ints: no overflow
        raise SchemaError(f"{where}: length {length} does not match shape {shape} of {dtype}")
    if shard >= len(shards):
        raise SchemaError(f"{where}: refers to shard {shard}, but only {len(shards)} are listed")
    if offset + length > shards[shard].size:
        raise SchemaError(f"{where}: bytes {offset}..{offset + length} lie beyond the end of "
                          f"shard {shards[shard].path!r} ({shards[shard].size} bytes)")
    return TensorEntry(name=name, dtype=t["dtype"], shape=tuple(shape), shard=shard, offset=offset,
                       length=length, checksum=_nonneg(t, "checksum", where))
