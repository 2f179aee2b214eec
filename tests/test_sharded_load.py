"""Load-time resharding: a checkpoint whose tensors were cut one way, loaded with templates cut
another way (N -> M), bit for bit against the global arrays built with NumPy; the byte ranges
planned; damage in the bytes read and outside them; locally and on the S3 server."""

from __future__ import annotations

import numpy as np
import pytest

import ckptcore
from ckptcore import (AccumulationState, Chunks, OptimizerState, ScheduleState, Shard,
                      TrainingState)
from ckptcore import _chunks
from ckptcore._manifest import CRC_BLOCK
from ckptcore._storage import Store
from ckptcore.api import read_manifest
from ckptcore.errors import CorruptCheckpointError, SchemaError


def _split(n: int, parts: int) -> list[int]:
    """Uneven bounds: numpy's array_split sizes."""
    sizes = [len(a) for a in np.array_split(np.arange(n), parts)]
    return [0, *np.cumsum(sizes).tolist()]


def _blocks(arr: np.ndarray, bounds: list[int], axis: int = 0) -> list[Shard]:
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        index = [slice(None)] * arr.ndim
        index[axis] = slice(a, b)
        offsets = [0] * arr.ndim
        offsets[axis] = a
        out.append(Shard(np.ascontiguousarray(arr[tuple(index)]), arr.shape, tuple(offsets)))
    return out


def _template(shard: Shard) -> Shard:
    """What a rank passes as ``like``: the block's shape and dtype, values ignored (garbage)."""
    return Shard(np.full(shard.shape, 77, shard.dtype), shard.global_shape, shard.offsets)


GLOBALS = {
    "w": np.random.default_rng(1).standard_normal((37, 6)).astype(np.float32),
    "m": np.random.default_rng(2).integers(-9, 9, (11, 5, 4)).astype(np.int64),
    "v": np.random.default_rng(3).standard_normal((23,)).astype(np.float64),
}


def _state(leaf) -> TrainingState:
    """A training state whose tensors are ``leaf(name, global array)``; the rest plain."""
    return TrainingState(
        model={"w": leaf("w", GLOBALS["w"]), "bias": np.arange(6, dtype=np.float32)},
        optimizer=OptimizerState("adam", step=11, hyperparams={"lr": 0.1},
                                 slots={"w": {"m": leaf("m", GLOBALS["m"])}}),
        schedule=ScheduleState("cosine", config={"total": 100}, step=11, last_lr=0.01),
        accumulation=AccumulationState(every=2, count=1, buffers={"w": leaf("v", GLOBALS["v"])}),
        rng={"python": (3, (1, 2), None), "numpy": np.uint32(5)},
        data={"epoch": 1, "position": 123, "seed": 7}, step=11, epoch=1)


def _save_cut(url, ranks: int, *, axis: int = 0, storage_options=None) -> None:
    """One save whose sharded leaves hold ``ranks`` chunks each (cut unevenly along ``axis``)."""
    def leaf(name, g):
        ax = axis if g.ndim > axis else 0
        return Chunks(_blocks(g, _split(g.shape[ax], ranks), ax))
    ckptcore.save_state(url, _state(leaf), storage_options=storage_options)


def _load_as(url, ranks: int, *, axis: int = 0, storage_options=None) -> list[TrainingState]:
    """Every one of ``ranks`` ranks' load, each with a template of its own blocks."""
    out = []
    for r in range(ranks):
        def leaf(name, g, r=r):
            ax = axis if g.ndim > axis else 0
            return _template(_blocks(g, _split(g.shape[ax], ranks), ax)[r])
        out.append(ckptcore.load_state(url, like=_state(leaf), storage_options=storage_options))
    return out


def _check_rank(state: TrainingState, ranks: int, r: int, axis: int = 0) -> None:
    got = {"w": state.model["w"], "m": state.optimizer.slots["w"]["m"],
           "v": state.accumulation.buffers["w"]}
    for name, g in GLOBALS.items():
        ax = axis if g.ndim > axis else 0
        want = _blocks(g, _split(g.shape[ax], ranks), ax)[r]
        s = got[name]
        assert isinstance(s, Shard) and s.offsets == want.offsets and s.global_shape == g.shape
        assert s.dtype == g.dtype and s.data.tobytes() == g[want.index()].tobytes(), name
    # the rest of the state comes back as saved
    assert state.model["bias"].tobytes() == np.arange(6, dtype=np.float32).tobytes()
    assert state.step == 11 and state.epoch == 1 and state.data["position"] == 123
    assert state.optimizer.step == 11 and state.optimizer.hyperparams == {"lr": 0.1}
    assert state.schedule.last_lr == 0.01 and state.rng["python"] == (3, (1, 2), None)
    assert state.rng["numpy"] == np.uint32(5) and type(state.rng["numpy"]) is np.uint32
    assert state.accumulation.count == 1


@pytest.mark.parametrize("saved, loaded", [(2, 1), (1, 4), (4, 2), (3, 2), (2, 3), (5, 5)])
def test_n_to_m(tmp_path, saved, loaded):
    url = str(tmp_path / "c")
    _save_cut(url, saved)
    for r, state in enumerate(_load_as(url, loaded)):
        _check_rank(state, loaded, r)


def test_cut_along_rows_loaded_along_columns(tmp_path):
    url = str(tmp_path / "c")
    _save_cut(url, 3, axis=0)
    for r, state in enumerate(_load_as(url, 2, axis=1)):
        _check_rank(state, 2, r, axis=1)


def test_sharded_to_plain_and_no_template(tmp_path):
    url = str(tmp_path / "c")
    _save_cut(url, 3)
    plain = ckptcore.load_state(url)
    assert plain.model["w"].tobytes() == GLOBALS["w"].tobytes()
    assert plain.optimizer.slots["w"]["m"].tobytes() == GLOBALS["m"].tobytes()
    like = _state(lambda name, g: np.zeros_like(g))  # a template of plain arrays: whole tensors
    whole = ckptcore.load_state(url, like=like)
    assert whole.accumulation.buffers["w"].tobytes() == GLOBALS["v"].tobytes()
    assert isinstance(whole.model["w"], np.ndarray)


def test_replicated_to_sharded(tmp_path):
    url = str(tmp_path / "c")
    ckptcore.save_state(url, _state(lambda name, g: g))  # plain arrays: a format-2 checkpoint
    assert ckptcore.inspect(url).format_version == 2
    for r, state in enumerate(_load_as(url, 3)):
        _check_rank(state, 3, r)


def test_a_template_leaf_with_several_blocks(tmp_path):
    url = str(tmp_path / "c")
    _save_cut(url, 2)
    g = GLOBALS["w"]
    like = _state(lambda name, a: Chunks([_template(b) for b in _blocks(a, [0, 1, 5])])
                  if name == "w" else np.zeros_like(a))
    got = ckptcore.load_state(url, like=like).model["w"]
    assert isinstance(got, Chunks) and [p.offsets for p in got.parts] == [(0, 0), (1, 0)]
    assert [p.data.tobytes() for p in got.parts] == [g[:1].tobytes(), g[1:5].tobytes()]


def test_incomplete_coverage_names_the_tensor_and_suggests_like(tmp_path):
    g = GLOBALS["w"]
    url = str(tmp_path / "c")
    ckptcore.save_state(url, TrainingState(model={"w": _blocks(g, [0, 10, 37])[0]}))  # one rank's part
    with pytest.raises(SchemaError, match=r"'model/w'.*like="):
        ckptcore.load_state(url)
    got = ckptcore.load_state(url, like=TrainingState(model={"w": _template(_blocks(g, [0, 4, 37])[0])}))
    assert got.model["w"].data.tobytes() == g[:4].tobytes()
    with pytest.raises(SchemaError, match=r"'model/w'.*block \[5, 0\]\.\.\[12, 6\]"):
        ckptcore.load_state(url, like=TrainingState(model={"w": _template(Shard(g[5:12], g.shape, (5, 0)))}))


def test_template_of_another_shape_is_refused(tmp_path):
    url = str(tmp_path / "c")
    _save_cut(url, 2)
    like = _state(lambda name, g: Shard(np.zeros((2, 6), np.float32), (40, 6), (0, 0))
                  if name == "w" else np.zeros_like(g))
    with pytest.raises(SchemaError, match=r"'model/w'.*\[40, 6\].*\[37, 6\]"):
        ckptcore.load_state(url, like=like)


# -------------------------------------------------------------- byte ranges and checksums
BIG = np.arange(4000 * 512, dtype=np.float32).reshape(4000, 512)  # 8.2 MB, rows of 2 KiB
HALF = BIG.nbytes // 2  # one chunk: 4,096,000 bytes, 4 checksum blocks (the last one shorter)


def _save_big(url, storage_options=None) -> None:
    ckptcore.save_state(url, TrainingState(model={"big": Chunks(_blocks(BIG, [0, 2000, 4000]))}),
                        storage_options=storage_options)


def test_plan_reads_only_the_blocks_holding_the_rows_asked_for(tmp_path):
    url = str(tmp_path / "c")
    _save_big(url)
    table = read_manifest(Store(url)).tensors
    # rows 2100..2200 of the global array: rows 100..200 of chunk 1, bytes 204,800..409,600,
    # inside its first 1 MiB checksum block
    p = _chunks.plan(table, [_chunks.Request(0, (2100, 0), (2200, 512))])
    assert [(r.row, r.start, r.end, r.whole) for r in p.reads] == [(1, 0, CRC_BLOCK, False)]
    assert p.nbytes() == CRC_BLOCK and p.nbytes() * 7 < BIG.nbytes
    # rows 1990..2010 straddle the chunks: the last block of chunk 0, the first of chunk 1
    p = _chunks.plan(table, [_chunks.Request(0, (1990, 0), (2010, 512))])
    assert [(r.row, r.start, r.end) for r in p.reads] == [(0, 3 * CRC_BLOCK, HALF),
                                                          (1, 0, CRC_BLOCK)]
    # a column slice still needs its rows' bytes (C order), no more
    p = _chunks.plan(table, [_chunks.Request(0, (0, 0), (10, 3))])
    assert [(r.row, r.start, r.end) for r in p.reads] == [(0, 0, CRC_BLOCK)]
    # a whole chunk is one read, checked by the chunk's own CRC
    p = _chunks.plan(table, [_chunks.Request(0, (2000, 0), (4000, 512))])
    assert [(r.row, r.start, r.end, r.whole) for r in p.reads] == [(1, 0, HALF, True)]
    got = ckptcore.load_state(url, like=TrainingState(
        model={"big": Shard(np.empty((100, 512), np.float32), BIG.shape, (2100, 0))}))
    assert got.model["big"].data.tobytes() == BIG[2100:2200].tobytes()


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_damage_in_a_block_read_is_found_and_outside_it_is_not_read(tmp_path):
    url = str(tmp_path / "c")
    _save_big(url)
    m = read_manifest(Store(url))
    t = m.tensors
    shard = tmp_path / "c" / m.shards[t.column("shard")[1]].path
    chunk1 = t.column("offset")[1]
    _flip(shard, chunk1 + 3 * CRC_BLOCK + 5)  # chunk 1, block 3: rows 3500..
    like = TrainingState(model={"big": Shard(np.empty((100, 512), np.float32), BIG.shape, (2100, 0))})
    got = ckptcore.load_state(url, like=like)  # block 0 of chunk 1 only: intact
    assert got.model["big"].data.tobytes() == BIG[2100:2200].tobytes()
    problems = ckptcore.verify(url)
    assert problems and all(isinstance(e, CorruptCheckpointError) for e in problems)
    assert any("model/big" in str(e) and "block 3" in str(e) for e in problems)
    bad = TrainingState(model={"big": Shard(np.empty((10, 512), np.float32), BIG.shape, (3600, 0))})
    with pytest.raises(CorruptCheckpointError, match="model/big.*block 3") as e:
        ckptcore.load_state(url, like=bad)
    assert e.value.file and shard.name in e.value.file
    with pytest.raises(CorruptCheckpointError):
        ckptcore.load_state(url)  # whole: chunk 1's own CRC


# ----------------------------------------------------------------------------- S3 server
@pytest.mark.parametrize("saved, loaded", [(3, 2), (1, 4)])
@pytest.mark.slow
def test_resharding_on_s3(s3_backend, saved, loaded):
    url, opts = s3_backend.url("c"), s3_backend.storage_options
    _save_cut(url, saved, storage_options=opts)
    for r, state in enumerate(_load_as(url, loaded, storage_options=opts)):
        _check_rank(state, loaded, r)
    assert ckptcore.verify(url, storage_options=opts) == []


def test_partial_ranged_reads_on_s3(s3_backend):
    url, opts = s3_backend.url("c"), s3_backend.storage_options
    _save_big(url, storage_options=opts)
    like = TrainingState(model={"big": Shard(np.empty((20, 512), np.float32), BIG.shape, (1990, 0))})
    got = ckptcore.load_state(url, like=like, storage_options=opts)
    assert got.model["big"].data.tobytes() == BIG[1990:2010].tobytes()
    whole = ckptcore.load_state(url, storage_options=opts)
    assert whole.model["big"].tobytes() == BIG.tobytes()


# ------------------------------------------------------------------------ ckpt inspect/verify
def test_ckpt_inspect_shows_global_shapes_and_chunking(tmp_path, capsys):
    from ckptcore import cli

    url = str(tmp_path / "c")
    _save_cut(url, 3)
    assert cli.main(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert "tensors     5 (11 chunks)" in out
    lines: dict[str, str] = {}
    for line in out.splitlines():  # (model/w first; accumulation/buffers/w later)
        if line.startswith("    "):
            lines.setdefault(line.split()[0], line)
    assert "37x6" in lines["w"] and "3 chunk(s) along dim 0: 0..13 13..25 25..37" in lines["w"]
    assert "11x5x4" in lines["m"] and "0..4 4..8 8..11" in lines["m"]
    assert "chunk" not in lines["bias"]
    part = str(tmp_path / "part")
    ckptcore.save_state(part, TrainingState(model={"w": _blocks(GLOBALS["w"], [0, 10, 37])[1]}))
    assert cli.main(["inspect", part]) == 0
    assert "1 chunk(s) along dim 0: 10..37  (holds 162 of 222 elements)" in capsys.readouterr().out


def test_ckpt_verify_checks_every_chunk(tmp_path, capsys):
    from ckptcore import cli

    url = str(tmp_path / "c")
    _save_cut(url, 3)
    assert cli.main(["verify", url]) == 0
    assert "OK (5 tensors (11 chunks), every chunk checked" in capsys.readouterr().out
    m = read_manifest(Store(url))
    t = m.tensors
    last_w = [i for i in range(len(t)) if t.names[i] == "model/w"][-1]  # the third chunk of w
    _flip(tmp_path / "c" / m.shards[t.column("shard")[last_w]].path, t.column("offset")[last_w] + 1)
    assert cli.main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert "BAD" in out and "'model/w'" in out and "Traceback" not in out
    problems = ckptcore.verify(url)
    assert len([p for p in problems if getattr(p, "tensor", None) == "model/w"]) == 1


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/io"), reason="Linux /proc only")
def test_a_partial_local_load_reads_about_one_block_from_disk(tmp_path):
    """Counted by the kernel (this process's read syscalls): one 1 MiB block, not 8 MB."""
    url = str(tmp_path / "c")
    _save_big(url)
    like = TrainingState(model={"big": Shard(np.empty((100, 512), np.float32), BIG.shape, (2100, 0))})
    ckptcore.load_state(url, like=like)  # warm the imports and caches
    before = _rchar()
    got = ckptcore.load_state(url, like=like)
    read = _rchar() - before
    assert got.model["big"].data.tobytes() == BIG[2100:2200].tobytes()
    assert CRC_BLOCK <= read < CRC_BLOCK + 256 * 1024, read  # the block, the manifest, /proc


def test_template_byte_order_and_sections(tmp_path):
    url = str(tmp_path / "c")
    _save_cut(url, 2)
    g = GLOBALS["w"]
    big_endian = Shard(np.zeros((5, 6), ">f4"), g.shape, (30, 0))  # same element type
    got = ckptcore.load_state(url, keys=["model"], like=TrainingState(model={"w": big_endian}))
    assert got.model["w"].data.tobytes() == g[30:35].tobytes() and got.optimizer is None


def test_manager_saves_and_restores_sharded_states(tmp_path):
    with ckptcore.CheckpointManager(str(tmp_path / "run")) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(lambda name, g: Chunks(_blocks(g, _split(g.shape[0], 2))))).result()
        restored = mgr.restore()
        assert restored.model["w"].tobytes() == GLOBALS["w"].tobytes()
        assert restored.step == 11


def test_many_small_chunked_tensors_on_s3(s3_backend):
    """Neighbouring chunks of a shard are fetched in shared ranged requests, sliced exactly."""
    url, opts = s3_backend.url("c"), s3_backend.storage_options
    rng = np.random.default_rng(4)
    arrays = {f"t{i}": rng.standard_normal(int(rng.integers(1, 50))).astype(np.float32)
              for i in range(300)}
    model = {k: Chunks(_blocks(a, [0, len(a) // 2, len(a)])) if len(a) > 1 else a
             for k, a in arrays.items()}
    ckptcore.save_state(url, TrainingState(model=model), storage_options=opts)
    got = ckptcore.load_state(url, storage_options=opts)
    assert {k: v.tobytes() for k, v in got.model.items()} == {k: a.tobytes() for k, a in arrays.items()}
    like = TrainingState(model={k: _template(Shard(a[: len(a) // 3], a.shape, (0,)))
                                for k, a in arrays.items()})
    part = ckptcore.load_state(url, like=like, storage_options=opts)
    assert all(part.model[k].data.tobytes() == a[: len(a) // 3].tobytes() for k, a in arrays.items())


def test_diff_compares_every_chunk_of_a_chunked_tensor(tmp_path):
    """ckptcore.diff keys chunks by name and start: a change in the first chunk of a tensor is
    found even though a later chunk has the same name."""
    import numpy as np

    import ckptcore

    whole = np.arange(40, dtype=np.float32).reshape(8, 5)

    def save(path, arr):
        parts = ckptcore.Chunks([ckptcore.Shard(arr[:4].copy(), (8, 5), (0, 0)),
                                 ckptcore.Shard(arr[4:].copy(), (8, 5), (4, 0))])
        ckptcore.save_state(path, ckptcore.TrainingState(model={"w": parts}))

    changed = whole.copy()
    changed[0, 0] += 1
    save(tmp_path / "a", whole)
    save(tmp_path / "b", changed)
    d = ckptcore.diff(tmp_path / "a", tmp_path / "b")
    assert [t.name for t in d.differences] == ["model/w@[0, 0]"], d.differences
    assert d.differences[0].change == "values"
    assert "model/w@[4, 0]" in d.same
