"""Round trips: every dtype, layout and section comes back bit for bit, on every backend."""

from __future__ import annotations

import uuid

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptcore
from ckptcore import (AccumulationState, OptimizerState, ParamInfo, ScheduleState, TrainingState,
                      _codec, _knobs)

from _support import assert_array_same, assert_state_same, sample_state

# ------------------------------------------------------------------------------------ dtypes
NUMERIC = ("bool int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 float32 float64 "
           "longdouble complex64 complex128 clongdouble").split()
_UNITS = "Y M W D h m s ms us ns ps fs as".split()
TIME = ([f"{k}64[{u}]" for k in ("datetime", "timedelta") for u in _UNITS]
        + ["datetime64", "timedelta64", "datetime64[10ns]", "timedelta64[25s]"])
SIZED = ["U1", "U7", "S1", "S5", "V1", "V3", "V16", "V0"]
ML_NAMES = ("bfloat16 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz float8_e4m3b11fnuz "
            "float8_e3m4 float8_e4m3 float8_e8m0fnu float6_e2m3fn float6_e3m2fn float4_e2m1fn "
            "int2 int4 uint2 uint4").split()
ML = [n for n in ML_NAMES if hasattr(ml_dtypes, n)]
ALL_DTYPES = [np.dtype(n) for n in NUMERIC + TIME + SIZED] + [np.dtype(getattr(ml_dtypes, n)) for n in ML]


def test_dtype_list_covers_the_codec():
    """Every dtype the codec knows is exercised here (guards against adding one untested)."""
    tested = {_codec.dtype_name(d) for d in ALL_DTYPES}
    known_here = set(_codec._PLAIN) | {n for n in _codec._ML if hasattr(ml_dtypes, n)}
    assert known_here <= tested, sorted(known_here - tested)
    assert {"bfloat16", "float8_e4m3fn", "float8_e5m2"} <= tested


def random_array(dtype: np.dtype, shape: tuple[int, ...], seed: int, *, big_endian: bool = False,
                 layout: str = "c") -> np.ndarray:
    """Arbitrary bit patterns (NaNs, NaT, invalid code points included) in the requested layout."""
    dtype = np.dtype(dtype)
    if big_endian and dtype.byteorder not in "|" and dtype.itemsize > 1:
        dtype = dtype.newbyteorder(">")
    full = shape
    if layout == "step" and shape:
        full = (shape[0] * 2,) + shape[1:]
    elif layout == "bcast":
        full = shape[1:] if shape else ()
    n = int(np.prod(full)) * dtype.itemsize
    if dtype.itemsize == 0:  # frombuffer refuses zero-width items
        base = np.zeros(full, dtype)
    else:
        base = np.frombuffer(np.random.default_rng(seed).bytes(n), dtype=dtype).reshape(full)
    if layout == "step" and shape:
        return base[::2]
    if layout == "rev" and shape:
        return base[::-1]
    if layout == "T":
        return np.ascontiguousarray(base.T).T if base.ndim >= 2 else base
    if layout == "fortran":
        return np.asfortranarray(base)
    if layout == "bcast":
        return np.broadcast_to(base, shape)
    return base.copy()


LAYOUTS = ["c", "step", "rev", "T", "fortran", "bcast"]


def test_random_array_layouts_are_what_they_claim():
    a = random_array("float32", (3, 4), 0, layout="rev")
    assert a.strides[0] < 0
    assert not random_array("float32", (3, 4), 0, layout="T").flags.c_contiguous
    assert random_array("float32", (3, 4), 0, layout="bcast").strides[0] == 0
    assert random_array(">f8", (2,), 0, big_endian=True).dtype.byteorder == ">"


def test_every_dtype_and_layout(backend):
    """One checkpoint holding each dtype as: C, big-endian, 0-d, empty, and each non-contiguous layout."""
    model, want = {}, {}
    for i, dt in enumerate(ALL_DTYPES):
        name = _codec.dtype_name(dt)
        variants = {
            "c": random_array(dt, (3, 5), i),
            "be": random_array(dt, (4, 3), i + 1000, big_endian=True),
            "0d": random_array(dt, (), i + 2000),
            "empty": random_array(dt, (0, 3), i),
            "empty2": random_array(dt, (2, 0), i),
        }
        for j, layout in enumerate(LAYOUTS[1:]):
            variants[layout] = random_array(dt, (3, 4), i + 3000 + j, big_endian=j % 2 == 1, layout=layout)
        for v, arr in variants.items():
            model[f"{name}/{v}"] = arr
            want[f"{name}/{v}"] = arr
    url = backend.url("all-dtypes")
    with _knobs.override(shard_size=4096):
        info = ckptcore.save_state(url, TrainingState(model=model), storage_options=backend.storage_options)
    assert len(info.shards) > 3
    got = ckptcore.load_state(url, storage_options=backend.storage_options)
    assert list(got.model) == list(want)
    for k, arr in want.items():
        assert_array_same(got.model[k], arr, k)
    assert ckptcore.verify(url, storage_options=backend.storage_options) == []


@pytest.mark.parametrize("shard_size", [1, 64, 1000, 1 << 27])
def test_sample_state_all_sections(backend, shard_size):
    state = sample_state(7)
    url = backend.url(f"s{shard_size}")
    with _knobs.override(shard_size=shard_size):
        info = ckptcore.save_state(url, state, storage_options=backend.storage_options)
    n_tensors = len(info.tensors)
    assert len(info.shards) == (n_tensors if shard_size <= 64 else 1 if shard_size > 1e6 else len(info.shards))
    got = ckptcore.load_state(url, storage_options=backend.storage_options)
    assert_state_same(got, state)
    assert set(info.sections) >= {"model", "optimizer", "schedule", "rng", "data", "accumulation",
                                  "metadata", "extra", "params", "framework"}


def test_loaded_arrays_are_writable_and_independent(local_backend):
    state = TrainingState(model={"w": np.arange(6.0)})
    url = local_backend.url("w")
    ckptcore.save_state(url, state)
    a = ckptcore.load_state(url).model["w"]
    a[:] = -1  # private pages: never reaches the file
    assert_array_same(ckptcore.load_state(url).model["w"], np.arange(6.0))


def test_tensor_name_collisions_keep_both_values(memory_backend):
    """"a/b" as a key and as a nested path name the same tensor path; both must survive."""
    x, y = np.arange(3), np.arange(4)
    state = TrainingState(model={"a/b": x}, extra={"a/b": x + 1, "a": {"b": y, "b#1": y + 1}})
    got = ckptcore.load_state(ckptcore.save_state(memory_backend.url("c"), state).url)
    assert_state_same(got, state)


@pytest.mark.parametrize("section", ["model", "optimizer", "schedule", "rng", "data",
                                     "accumulation", "extra", "metadata"])
def test_partial_load_returns_only_that_section(backend, section):
    state = sample_state(3)
    url = backend.url("p")
    with _knobs.override(shard_size=256):
        ckptcore.save_state(url, state, storage_options=backend.storage_options)
    got = ckptcore.load_state(url, keys=[section], storage_options=backend.storage_options)
    assert_state_same(got, state, sections=(section, "step", "epoch", "framework", "metadata", "params"))
    empty = TrainingState()
    for other in ("model", "optimizer", "schedule", "rng", "data", "accumulation", "extra"):
        if other != section:
            assert_state_same(got, empty, sections=(other,))
    # A bare string means the same as a one-element list.
    assert_state_same(ckptcore.load_state(url, keys=section, storage_options=backend.storage_options),
                      got)


@pytest.mark.parametrize("keys, state", [
    (["model"], TrainingState(model={"e": np.zeros(0, np.float32)}, extra={"x": np.ones(4)})),
    (["extra"], TrainingState(model={"w": np.ones(8)}, extra={"e": np.zeros((2, 0))})),
], ids=["empty-at-start", "empty-at-end-of-shard"])
def test_partial_load_of_only_empty_tensors(request, backend, keys, state):
    """An empty tensor needs no bytes; asking a shard for none must not fail."""
    url = backend.url("e")
    ckptcore.save_state(url, state, storage_options=backend.storage_options)
    got = ckptcore.load_state(url, keys=keys, storage_options=backend.storage_options)
    assert_state_same(got, state, sections=keys)


def test_partial_load_rejects_unknown_sections(memory_backend):
    url = ckptcore.save_state(memory_backend.url("k"), sample_state()).url
    with pytest.raises(ValueError, match="nope"):
        ckptcore.load_state(url, keys=["model", "nope"])


def test_model_only_load_reads_only_model_bytes(backend):
    """Damage every non-model tensor (local: flip its bytes; also remove its shard): keys=["model"] loads."""
    state = sample_state(5)
    url = backend.url("m")
    with _knobs.override(shard_size=64):  # one tensor per shard
        info = ckptcore.save_state(url, state, storage_options=backend.storage_options)
    manifest_tensors = {t.name: t for t in info.tensors}
    model_shards = {t.shard for t in info.tensors if t.name.startswith("model/")}
    for t in info.tensors:
        if t.name.startswith("optimizer/") and t.nbytes:
            raw = bytearray(backend.read("m", t.shard))
            raw[0] ^= 0xFF
            backend.write(bytes(raw), "m", t.shard)
    with pytest.raises(ckptcore.CorruptCheckpointError) as e:
        ckptcore.load_state(url, storage_options=backend.storage_options)
    assert e.value.tensor.startswith("optimizer/")
    got = ckptcore.load_state(url, keys=["model"], storage_options=backend.storage_options)
    assert_state_same(got, state, sections=("model",))
    # Stronger: without any of the other shards at all.
    for t in manifest_tensors.values():
        if t.shard not in model_shards:
            backend.delete("m", t.shard)
    got = ckptcore.load_state(url, keys=["model"], storage_options=backend.storage_options)
    assert_state_same(got, state, sections=("model",))
    with pytest.raises(ckptcore.IncompleteCheckpointError):
        ckptcore.load_state(url, storage_options=backend.storage_options)


def test_model_only_load_within_one_shard(local_backend):
    """Everything in one shard: flipping an optimizer tensor's bytes does not disturb a model load."""
    state = sample_state(2)
    url = local_backend.url("one")
    info = ckptcore.save_state(url, state)
    assert len(info.shards) == 1
    slot = next(t for t in info.tensors if t.name.startswith("optimizer/slots/"))
    offset = _offset_of(url, slot.name)
    raw = bytearray(local_backend.read("one", slot.shard))
    raw[offset + 1] ^= 0x01
    local_backend.write(bytes(raw), "one", slot.shard)
    assert_state_same(ckptcore.load_state(url, keys=["model"]), state, sections=("model",))
    with pytest.raises(ckptcore.CorruptCheckpointError, match="optimizer/slots"):
        ckptcore.load_state(url)


def _offset_of(url: str, tensor: str) -> int:
    from ckptcore._manifest import Manifest
    with open(f"{url}/manifest.msgpack", "rb") as f:
        m = Manifest.from_bytes(f.read())
    return next(t.offset for t in m.tensors if t.name == tensor)


# ------------------------------------------------------------------------------- hypothesis
EDGE_INTS = [0, 1, -1, 2**31 - 1, -2**31, 2**32, 2**53 + 1, 2**63 - 1, -2**63, 2**63, 2**64 - 1]
ints64 = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-2**63, 2**64 - 1))
_no_trailing_nul = st.binary(max_size=6).filter(lambda b: not b.endswith(b"\x00"))
_text = st.text(max_size=6)
numpy_scalars = st.one_of(
    st.builds(np.float32, st.floats(width=32)),
    st.builds(np.float64, st.floats()),
    st.builds(np.float16, st.floats(width=16)),
    st.builds(np.int64, st.integers(-2**63, 2**63 - 1)),
    st.builds(np.uint64, st.integers(0, 2**64 - 1)),
    st.builds(np.int8, st.integers(-128, 127)),
    st.builds(np.bool_, st.booleans()),
    st.builds(np.complex128, st.complex_numbers()),
    st.builds(np.str_, _text.filter(lambda s: not s.endswith("\x00"))),
    st.builds(np.bytes_, _no_trailing_nul),
    st.builds(lambda v: np.datetime64(v, "ns"), st.integers(-2**62, 2**62)),
    st.builds(lambda v: ml_dtypes.bfloat16(v), st.floats(width=32)),
)
leaves = st.one_of(st.none(), st.booleans(), ints64, st.floats(), _text, st.binary(max_size=8),
                   numpy_scalars)


@st.composite
def arrays(draw, max_elems: int = 24, empty: bool = True):
    dtype = draw(st.sampled_from(ALL_DTYPES if empty else [d for d in ALL_DTYPES if d.itemsize]))
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0 if empty else 1, 4), min_size=ndim, max_size=ndim)))
    if int(np.prod(shape)) > max_elems:
        shape = shape[:1]
    layout = draw(st.sampled_from(LAYOUTS)) if shape else "c"
    return random_array(dtype, shape, draw(st.integers(0, 2**32 - 1)),
                        big_endian=draw(st.booleans()), layout=layout)


keys = st.one_of(_text, ints64)


def tree_strategy(empty: bool = True):
    return st.recursive(
        st.one_of(leaves, arrays(empty=empty)),
        lambda children: st.one_of(st.lists(children, max_size=4),
                                   st.lists(children, max_size=4).map(tuple),
                                   st.dictionaries(keys, children, max_size=4)),
        max_leaves=12)


trees = tree_strategy()
names = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=12)


@st.composite
def training_states(draw, empty: bool = True) -> TrainingState:
    """Random states; ``empty=False`` leaves out zero-byte tensors."""
    arrays_ = arrays(empty=empty)
    str_trees = st.dictionaries(keys, tree_strategy(empty), max_size=4)
    model = draw(st.dictionaries(names, arrays_, max_size=5))
    pnames = list(model)
    opt = draw(st.none() | st.builds(
        OptimizerState, kind=_text, step=ints64, hyperparams=str_trees,
        slots=st.fixed_dictionaries({n: st.dictionaries(_text, arrays_, max_size=2) for n in pnames}),
        extra=str_trees))
    sched = draw(st.none() | st.builds(ScheduleState, kind=_text, config=str_trees, step=ints64,
                                       last_lr=st.none() | st.floats(), state=str_trees))
    acc = draw(st.none() | st.builds(AccumulationState, every=ints64, count=ints64,
                                     buffers=st.dictionaries(names, arrays_, max_size=3)))
    params = draw(st.dictionaries(names, st.builds(
        ParamInfo, index=st.integers(0, 2**63 - 1), layer=_text, kind=_text, role=_text,
        layout=st.none() | _text, attrs=st.dictionaries(_text, ints64 | _text, max_size=2)), max_size=3))
    return TrainingState(
        model=model, optimizer=opt, schedule=sched, accumulation=acc, params=params,
        rng=draw(str_trees), data=draw(str_trees), extra=draw(str_trees),
        metadata=draw(st.dictionaries(_text, st.none() | st.booleans() | ints64 | _text, max_size=3)),
        step=draw(ints64), epoch=draw(ints64), framework=draw(st.none() | _text))


SECTIONS = ["model", "optimizer", "schedule", "accumulation", "params", "rng", "data", "metadata", "extra"]


EXAMPLES = {"local": 40, "memory": 40, "s3": 12, "gcs": 12, "azure": 12}  # ~10 ms per request


@pytest.mark.slow
def test_hypothesis_roundtrip(backend):
    opts = backend.storage_options

    @settings(max_examples=EXAMPLES[backend.name], deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(state=training_states(), shard_size=st.sampled_from([64, 300, 4096, 1 << 27]),
           keys=st.none() | st.lists(st.sampled_from(SECTIONS), min_size=1, max_size=3, unique=True))
    def roundtrip(state, shard_size, keys):
        url = backend.url(uuid.uuid4().hex)
        with _knobs.override(shard_size=shard_size):
            info = ckptcore.save_state(url, state, storage_options=opts)
        assert info.nbytes == sum(t.nbytes for t in info.tensors)
        assert_state_same(ckptcore.load_state(url, storage_options=opts), state)
        if keys is not None:
            got = ckptcore.load_state(url, keys=keys, storage_options=opts)
            assert_state_same(got, state, sections=keys + ["step", "epoch", "framework", "metadata", "params"])
            for other in set(SECTIONS) - set(keys) - {"metadata", "params"}:
                assert_state_same(got, TrainingState(), sections=(other,))
        assert ckptcore.verify(url, storage_options=opts) == []

    roundtrip()


@settings(max_examples=60, deadline=None)
@given(tree=trees)
def test_hypothesis_tree_roundtrip_in_extra(tree):
    url = f"memory://ckptcore-tree/{uuid.uuid4().hex}"
    state = TrainingState(extra={"t": tree})
    got = ckptcore.load_state(ckptcore.save_state(url, state).url)
    assert_state_same(got, state, sections=("extra",))
