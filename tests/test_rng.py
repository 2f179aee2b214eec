"""RNG capture/restore: exact continuation, msgpack-able values, validation before any change."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest

from ckptcore.errors import RestoreError, SchemaError
from ckptcore.rng import capture_rng, restore_rng

BIT_GENERATORS = [np.random.PCG64, np.random.PCG64DXSM, np.random.Philox, np.random.MT19937,
                  np.random.SFC64]


@pytest.fixture(autouse=True)
def _keep_global_rngs():
    py, npy = random.getstate(), np.random.get_state()
    yield
    random.setstate(py)
    np.random.set_state(npy)


def _ext(obj):
    # Stands in for the codec: arrays become tensors, anything else msgpack can't hold is a bug.
    if isinstance(obj, np.ndarray):
        return {"__nd__": [obj.dtype.str, list(obj.shape), obj.tobytes()]}
    raise TypeError(f"not msgpack-able: {type(obj).__name__} {obj!r}")


def _unext(d):
    if "__nd__" in d:
        dtype, shape, data = d["__nd__"]
        return np.frombuffer(data, dtype=dtype).reshape(shape).copy()
    return d


def _through_msgpack(tree):
    return msgpack.unpackb(msgpack.packb(tree, default=_ext), object_hook=_unext)


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree


def _assert_plain(tree):
    for leaf in _leaves(tree):
        if isinstance(leaf, np.ndarray):
            continue
        assert type(leaf) in (int, float, str, bool, type(None)), (type(leaf), leaf)
        if type(leaf) is int:
            assert -(2**63) <= leaf < 2**63
        msgpack.packb(leaf)


def _draws(gen):
    return (gen.random(5).tobytes(), gen.integers(0, 2**64 - 1, 3, dtype=np.uint64).tobytes(),
            gen.integers(0, 2**32 - 1, 3, dtype=np.uint32).tobytes(),
            gen.standard_normal(4).tobytes())


@pytest.mark.parametrize("bitgen", BIT_GENERATORS, ids=lambda b: b.__name__)
def test_generator_round_trip(bitgen):
    gen = np.random.Generator(bitgen(2024))
    gen.integers(0, 2**32 - 1, 1, dtype=np.uint32)  # leaves half a 64-bit word buffered
    saved = capture_rng(python=False, numpy=False, generators={"g": gen})
    _assert_plain(saved)
    want = _draws(gen)
    restored = _through_msgpack(saved)
    restore_rng(restored, generators={"g": gen})
    assert _draws(gen) == want
    fresh = np.random.Generator(bitgen(7))  # a different object of the same kind
    restore_rng(restored, generators={"g": fresh})
    assert _draws(fresh) == want


def test_pcg64_big_ints_become_decimal_strings():
    gen = np.random.Generator(np.random.PCG64(1))
    saved = capture_rng(python=False, numpy=False, generators={"g": gen})
    state = saved["numpy_generators"]["g"]["state"]
    assert isinstance(state["state"], str) and int(state["state"]) == gen.bit_generator.state[
        "state"]["state"]
    with pytest.raises(OverflowError):  # why the encoding exists
        msgpack.packb(gen.bit_generator.state["state"]["state"])


def test_python_random_round_trip():
    random.seed(99)
    random.gauss(0, 1)  # caches a second normal in gauss_next
    saved = capture_rng(numpy=False)
    assert set(saved) == {"python"}
    assert saved["python"]["gauss_next"] is not None
    _assert_plain(saved)
    want = [random.gauss(0, 1), random.random(), random.getrandbits(200)]
    restore_rng(_through_msgpack(saved))
    assert [random.gauss(0, 1), random.random(), random.getrandbits(200)] == want


def test_numpy_global_round_trip():
    np.random.seed(5)
    np.random.standard_normal()  # legacy gauss caches one value
    saved = capture_rng(python=False)
    assert saved["numpy"]["has_gauss"] == 1
    _assert_plain(saved)
    want = (np.random.standard_normal(3).tobytes(), np.random.permutation(50).tobytes(),
            np.random.randint(0, 2**31, 4).tobytes())
    restore_rng(_through_msgpack(saved))
    assert (np.random.standard_normal(3).tobytes(), np.random.permutation(50).tobytes(),
            np.random.randint(0, 2**31, 4).tobytes()) == want


def test_capture_everything_is_plain_and_detached():
    gens = {b.__name__: np.random.Generator(b(3)) for b in BIT_GENERATORS}
    saved = capture_rng(generators=gens)
    assert set(saved) == {"python", "numpy", "numpy_generators"}
    assert set(saved["numpy_generators"]) == set(gens)
    _assert_plain(saved)
    msgpack.packb(saved, default=_ext)
    key = saved["numpy_generators"]["MT19937"]["state"]["key"].copy()
    gens["MT19937"].random(10_000)  # regenerates the live key array
    assert np.array_equal(saved["numpy_generators"]["MT19937"]["state"]["key"], key)


def test_everything_at_once():
    random.seed(3)
    np.random.seed(3)
    gens = {b.__name__: np.random.Generator(b(11)) for b in BIT_GENERATORS}
    saved = _through_msgpack(capture_rng(generators=gens))

    def draws():
        return ([random.random() for _ in range(3)], np.random.random(3).tobytes(),
                {name: _draws(g) for name, g in gens.items()})

    want = draws()
    restore_rng(saved, generators=gens)
    assert draws() == want


def test_unnamed_generators_are_left_alone():
    a, b = np.random.default_rng(1), np.random.default_rng(2)
    saved = capture_rng(python=False, numpy=False, generators={"a": a, "b": b})
    before = b.bit_generator.state
    a.random(3)
    b.random(3)
    after = b.bit_generator.state
    restore_rng(saved, generators={"a": a})
    assert b.bit_generator.state == after != before


def test_bad_entries_name_the_key_and_change_nothing():
    random.seed(1)
    np.random.seed(1)
    saved = capture_rng()
    random.random()
    py_now = random.getstate()
    broken = {**saved, "numpy": {**saved["numpy"], "state": {"key": "abc", "pos": 0}}}
    with pytest.raises(SchemaError, match=r"\['numpy'\]"):
        restore_rng(broken)
    assert random.getstate() == py_now  # the valid "python" entry was not applied either


@pytest.mark.parametrize("rng,match", [
    ([1, 2], "mapping"),
    ({"python": {"version": 3}}, "python"),
    ({"python": {"version": 3, "state": np.zeros(10, np.uint32), "gauss_next": None}}, "python"),
    ({"python": {"version": 3, "state": np.zeros(625, np.uint32), "gauss_next": "x"}},
     "gauss_next"),
    ({"python": {"version": 99, "state": np.zeros(625, np.uint32), "gauss_next": None}}, "python"),
    ({"numpy": {"state": {}}}, "numpy"),
    ({"numpy": {"bit_generator": "MT19937", "state": {"key": [1, 2], "pos": 0}}}, "numpy"),
])
def test_malformed_states(rng, match):
    with pytest.raises(SchemaError, match=match):
        restore_rng(rng)


def test_generator_errors():
    gen = np.random.default_rng(0)
    saved = capture_rng(python=False, numpy=False, generators={"g": gen})
    with pytest.raises(SchemaError, match="'other'"):
        restore_rng(saved, generators={"other": gen})
    with pytest.raises(RestoreError, match="PCG64"):
        restore_rng(saved, generators={"g": np.random.Generator(np.random.Philox(0))})
    with pytest.raises(TypeError):
        capture_rng(generators={"g": random.Random()})
    with pytest.raises(TypeError):
        restore_rng(saved, generators={"g": 3})
    bad = {"numpy_generators": {"g": {**saved["numpy_generators"]["g"],
                                      "state": {"state": "12x", "inc": "1"}}}}
    with pytest.raises(SchemaError, match="12x"):
        restore_rng(bad, generators={"g": gen})


def test_bit_generator_objects_are_accepted():
    bitgen = np.random.SFC64(8)
    saved = capture_rng(python=False, numpy=False, generators={"s": bitgen})
    want = bitgen.random_raw(5).tobytes()
    restore_rng(saved, generators={"s": bitgen})
    assert bitgen.random_raw(5).tobytes() == want
