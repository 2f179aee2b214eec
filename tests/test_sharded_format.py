"""Format 3: sharded leaves saved as chunked tensors, the per-block checksums, and the merge of
several ranks' tensor tables (``_manifest.merge_tables``), on real files."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

import crc32c

import ckptcore
from ckptcore import (AccumulationState, Chunks, OptimizerState, Shard, TrainingState, _knobs)
from ckptcore._manifest import (CRC_BLOCK, MANIFEST_NAME, Manifest, TensorTable, merge_tables)
from ckptcore._storage import Store
from ckptcore.api import read_manifest
from ckptcore.errors import SchemaError

from _support import assert_state_same


def _outer(path) -> dict:
    return msgpack.unpackb((path / MANIFEST_NAME).read_bytes(), raw=False)


def _cut(arr: np.ndarray, bounds: list[int], axis: int = 0) -> Chunks:
    """``arr`` as chunks cut at ``bounds`` along ``axis``."""
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        index = [slice(None)] * arr.ndim
        index[axis] = slice(a, b)
        offsets = [0] * arr.ndim
        offsets[axis] = a
        parts.append(Shard(arr[tuple(index)], arr.shape, tuple(offsets)))
    return Chunks(parts)


def test_plain_state_is_still_written_as_version_2(tmp_path):
    state = TrainingState(model={"w": np.arange(12.0).reshape(3, 4)}, step=1)
    info = ckptcore.save_state(tmp_path / "c", state)
    assert info.format_version == 2 and _outer(tmp_path / "c")["version"] == 2
    body = msgpack.unpackb(_outer(tmp_path / "c")["body"], raw=False, strict_map_key=False)
    assert list(body["tensors"]) == ["names", "dtypes", "dtype", "ndim", "shape", "shard",
                                     "offset", "length", "checksum"]


def test_a_shard_leaf_anywhere_makes_version_3_and_loads_whole(tmp_path):
    rng = np.random.default_rng(0)
    w, m, acc, x = (rng.standard_normal(s).astype(np.float32) for s in [(10, 4), (10, 4), (6,), (5, 3)])
    state = TrainingState(
        model={"w": _cut(w, [0, 3, 10]), "b": np.arange(4, dtype=np.int16)},
        optimizer=OptimizerState("adam", step=3, slots={"w": {"m": _cut(m, [0, 1, 4], axis=1)}}),
        accumulation=AccumulationState(every=2, count=1, buffers={"w": Shard(acc, (6,), (0,))}),
        extra={"deep": [{"x": _cut(x, [0, 2, 5])}]}, step=3, data={"position": 9},
        rng={"numpy": np.uint32(7)})
    info = ckptcore.save_state(tmp_path / "c", state)
    assert info.format_version == 3 and _outer(tmp_path / "c")["version"] == 3
    got = ckptcore.load_state(tmp_path / "c")
    want = TrainingState(model={"w": w, "b": state.model["b"]},
                         optimizer=OptimizerState("adam", step=3, slots={"w": {"m": m}}),
                         accumulation=AccumulationState(every=2, count=1, buffers={"w": acc}),
                         extra={"deep": [{"x": x}]}, step=3, data={"position": 9},
                         rng={"numpy": np.uint32(7)})
    assert_state_same(got, want)
    assert got.model["w"].tobytes() == w.tobytes()
    assert ckptcore.verify(tmp_path / "c") == []


def test_chunks_longer_than_a_block_carry_block_checksums(tmp_path):
    big = np.arange(3 * CRC_BLOCK // 8 + 5, dtype=np.float64)  # 3 blocks and a bit
    state = TrainingState(model={"v": Shard(big, (2 * big.size,), (big.size,))})
    ckptcore.save_state(tmp_path / "c", state)
    table = read_manifest(Store(str(tmp_path / "c"))).tensors
    raw = big.tobytes()
    assert table.crc_block == CRC_BLOCK
    assert table.blocks(0) == [crc32c.crc32c(raw[i:i + CRC_BLOCK])
                               for i in range(0, len(raw), CRC_BLOCK)]
    assert table.column("checksum")[0] == crc32c.crc32c(raw)
    assert table.global_shape(0) == (2 * big.size,) and table.chunk_start(0) == (big.size,)


def test_format_version_1_cannot_hold_shards(tmp_path):
    state = TrainingState(model={"w": Shard(np.zeros(2), (4,), (0,))})
    with _knobs.override(format_version=1), pytest.raises(ValueError, match="version 3"):
        ckptcore.save_state(tmp_path / "c", state)
    assert not (tmp_path / "c").exists()


def test_overlapping_chunks_are_refused_at_save(tmp_path):
    a = np.zeros((4, 2))
    state = TrainingState(model={"w": Chunks([Shard(a[:3], (4, 2), (0, 0)),
                                              Shard(a[:2], (4, 2), (2, 0))])})
    with pytest.raises(ValueError, match="model/w.*overlap"):
        ckptcore.save_state(tmp_path / "c", state)
    assert not (tmp_path / "c").exists()


def test_chunks_must_share_global_shape_and_dtype():
    with pytest.raises(ValueError, match="global shape"):
        Chunks([Shard(np.zeros(2), (4,), (0,)), Shard(np.zeros(2), (5,), (2,))])
    with pytest.raises(ValueError, match="dtype"):
        Chunks([Shard(np.zeros(2), (4,), (0,)), Shard(np.zeros(2, np.float32), (4,), (2,))])
    with pytest.raises(TypeError):
        Chunks([])


# ------------------------------------------------------------------------------ merge_tables
def _table(names, dtypes, shapes, gshapes, starts, tensor, shard, offset) -> TensorTable:
    lengths = [int(np.prod(s)) * np.dtype(d).itemsize for s, d in zip(shapes, dtypes)]
    return TensorTable.from_columns(names, dtypes, shapes, shard, offset, lengths,
                                    [0] * len(names), tensor=tensor, global_shapes=gshapes,
                                    starts=starts, block_crc=[], crc_block=CRC_BLOCK)


def test_merge_tables_concatenates_rows_and_shifts_shards():
    r0 = _table(["w", "b"], ["float32", "int8"], [(2, 3), (5,)], [(4, 3), (5,)], [(0, 0), (0,)],
                [0, 1], [0, 1], [0, 0])
    r1 = _table(["w"], ["float32"], [(2, 3)], [(4, 3)], [(2, 0)], [0], [0], [64])
    merged = merge_tables([r0, r1], [0, 2])
    assert merged.names == ["w", "b", "w"]
    assert merged.column("shard") == [0, 1, 2] and merged.column("offset") == [0, 0, 64]
    assert merged.dtype_names() == ["float32", "int8", "float32"]
    assert merged.column("tensor") == [0, 1, 0]
    assert [merged.chunk_start(i) for i in range(3)] == [(0, 0), (0,), (2, 0)]
    assert merged.rows_of() == [[0, 2], [1]] and merged.logical_count() == 2


def test_merge_tables_refuses_disagreeing_ranks():
    r0 = _table(["w"], ["float32"], [(2, 3)], [(4, 3)], [(0, 0)], [0], [0], [0])
    other_shape = _table(["w"], ["float32"], [(2, 3)], [(5, 3)], [(2, 0)], [0], [0], [0])
    overlapping = _table(["w"], ["float32"], [(2, 3)], [(4, 3)], [(1, 0)], [0], [0], [0])
    other_name = _table(["v"], ["float32"], [(2, 3)], [(4, 3)], [(2, 0)], [0], [0], [0])
    gap = _table(["w", "x"], ["float32"] * 2, [(2, 3)] * 2, [(4, 3)] * 2, [(2, 0), (0, 0)],
                 [0, 2], [0, 0], [0, 64])
    with pytest.raises(SchemaError, match="'w'.*global shape"):
        merge_tables([r0, other_shape], [0, 1])
    with pytest.raises(SchemaError, match="'w'.*overlap"):
        merge_tables([r0, overlapping], [0, 1])
    with pytest.raises(SchemaError, match="named 'v'"):
        merge_tables([r0, other_name], [0, 1])
    with pytest.raises(SchemaError, match="logical tensor 1 has no chunks"):
        merge_tables([r0, gap], [0, 1])


def test_two_ranks_parts_merged_into_one_checkpoint_load_whole(tmp_path):
    """What the distributed commit does, in one process: each rank encodes its own state (its
    Shard leaves), writes its shards, and the tables are merged into one manifest."""
    from ckptcore import _codec, _io

    g = np.arange(7 * 3, dtype=np.int32).reshape(7, 3)
    bias = np.arange(3, dtype=np.float64)
    folder = tmp_path / "c"
    folder.mkdir()
    store = Store(str(folder))
    shards, tables, tree = [], [], None
    for rank, (a, b) in enumerate([(0, 4), (4, 7)]):
        state = TrainingState(model={"w": Shard(g[a:b], g.shape, (a, 0)), "b": bias}, step=5)
        enc = _codec.encode_state(state)
        keep = [i for i, name in enumerate(enc.names) if name != "model/b" or rank == 0]
        chunks = _codec.Chunking([enc.chunks.tensor[i] for i in keep],
                                 [enc.chunks.global_shapes[i] for i in keep],
                                 [enc.chunks.starts[i] for i in keep])
        s, t = _io.write_payload(store, [enc.arrays[i] for i in keep],
                                 [enc.names[i] for i in keep], f"r{rank:05d}-tok",
                                 [enc.dtypes[i] for i in keep], chunks=chunks)
        shards.append(s)
        tables.append(t)
        tree = enc.tree
    offsets = [0, len(shards[0])]
    table = merge_tables(tables, offsets)
    manifest = Manifest(created=0.0, writer={"id": "t", "host": "h", "pid": 0}, library={},
                        framework={"name": None, "versions": {}}, alignment=64,
                        shards=tuple(shards[0] + shards[1]), tensors=table, tree=tree, version=3)
    (folder / MANIFEST_NAME).write_bytes(manifest.to_bytes())
    got = ckptcore.load_state(folder)
    assert got.model["w"].tobytes() == g.tobytes() and got.model["b"].tobytes() == bias.tobytes()
    assert got.step == 5
    assert ckptcore.verify(folder) == []


@pytest.mark.slow
def test_a_table_too_irregular_to_check_is_refused_quickly():
    """Chunks that do not overlap, arranged so that every dimension has billions of candidate
    pairs: a typed error in a moment, not minutes of checking."""
    import time

    from ckptcore._manifest import check_chunks

    k = 40_000
    a = np.arange(k // 2)
    tall = [((0, int(i)), (k, 1)) for i in a]            # side by side: all overlap along dim 0
    wide = [((k + int(i), k), (1, 2 * k)) for i in a]    # stacked: all overlap along dim 1
    starts, shapes = zip(*(tall + wide))
    t = _table(["w"] * k, ["int8"] * k, list(shapes), [(2 * k, 3 * k)] * k, list(starts),
               [0] * k, [0] * k, [0] * k)
    began = time.perf_counter()
    with pytest.raises(SchemaError, match="'w'.*too irregularly"):
        check_chunks(t, "test")
    assert time.perf_counter() - began < 10


def test_a_ranks_table_travels_as_v3_columns(tmp_path):
    """What a rank sends its coordinator: ``table.to_v3()`` through msgpack, read back checked."""
    from ckptcore import _codec, _io
    from ckptcore._manifest import read_table

    g = np.arange(40, dtype=np.float32).reshape(8, 5)
    enc = _codec.encode_state(TrainingState(model={"w": _cut(g, [0, 3, 8]), "b": np.ones(2)}))
    shards, table = _io.write_payload(Store(str(tmp_path)), enc.arrays, enc.names, "tok",
                                      enc.dtypes, chunks=enc.chunks)
    wire = msgpack.packb(table.to_v3(), use_bin_type=True)
    back = read_table(msgpack.unpackb(wire, raw=False), shards, source="rank 1")
    assert back == table and back.rows_of() == [[0, 1], [2]]
    damaged = msgpack.unpackb(wire, raw=False)
    damaged["start"] = np.array([0, 0, 2, 0, 0], "<u8").tobytes()  # chunk 2 now at row 2: overlap
    with pytest.raises(SchemaError, match="rank 1: tensor 'model/w'.*overlap"):
        read_table(damaged, shards, source="rank 1")
    with pytest.raises(SchemaError, match="rank 1"):
        read_table([1, 2], shards, source="rank 1")


def _brute_overlap(starts, shapes) -> bool:
    """Whether two non-empty boxes share a point, pair by pair."""
    boxes = [(np.array(s), np.array(s) + np.array(h)) for s, h in zip(starts, shapes)
             if all(h)]
    return any(((a_lo < b_hi) & (b_lo < a_hi)).all()
               for i, (a_lo, a_hi) in enumerate(boxes) for b_lo, b_hi in boxes[i + 1:])


@pytest.mark.parametrize("seed", range(40))
def test_the_overlap_check_agrees_with_a_pair_by_pair_check(seed):
    """The vectorised fast path (chunks separated along one dimension in table order) and the
    exact sweep behind it together refuse exactly the tables with overlapping chunks: grids,
    cuts along any dimension, shuffled rows, empty chunks, several tensors, shifted chunks."""
    from ckptcore._manifest import check_chunks

    rng = np.random.default_rng(seed)
    names, shapes, gshapes, starts, tensor = [], [], [], [], []
    overlapping = set()
    for k in range(int(rng.integers(1, 5))):
        nd = int(rng.integers(1, 4))
        g = [int(x) for x in rng.integers(1, 7, nd)]
        cuts = [sorted({0, g[d], *rng.integers(0, g[d] + 1, int(rng.integers(0, 3))).tolist()})
                for d in range(nd)]
        boxes = [([], [])]
        for d in range(nd):  # a grid of the cuts
            boxes = [(s + [a], h + [b - a]) for s, h in boxes
                     for a, b in zip(cuts[d][:-1], cuts[d][1:])]
        if rng.random() < 0.5:  # move one chunk inside the shape: maybe onto another
            i, d = int(rng.integers(len(boxes))), int(rng.integers(nd))
            boxes[i][0][d] = int(rng.integers(0, g[d] - boxes[i][1][d] + 1))
        if rng.random() < 0.2:
            boxes.append(([0] * nd, [0] * nd))  # an empty chunk
        if rng.random() < 0.5:
            boxes = [boxes[i] for i in rng.permutation(len(boxes))]
        if _brute_overlap(*zip(*boxes)):
            overlapping.add(f"t{k}")
        for s, h in boxes:
            names.append(f"t{k}"), starts.append(tuple(s)), shapes.append(tuple(h))
            gshapes.append(tuple(g)), tensor.append(k)
    t = _table(names, ["int8"] * len(names), shapes, gshapes, starts, tensor,
               [0] * len(names), [0] * len(names))
    if overlapping:
        with pytest.raises(SchemaError, match="overlap") as e:
            check_chunks(t, "test")
        assert str(e.value).split("tensor ")[1].split(":")[0].strip("'") in overlapping
    else:
        check_chunks(t, "test")
