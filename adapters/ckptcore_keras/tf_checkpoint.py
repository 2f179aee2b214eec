"""Read and write ``tf.train.Checkpoint(model=..., optimizer=...)`` files as training states.

A checkpoint stores each variable once, under its shortest object path (trainable
weights under ``optimizer/_trainable_variables/<i>`` when the optimizer is saved
too), and the object graph (``_CHECKPOINTABLE_OBJECT_GRAPH``) lists every path
to it.  The import walks that graph instead of parsing keys:

* model variables are the variable nodes reachable from ``model`` (not through
  its ``optimizer``); they are named by the Keras path recorded with them
  (``full_name``), or, when ``model=`` is given, by the same names
  :func:`ckptcore_keras.capture` gives the live model's variables;
* an optimizer list attribute with one entry per ``_trainable_variables`` holds a
  slot of each parameter (``_momentums/<i>`` belongs to ``_trainable_variables/<i>``);
  ``_accumulated_gradients`` are the ``gradient_accumulation_steps`` buffers.

The files are validated before TensorFlow's reader sees them (a crafted checkpoint can crash
or hang it; see "checking the files" below): damage or hostile content raises a
:class:`ckptcore.errors.CheckpointError` naming the file and tensor.

TensorFlow checkpoints do not hold Keras seed-generator states (Dropout) nor
``keras.Variable`` objects kept in Python lists on a layer, so a state imported
from one restores into a model that has them only with ``strict=False``.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import stat
import struct
from typing import Any, Iterator

import crc32c
import numpy as np

from ckptcore._storage import check_url
from ckptcore.errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                             IncompleteCheckpointError, SchemaError, UnsafeCheckpointError,
                             UnsupportedCheckpointError)
from ckptcore.state import AccumulationState, OptimizerState, ScheduleState, TrainingState

from ._optimizer import ensure_built, plain, unwrap, variable_roles
from ._params import describe_params
from ._variables import named_variables

__all__ = ["import_tf_checkpoint", "export_tf_checkpoint"]

log = logging.getLogger("ckptcore")

_VALUE = "VARIABLE_VALUE"
_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
# Children of a model that hold training bookkeeping, not model state.
_SKIP = {"optimizer", "_loss_tracker", "_compile_metrics", "_compile_loss", "_metrics",
         "metrics", "_metrics_list", "_compiled_trainable_state"}
_OPT_FIXED = {"_variables", "_trainable_variables", "_trainable_variables_indices",
              "_iterations", "_learning_rate", "inner_optimizer", "_accumulated_gradients"}


# -- checking the files before TensorFlow reads them ------------------------------------------------
#
# Why in Python, before TensorFlow, rather than reading in a child process: measured with TF 2.21,
# TensorFlow's C++ reader aborts the whole process (CHECK failures in tf.train.load_checkpoint) on
# an index entry that is not a protobuf, on a negative, overflowing or >254-dimension shape and on
# an unknown dtype; it segfaults on a string tensor declaring a 2^40-byte element (its length
# checksum is only a CRC, easy to forge); it blocks forever on a FIFO; and it allocates a tensor of
# the declared shape before comparing that with the stored size (4 TiB for a 2 KB shard).  A child
# process would contain the crashes but not the allocation, would cost a TensorFlow import per
# call and could not hand back the live model's variables.  The format is small, so everything
# TensorFlow acts on is checked here first:
#
# * the ``.index`` is a LevelDB table: footer magic, block bounds and CRC32C checksums, restart
#   points and strictly increasing keys, so TensorFlow's lookups see exactly the entries read here;
# * every entry (TensorFlow's reader parses them all when it opens the checkpoint): a
#   BundleEntryProto with a valid shape and a known dtype whose size matches the declared shape,
#   inside an existing shard, not overlapping another tensor's bytes;
# * every file (index, shards, the ``checkpoint`` state file) is a regular file whose real path
#   stays inside the checkpoint's directory, and the state file may not name a checkpoint outside it;
# * TensorFlow only reads numeric tensors; the one string tensor (the object graph) is decoded and
#   checksummed here.
#
# Not covered: files swapped between this check and TensorFlow's read (whoever can do that can
# write the checkpoint anyway).  Object stores (``gs://``...) have no symlinks or FIFOs, so only
# their paths are confined.

_TABLE_MAGIC = 0xDB4775248B80FB57
_FOOTER = 48            # two block handles padded to 40 bytes, then the 8-byte magic
_TRAILER = 5            # after each block: a compression-type byte and a masked CRC32C
_MAX_INDEX_BYTES = 1 << 28   # ~2 million tensors; only ever read whole up to this size
_MAX_STATE_BYTES = 1 << 24
_MAX_DIMS = 254         # TensorShape's limit
_INT64_MAX = (1 << 63) - 1

# DataType enum -> bytes per element, for the fixed-size types a checkpoint may hold.
_FIXED = {1: 4, 2: 8, 3: 4, 4: 1, 5: 2, 6: 1, 8: 8, 9: 8, 10: 1, 11: 1, 12: 1, 13: 4, 14: 2,
          15: 2, 16: 2, 17: 2, 18: 16, 19: 2, 22: 4, 23: 8, 24: 1, 25: 1, 26: 1, 27: 1, 28: 1}
_QUANTIZED = {11, 12, 13, 15, 16}   # no numpy equivalent: refused as variable values
_STRING, _VARIANT = 7, 21


def _dtype_name(dtype: int) -> str:
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


def _is_remote(path: str) -> bool:
    return "://" in path


def _inside(path: str, directory: str) -> bool:
    """Whether ``path`` (resolved through symlinks, for local paths) lies inside ``directory``."""
    if _is_remote(path):
        path, directory = posixpath.normpath(path), posixpath.normpath(directory)
        return path.startswith(directory.rstrip("/") + "/")
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return path != directory and os.path.commonpath([path, directory]) == directory


class _Files:
    """The files of one checkpoint, which must be regular files inside ``directory``."""

    def __init__(self, directory: str):
        self.directory = directory
        if _is_remote(directory):
            log.debug("%s: remote checkpoint: paths are confined to it, no symlink or FIFO checks", directory)

    def size(self, path: str, what: str, missing: CheckpointError) -> int:
        """The size of ``path``; ``missing`` if it does not exist or is a directory."""
        if not _inside(path, self.directory):
            real = path if _is_remote(path) else os.path.realpath(path)
            raise UnsafeCheckpointError(f"{path}: {what} leads to {real}, outside the checkpoint's "
                                        f"directory {self.directory}; refusing to read it")
        if _is_remote(path):
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
            if _is_remote(path):
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


class _Bundle:
    """One checkpoint prefix, validated (see above), read through TensorFlow only once it is safe."""

    def __init__(self, prefix: str, directory: str):
        from tensorflow.core.protobuf import tensor_bundle_pb2

        self.prefix, self.files = prefix, _Files(directory)
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
        if entry.dtype in _FIXED:
            if count * _FIXED[entry.dtype] != entry.size:
                raise self._corrupt(key, f"its shape {self.shape(entry)} of {_dtype_name(entry.dtype)} "
                                         f"needs {count * _FIXED[entry.dtype]} bytes but the entry "
                                         f"stores {entry.size}")
        elif entry.dtype in (_STRING, _VARIANT):
            if count > entry.size:  # at least one length byte per element
                raise self._corrupt(key, f"{count} strings cannot fit in {entry.size} bytes")
        elif (name := _dtype_name(entry.dtype)) in ("DT_INVALID", "DT_RESOURCE") or name.endswith("_REF"):
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
        if _GRAPH_KEY not in self.entries:
            raise SchemaError(f"{self.prefix}: no {_GRAPH_KEY} tensor, so this is not an object-based "
                              "tf.train.Checkpoint (a TF1 tf.compat.v1.train.Saver file?)")
        e = self.entries[_GRAPH_KEY]
        path = self.shard(e.shard_id)
        if e.dtype != _STRING or e.shape.dim:
            raise SchemaError(f"{self.prefix}: tensor {_GRAPH_KEY!r} is {_dtype_name(e.dtype)} "
                              f"{self.shape(e)}, not a scalar string")
        raw = self.files.read(path, e.offset, e.size)

        def corrupt(problem: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{path}: tensor {_GRAPH_KEY!r}: {problem}",
                                          file=path, tensor=_GRAPH_KEY)

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
            raise CorruptCheckpointError(f"{path}: tensor {_GRAPH_KEY!r} fails its CRC32C checksum "
                                         f"(stored {_unmask(e.crc32c):#010x}, computed {crc:#010x})",
                                         file=path, tensor=_GRAPH_KEY, expected=_unmask(e.crc32c), actual=crc)
        return raw[pos + 4:]

    def read(self, key: str, node: int) -> np.ndarray:
        """The numeric tensor ``key``, read by TensorFlow (which verifies its checksum)."""
        owner = self._owner.setdefault(key, node)
        if owner != node:  # TensorFlow saves each object once; two objects on one tensor are forged
            raise SchemaError(f"{self.prefix}: objects {owner} and {node} of the object graph both "
                              f"name tensor {key!r}")
        e = self.entry(key)
        if e.dtype not in _FIXED or e.dtype in _QUANTIZED:
            raise SchemaError(f"{self.prefix}: tensor {key!r} holds {_dtype_name(e.dtype)}, not numbers; "
                              "a variable of a Keras model or optimizer cannot have that type")
        path = self.shard(e.shard_id)
        if self._reader is None:
            self._reader = self._tf(lambda: _load_checkpoint(self.prefix), self.index, None)
        value = np.asarray(self._tf(lambda: self._reader.get_tensor(key), path, key))
        if value.shape != self.shape(e) or value.dtype.itemsize != _FIXED[e.dtype]:
            raise CorruptCheckpointError(f"{path}: tensor {key!r} read as {value.dtype}{value.shape}, "
                                         f"not {_dtype_name(e.dtype)}{self.shape(e)}", file=path, tensor=key)
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


class _Graph:
    """The object graph of one checkpoint, with values read on demand."""

    def __init__(self, bundle: _Bundle):
        from tensorflow.core.protobuf import trackable_object_graph_pb2

        self.bundle = bundle
        self.proto = trackable_object_graph_pb2.TrackableObjectGraph()
        try:
            self.proto.ParseFromString(bundle.object_graph())
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
            raise CorruptCheckpointError(f"{bundle.prefix}: tensor {_GRAPH_KEY!r} is not a "
                                         "TrackableObjectGraph", tensor=_GRAPH_KEY) from e
        count = len(self.proto.nodes)
        if not count:
            raise SchemaError(f"{bundle.prefix}: the object graph ({_GRAPH_KEY!r}) has no nodes")
        for i, node in enumerate(self.proto.nodes):
            for c in node.children:
                if not 0 <= c.node_id < count:
                    raise SchemaError(f"{bundle.prefix}: node {i} of the object graph ({_GRAPH_KEY!r}) "
                                      f"has a child {c.local_name!r} at node {c.node_id}, but the graph "
                                      f"has {count} nodes")

    def children(self, node: int) -> dict[str, int]:
        return {c.local_name: c.node_id for c in self.proto.nodes[node].children}

    def attribute(self, node: int) -> Any:
        for a in self.proto.nodes[node].attributes:
            if a.name == _VALUE:
                return a
        return None

    def value(self, node: int) -> np.ndarray:
        return self.bundle.read(self.attribute(node).checkpoint_key, node)

    def leaf_name(self, node: int) -> str:
        return self.attribute(node).full_name.rsplit("/", 1)[-1]

    def variables(self, node: int, skip: set[str] = frozenset()) -> Iterator[tuple[int, list[str]]]:
        """``(variable node, path from node)`` depth first, each variable once.

        An explicit stack: a crafted graph can nest deeper than Python's recursion limit.
        """
        seen: set[int] = set()
        stack: list[tuple[int, list[str]]] = [(node, [])]
        while stack:
            n, path = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if self.attribute(n) is not None:
                yield n, path
            kids = [(name, child) for name, child in self.children(n).items()
                    if not (path == [] and name in skip)]
            stack.extend((child, path + [name]) for name, child in reversed(kids))

    def list_of_variables(self, node: int) -> dict[int, int] | None:
        """``{index: variable node}`` if ``node`` is a list of variables."""
        kids = self.children(node)
        if not kids or not all(k.isdigit() and self.attribute(v) is not None for k, v in kids.items()):
            return None
        return {int(k): v for k, v in kids.items()}


def _resolve(prefix_or_dir: Any) -> tuple[str, str]:
    """``(prefix, directory its files must stay in)`` for a prefix or a CheckpointManager directory."""
    import tensorflow as tf
    from google.protobuf import text_format
    from tensorflow.python.training import checkpoint_state_pb2

    path = check_url(prefix_or_dir, "prefix_or_dir")
    if not (tf.io.gfile.isdir(path) if _is_remote(path) else os.path.isdir(path)):
        return path, os.path.dirname(path) or "."
    files = _Files(path)
    state_path = os.path.join(path, "checkpoint")
    size = files.size(state_path, "the 'checkpoint' state file", CheckpointNotFoundError(
        f"{path}: no TensorFlow checkpoint in this directory (no 'checkpoint' file naming one)"))
    if size > _MAX_STATE_BYTES:
        raise CorruptCheckpointError(f"{state_path}: {size} bytes is too large for a checkpoint "
                                     "state file", file=state_path)
    state = checkpoint_state_pb2.CheckpointState()
    try:
        text_format.Parse(files.read(state_path, 0, size).decode("utf-8"), state)
    except (UnicodeDecodeError, text_format.ParseError) as e:
        raise CorruptCheckpointError(f"{state_path}: not a checkpoint state file: {e}",
                                     file=state_path) from e
    name = state.model_checkpoint_path
    if not name:
        raise CheckpointNotFoundError(f"{state_path}: names no checkpoint (empty model_checkpoint_path)")
    prefix = name if os.path.isabs(name) or _is_remote(name) else os.path.join(path, name)
    if not _inside(prefix, path):
        raise UnsafeCheckpointError(f"{state_path}: names the checkpoint {name!r}, which is outside "
                                    f"{path}; refusing to read it")
    return prefix, path


def _live_names(graph: _Graph, node: int, obj: Any, names: dict[int, str]) -> dict[int, str]:
    """Checkpoint variable node -> the live variable's state name, walking both graphs together."""
    out: dict[int, str] = {}
    seen: set[int] = set()

    def visit(n: int, live: Any) -> None:
        if n in seen or live is None:
            return
        seen.add(n)
        if graph.attribute(n) is not None:
            name = names.get(id(live)) or names.get(id(getattr(live, "value", None)))
            if name is not None:
                out[n] = name
            return
        try:
            kids = live._trackable_children(save_type="checkpoint")
        except (AttributeError, TypeError):
            return
        for local, child in graph.children(n).items():
            visit(child, kids.get(local))

    visit(node, obj)
    return out


def import_tf_checkpoint(prefix_or_dir: Any, *, model: Any = None,
                         optimizer: Any = None) -> TrainingState:
    """Read a ``tf.train.Checkpoint(model=..., optimizer=...)`` file as a :class:`TrainingState`.

    Args:
        prefix_or_dir: A checkpoint prefix (``.../ckpt-3``) or a
            ``tf.train.CheckpointManager`` directory (its latest checkpoint is read).
        model: Optional: the model the checkpoint belongs to.  Names then match
            :func:`ckptcore_keras.capture` exactly (including raw ``tf.Variable``
            attributes) and ``state.params`` is filled.  The model's values are not changed.
        optimizer: Optional: its optimizer (defaults to ``model.optimizer``; built over the
            model if it has not been).  Needed to read hyperparameters, the schedule and
            ``gradient_accumulation_steps``, and to place slots of optimizers whose slot
            lists TensorFlow does not track (Adafactor); otherwise slots are found
            through the lists parallel to ``_trainable_variables`` in the checkpoint.

    Raises:
        CheckpointNotFoundError: No checkpoint at ``prefix_or_dir``.
        IncompleteCheckpointError: A data shard is missing or shorter than the index says.
        CorruptCheckpointError: The index, a shard, a tensor or the state file is damaged.
        UnsafeCheckpointError: A file or the state file leads outside the checkpoint's
            directory, or is not a regular file (a FIFO would block forever).
        SchemaError: The object graph or a tensor does not fit a Keras model and optimizer
            (or, with ``model=``, a saved variable's shape or dtype differs from the model's).
        UnsupportedCheckpointError: Sliced (TF1 partitioned) tensors, unknown dtypes.

    Example:
        >>> state = ckptcore_keras.import_tf_checkpoint("/tmp/training_checkpoints")  # doctest: +SKIP
        >>> state.optimizer.slots["sequential/dense/kernel"]                           # doctest: +SKIP
    """
    path, directory = _resolve(prefix_or_dir)
    graph = _Graph(_Bundle(path, directory))
    try:
        return _import(graph, path, model, optimizer)
    except CheckpointError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        # The graph passed the structural checks but its objects do not fit together (a slot list
        # longer than the parameters, a non-scalar step...): it was not written by Keras.
        raise SchemaError(f"{path}: the object graph does not describe a Keras model and optimizer "
                          f"that ckptcore can read ({type(e).__name__}: {e})") from e


def _import(graph: _Graph, path: str, model: Any, optimizer: Any) -> TrainingState:
    import keras
    import tensorflow as tf

    root = graph.children(0)
    model_node = root.get("model")
    opt_node = root.get("optimizer")
    if opt_node is None and model_node is not None:
        opt_node = graph.children(model_node).get("optimizer")
    if optimizer is None and model is not None:
        optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and model is not None and opt_node is not None:
        ensure_built(optimizer, model)  # its variables' order tells what each saved one is

    names: dict[int, str] = {}
    order: list[str] = []
    live: dict[int, str] = {}
    if model is not None and model_node is not None:
        live_vars = dict(named_variables(model))
        live = _live_names(graph, model_node, model, {id(v): n for n, v in live_vars.items()})
        _check_live(graph, live, live_vars)
    if model_node is not None:
        for n, rel in graph.variables(model_node, _SKIP):
            name = live.get(n) or _checkpoint_name(graph, n, rel)
            if model is not None and n not in live:
                continue  # metric or other bookkeeping state the live model does not have
            name = _unique(name, names.values())
            names[n] = name
            order.append(name)
    state = TrainingState(framework="keras", model={names[n]: graph.value(n) for n in names},
                          extra={"keras": {"variables": order, "source": "tf.train.Checkpoint"}},
                          metadata={"versions": {"tensorflow": tf.__version__,
                                                 "keras": keras.__version__},
                                    "source": path})
    if model is not None:
        by_id = {id(v): n for n, v in named_variables(model) if n in state.model}
        state.params = describe_params(model, by_id)
    if opt_node is not None:
        _import_optimizer(graph, opt_node, names, optimizer, state)
    return state


def _check_live(graph: _Graph, live: dict[int, str], live_vars: dict[str, Any]) -> None:
    """Each saved variable has its live counterpart's shape and dtype (TensorFlow's restore insists too)."""
    import keras
    import tensorflow as tf

    bundle = graph.bundle
    for n, name in live.items():
        key = graph.attribute(n).checkpoint_key
        entry = bundle.entry(key)
        var = live_vars[name]
        have = (tf.as_dtype(entry.dtype).name if entry.dtype in _FIXED else _dtype_name(entry.dtype),
                bundle.shape(entry))
        want = (keras.backend.standardize_dtype(getattr(var.dtype, "name", var.dtype)),
                tuple(int(d) for d in var.shape))
        if have != want:
            raise SchemaError(f"{bundle.prefix}: tensor {key!r} is {have[0]} {have[1]} in the checkpoint "
                              f"but the model's {name!r} is {want[0]} {want[1]}")


def _checkpoint_name(graph: _Graph, node: int, rel: list[str]) -> str:
    full = graph.attribute(node).full_name
    return full if "/" in full else "/".join(rel)  # raw tf.Variables have no Keras path


def _unique(name: str, used: Any) -> str:
    used = set(used)
    unique, k = name, 0
    while unique in used:
        k += 1
        unique = f"{name}#{k}"
    return unique


def _roles_from_graph(graph: _Graph, kids: dict[str, int], params: dict[int, int]) -> dict[int, tuple]:
    """Slot roles found in the checkpoint's own structure (lists parallel to the parameters)."""
    prefix = {i: graph.attribute(v).full_name.replace("/", "_") + "_" for i, v in params.items()}
    roles: dict[int, tuple] = {}
    known = {kids.get("_iterations"), kids.get("_learning_rate")} | set(params.values())
    for attr, child in kids.items():
        items = None if attr in _OPT_FIXED else graph.list_of_variables(child)
        if not items or max(items) >= len(params) or set(items.values()) & (known | set(roles)):
            continue
        for i, v in items.items():
            leaf = graph.leaf_name(v)
            roles[v] = ("slot", i, leaf[len(prefix[i]):] if leaf.startswith(prefix[i]) else attr.strip("_"))
    accum = graph.list_of_variables(kids["_accumulated_gradients"]) if "_accumulated_gradients" in kids else {}
    roles.update({v: ("accumulator", i) for i, v in (accum or {}).items()})
    attr_of = {v: a.strip("_") for a, v in kids.items() if graph.attribute(v) is not None}
    others = graph.list_of_variables(kids["_variables"]) if "_variables" in kids else {}
    for _, v in sorted((others or {}).items()):
        if v not in known and v not in roles:
            roles[v] = ("extra", attr_of.get(v, graph.leaf_name(v)))
    return roles


def _roles_from_live(graph: _Graph, kids: dict[str, int], inner_opt: Any) -> dict[int, tuple] | None:
    """Roles from the live optimizer: ``_variables/<i>`` is ``optimizer.variables[i]``.

    Needed for optimizers whose slot lists TensorFlow does not track (e.g. Adafactor).
    """
    saved = graph.list_of_variables(kids["_variables"]) if "_variables" in kids else None
    if inner_opt is None or not inner_opt.built or not saved:
        return None
    roles = variable_roles(inner_opt)
    if sorted(saved) != list(range(len(roles))):
        return None
    return {v: roles[i] for i, v in saved.items() if roles[i][0] in ("slot", "accumulator", "extra")}


def _import_optimizer(graph: _Graph, node: int, names: dict[int, str], optimizer: Any,
                      state: TrainingState) -> None:
    kids = graph.children(node)
    extra: dict[str, Any] = {}
    inner_opt, wrapper = unwrap(optimizer) if optimizer is not None else (None, None)
    if "inner_optimizer" in kids:
        outer = graph.list_of_variables(kids["_variables"]) if "_variables" in kids else {}
        extra["loss_scale"] = {"variables": {graph.leaf_name(v): graph.value(v)
                                             for _, v in sorted((outer or {}).items())}}
        if wrapper is not None:
            extra["loss_scale"]["config"] = {"initial_scale": float(wrapper.initial_scale),
                                             "dynamic_growth_steps": int(wrapper.dynamic_growth_steps)}
        node, kids = kids["inner_optimizer"], graph.children(kids["inner_optimizer"])
    params = graph.list_of_variables(kids["_trainable_variables"]) if "_trainable_variables" in kids else None
    params = params or {}
    pname = {i: names.get(v) or graph.attribute(v).full_name for i, v in params.items()}
    roles = _roles_from_live(graph, kids, inner_opt) or _roles_from_graph(graph, kids, params)
    slots: dict[str, dict[str, np.ndarray]] = {}
    buffers: dict[str, np.ndarray] = {}
    for v, role in sorted(roles.items()):
        if role[0] == "slot":
            slots.setdefault(pname[role[1]], {})[role[2]] = graph.value(v)
        elif role[0] == "accumulator":
            buffers[pname[role[1]]] = graph.value(v)
        else:
            extra.setdefault("variables", {})[role[1]] = graph.value(v)
    slots = {pname[i]: slots[pname[i]] for i in sorted(pname) if pname[i] in slots}  # parameter order
    raw = int(graph.value(kids["_iterations"])) if "_iterations" in kids else 0
    hyper: dict[str, Any] = plain(inner_opt.get_config()) if inner_opt is not None else {}
    if "_learning_rate" in kids:
        hyper["learning_rate"] = float(graph.value(kids["_learning_rate"]))
    every = 0
    if buffers:
        every = int((inner_opt.gradient_accumulation_steps or 0) if inner_opt is not None else 0)
        if not every:
            raise SchemaError("the checkpoint holds gradient-accumulation buffers: pass the "
                              "optimizer (built with gradient_accumulation_steps) as optimizer=")
        buffers = {pname[i]: buffers[pname[i]] for i in sorted(pname) if pname[i] in buffers}
        state.accumulation = AccumulationState(every=every, count=raw % every, buffers=buffers)
    kind = type(inner_opt).__name__.lower() if inner_opt is not None else _kind_from_name(
        graph.attribute(kids["_iterations"]).full_name if "_iterations" in kids else "")
    state.optimizer = OptimizerState(kind=kind, step=raw // every if every else raw,
                                     hyperparams=hyper, slots=slots, extra=extra)
    state.step = state.optimizer.step
    _import_schedule(inner_opt, raw, state)


def _import_schedule(inner_opt: Any, raw: int, state: TrainingState) -> None:
    if inner_opt is None:
        return
    from keras.optimizers.schedules import LearningRateSchedule

    sched = inner_opt._learning_rate
    if isinstance(sched, LearningRateSchedule):
        lr = float(np.asarray(sched(raw)))
        state.schedule = ScheduleState(kind=type(sched).__name__, config=plain(sched.get_config()),
                                       step=raw, last_lr=lr)
        state.optimizer.hyperparams["learning_rate"] = lr


def _kind_from_name(full_name: str) -> str:
    # Keras names optimizers snake_case(ClassName)[_N]: "adam_w_1" -> "adamw".
    return re.sub(r"_\d+$", "", full_name.split("/")[0]).replace("_", "")


def export_tf_checkpoint(state: TrainingState, prefix: Any, model: Any,
                         optimizer: Any = None, *, strict: bool = True) -> str:
    """Write ``state`` as a checkpoint that ``tf.train.Checkpoint(model=, optimizer=)`` restores.

    The state is restored into ``model`` and ``optimizer`` (which end up holding its
    values; global RNGs are left alone), then written with
    ``tf.train.Checkpoint(model=model, optimizer=optimizer)``.  The file includes a
    ``save_counter``, so ``Checkpoint(...).restore(path).assert_consumed()`` passes
    into a model whose optimizer is built.

    Returns:
        The path written (``prefix``).

    Example:
        >>> ckptcore_keras.export_tf_checkpoint(state, "/tmp/tf/ckpt", model, opt)  # doctest: +SKIP
        '/tmp/tf/ckpt'
    """
    import tensorflow as tf

    from ._capture import restore_objects

    opt = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    restore_objects(state, model, opt, strict=strict)
    if opt is not None:
        ensure_built(opt, model)
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt) if opt is not None \
        else tf.train.Checkpoint(model=model)
    _ = ckpt.save_counter  # created now so that it is written, as save() would
    return ckpt.write(os.fspath(prefix))
