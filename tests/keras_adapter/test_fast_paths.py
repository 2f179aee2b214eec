"""The capture and restore fast paths: the ParamInfo cache follows the model's variables, bare
variable ops read snapshots and write copies, and every other variable keeps its own methods."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import ckptcore  # noqa: E402
import ckptcore_keras  # noqa: E402
from _keras_helpers import assert_same_bits, batches, functional_sgd, snapshot  # noqa: E402
from ckptcore_keras import _params, _tensors  # noqa: E402


def _trained(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = functional_sgd()
    for x, y in batches("reg5", 2, seed):
        model.train_on_batch(x, y)
    return model


def _uncached(model) -> dict:
    named = _tensors.named_tensors(model)
    return _params.describe_params(model, {id(v): n for n, v in named})


# --- the ParamInfo cache ------------------------------------------------------------------

def test_cached_params_equal_fresh_ones_and_are_new_objects():
    model = _trained()
    first = ckptcore_keras.capture(model).params
    second = ckptcore_keras.capture(model).params
    assert first == second == _uncached(model)
    assert any("inputs" in p.attrs for p in first.values())  # the structure record is kept
    name = next(n for n, p in first.items() if "inputs" in p.attrs)
    assert first[name] is not second[name] and first[name].attrs is not second[name].attrs
    first[name].attrs["inputs"].append("changed by the caller")
    first[name].attrs["order"] = -5
    assert ckptcore_keras.capture(model).params[name] == second[name]


def test_cache_follows_a_model_that_gains_and_loses_layers():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    before = ckptcore_keras.capture(model, rng=False)
    model.add(keras.layers.Dense(2, name="added"))
    grown = ckptcore_keras.capture(model, rng=False)
    base = model.name  # "sequential", or "sequential_<n>" after other tests built some
    assert set(grown.model) - set(before.model) == {f"{base}/added/kernel", f"{base}/added/bias"}
    assert grown.params[f"{base}/added/kernel"].index == 1
    assert grown.params == _uncached(model)
    model.pop()
    shrunk = ckptcore_keras.capture(model, rng=False)
    assert set(shrunk.model) == set(before.model) and shrunk.params == before.params


def test_cache_follows_a_raw_variable_added_or_replaced_after_a_capture():
    model = _trained()
    ckptcore_keras.capture(model, rng=False)
    model.counter = tf.Variable(5, dtype=tf.int64, trainable=False)
    state = ckptcore_keras.capture(model, rng=False)
    name = f"{model.name}/counter"
    assert int(state.model[name]) == 5 and state.params[name].kind == "custom"
    assert state.params == _uncached(model)
    model.counter = tf.Variable(np.zeros(3, "float32"), trainable=False)  # same name, new object
    state = ckptcore_keras.capture(model, rng=False)
    assert state.model[name].shape == (3,) and state.params[name].role == "counter"


def test_cache_follows_a_rebuilt_model_and_does_not_keep_it_alive():
    model = _trained()
    ckptcore_keras.capture(model, rng=False)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None, "the ParamInfo cache keeps a model alive"
    rebuilt = _trained(1)
    assert ckptcore_keras.capture(rebuilt, rng=False).params == _uncached(rebuilt)


def test_optimizer_built_after_the_first_capture():
    keras.utils.set_random_seed(0)
    model = functional_sgd()
    opt = model.optimizer
    first = ckptcore_keras.capture(model, rng=False)    # builds the optimizer: zero momentums
    assert all(not np.any(s) for slots in first.optimizer.slots.values() for s in slots.values())
    for x, y in batches("reg5", 2, 0):
        model.train_on_batch(x, y)
    second = ckptcore_keras.capture(model, rng=False)
    assert second.optimizer.step == 2
    live = {v.path: v.numpy() for v in opt.variables}
    for param, slots in second.optimizer.slots.items():
        for slot, value in slots.items():
            key = next(k for k in live if k.endswith(param.replace("/", "_") + "_" + slot))
            np.testing.assert_array_equal(value, live[key])
    assert any(np.any(s) for slots in second.optimizer.slots.values() for s in slots.values())


# --- reads are snapshots, writes are copies ------------------------------------------------

def test_captured_arrays_are_read_only_snapshots():
    model = _trained()
    state = ckptcore_keras.capture(model, rng=False)
    kept = {n: np.array(a) for n, a in state.model.items()}
    assert all(not a.flags.writeable for a in state.model.values())
    for x, y in batches("reg5", 2, 5):
        model.train_on_batch(x, y)
    assert all(np.array_equal(state.model[n], kept[n]) for n in kept)
    assert any(not np.array_equal(state.model[n], v.numpy())
               for n, v in _tensors.named_tensors(model) if n.endswith("kernel"))


def test_restore_copies_values_never_aliases_the_state():
    source, target = _trained(0), _trained(1)
    state = ckptcore_keras.capture(source, rng=False)
    # Writable, 64-byte-aligned arrays: the ones a conversion could alias.
    for section in (state.model, *state.optimizer.slots.values()):
        for k, a in list(section.items()):
            buf = np.empty(a.nbytes + 64, np.uint8)
            off = (-buf.ctypes.data) % 64
            aligned = buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
            aligned[...] = a
            section[k] = aligned
    expected = snapshot(source)
    ckptcore_keras.restore(state, target)
    for section in (state.model, *state.optimizer.slots.values()):
        for a in section.values():
            a[...] = 7
    assert_same_bits(expected, snapshot(target))
    for x, y in batches("reg5", 1, 3):  # updates in place must not reach the state's memory
        target.train_on_batch(x, y)
    assert all(np.all(a == 7) for a in state.model.values())


def test_restore_from_mapped_files_then_train(tmp_path):
    source, target = _trained(0), _trained(1)
    ckptcore.save_state(tmp_path / "c", model=source)
    ckptcore.load_state(tmp_path / "c", model=target)
    assert_same_bits(snapshot(source), snapshot(target))
    for x, y in batches("reg5", 2, 4):  # the variables own their memory: training writes it
        target.train_on_batch(x, y)
        source.train_on_batch(x, y)
    assert_same_bits(snapshot(source), snapshot(target))


def test_assign_falls_back_to_the_variable_for_other_dtypes_and_scopes():
    var = keras.Variable(np.zeros(3, "float32"))
    _tensors.assign(var, np.arange(3, dtype="float64"))  # keras casts, as before
    np.testing.assert_array_equal(var.numpy(), [0, 1, 2])
    from keras.src.backend.common.stateless_scope import StatelessScope

    with StatelessScope() as scope:
        _tensors.assign(var, np.full(3, 9, "float32"))
    np.testing.assert_array_equal(var.numpy(), [0, 1, 2])  # the scope took it, not the variable
    np.testing.assert_array_equal(scope.get_current_value(var), [9, 9, 9])
    with pytest.raises(ValueError):
        _tensors.assign(var, np.zeros(4, "float32"))  # never silently reshapes a variable


def test_mirrored_variables_keep_their_own_read_and_assign():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        var = tf.Variable(np.arange(4, dtype="float32"))
    assert _tensors._plain_tf_variable(var) is None
    np.testing.assert_array_equal(_tensors.to_numpy(var), np.arange(4))
    _tensors.assign(var, np.ones(4, "float32"))
    np.testing.assert_array_equal(var.numpy(), np.ones(4))
