"""Checking a ``tf.train.Checkpoint``'s files before TensorFlow reads them, and reading its tensors.

Why in Python, before TensorFlow, rather than reading in a child process: measured with TF 2.21,
TensorFlow's C++ reader aborts the whole process (CHECK failures in tf.train.load_checkpoint) on
an index entry that is not a protobuf, on a negative, overflowing or >254-dimension shape and on
an unknown dtype; it segfaults on a string tensor declaring a 2^40-byte element (its length
checksum is only a CRC, easy to forge); it blocks forever on a FIFO; and it allocates a tensor of
the declared shape before comparing that with the stored size (4 TiB for a 2 KB shard).  A child
process would contain the crashes but not the allocation, would cost a TensorFlow import per
call and could not hand back the live model's variables.  The format is small, so everything
TensorFlow acts on is checked here first:

* the ``.index`` is a LevelDB table: footer magic, block bounds and CRC32C checksums, restart
  points and strictly increasing keys, so TensorFlow's lookups see exactly the entries read here;
* every entry (TensorFlow's reader parses them all when it opens the checkpoint): a
  BundleEntryProto with a valid shape and a known dtype whose size matches the declared shape,
  inside an existing shard, not overlapping another tensor's bytes;
* every file (index, shards, the ``checkpoint`` state file) is a regular file whose real path
  stays inside the checkpoint's directory, and the state file may not name a checkpoint outside it;
* TensorFlow only reads numeric tensors; the one string tensor (the object graph) is decoded and
  checksummed here.

Not covered: files swapped between this check and TensorFlow's read (whoever can do that can
write the checkpoint anyway).  Object stores (``gs://``...) have no symlinks or FIFOs, so only
their paths are confined.

:class:`Bundle` is one validated checkpoint prefix.  Finding the prefix and interpreting the
object graph are ``_files.py``'s.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import stat
import struct
from typing import Any

import crc32c
import numpy as np

from ckptcore.errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                             IncompleteCheckpointError, SchemaError, UnsafeCheckpointError,
                             UnsupportedCheckpointError)

__all__ = ["Bundle", "Files", "GRAPH_KEY", "FIXED", "MAX_STATE_BYTES", "dtype_name", "inside",
           "is_remote"]

log = logging.getLogger("ckptcore")

GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"

_TABLE_MAGIC = 0xDB4775248B80FB57
_FOOTER = 48            # two block handles padded to 40 bytes, then the 8-byte magic
_TRAILER = 5            # after each block: a compression-type byte and a masked CRC32C
_MAX_INDEX_BYTES = 1 << 28   # ~2 million tensors; only ever read whole up to this size
MAX_STATE_BYTES = 1 << 24
_MAX_DIMS = 254         # TensorShape's limit
_INT64_MAX = (1 << 63) - 1

# DataType enum -> bytes per element, for the fixed-size types a checkpoint may hold.
FIXED = {1: 4, 2: 8, 3: 4, 4: 1, 5: 2, 6: 1, 8: 8, 9: 8, 10: 1, 11: 1, 12: 1, 13: 4, 14: 2,
          15: 2, 16: 2, 17: 2, 18: 16, 19: 2, 22: 4, 23: 8, 24: 1, 25: 1, 26: 1, 27: 1, 28: 1}
_QUANTIZED = {11, 12, 13, 15, 16}   # no numpy equivalent: refused as variable values
_STRING, _VARIANT = 7, 21


def dtype_name(dtype: int) -> str:
    from tensorflow.core.framework import types_pb2

    try:
        return types_pb2.DataType.Name(dtype)
    except ValueError:
        return f"dtype {dtype}"


def _unmask(masked: int) -> int:
    rot = (masked - 0xA282EAD8) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


class _Malformed(Exception):
    """A structural problem in the ``.index``; turned into CorruptCheckpointError naming the file."""


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    for _ in range(10):
        if pos >= end:
            raise _Malformed("a length runs past the end of its block")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos
    raise _Malformed("a length is longer than 10 bytes")


def _handle(buf: bytes, pos: int, end: int) -> tuple[tuple[int, int], int]:
    offset, pos = _varint(buf, pos, end)
    size, pos = _varint(buf, pos, end)
    return (offset, size), pos


def _block(buf: bytes, handle: tuple[int, int]) -> bytes:
    """The contents of the block at ``handle``, its bounds, type and checksum verified."""
    offset, size = handle
    if offset + size + _TRAILER > len(buf) - _FOOTER:
        raise _Malformed(f"a block at offset {offset} ({size} bytes) runs past the end of the file")
    kind = buf[offset + size]
    stored = struct.unpack_from("<I", buf, offset + size + 1)[0]
    if crc32c.crc32c(buf[offset:offset + size + 1]) != _unmask(stored):
        raise _Malformed(f"the block at offset {offset} fails its CRC32C checksum")
    if kind != 0:  # TensorFlow writes bundle indexes uncompressed (kNoCompression)
        raise _Malformed(f"the block at offset {offset} has compression type {kind}; "
                         "TensorFlow writes checkpoint indexes uncompressed")
    return buf[offset:offset + size]


def _block_entries(block: bytes) -> list[tuple[bytes, bytes]]:
    """Every ``(key, value)`` of one block, checking that its restart points agree with them."""
    if len(block) < 8:
        raise _Malformed("a block is too short to hold its restart points")
    count = struct.unpack_from("<I", block, len(block) - 4)[0]
    end = len(block) - 4 - 4 * count
    if count < 1 or end < 0:
        raise _Malformed(f"a block declares {count} restart points, which do not fit in it")
    restarts = struct.unpack_from(f"<{count}I", block, end)
    entries, fresh, key, pos = [], set(), b"", 0
    while pos < end:
        start = pos
        shared, pos = _varint(block, pos, end)
        own, pos = _varint(block, pos, end)
        size, pos = _varint(block, pos, end)
        if shared > len(key) or pos + own + size > end:
            raise _Malformed(f"the entry at offset {start} of a block overruns it")
        if shared == 0:
            fresh.add(start)
        key = key[:shared] + block[pos:pos + own]
        entries.append((key, block[pos + own:pos + own + size]))
        pos += own + size
    starts = fresh if entries else {0}  # an empty block still has its one restart point, at 0
    if list(restarts) != sorted(set(restarts)) or not set(restarts) <= starts:
        raise _Malformed("a block's restart points do not fall on its entries")
    return entries


def _read_table(buf: bytes) -> list[tuple[bytes, bytes]]:
    if len(buf) < _FOOTER:
        raise _Malformed(f"{len(buf)} bytes is too short to be a TensorFlow checkpoint index "
                         f"(a LevelDB table ends with a {_FOOTER}-byte footer)")
    if struct.unpack_from("<Q", buf, len(buf) - 8)[0] != _TABLE_MAGIC:
        raise _Malformed("it does not end with the LevelDB table magic number (truncated or not an index)")
    foot = len(buf) - _FOOTER
    _, pos = _handle(buf, foot, foot + 40)  # the metaindex block: TensorFlow never reads it
    index_handle, _ = _handle(buf, pos, foot + 40)
    entries: list[tuple[bytes, bytes]] = []
    previous_separator = None
    for separator, value in _block_entries(_block(buf, index_handle)):
        handle, _ = _handle(value, 0, len(value))
        block = _block_entries(_block(buf, handle))
        if not block or (previous_separator is not None and block[0][0] <= previous_separator) \
                or block[-1][0] > separator:
            raise _Malformed("the index block's keys do not bound the data blocks' keys")
        previous_separator = separator
        entries += block
    for (a, _), (b, _) in zip(entries, entries[1:]):
        if not a < b:
            raise _Malformed(f"keys are not in strictly increasing order ({b!r} follows {a!r})")
    return entries


def is_remote(path: str) -> bool:
    return "://" in path


def inside(path: str, directory: str) -> bool:
    """Whether ``path`` (resolved through symlinks, for local paths) lies inside ``directory``."""
    if is_remote(path):
        path, directory = posixpath.normpath(path), posixpath.normpath(directory)
        return path.startswith(directory.rstrip("/") + "/")
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return path != directory and os.path.commonpath([path, directory]) == directory


class Files:
    """The files of one checkpoint, which must be regular files inside ``directory``."""

    def __init__(self, directory: str):
        self.directory = directory
        if is_remote(directory):
            log.debug("%s: remote checkpoint: paths are confined to it, no symlink or FIFO checks", directory)

    def size(self, path: str, what: str, missing: CheckpointError) -> int:
        """The size of ``path``; ``missing`` if it does not exist or is a directory."""
        if not inside(path, self.directory):
            real = path if is_remote(path) else os.path.realpath(path)
            raise UnsafeCheckpointError(f"{path}: {what} leads to {real}, outside the checkpoint's "
                                        f"directory {self.directory}; refusing to read it")
        if is_remote(path):
            import tensorflow as tf

            if not tf.io.gfile.exists(path) or tf.io.gfile.isdir(path):
                raise missing
            return int(tf.io.gfile.stat(path).length)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise missing from None
        except OSError as e:
            raise IncompleteCheckpointError(f"{path}: cannot read {what}: {e}") from e
        if stat.S_ISDIR(st.st_mode):
            raise missing
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCheckpointError(f"{path}: {what} is not a regular file (a FIFO, socket or "
                                        "device: reading it could block or never end); refusing to read it")
        return st.st_size

    @staticmethod
    def read(path: str, offset: int, size: int) -> bytes:
        try:
            if is_remote(path):
                import tensorflow as tf

                with tf.io.gfile.GFile(path, "rb") as f:
                    f.seek(offset)
                    data = f.read(size)
            else:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read(size)
        except Exception as e:  # noqa: BLE001 - any failure to read is reported with the file
            raise IncompleteCheckpointError(
                f"{path}: cannot read {size} bytes at offset {offset}: {e}") from e
        if len(data) != size:
            raise IncompleteCheckpointError(f"{path}: {size} bytes expected at offset {offset}, "
                                            f"{len(data)} found (the file shrank while being read)")
        return data


class Bundle:
    """One checkpoint prefix, validated (see above), read through TensorFlow only once it is safe."""

    def __init__(self, prefix: str, directory: str):
        from tensorflow.core.protobuf import tensor_bundle_pb2

        self.prefix, self.files = prefix, Files(directory)
        self.index = prefix + ".index"
        size = self.files.size(self.index, "the index", CheckpointNotFoundError(
            f"{prefix}: not a TensorFlow checkpoint prefix ({self.index} does not exist or is a directory)"))
        if size > _MAX_INDEX_BYTES:
            raise UnsupportedCheckpointError(f"{self.index}: {size} bytes; indexes above "
                                             f"{_MAX_INDEX_BYTES} bytes are not read")
        try:
            table = _read_table(self.files.read(self.index, 0, size))
        except _Malformed as e:
            raise CorruptCheckpointError(f"{self.index}: not a valid checkpoint index: {e}",
                                         file=self.index) from None
        if not table or table[0][0] != b"":
            raise CorruptCheckpointError(f"{self.index}: the index has no header entry", file=self.index)
        header = tensor_bundle_pb2.BundleHeaderProto()
        try:
            header.ParseFromString(table[0][1])
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError, or anything its parser raises
            raise CorruptCheckpointError(f"{self.index}: the header entry is not a BundleHeaderProto",
                                         file=self.index) from e
        if not 1 <= header.num_shards <= 99999:
            raise CorruptCheckpointError(f"{self.index}: the header declares {header.num_shards} data "
                                         "shards (1 to 99999 expected)", file=self.index)
        self.num_shards = header.num_shards
        self.order = ">" if header.endianness == tensor_bundle_pb2.BundleHeaderProto.BIG else "<"
        self.entries: dict[str, Any] = {}
        for raw_key, value in table[1:]:
            try:  # TensorFlow's keys come from Python str; lookups go through their UTF-8 bytes
                key = raw_key.decode("utf-8")
            except UnicodeDecodeError:
                raise CorruptCheckpointError(f"{self.index}: the key {raw_key!r} is not UTF-8 text",
                                             file=self.index) from None
            self.entries[key] = self._entry(key, value)
        self._check_shards()
        self._reader: Any = None
        self._owner: dict[str, int] = {}

    def shard(self, shard_id: int) -> str:
        return f"{self.prefix}.data-{shard_id:05d}-of-{self.num_shards:05d}"

    def _corrupt(self, key: str, problem: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.index}: tensor {key!r}: {problem}", file=self.index, tensor=key)

    def _entry(self, key: str, value: bytes) -> Any:
        from tensorflow.core.protobuf import tensor_bundle_pb2

        entry = tensor_bundle_pb2.BundleEntryProto()
        try:
            entry.ParseFromString(value)
        except Exception as e:  # noqa: BLE001 - TensorFlow would abort the process on this entry
            raise self._corrupt(key, "its entry is not a BundleEntryProto") from e
        if entry.slices:
            raise UnsupportedCheckpointError(
                f"{self.index}: tensor {key!r} is saved in slices (a TF1 partitioned variable); "
                "sliced checkpoints are not read")
        shape = entry.shape
        if shape.unknown_rank or len(shape.dim) > _MAX_DIMS or any(d.size < 0 or d.name for d in shape.dim):
            raise self._corrupt(key, f"invalid shape {[d.size for d in shape.dim][:8]} "
                                     f"({len(shape.dim)} dimensions)")
        count = 1
        for d in shape.dim:
            count *= d.size
            if count > _INT64_MAX:
                raise self._corrupt(key, "its shape's element count overflows 64 bits")
        if entry.dtype in FIXED:
            if count * FIXED[entry.dtype] != entry.size:
                raise self._corrupt(key, f"its shape {self.shape(entry)} of {dtype_name(entry.dtype)} "
                                         f"needs {count * FIXED[entry.dtype]} bytes but the entry "
                                         f"stores {entry.size}")
        elif entry.dtype in (_STRING, _VARIANT):
            if count > entry.size:  # at least one length byte per element
                raise self._corrupt(key, f"{count} strings cannot fit in {entry.size} bytes")
        elif (name := dtype_name(entry.dtype)) in ("DT_INVALID", "DT_RESOURCE") or name.endswith("_REF"):
            raise self._corrupt(key, f"{name} is not a type a checkpoint stores")
        elif name.startswith("DT_"):  # int4, float4...: their sizes are not modelled here
            raise UnsupportedCheckpointError(f"{self.index}: tensor {key!r} has dtype {name}, "
                                             "which ckptcore does not read")
        else:  # TensorFlow aborts the process on a dtype it does not know
            raise UnsupportedCheckpointError(
                f"{self.index}: tensor {key!r} has dtype {entry.dtype}, unknown to this TensorFlow "
                "(a newer TensorFlow's, or damage)")
        if not 0 <= entry.shard_id < self.num_shards or entry.offset < 0 or entry.size < 0:
            raise self._corrupt(key, f"it points at shard {entry.shard_id}, offset {entry.offset}, size "
                                     f"{entry.size} (the header declares {self.num_shards} shards)")
        return entry

    def _check_shards(self) -> None:
        sizes: dict[int, int] = {}
        spans: dict[int, list[tuple[int, int, str]]] = {}
        for key, e in self.entries.items():
            if e.shard_id not in sizes:
                path = self.shard(e.shard_id)
                sizes[e.shard_id] = self.files.size(path, "a data shard", IncompleteCheckpointError(
                    f"{path}: data shard missing (or a directory); the index stores tensor {key!r} in it"))
            if e.offset + e.size > sizes[e.shard_id]:
                path = self.shard(e.shard_id)
                raise IncompleteCheckpointError(
                    f"{path}: tensor {key!r} needs bytes {e.offset} to {e.offset + e.size} but the shard "
                    f"holds {sizes[e.shard_id]} (truncated, or the index belongs to another save)")
            if e.size:
                spans.setdefault(e.shard_id, []).append((e.offset, e.offset + e.size, key))
        for shard_id, items in spans.items():
            items.sort()
            for (_, end, a), (start, _, b) in zip(items, items[1:]):
                if start < end:  # TensorFlow writes each tensor once; shared bytes are forged
                    raise CorruptCheckpointError(
                        f"{self.shard(shard_id)}: tensors {a!r} and {b!r} overlap in the shard",
                        file=self.shard(shard_id), tensor=b)
        self._check_other_saves()

    def _check_other_saves(self) -> None:
        """Shards of this prefix with another shard count come from another save over the same prefix.

        Which save the index belongs to cannot be told (a save interrupted after its shards were
        renamed into place leaves the older index), so the checkpoint is refused, not guessed at.
        """
        import tensorflow as tf

        directory, base = os.path.split(self.prefix)
        pattern = re.compile(re.escape(base) + r"\.data-(\d{5})-of-(\d{5})$")
        try:
            names = tf.io.gfile.listdir(directory or ".")
        except Exception as e:  # noqa: BLE001 - the shards were just opened; report, do not guess
            raise IncompleteCheckpointError(f"{self.prefix}: cannot list {directory or '.'}: {e}") from e
        for name in sorted(names):
            m = pattern.match(name)
            if m and (int(m[2]) != self.num_shards or int(m[1]) >= self.num_shards):
                path = os.path.join(directory, name)
                raise CorruptCheckpointError(
                    f"{path}: a data shard of another save ({m[2]} shards) beside {self.index}, "
                    f"which declares {self.num_shards}: the files under this prefix come from "
                    "different saves; remove the stale ones", file=path)

    @staticmethod
    def shape(entry: Any) -> tuple[int, ...]:
        return tuple(int(d.size) for d in entry.shape.dim)

    def entry(self, key: str) -> Any:
        try:
            return self.entries[key]
        except KeyError:
            raise SchemaError(f"{self.prefix}: the object graph names tensor {key!r}, "
                              f"which {self.index} does not list") from None

    def object_graph(self) -> bytes:
        """The serialized object graph: a scalar string tensor, decoded and checksummed here."""
        if GRAPH_KEY not in self.entries:
            raise SchemaError(f"{self.prefix}: no {GRAPH_KEY} tensor, so this is not an object-based "
                              "tf.train.Checkpoint (a TF1 tf.compat.v1.train.Saver file?)")
        e = self.entries[GRAPH_KEY]
        path = self.shard(e.shard_id)
        if e.dtype != _STRING or e.shape.dim:
            raise SchemaError(f"{self.prefix}: tensor {GRAPH_KEY!r} is {dtype_name(e.dtype)} "
                              f"{self.shape(e)}, not a scalar string")
        raw = self.files.read(path, e.offset, e.size)

        def corrupt(problem: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{path}: tensor {GRAPH_KEY!r}: {problem}",
                                          file=path, tensor=GRAPH_KEY)

        try:
            length, pos = _varint(raw, 0, len(raw))
        except _Malformed:
            raise corrupt("its length is not readable") from None
        if pos + 4 + length != len(raw):
            raise corrupt(f"it declares a {length}-byte string but its entry holds {len(raw)} bytes")
        crc = crc32c.crc32c(struct.pack(self.order + ("I" if length <= 0xFFFFFFFF else "Q"), length))
        if _unmask(struct.unpack_from(self.order + "I", raw, pos)[0]) != crc:
            raise corrupt("its length checksum does not match")
        crc = crc32c.crc32c(raw[pos + 4:], crc32c.crc32c(raw[pos:pos + 4], crc))
        if crc != _unmask(e.crc32c):
            raise CorruptCheckpointError(f"{path}: tensor {GRAPH_KEY!r} fails its CRC32C checksum "
                                         f"(stored {_unmask(e.crc32c):#010x}, computed {crc:#010x})",
                                         file=path, tensor=GRAPH_KEY, expected=_unmask(e.crc32c), actual=crc)
        return raw[pos + 4:]

    def read(self, key: str, node: int) -> np.ndarray:
        """The numeric tensor ``key``, read by TensorFlow (which verifies its checksum)."""
        owner = self._owner.setdefault(key, node)
        if owner != node:  # TensorFlow saves each object once; two objects on one tensor are forged
            raise SchemaError(f"{self.prefix}: objects {owner} and {node} of the object graph both "
                              f"name tensor {key!r}")
        e = self.entry(key)
        if e.dtype not in FIXED or e.dtype in _QUANTIZED:
            raise SchemaError(f"{self.prefix}: tensor {key!r} holds {dtype_name(e.dtype)}, not numbers; "
                              "a variable of a Keras model or optimizer cannot have that type")
        path = self.shard(e.shard_id)
        if self._reader is None:
            self._reader = self._tf(lambda: _load_checkpoint(self.prefix), self.index, None)
        value = np.asarray(self._tf(lambda: self._reader.get_tensor(key), path, key))
        if value.shape != self.shape(e) or value.dtype.itemsize != FIXED[e.dtype]:
            raise CorruptCheckpointError(f"{path}: tensor {key!r} read as {value.dtype}{value.shape}, "
                                         f"not {dtype_name(e.dtype)}{self.shape(e)}", file=path, tensor=key)
        return value

    def _tf(self, fn: Any, path: str, key: str | None) -> Any:
        """``fn()``, TensorFlow's exceptions turned into ckptcore's, naming the file and tensor."""
        import tensorflow as tf

        what = f"{path}: tensor {key!r}" if key else path
        try:
            return fn()
        except CheckpointError:
            raise
        except tf.errors.InvalidArgumentError as e:  # e.g. the bundle's format version is too new
            raise UnsupportedCheckpointError(f"{what}: TensorFlow cannot read it: {e.message}") from e
        except tf.errors.NotFoundError as e:
            raise IncompleteCheckpointError(f"{what}: {e.message}") from e
        except tf.errors.OpError as e:  # DataLossError (checksums) and the rest
            raise CorruptCheckpointError(f"{what}: TensorFlow could not read it: {e.message}",
                                         file=path, tensor=key) from e
        except (ValueError, IndexError, TypeError, OSError, RuntimeError) as e:
            raise CorruptCheckpointError(f"{what}: TensorFlow could not read it: {e}",
                                         file=path, tensor=key) from e


def _load_checkpoint(prefix: str) -> Any:
    import tensorflow as tf

    return tf.train.load_checkpoint(prefix)
