"""import_tf_checkpoint against damaged and hostile TensorFlow checkpoints.

Every case starts from one real ``tf.train.Checkpoint`` (written once per module by a
``tf.train.CheckpointManager``), damages a copy of it and expects a typed
:class:`ckptcore.errors.CheckpointError` whose message names the file or prefix (and the
tensor, where there is one), raised in a live process.

The ``.index`` is rewritten with the small LevelDB-table writer below (valid block checksums),
so a crafted entry gets past the table's own checks and reaches TensorFlow's tensor reader.
Cases marked ``tf_dies`` made TensorFlow's C++ reader abort, segfault or hang before
import_tf_checkpoint validated its input (measured with TF 2.21); they run in one child process
so that a guard that stops working fails those tests instead of killing the pytest process.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import crc32c  # noqa: E402
from tensorflow.core.protobuf import tensor_bundle_pb2, trackable_object_graph_pb2  # noqa: E402

import ckptcore_keras  # noqa: E402
from ckptcore.errors import (CheckpointError, CheckpointNotFoundError,  # noqa: E402
                             CorruptCheckpointError, IncompleteCheckpointError, SchemaError,
                             UnsafeCheckpointError, UnsupportedCheckpointError)

GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"
KERNEL = "optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE"  # first Dense kernel, (4, 3)
BIAS = "optimizer/_trainable_variables/1/.ATTRIBUTES/VARIABLE_VALUE"    # its bias, (3,)
DT = {"float": 1, "int32": 3, "string": 7, "resource": 20, "variant": 21}


# -- a LevelDB table (the .index format), written and read independently of the adapter ------------

_MAGIC = 0xDB4775248B80FB57


def _mask(crc: int) -> int:
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(b: bytes, p: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        c = b[p]
        p += 1
        value |= (c & 0x7F) << shift
        shift += 7
        if c < 0x80:
            return value, p


def _read_block(b: bytes, off: int, size: int) -> list[tuple[bytes, bytes]]:
    data = b[off:off + size]
    restarts = struct.unpack_from("<I", data, len(data) - 4)[0]
    end, p, key, out = len(data) - 4 - 4 * restarts, 0, b"", []
    while p < end:
        shared, p = _read_varint(data, p)
        own, p = _read_varint(data, p)
        vlen, p = _read_varint(data, p)
        key = key[:shared] + data[p:p + own]
        p += own
        out.append((key, data[p:p + vlen]))
        p += vlen
    return out


def read_table(b: bytes) -> list[tuple[bytes, bytes]]:
    foot, p = b[-48:], 0
    for _ in range(2):  # skip the metaindex handle
        _, p = _read_varint(foot, p)
    off, p = _read_varint(foot, p)
    size, p = _read_varint(foot, p)
    out = []
    for _, handle in _read_block(b, off, size):
        o, q = _read_varint(handle, 0)
        s, q = _read_varint(handle, q)
        out += _read_block(b, o, s)
    return out


def write_table(entries: list[tuple[bytes, bytes]], per_block: int = 64) -> bytes:
    """A table TensorFlow opens: keys unshared, one restart per block, checksummed blocks."""
    out, index = bytearray(), []

    def emit(raw: bytes) -> bytes:
        off = len(out)
        out.extend(raw + b"\0")
        out.extend(struct.pack("<I", _mask(crc32c.crc32c(raw + b"\0"))))
        return _varint(off) + _varint(len(raw))

    def block(items: list[tuple[bytes, bytes]]) -> bytes:
        body = b"".join(_varint(0) + _varint(len(k)) + _varint(len(v)) + k + v for k, v in items)
        return body + struct.pack("<II", 0, 1)

    for i in range(0, len(entries), per_block):
        chunk = entries[i:i + per_block]
        index.append((chunk[-1][0], emit(block(chunk))))
    handles = emit(block([])) + emit(block(index))
    return bytes(out + handles.ljust(40, b"\0") + struct.pack("<Q", _MAGIC))


# -- the real checkpoint and damaged copies of it ----------------------------------------------------

def _model() -> tuple[Any, Any]:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    model.compile(opt, "mse")
    model.train_on_batch(np.ones((2, 4), "float32"), np.ones((2, 2), "float32"))
    return model, opt


@dataclass
class Real:
    dir: Path
    model: Any
    optimizer: Any


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> Real:
    model, opt = _model()
    run = tmp_path_factory.mktemp("real") / "run"
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=opt), str(run), 2)
    assert manager.save() == str(run / "ckpt-1")
    return Real(run, model, opt)


class Copy:
    """A fresh copy of the real checkpoint directory, with helpers to damage it."""

    def __init__(self, real: Real, root: Path):
        self.root = root
        self.dir = root / "run"
        shutil.copytree(real.dir, self.dir)
        self.prefix = self.dir / "ckpt-1"
        self.index = self.dir / "ckpt-1.index"
        self.data = self.dir / "ckpt-1.data-00000-of-00001"
        self.state = self.dir / "checkpoint"

    def outside(self, path: Path) -> Path:
        """Move ``path`` out of the checkpoint directory and leave a symlink to it in its place."""
        (self.root / "elsewhere").mkdir(exist_ok=True)
        target = self.root / "elsewhere" / path.name
        shutil.move(path, target)
        path.symlink_to(target)
        return target

    def flip(self, path: Path, offset: int) -> None:
        b = bytearray(path.read_bytes())
        b[offset] ^= 0x5A
        path.write_bytes(bytes(b))

    def entries(self) -> list[tuple[bytes, Any]]:
        """The index as ``[(key, proto)]``: the header (key ``b""``) then every tensor entry."""
        out = []
        for key, value in read_table(self.index.read_bytes()):
            kind = tensor_bundle_pb2.BundleHeaderProto if key == b"" else tensor_bundle_pb2.BundleEntryProto
            proto = kind()
            proto.ParseFromString(value)
            out.append((key, proto))
        return out

    def write(self, entries: list[tuple[bytes, Any]]) -> None:
        self.index.write_bytes(write_table([(k, v if isinstance(v, bytes) else v.SerializeToString())
                                            for k, v in entries]))

    def edit(self, key: str, fn: Callable[[Any], None]) -> None:
        entries = self.entries()
        for k, proto in entries:
            if k == key.encode():
                fn(proto)
        self.write(entries)

    def entry(self, key: str) -> Any:
        return dict(self.entries())[key.encode()]

    def graph(self) -> Any:
        g = trackable_object_graph_pb2.TrackableObjectGraph()
        g.ParseFromString(tf.train.load_checkpoint(str(self.prefix)).get_tensor(GRAPH))
        return g

    def set_string(self, key: str, payload: bytes) -> None:
        """Append ``payload`` as the scalar string tensor ``key``, encoded as TensorFlow does."""
        lengths_crc = crc32c.crc32c(struct.pack("<I", len(payload)))
        check = struct.pack("<I", _mask(lengths_crc))
        body = _varint(len(payload)) + check + payload
        crc = crc32c.crc32c(payload, crc32c.crc32c(check, lengths_crc))
        offset = self.data.stat().st_size
        with open(self.data, "ab") as f:
            f.write(body)

        def point(e: Any) -> None:
            e.offset, e.size, e.crc32c = offset, len(body), _mask(crc)
        self.edit(key, point)

    def set_graph(self, graph: Any) -> None:
        self.set_string(GRAPH, graph.SerializeToString())


@dataclass
class Case:
    build: Callable[[Copy], tuple[Path, list[Any]]]  # -> (argument, what the message names)
    error: type
    with_model: bool = False
    tf_dies: str = ""  # what TensorFlow did on this input before the guard: "abort", "hang"


CASES: dict[str, Case] = {}


def case(error: type, *, with_model: bool = False, tf_dies: str = ""):
    def register(fn: Callable[[Copy], tuple[Path, list[Any]]]):
        CASES[fn.__name__] = Case(fn, error, with_model, tf_dies)
        return fn
    return register


def _shape(e: Any, *dims: int) -> None:
    del e.shape.dim[:]
    for d in dims:
        e.shape.dim.add(size=d)


# .index -------------------------------------------------------------------------------------------

@case(CorruptCheckpointError)
def index_empty(c: Copy):
    c.index.write_bytes(b"")
    return c.prefix, [c.index]


@case(CorruptCheckpointError)
def index_truncated(c: Copy):
    c.index.write_bytes(c.index.read_bytes()[: c.index.stat().st_size // 2])
    return c.prefix, [c.index]


@case(CorruptCheckpointError)
def index_last_byte_cut(c: Copy):
    c.index.write_bytes(c.index.read_bytes()[:-1])
    return c.prefix, [c.index]


@case(CorruptCheckpointError)
def index_garbage(c: Copy):
    c.index.write_bytes(np.random.RandomState(1).bytes(c.index.stat().st_size))
    return c.prefix, [c.index]


@case(CorruptCheckpointError)
def index_bad_magic(c: Copy):
    c.flip(c.index, c.index.stat().st_size - 1)
    return c.prefix, [c.index]


@case(CorruptCheckpointError)
def index_flipped_entry_byte(c: Copy):
    c.flip(c.index, 40)  # inside the first block: its checksum no longer matches
    return c.prefix, [c.index]


@case(CorruptCheckpointError)
def index_footer_points_past_end(c: Copy):
    b = c.index.read_bytes()
    footer = (_varint(0) + _varint(5) + _varint(10 ** 9) + _varint(100)).ljust(40, b"\0")
    c.index.write_bytes(b[:-48] + footer + b[-8:])
    return c.prefix, [c.index]


@case(CorruptCheckpointError)
def index_without_header(c: Copy):
    c.write([(k, p) for k, p in c.entries() if k != b""])
    return c.prefix, [c.index]


@case(CorruptCheckpointError)
def index_keys_unsorted(c: Copy):
    entries = c.entries()
    c.write(entries[:1] + entries[:0:-1])
    return c.prefix, [c.index]


@case(CorruptCheckpointError, tf_dies="abort")
def index_entry_not_a_proto(c: Copy):
    c.write([(k, b"\xff\xff\xff\xff" if k == KERNEL.encode() else p) for k, p in c.entries()])
    return c.prefix, [c.index, KERNEL]


@case(CorruptCheckpointError)
def index_header_not_a_proto(c: Copy):
    c.write([(k, b"\xff\xff\xff\xff" if k == b"" else p) for k, p in c.entries()])
    return c.prefix, [c.index]


@case(CorruptCheckpointError)
def index_zero_shards(c: Copy):
    c.edit("", lambda h: setattr(h, "num_shards", 0))
    return c.prefix, [c.index]


@case(IncompleteCheckpointError)
def index_thousands_of_keys(c: Copy):
    entries = c.entries()
    for i in range(5000):  # each claims 4 KB past the end of the 2 KB shard
        e = tensor_bundle_pb2.BundleEntryProto(dtype=DT["float"], offset=4096 * (i + 1), size=4096)
        e.shape.dim.add(size=1024)
        entries.append((f"junk/{i:05d}".encode(), e))
    c.write(sorted(entries, key=lambda kv: kv[0]))
    return c.prefix, [c.data, "junk/00000"]


@case(CheckpointNotFoundError)
def index_is_a_directory(c: Copy):
    c.index.unlink()
    c.index.mkdir()
    return c.prefix, [c.index]


@case(UnsafeCheckpointError, tf_dies="hang")
def index_is_a_fifo(c: Copy):
    c.index.unlink()
    os.mkfifo(c.index)
    return c.prefix, [c.index]


@case(UnsafeCheckpointError)
def index_symlink_outside(c: Copy):
    c.outside(c.index)
    return c.prefix, [c.index]


# data shards --------------------------------------------------------------------------------------

@case(IncompleteCheckpointError)
def data_empty(c: Copy):
    c.data.write_bytes(b"")
    return c.prefix, [c.data]


@case(IncompleteCheckpointError)
def data_truncated(c: Copy):
    c.data.write_bytes(c.data.read_bytes()[:-100])
    return c.prefix, [c.data, GRAPH]  # the object graph is the last tensor written


@case(IncompleteCheckpointError)
def data_missing(c: Copy):
    c.data.unlink()
    return c.prefix, [c.data]


@case(CorruptCheckpointError)
def data_garbage(c: Copy):
    c.data.write_bytes(np.random.RandomState(2).bytes(c.data.stat().st_size))
    return c.prefix, [c.data, GRAPH]


@case(CorruptCheckpointError)
def data_flipped_kernel_byte(c: Copy):
    c.flip(c.data, c.entry(KERNEL).offset + 5)
    return c.prefix, [c.data, KERNEL]


@case(CorruptCheckpointError)
def data_flipped_graph_byte(c: Copy):
    e = c.entry(GRAPH)
    c.flip(c.data, e.offset + e.size // 2)
    return c.prefix, [c.data, GRAPH]


@case(UnsafeCheckpointError, tf_dies="hang")
def data_is_a_fifo(c: Copy):
    c.data.unlink()
    os.mkfifo(c.data)
    return c.prefix, [c.data]


@case(IncompleteCheckpointError)
def data_is_a_directory(c: Copy):
    c.data.unlink()
    c.data.mkdir()
    return c.prefix, [c.data]


@case(UnsafeCheckpointError)
def data_symlink_outside(c: Copy):
    c.outside(c.data)
    return c.prefix, [c.data]


@case(IncompleteCheckpointError)
def data_second_shard_missing(c: Copy):
    entries = c.entries()
    for k, p in entries:
        if k == b"":
            p.num_shards = 2
        elif k == BIAS.encode():
            p.shard_id = 1
    c.write(entries)
    c.data.rename(c.dir / "ckpt-1.data-00000-of-00002")
    return c.prefix, [c.dir / "ckpt-1.data-00001-of-00002", BIAS]


@case(CorruptCheckpointError)
def data_extra_shards_of_another_save(c: Copy):
    for name in ("ckpt-1.data-00000-of-00002", "ckpt-1.data-00001-of-00002"):
        shutil.copy(c.data, c.dir / name)
    return c.prefix, [c.dir / "ckpt-1.data-00000-of-00002"]


@case(IncompleteCheckpointError)
def entry_offset_past_end(c: Copy):
    size = c.data.stat().st_size
    c.edit(KERNEL, lambda e: setattr(e, "offset", size + 10))
    return c.prefix, [c.data, KERNEL]


@case(CorruptCheckpointError)
def entry_overlaps_another(c: Copy):
    kernel = c.entry(KERNEL)
    raw = c.data.read_bytes()[kernel.offset:kernel.offset + 12]

    def alias(e: Any) -> None:  # the bias reads the kernel's first 12 bytes, checksum and all
        e.offset, e.crc32c = kernel.offset, _mask(crc32c.crc32c(raw))
    c.edit(BIAS, alias)
    return c.prefix, [c.data, BIAS]


# declared shapes and dtypes -------------------------------------------------------------------------

@case(CorruptCheckpointError)
def shape_disagrees_with_size(c: Copy):
    c.edit(KERNEL, lambda e: _shape(e, 4, 4))
    return c.prefix, [c.index, KERNEL]


@case(CorruptCheckpointError)
def shape_huge(c: Copy):  # 2^62 elements declared for 48 bytes
    c.edit(KERNEL, lambda e: _shape(e, 2 ** 31, 2 ** 31))
    return c.prefix, [c.index, KERNEL]


@case(IncompleteCheckpointError)
def shape_huge_size_consistent(c: Copy):  # 4 TiB declared, and the size field agrees
    def huge(e: Any) -> None:
        _shape(e, 2 ** 40)
        e.size = 4 * 2 ** 40
    c.edit(KERNEL, huge)
    return c.prefix, [c.data, KERNEL]


@case(CorruptCheckpointError, tf_dies="abort")
def shape_negative_dim(c: Copy):
    c.edit(KERNEL, lambda e: _shape(e, -3, 4))
    return c.prefix, [c.index, KERNEL]


@case(CorruptCheckpointError, tf_dies="abort")
def shape_element_count_overflows(c: Copy):
    c.edit(KERNEL, lambda e: _shape(e, 2 ** 40, 2 ** 40))
    return c.prefix, [c.index, KERNEL]


@case(CorruptCheckpointError, tf_dies="abort")
def shape_too_many_dims(c: Copy):
    c.edit(KERNEL, lambda e: _shape(e, *[1] * 300))
    return c.prefix, [c.index, KERNEL]


@case(UnsupportedCheckpointError, tf_dies="abort")
def dtype_unknown(c: Copy):
    c.edit(KERNEL, lambda e: setattr(e, "dtype", 999))
    return c.prefix, [c.index, KERNEL]


@case(CorruptCheckpointError)
def dtype_resource(c: Copy):
    c.edit(KERNEL, lambda e: setattr(e, "dtype", DT["resource"]))
    return c.prefix, [c.index, KERNEL]


@case(SchemaError)
def dtype_string_for_a_weight(c: Copy):
    c.edit(KERNEL, lambda e: setattr(e, "dtype", DT["string"]))
    return c.prefix, [c.prefix, KERNEL]


@case(SchemaError)
def dtype_variant_for_a_weight(c: Copy):
    c.edit(KERNEL, lambda e: setattr(e, "dtype", DT["variant"]))
    return c.prefix, [c.prefix, KERNEL]


@case(UnsupportedCheckpointError)
def entry_with_slices(c: Copy):
    def sliced(e: Any) -> None:
        s = e.slices.add()
        s.extent.add(start=0, length=2)
        s.extent.add()
    c.edit(KERNEL, sliced)
    return c.prefix, [c.index, KERNEL]


@case(SchemaError, with_model=True)
def shape_disagrees_with_model(c: Copy):
    c.edit(KERNEL, lambda e: _shape(e, 3, 4))  # same size and bytes, transposed shape
    return c.prefix, [c.prefix, KERNEL, "(4, 3)"]


@case(SchemaError, with_model=True)
def dtype_disagrees_with_model(c: Copy):
    c.edit(KERNEL, lambda e: setattr(e, "dtype", DT["int32"]))  # same size and bytes
    return c.prefix, [c.prefix, KERNEL, "float32"]


@case(CorruptCheckpointError, tf_dies="segfault")
def string_length_huge(c: Copy):
    # A string tensor whose element claims 2^40 bytes, with a valid length checksum.
    lengths_crc = crc32c.crc32c(struct.pack("<Q", 2 ** 40))
    body = _varint(2 ** 40) + struct.pack("<I", _mask(lengths_crc)) + b"x" * 16
    offset = c.data.stat().st_size
    with open(c.data, "ab") as f:
        f.write(body)

    def point(e: Any) -> None:
        e.offset, e.size = offset, len(body)
    c.edit(GRAPH, point)
    return c.prefix, [c.data, GRAPH]


# the object graph --------------------------------------------------------------------------------------

@case(SchemaError)
def graph_missing(c: Copy):
    c.write([(b"_NOT_THE_GRAPH" if k == GRAPH.encode() else k, p) for k, p in c.entries()])
    return c.prefix, [c.prefix, GRAPH]


@case(CorruptCheckpointError)
def graph_not_a_proto(c: Copy):
    c.set_string(GRAPH, b"\xff" * 64)
    return c.prefix, [c.prefix, GRAPH]


@case(SchemaError)
def graph_child_out_of_range(c: Copy):
    g = c.graph()
    g.nodes[0].children[0].node_id = 10 ** 6
    c.set_graph(g)
    return c.prefix, [c.prefix, "10000", "node"]


@case(SchemaError)
def graph_names_a_missing_tensor(c: Copy):
    g = c.graph()
    for node in g.nodes:
        for a in node.attributes:
            if a.checkpoint_key == KERNEL:
                a.checkpoint_key = "model/nope/.ATTRIBUTES/VARIABLE_VALUE"
    c.set_graph(g)
    return c.prefix, [c.prefix, "model/nope/.ATTRIBUTES/VARIABLE_VALUE"]


@case(SchemaError)
def graph_two_nodes_one_tensor(c: Copy):
    g = c.graph()
    for node in g.nodes:
        for a in node.attributes:
            if a.checkpoint_key == BIAS:
                a.checkpoint_key = KERNEL
    c.set_graph(g)
    return c.prefix, [c.prefix, KERNEL]


@case(SchemaError)
def graph_step_not_a_scalar(c: Copy):
    # The optimizer's step as two int32 instead of one int64: same bytes, so every checksum holds.
    def pair(e: Any) -> None:
        e.dtype = DT["int32"]
        _shape(e, 2)
    c.edit("optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE", pair)
    return c.prefix, [c.prefix, "object graph"]


@case(SchemaError)
def graph_nested_thousands_deep(c: Copy):
    # model -> 5000 nested objects -> a variable whose tensor is not in the index
    g = c.graph()
    model = next(ch.node_id for ch in g.nodes[0].children if ch.local_name == "model")
    parent = model
    for i in range(5000):
        g.nodes[parent].children.add(node_id=len(g.nodes), local_name=f"n{i}")
        parent = len(g.nodes)
        g.nodes.add()
    g.nodes[parent].attributes.add(name="VARIABLE_VALUE", full_name="deep/v",
                                   checkpoint_key="deep/.ATTRIBUTES/VARIABLE_VALUE")
    c.set_graph(g)
    return c.prefix, [c.prefix, "deep/.ATTRIBUTES/VARIABLE_VALUE"]


# the `checkpoint` state file and the prefix itself ------------------------------------------------------

@case(UnsafeCheckpointError)
def state_absolute_path_outside(c: Copy):
    other = c.root / "other"
    shutil.copytree(c.dir, other)  # a valid checkpoint: only its place is wrong
    c.state.write_text(f'model_checkpoint_path: "{other / "ckpt-1"}"\n')
    return c.dir, [c.state, other / "ckpt-1"]


@case(UnsafeCheckpointError)
def state_dotdot_path_outside(c: Copy):
    shutil.copytree(c.dir, c.root / "other")
    c.state.write_text('model_checkpoint_path: "../other/ckpt-1"\n')
    return c.dir, [c.state, "../other/ckpt-1"]


@case(CorruptCheckpointError)
def state_garbage(c: Copy):
    c.state.write_bytes(np.random.RandomState(3).bytes(200))
    return c.dir, [c.state]


@case(CheckpointNotFoundError)
def state_names_a_missing_prefix(c: Copy):
    c.state.write_text('model_checkpoint_path: "ckpt-9"\n')
    return c.dir, [c.dir / "ckpt-9"]


@case(UnsafeCheckpointError, tf_dies="hang")
def state_is_a_fifo(c: Copy):
    c.state.unlink()
    os.mkfifo(c.state)
    return c.dir, [c.state]


@case(UnsafeCheckpointError)
def state_symlink_outside(c: Copy):
    c.outside(c.state)
    return c.dir, [c.state]


@case(UnsafeCheckpointError)
def prefix_files_all_elsewhere(c: Copy):
    c.outside(c.index)
    c.outside(c.data)
    return c.dir, [c.index]


@case(CheckpointNotFoundError)
def prefix_is_a_directory_without_state(c: Copy):
    c.state.unlink()
    return c.dir, [c.dir]


@case(CheckpointNotFoundError)
def prefix_does_not_exist(c: Copy):
    return c.dir / "ckpt-7", [c.dir / "ckpt-7"]


# -- the tests ------------------------------------------------------------------------------------------

def _check(name: str, error_type: str, message: str, names: list[Any]) -> None:
    assert error_type == CASES[name].error.__name__, (name, error_type, message)
    for n in names:
        assert str(n) in message, f"{name}: {n!s} not named in {message!r}"


def test_corpus_is_large_and_the_real_checkpoint_imports(real, tmp_path):
    assert len(CASES) >= 25
    c = Copy(real, tmp_path)
    state = ckptcore_keras.import_tf_checkpoint(c.dir, model=real.model, optimizer=real.optimizer)
    assert state.step == 1 and len(state.model) == 4
    # The table writer above round-trips: a rewritten index still reads, value for value.
    c.write(c.entries())
    again = ckptcore_keras.import_tf_checkpoint(c.prefix)
    assert [np.asarray(v).tobytes() for v in again.model.values()] == \
        [np.asarray(v).tobytes() for v in state.model.values()]


def test_large_real_index_passes_validation(tmp_path):
    """A TensorFlow-written index of several blocks, with prefix-compressed keys and restart points."""
    layers = [keras.Input((2,))] + [keras.layers.Dense(2) for _ in range(80)]
    model, opt = keras.Sequential(layers), keras.optimizers.Adam(0.01)
    opt.build(model.trainable_variables)  # no training step: tracing 80 layers takes ~20 s
    prefix = tf.train.Checkpoint(model=model, optimizer=opt).write(str(tmp_path / "big"))
    assert os.path.getsize(prefix + ".index") > 3 * 4096  # TensorFlow's blocks are ~4 KB
    state = ckptcore_keras.import_tf_checkpoint(prefix, model=model, optimizer=opt)
    assert len(state.model) == 160 and len(state.optimizer.slots) == 160
    for v in model.trainable_variables:
        assert np.array_equal(state.model[v.path], v.numpy()), v.path


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if not c.tf_dies))
def test_hostile_input_raises_typed_error(name, real, tmp_path):
    spec = CASES[name]
    arg, names = spec.build(Copy(real, tmp_path))
    kwargs = {"model": real.model, "optimizer": real.optimizer} if spec.with_model else {}
    with pytest.raises(CheckpointError) as info:
        ckptcore_keras.import_tf_checkpoint(arg, **kwargs)
    _check(name, type(info.value).__name__, str(info.value), names)


_WORKER = r"""
import json, sys
import ckptcore_keras
for name, arg in json.loads(sys.argv[1]):
    print("START", name, flush=True)
    try:
        ckptcore_keras.import_tf_checkpoint(arg)
        result = ["no error", ""]
    except Exception as e:
        result = [type(e).__name__, str(e)]
    print("RESULT", json.dumps([name] + result), flush=True)
"""


@pytest.fixture(scope="module")
def dying_cases(real, tmp_path_factory, spawn_python) -> dict[str, Any]:
    """Run every ``tf_dies`` case in one child process; ``{name: (error type, message, names)}``."""
    built, names = [], {}
    for name in sorted(n for n, c in CASES.items() if c.tf_dies):
        arg, names[name] = CASES[name].build(Copy(real, tmp_path_factory.mktemp(name)))
        built.append((name, str(arg)))
    proc = spawn_python("-c", _WORKER, json.dumps(built))  # may die: its exit status is reported
    try:
        out, _ = proc.communicate(timeout=180)
        why = f"exit status {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        why = "hung"
    results = {}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            name, kind, message = json.loads(line[len("RESULT "):])
            results[name] = (kind, message)
        elif line.startswith("START "):
            results[line.split()[1]] = (f"the child process stopped here ({why})", "")
    return {n: (*results.get(n, (f"not reached ({why})", "")), names[n]) for n in names}


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c.tf_dies))
def test_input_that_kills_tensorflow_is_refused_first(name, dying_cases):
    kind, message, names = dying_cases[name]
    _check(name, kind, message, names)
