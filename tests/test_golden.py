"""Golden checkpoints of formats v1 and v2 (tests/golden/v1, v2, made by tests/golden/make_golden.py).

Both hold the same state; v1 lists tensors as one map each, v2 as columns.

The expected values are written out here independently of the generator; the ml_dtypes and
float16 tensors are pinned to their raw IEEE-style bit patterns, so a reader in another
language, or a future ml_dtypes, has to agree with these bytes.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib

import crc32c
import msgpack
import numpy as np
import pytest

import ckptcore
from ckptcore import AccumulationState, OptimizerState, ParamInfo, ScheduleState, TrainingState

from _support import assert_state_same

ROOT = pathlib.Path(__file__).parent / "golden"
VERSIONS = [1, 2]
NAMES = ["full", "sharded"]
CASES = [(v, n) for v in VERSIONS for n in NAMES]
IDS = [f"v{v}-{n}" for v, n in CASES]


def _dir(version: int, name: str) -> pathlib.Path:
    return ROOT / f"v{version}" / name

# (name, dtype, shape, raw little-endian bytes) in tensor-table order.
_F32 = "<f4"
_KERNEL = np.array([[-0.75, -0.5, -0.25], [0, 0.25, 0.5], [0.75, -0.75, -0.5], [-0.25, 0, 0.25]], _F32)
TENSORS = [
    ("model/dense/kernel", "float32", (4, 3), _KERNEL.tobytes()),
    ("model/dense/bias", "bfloat16", (3,), bytes.fromhex("003f 80bf 0040")),          # 0.5, -1, 2
    ("model/bn/mean", "float16", (3,), bytes.fromhex("003e 00b4 0042")),              # 1.5, -0.25, 3
    ("model/embed/table", "int64", (2, 2), (np.array([[0, 2], [4, 6]], "<i8") - 2**62).tobytes()),
    ("model/count", "int32", (), (7).to_bytes(4, "little")),
    ("model/empty", "float32", (0, 4), b""),
    ("model/flags", "bool", (5,), bytes([1, 0, 1, 1, 0])),
    ("model/fp8", "float8_e4m3fn", (4,), bytes.fromhex("30 c0 7e 00")),               # 0.5, -2, 448, 0
    ("model/cplx", "complex64", (2,), np.array([1 + 2j, -0.5j], "<c8").tobytes()),
    ("model/names", "U3", (2,), "ab\0xyz".encode("utf-32-le")),
    ("model/when", "datetime64[s]", (2,), np.array([0, 86400], "<i8").tobytes()),
    ("optimizer/slots/dense/kernel/m", "float32", (4, 3), np.full(12, 0.25, _F32).tobytes()),
    ("optimizer/slots/dense/kernel/v", "float32", (4, 3), np.full(12, 0.0625, _F32).tobytes()),
    ("optimizer/extra/loss_scale", "float32", (), np.float32(1024).tobytes()),
    ("rng/numpy/counter", "uint64", (2,), np.array([1, 2], "<u8").tobytes()),
    ("accumulation/buffers/dense/kernel", "float32", (4, 3), np.full(12, -1.0, _F32).tobytes()),
    ("extra/arr", "uint16", (3,), np.array([0, 1, 2], "<u2").tobytes()),
]
# Tensor index -> shard index, per checkpoint.
SHARD_OF = {"full": [0] * 17, "sharded": [0] * 4 + [1] * 5 + [2] * 4 + [3] * 4}


def expected_state() -> TrainingState:
    import ml_dtypes
    t = {name: np.frombuffer(raw, dtype=ckptcore._codec.parse_dtype(dt)).reshape(shape)
         for name, dt, shape, raw in TENSORS}
    assert t["model/dense/bias"].astype(np.float32).tolist() == [0.5, -1.0, 2.0]
    assert t["model/fp8"].astype(np.float32).tolist() == [0.5, -2.0, 448.0, 0.0]
    assert t["model/fp8"].dtype == ml_dtypes.float8_e4m3fn
    assert t["model/names"].tolist() == ["ab", "xyz"]
    return TrainingState(
        model={k[len("model/"):]: v for k, v in t.items() if k.startswith("model/")},
        optimizer=OptimizerState(
            "adam", step=7, hyperparams={"lr": 0.001, "betas": (0.9, 0.999), "amsgrad": False},
            slots={"dense/kernel": {"m": t["optimizer/slots/dense/kernel/m"],
                                    "v": t["optimizer/slots/dense/kernel/v"]}},
            extra={"loss_scale": np.float32(1024.0)}),
        schedule=ScheduleState("cosine", config={"warmup": 10, "total": 100}, step=7, last_lr=0.0005,
                               state={"best": 0.5, "bad_epochs": 2}),
        rng={"python": (3, (1, 2, 3), None), "numpy": {"counter": t["rng/numpy/counter"]}},
        data={"epoch": 2, "position": 96, "seed": 1234},
        accumulation=AccumulationState(every=4, count=1,
                                       buffers={"dense/kernel": t["accumulation/buffers/dense/kernel"]}),
        step=7, epoch=2, framework="numpy", metadata={"note": "golden v1"},
        extra={"list": [1, "two", b"three", None, True, -2**63, 2**64 - 1, 1.5],
               "tuple": (1, (2.5, "x")), 7: "int key", "arr": t["extra/arr"]},
        params={"dense/kernel": ParamInfo(index=0, layer="dense", kind="dense", role="kernel", layout="io")},
    )


def _manifest(version: int, name: str) -> tuple[dict, dict]:
    outer = msgpack.unpackb((_dir(version, name) / "manifest.msgpack").read_bytes(), raw=False)
    return outer, msgpack.unpackb(outer["body"], raw=False, strict_map_key=False)


def _entries(body: dict) -> list[dict]:
    """The tensor table as one map per tensor, decoded here from either version's layout
    (docs/FORMAT.md, section 5) without ckptcore."""
    t = body["tensors"]
    if isinstance(t, list):
        return t
    col = {k: np.frombuffer(t[k], dt).tolist() for k, dt in (
        ("dtype", "<u4"), ("ndim", "u1"), ("shape", "<u8"), ("shard", "<u4"), ("offset", "<u8"),
        ("length", "<u8"), ("checksum", "<u4"))}
    out, pos = [], 0
    for i, name in enumerate(t["names"]):
        n = col["ndim"][i]
        out.append({"name": name, "dtype": t["dtypes"][col["dtype"][i]],
                    "shape": col["shape"][pos:pos + n], "shard": col["shard"][i],
                    "offset": col["offset"][i], "length": col["length"][i],
                    "checksum": col["checksum"][i]})
        pos += n
    assert pos == len(col["shape"])
    return out


@pytest.mark.parametrize("version, name", CASES, ids=IDS)
def test_golden_loads_byte_for_byte(version, name):
    state = ckptcore.load_state(_dir(version, name))
    assert_state_same(state, expected_state())
    got = {"model/" + k: v for k, v in state.model.items()}
    for tname, dtype, shape, raw in TENSORS:
        if tname in got:
            assert got[tname].tobytes() == raw and got[tname].shape == shape, tname
    assert type(state.optimizer.extra["loss_scale"]) is np.float32
    assert ckptcore.verify(_dir(version, name)) == []


@pytest.mark.parametrize("version, name", CASES, ids=IDS)
def test_golden_partial_load(version, name):
    got = ckptcore.load_state(_dir(version, name), keys=["model"])
    assert_state_same(got, expected_state(), sections=("model", "step", "epoch", "metadata"))
    assert got.optimizer is None and got.extra == {}


@pytest.mark.parametrize("version, name", CASES, ids=IDS)
def test_golden_manifest_fields(version, name):
    outer, body = _manifest(version, name)
    assert list(outer) == ["format", "version", "body", "body_crc32c"]
    assert outer["format"] == "ckptcore" and outer["version"] == version
    assert outer["body_crc32c"] == crc32c.crc32c(outer["body"])
    assert body["checksum"] == "crc32c" and body["alignment"] == 64
    assert body["created"] == 1700000000.0 and body["writer"]["id"] == "golden"
    assert body["framework"] == {"name": "numpy", "versions": {}}
    if version == 2:
        table = body["tensors"]
        assert list(table) == ["names", "dtypes", "dtype", "ndim", "shape", "shard", "offset",
                               "length", "checksum"]
        # dtype names are listed once each, in order of first use
        assert table["dtypes"] == list(dict.fromkeys(d for _, d, _, _ in TENSORS))
    else:
        assert isinstance(body["tensors"], list)
    tensors = _entries(body)
    assert [(t["name"], t["dtype"], tuple(t["shape"])) for t in tensors] == \
           [(n, d, s) for n, d, s, _ in TENSORS]
    assert [t["shard"] for t in tensors] == SHARD_OF[name]
    for t, (_, _, shape, raw) in zip(tensors, TENSORS):
        assert t["length"] == len(raw) == math.prod(shape) * ckptcore._codec.parse_dtype(t["dtype"]).itemsize
        assert t["checksum"] == crc32c.crc32c(raw)
        assert t["offset"] % 64 == 0
    tree = body["tree"]
    assert tree["model"]["dense/kernel"] == msgpack.ExtType(1, msgpack.packb(0))
    assert tree["optimizer"]["extra"]["loss_scale"] == msgpack.ExtType(3, msgpack.packb(13))
    assert tree["rng"]["python"] == msgpack.ExtType(2, msgpack.packb([3, msgpack.ExtType(2, msgpack.packb([1, 2, 3])), None]))
    info = ckptcore.inspect(_dir(version, name))
    assert (info.format_version, info.step, info.epoch, info.framework) == (version, 7, 2, "numpy")
    assert info.created == 1700000000.0 and len(info.tensors) == len(TENSORS)
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in info.tensors] == \
           [(n, d, s, len(raw)) for n, d, s, raw in TENSORS]


@pytest.mark.parametrize("version, name", CASES, ids=IDS)
def test_golden_shard_files_are_the_documented_layout(version, name):
    """Each shard is its tensors' raw bytes at their offsets, zero padding between, nothing after."""
    _, body = _manifest(version, name)
    files = sorted(p.name for p in _dir(version, name).iterdir())
    assert files == sorted(["manifest.msgpack"] + [s["path"] for s in body["shards"]])
    for i, shard in enumerate(body["shards"]):
        data = (_dir(version, name) / shard["path"]).read_bytes()
        assert len(data) == shard["size"] and crc32c.crc32c(data) == shard["checksum"]
        expect = bytearray()
        for t, (_, _, _, raw) in zip(_entries(body), TENSORS):
            if t["shard"] == i:
                assert t["offset"] >= len(expect)
                expect += bytes(t["offset"] - len(expect)) + raw
        assert bytes(expect) == data


def test_v1_and_v2_hold_the_same_shards():
    """Only the manifest's table changed between the versions: the shard bytes are identical."""
    for name in NAMES:
        for f in _dir(1, name).iterdir():
            if f.name != "manifest.msgpack":
                assert (_dir(2, name) / f.name).read_bytes() == f.read_bytes(), f"{name}/{f.name}"


def test_writer_still_produces_the_golden_bytes(tmp_path):
    """The current writer, through the committed generator, reproduces the committed files exactly.

    Version 1 is written through the ``format_version`` knob, so old releases' checkpoints can
    still be produced byte for byte.  If this fails after a deliberate format change, bump the
    format version and add golden/v3 (keep the old ones: they are what old checkpoints look like).
    """
    spec = importlib.util.spec_from_file_location("make_golden", ROOT / "make_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--out", str(tmp_path)]) == 0
    for version, name in CASES:
        for f in _dir(version, name).iterdir():
            got = tmp_path / f"v{version}" / name / f.name
            assert got.read_bytes() == f.read_bytes(), f"v{version}/{name}/{f.name} drifted"


def _format_md_reader():
    """The reader printed in docs/FORMAT.md, section 11, executed as written."""
    text = (pathlib.Path(__file__).parents[1] / "docs" / "FORMAT.md").read_text()
    section = text[text.index("## 11."):]
    code = section[section.index("```python") + len("```python"):]
    code = code[:code.index("```")]
    namespace: dict = {}
    exec(compile(code, "docs/FORMAT.md", "exec"), namespace)
    return namespace["read_checkpoint"]


@pytest.mark.parametrize("version, name", CASES, ids=IDS)
def test_format_md_reader_reads_the_golden_checkpoints(version, name):
    """The spec is enough to read a checkpoint: its own reader, without ckptcore, gets the state."""
    tree = _format_md_reader()(str(_dir(version, name)))
    want = expected_state()
    assert_state_same(TrainingState(
        model=tree["model"], optimizer=OptimizerState(**tree["optimizer"]),
        schedule=ScheduleState(**tree["schedule"]), rng=tree["rng"], data=tree["data"],
        accumulation=AccumulationState(**tree["accumulation"]), step=tree["step"], epoch=tree["epoch"],
        framework=tree["framework"], metadata=tree["metadata"], extra=tree["extra"],
        params={k: ParamInfo(**v) for k, v in tree["params"].items()}), want)


@pytest.mark.parametrize("version", VERSIONS)
def test_format_md_reader_rejects_damage(tmp_path, version):
    import shutil
    shutil.copytree(_dir(version, "sharded"), tmp_path / "c")
    shard = sorted((tmp_path / "c").glob("shard-*"))[1]
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(AssertionError):
        _format_md_reader()(str(tmp_path / "c"))


# ------------------------------------------------------------------------------------ format 3
# tests/golden/v3: the same values, "model/dense/kernel" saved as chunks of rows [0, 1) and
# [1, 4), "optimizer/slots/dense/kernel/m" as chunks of columns [0, 2) and [2, 3).
def _v3_rows() -> list[tuple[str, str, tuple, tuple, tuple, bytes]]:
    """(name, dtype, chunk shape, global shape, start, raw bytes) of every row of the v3 table."""
    rows = []
    for name, dtype, shape, raw in TENSORS:
        arr = np.frombuffer(raw, ckptcore._codec.parse_dtype(dtype)).reshape(shape)
        if name == "model/dense/kernel":
            rows += [(name, dtype, (1, 3), shape, (0, 0), arr[:1].tobytes()),
                     (name, dtype, (3, 3), shape, (1, 0), arr[1:].tobytes())]
        elif name == "optimizer/slots/dense/kernel/m":
            rows += [(name, dtype, (4, 2), shape, (0, 0), np.ascontiguousarray(arr[:, :2]).tobytes()),
                     (name, dtype, (4, 1), shape, (0, 2), np.ascontiguousarray(arr[:, 2:]).tobytes())]
        else:
            rows.append((name, dtype, shape, shape, (0,) * len(shape), raw))
    return rows


def _v3_columns(body: dict) -> dict:
    t = body["tensors"]
    return {k: np.frombuffer(t[k], dt).tolist() for k, dt in (
        ("tensor", "<u4"), ("gshape", "<u8"), ("start", "<u8"), ("block_crc", "<u4"))}


@pytest.mark.parametrize("name", NAMES)
def test_golden_v3_loads_whole_and_verifies(name):
    state = ckptcore.load_state(_dir(3, name))
    assert_state_same(state, expected_state())
    assert state.model["dense/kernel"].tobytes() == _KERNEL.tobytes()
    assert ckptcore.verify(_dir(3, name)) == []


@pytest.mark.parametrize("name", NAMES)
def test_golden_v3_manifest_fields(name):
    outer, body = _manifest(3, name)
    assert outer["version"] == 3 and outer["body_crc32c"] == crc32c.crc32c(outer["body"])
    table = body["tensors"]
    assert list(table) == ["names", "dtypes", "dtype", "ndim", "shape", "shard", "offset",
                           "length", "checksum", "crc_block", "tensor", "gshape", "start",
                           "block_crc"]
    assert table["crc_block"] == 1 << 20
    rows = _v3_rows()
    entries = _entries(body)
    cols = _v3_columns(body)
    assert [(e["name"], e["dtype"], tuple(e["shape"])) for e in entries] == \
           [(n, d, s) for n, d, s, _, _, _ in rows]
    gshape = [g for _, _, _, g, _, _ in rows]
    start = [s for _, _, _, _, s, _ in rows]
    assert cols["gshape"] == [d for g in gshape for d in g]
    assert cols["start"] == [d for s in start for d in s]
    # rows of one tensor share its logical index; the tree refers to logical indices
    names = [n for n, *_ in rows]
    logical = list(dict.fromkeys(names))
    assert cols["tensor"] == [logical.index(n) for n in names]
    assert cols["block_crc"] == []  # no chunk is longer than one block
    for e, (_, _, _, _, _, raw) in zip(entries, rows):
        assert e["length"] == len(raw) and e["checksum"] == crc32c.crc32c(raw)
    assert body["tree"]["model"]["dense/kernel"] == msgpack.ExtType(1, msgpack.packb(0))
    assert body["tree"]["optimizer"]["extra"]["loss_scale"] == msgpack.ExtType(3, msgpack.packb(13))
    info = ckptcore.inspect(_dir(3, name))
    assert info.format_version == 3
    assert [(t.name, t.shape, t.global_shape, t.start) for t in info.tensors] == \
           [(n, s, g, st) for n, _, s, g, st, _ in rows]


@pytest.mark.parametrize("name", NAMES)
def test_golden_v3_shard_files_are_the_documented_layout(name):
    _, body = _manifest(3, name)
    for i, shard in enumerate(body["shards"]):
        data = (_dir(3, name) / shard["path"]).read_bytes()
        assert len(data) == shard["size"] and crc32c.crc32c(data) == shard["checksum"]
        expect = bytearray()
        for e, row in zip(_entries(body), _v3_rows()):
            if e["shard"] == i:
                assert e["offset"] >= len(expect) and e["offset"] % 64 == 0
                expect += bytes(e["offset"] - len(expect)) + row[-1]
        assert bytes(expect) == data


def test_writer_still_produces_the_golden_v3_bytes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_golden", ROOT / "make_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--out", str(tmp_path), "--version", "3"]) == 0
    for name in NAMES:
        for f in _dir(3, name).iterdir():
            got = tmp_path / "v3" / name / f.name
            assert got.read_bytes() == f.read_bytes(), f"v3/{name}/{f.name} drifted"


@pytest.mark.parametrize("name", NAMES)
def test_format_md_reader_reads_the_golden_v3_checkpoints(name):
    tree = _format_md_reader()(str(_dir(3, name)))
    assert tree["model"]["dense/kernel"].tobytes() == _KERNEL.tobytes()
    assert tree["optimizer"]["slots"]["dense/kernel"]["m"].tobytes() == np.full(12, 0.25, _F32).tobytes()
    assert_state_same(TrainingState(
        model=tree["model"], optimizer=OptimizerState(**tree["optimizer"]),
        schedule=ScheduleState(**tree["schedule"]), rng=tree["rng"], data=tree["data"],
        accumulation=AccumulationState(**tree["accumulation"]), step=tree["step"], epoch=tree["epoch"],
        framework=tree["framework"], metadata=tree["metadata"], extra=tree["extra"],
        params={k: ParamInfo(**v) for k, v in tree["params"].items()}), expected_state())


# ------------------------------------------------------------------------------------ format 4
# tests/golden/v4: v3's state, its rows in the rows object "shard-rows-golden.bin" (one group).
@pytest.mark.parametrize("name", NAMES)
def test_golden_v4_loads_whole_and_verifies(name):
    state = ckptcore.load_state(_dir(4, name))
    assert_state_same(state, expected_state())
    assert ckptcore.verify(_dir(4, name)) == []
    assert ckptcore.inspect(_dir(4, name)).format_version == 4


@pytest.mark.parametrize("name", NAMES)
def test_golden_v4_manifest_fields(name):
    outer, body = _manifest(4, name)
    assert outer["version"] == 4 and outer["body_crc32c"] == crc32c.crc32c(outer["body"])
    t = body["tensors"]
    assert list(t) == ["names", "dtypes", "crc_block", "rows", "object", "index"]
    rows = _v3_rows()
    assert t["names"] == list(dict.fromkeys(n for n, *_ in rows))  # one per logical tensor
    assert t["rows"] == len(rows)
    data = (_dir(4, name) / "shard-rows-golden.bin").read_bytes()
    assert t["object"] == {"path": "shard-rows-golden.bin", "size": len(data),
                           "checksum": crc32c.crc32c(data)}
    idx = {k: np.frombuffer(t["index"][k], dt).tolist() for k, dt in (
        ("rows", "<u4"), ("offset", "<u8"), ("length", "<u8"), ("checksum", "<u4"))}
    assert idx == {"rows": [len(rows)], "offset": [0], "length": [len(data)],
                   "checksum": [crc32c.crc32c(data)]}
    group = msgpack.unpackb(data, raw=False)
    _, body3 = _manifest(3, name)
    for k, v in group.items():  # the version-3 columns, names and dtypes left in the manifest
        assert v == body3["tensors"][k], k
    assert body["tree"] == body3["tree"]


def test_writer_still_produces_the_golden_v4_bytes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_golden", ROOT / "make_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--out", str(tmp_path), "--version", "4"]) == 0
    for name in NAMES:
        for f in _dir(4, name).iterdir():
            got = tmp_path / "v4" / name / f.name
            assert got.read_bytes() == f.read_bytes(), f"v4/{name}/{f.name} drifted"


def test_a_reader_of_versions_1_to_3_refuses_v4(monkeypatch):
    from ckptcore import _manifest

    monkeypatch.setattr(_manifest, "READ_VERSIONS", (1, 2, 3))
    with pytest.raises(ckptcore.errors.UnsupportedCheckpointError, match="version 4"):
        ckptcore.load_state(_dir(4, "full"))
