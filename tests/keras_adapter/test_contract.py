"""The adapter contract as the Keras adapter keeps it: ``rng=False``, ``copy``, unknown objects,
and the names and wording of a :class:`ckptcore.RestoreReport`."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import ckptcore  # noqa: E402
import ckptcore_keras  # noqa: E402
from _keras_helpers import (accum4, assert_same_bits, batches, draw_all, same_bits,  # noqa: E402
                            seed_everything, seq_bn_dropout, snapshot)
from ckptcore.errors import RestoreError, UnappliedStateWarning  # noqa: E402


def _train(model, kind: str, n: int, seed: int = 7) -> None:
    for x, y in batches(kind, n, seed):
        model.train_on_batch(x, y)


def _trained(build=seq_bn_dropout, kind="image3", seed=3):
    seed_everything(seed)  # also creates TensorFlow's global generator, so states carry it
    model = build()
    _train(model, kind, 3)
    return model


def _dense(name: str, *widths: int, optimizer: bool = True) -> keras.Model:
    model = keras.Sequential([keras.Input((5,))] + [keras.layers.Dense(w, name=n)
                                                     for n, w in zip("abc", widths)], name=name)
    if optimizer:
        model.compile(keras.optimizers.Adam(0.01), "mse")
        model.optimizer.build(model.trainable_variables)
    return model


# --- rng=False -----------------------------------------------------------------------------

def _restore_and_draw(restore) -> list[np.ndarray]:
    """Put every global RNG in one known state, call ``restore()``, then draw from each."""
    seed_everything(99)
    keras.random.uniform((1,))  # creates Keras' global seed generator
    restore()
    return draw_all()


@pytest.mark.parametrize("how", ["restore", "load_state"])
def test_rng_false_leaves_every_rng_untouched(how, tmp_path):
    model = _trained()
    state = ckptcore_keras.capture(model)  # holds Python, NumPy, TensorFlow and Keras RNGs
    url = str(tmp_path / "ck")
    ckptcore.save_state(url, state)
    target = seq_bn_dropout()

    def restore(rng: bool):
        if how == "restore":
            return lambda: ckptcore_keras.restore(state, target, rng=rng)
        return lambda: ckptcore.load_state(url, model=target, rng=rng)

    untouched = _restore_and_draw(lambda: None)
    assert_same_bits(_restore_and_draw(restore(False)), untouched, "rng=False")
    assert_same_bits(snapshot(model), snapshot(target), "the model is restored all the same")
    restored = _restore_and_draw(restore(True))
    assert not any(same_bits(a, b) for a, b in zip(restored, untouched))  # rng=True does restore


def test_rng_false_capture_has_no_rng():
    model = _trained()
    assert ckptcore_keras.capture(model, rng=False).rng == {}
    assert set(ckptcore_keras.capture(model).rng) == {"python", "numpy", "tensorflow", "keras"}


# --- copy ----------------------------------------------------------------------------------

@pytest.mark.parametrize("copy", [True, False])
def test_capture_is_a_read_only_snapshot_with_or_without_copy(copy):
    model = _trained()
    state = ckptcore_keras.capture(model, copy=copy, rng=False)
    arrays = list(state.model.values()) + [a for s in state.optimizer.slots.values() for a in s.values()]
    kept = [np.array(a) for a in arrays]
    assert all(not a.flags.writeable for a in arrays)
    with pytest.raises(ValueError):
        arrays[0][...] = 0
    _train(model, "image3", 2, seed=11)  # writes new buffers into every trainable variable
    assert_same_bits(arrays, kept, f"copy={copy}: training changed a captured array")
    assert not same_bits(state.model[model.layers[0].kernel.path], model.layers[0].kernel.numpy())


def test_capture_views_is_false_and_async_save_keeps_the_snapshot(tmp_path):
    """No capture returns live views, so the core does not copy before an async save."""
    assert ckptcore_keras.ADAPTER.capture_views is False
    model = _trained()
    expected = snapshot(model)
    with ckptcore.CheckpointManager(str(tmp_path / "run"), async_save=True) as mgr:
        mgr.save(3, model=model)
        _train(model, "image3", 2, seed=11)  # while the save may still be writing
    fresh = seq_bn_dropout()
    ckptcore.load_state(str(tmp_path / "run" / "step-000000000003"), model=fresh)
    assert_same_bits(snapshot(fresh), expected)


# --- unknown objects -----------------------------------------------------------------------

def test_unknown_objects_are_a_type_error_naming_them(tmp_path):
    model = _trained()
    state = ckptcore_keras.capture(model, rng=False)
    with pytest.raises(TypeError, match="scheduler"):
        ckptcore_keras.capture(model, scheduler=object())
    with pytest.raises(TypeError, match=r"\['scaler', 'zz'\]"):
        ckptcore_keras.restore(state, model, scaler=object(), zz=1)
    with pytest.raises(TypeError, match="grad_scaler"):
        ckptcore_keras.ADAPTER.capture(model=model, grad_scaler=object())
    with pytest.raises(TypeError, match="scheduler"):
        ckptcore.save_state(str(tmp_path / "ck"), model=model, scheduler=object())
    assert not (tmp_path / "ck").exists()
    with pytest.raises(TypeError, match="needs a Keras model, got builtins.dict"):
        ckptcore_keras.capture({"w": np.zeros(2)})
    with pytest.raises(TypeError, match="needs a Keras model"):
        ckptcore_keras.restore(state, [model])


# --- RestoreReport names -------------------------------------------------------------------

def test_report_names_model_optimizer_slots_and_sections():
    small, big = _dense("net", 3, 1), _dense("net", 3, 2, 1)  # net/a, net/b | net/a, net/b, net/c
    state = ckptcore_keras.capture(small, rng=False)
    slots = ("momentum", "velocity")
    # small's net/b (3 -> 1) does not fit big's net/b (3 -> 2): compare the parts that can fit.
    del state.model["net/b/kernel"], state.model["net/b/bias"]
    state.extra["keras"]["variables"] = ["net/a/kernel", "net/a/bias"]
    del state.optimizer.slots["net/b/kernel"], state.optimizer.slots["net/b/bias"]
    report = ckptcore_keras.restore(state, big, strict=False)
    target = ["net/b/kernel", "net/b/bias", "net/c/kernel", "net/c/bias"]
    assert report.unexpected == ()
    assert report.missing == tuple(target) + tuple(f"optimizer/{p}/{s}" for p in target for s in slots)
    assert same_bits(big.layers[0].kernel.numpy(), small.layers[0].kernel.numpy())

    back = ckptcore_keras.capture(big, rng=False)
    report = ckptcore_keras.restore(back, _dense("net", 3, 2, optimizer=True), strict=False)
    assert report.unexpected == ("net/c/kernel", "net/c/bias",
                                 "optimizer/net/c/kernel/momentum", "optimizer/net/c/kernel/velocity",
                                 "optimizer/net/c/bias/momentum", "optimizer/net/c/bias/velocity")
    with pytest.raises(RestoreError, match="the checkpoint does not fit the target: in the checkpoint "
                                           r"but not in the target: net/c/kernel, .*strict=False"):
        ckptcore_keras.restore(back, _dense("net", 3, 2))


def test_report_names_optimizer_data_schedule_accumulation():
    cursor = ckptcore.DataCursor(15, 4, seed=0)
    bare = _dense("net", 1, optimizer=False)
    with_opt = _dense("net", 1)
    with pytest.warns(UnappliedStateWarning, match="holds no optimizer slots"):
        report = ckptcore_keras.restore(ckptcore_keras.capture(bare, rng=False), with_opt,
                                        cursor=cursor, strict=False)
    assert report.missing == ("optimizer", "data")
    with pytest.warns(UnappliedStateWarning, match=r"unapplied: optimizer \(pass optimizer="):
        report = ckptcore_keras.restore(ckptcore_keras.capture(with_opt, rng=False), bare,
                                        strict=False)
    assert report.unexpected == ("optimizer",)

    scheduled = _trained()  # Adam with ExponentialDecay
    constant = seq_bn_dropout()
    constant.compile(keras.optimizers.Adam(0.01), "mse")
    with pytest.warns(UnappliedStateWarning, match="schedule .give the optimizer the saved "
                                                   "ExponentialDecay"):
        report = ckptcore_keras.restore(ckptcore_keras.capture(scheduled, rng=False), constant,
                                        strict=False)
    assert report.unexpected == ("schedule",) and report.missing == ()
    # No schedule target is the caller's choice, not a mismatch: warned, never raised.
    with pytest.warns(UnappliedStateWarning, match="schedule"):
        assert ckptcore_keras.restore(ckptcore_keras.capture(scheduled, rng=False), constant).ok

    accumulating = _trained(accum4, "reg5")
    state = ckptcore_keras.capture(accumulating, rng=False)
    name = accumulating.layers[0].kernel.path
    state.accumulation.buffers["elsewhere/kernel"] = state.accumulation.buffers.pop(name)
    fresh = accum4()  # auto-named differently: missing names are the target's
    report = ckptcore_keras.restore(state, fresh, strict=False)
    assert report.missing == (f"accumulation/{fresh.layers[0].kernel.path}",)
    assert report.unexpected == ("accumulation/elsewhere/kernel",)
