"""capture/restore in one process: names, parameter descriptions, optimizer state, errors, RNG."""

from __future__ import annotations

import random

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import ckptcore_keras  # noqa: E402
from _keras_helpers import (accum4, assert_plain, assert_same_bits, batches, functional_sgd,  # noqa: E402
                            loss_scale, same_bits, accumulating_train_step, seq_bn_dropout, snapshot,
                            subclassed_rmsprop)
from ckptcore.errors import RestoreError, UnappliedStateWarning  # noqa: E402


def _train(model, kind: str, n: int, seed: int = 7) -> None:
    for x, y in batches(kind, n, seed):
        model.train_on_batch(x, y)


@pytest.fixture(scope="module")
def trained_seq():
    keras.utils.set_random_seed(3)
    model = seq_bn_dropout()
    _train(model, "image3", 3)
    return model


# --- what a state holds -------------------------------------------------------------------

def test_state_names_values_and_plain_types(trained_seq):
    model = trained_seq
    state = ckptcore_keras.capture(model)
    assert state.framework == "keras" and state.step == 3
    assert list(state.model) == [v.path for v in model.variables]
    for v in model.variables:
        assert same_bits(state.model[v.path], v.numpy()), v.path
    assert any(n.endswith("seed_generator_state") for n in state.model)
    assert state.metadata["versions"]["keras"] == keras.__version__
    assert set(state.rng) >= {"python", "numpy", "tensorflow", "keras"}
    assert_plain(state)


def test_optimizer_slots_keyed_by_parameter(trained_seq):
    model = trained_seq
    opt = ckptcore_keras.capture(model).optimizer
    assert opt.kind == "adam" and opt.step == 3
    trainable = [v.path for v in model.trainable_variables]
    assert list(opt.slots) == trainable
    for v in model.trainable_variables:
        prefix = model.optimizer.name + "/" + v.path.replace("/", "_")
        by_path = {w.path: w for w in model.optimizer.variables}
        for slot in ("momentum", "velocity"):
            assert same_bits(opt.slots[v.path][slot], by_path[f"{prefix}_{slot}"].numpy())
    assert opt.hyperparams["beta_1"] == 0.9 and isinstance(opt.hyperparams["learning_rate"], float)


def test_schedule_state(trained_seq):
    state = ckptcore_keras.capture(trained_seq)
    sched = state.schedule
    assert sched.kind == "ExponentialDecay" and sched.step == 3
    assert sched.config["decay_steps"] == 3 and sched.config["initial_learning_rate"] == 0.01
    expected = float(np.float32(0.01) * np.float32(0.5) ** np.float32(1.0))  # step 3 of 3
    assert sched.last_lr == pytest.approx(expected, rel=1e-6)
    assert state.optimizer.hyperparams["learning_rate"] == sched.last_lr


def test_param_infos_describe_layouts():
    keras.utils.set_random_seed(0)
    inp = keras.Input((6, 4))
    x = keras.layers.LSTM(3, return_sequences=True, name="lstm")(inp)
    x = keras.layers.GRU(2, return_sequences=True, name="gru")(x)
    x = keras.layers.Reshape((6, 2, 1))(x)
    x = keras.layers.Conv2D(2, 3, padding="same", name="conv")(x)
    x = keras.layers.DepthwiseConv2D(3, depth_multiplier=2, padding="same", name="dw")(x)
    x = keras.layers.Conv2DTranspose(2, 3, name="convt")(x)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dropout(0.1)(x)
    out = keras.layers.Dense(2, name="head")(x)
    model = keras.Model(inp, out)
    p = ckptcore_keras.capture(model, rng=False).params
    assert set(p) == {v.path for v in model.variables}
    assert (p["lstm/lstm_cell/kernel"].kind, p["lstm/lstm_cell/kernel"].layout) == ("lstm", "ifco")
    assert p["lstm/lstm_cell/recurrent_kernel"].role == "recurrent_kernel"
    gru = p["gru/gru_cell/bias"]
    assert (gru.kind, gru.layout, gru.attrs["reset_after"], gru.layer) == ("gru", "zrh", True, "gru")
    assert (p["conv/kernel"].kind, p["conv/kernel"].layout) == ("conv2d", "hwio")
    assert p["conv/kernel"].attrs["data_format"] == "channels_last"
    assert (p["dw/kernel"].kind, p["dw/kernel"].layout) == ("depthwise_conv2d", "hwim")
    assert (p["convt/kernel"].kind, p["convt/kernel"].layout) == ("conv2d_transpose", "hwoi")
    assert [p[f"bn/{r}"].role for r in ("gamma", "beta", "moving_mean", "moving_variance")] == \
        ["gamma", "beta", "moving_mean", "moving_variance"]
    assert p["bn/gamma"].kind == "batch_norm"
    head = p["head/kernel"]
    assert (head.kind, head.role, head.layout) == ("dense", "kernel", "io")
    assert head.attrs["input_shape"] == [8, 4, 2] and head.attrs["input_order"] == "channels_last"
    indices = [p[n].index for n in ("lstm/lstm_cell/kernel", "gru/gru_cell/kernel", "conv/kernel",
                                    "dw/kernel", "convt/kernel", "bn/gamma", "head/kernel")]
    assert indices == list(range(7))
    seeds = [i for n, i in p.items() if i.role == "seed_state"]
    assert seeds and all(i.index == -1 for i in seeds)


# --- restoring ----------------------------------------------------------------------------

@pytest.mark.parametrize("build,kind", [(seq_bn_dropout, "image3"), (functional_sgd, "reg5"),
                                        (subclassed_rmsprop, "tokens")],
                         ids=["sequential", "functional", "subclassed"])
def test_restore_into_second_copy_in_same_process(build, kind):
    keras.utils.set_random_seed(1)
    model = build()
    _train(model, kind, 3)
    state = ckptcore_keras.capture(model)
    keras.utils.set_random_seed(2)
    fresh = build()  # auto-named differently (dense_1...), optimizer not built yet
    assert not fresh.optimizer.built
    assert {v.path for v in fresh.variables} != {v.path for v in model.variables}
    report = ckptcore_keras.restore(state, fresh)
    assert report.ok
    assert_same_bits(snapshot(model), snapshot(fresh), build.__name__)
    _train(model, kind, 2, seed=9)
    _train(fresh, kind, 2, seed=9)
    assert_same_bits(snapshot(model), snapshot(fresh), build.__name__ + " after training")


def test_train_step_raw_tf_variables_are_captured():
    keras.utils.set_random_seed(1)
    model = accumulating_train_step()
    _train(model, "onehot16", 6)
    state = ckptcore_keras.capture(model)
    base = model.name
    assert int(state.model[f"{base}/n_acum_step"]) == 2
    acc = [state.model[f"{base}/gradient_accumulation/{i}"] for i in range(4)]
    assert all(same_bits(a, v.numpy()) for a, v in zip(acc, model.gradient_accumulation))
    assert np.any(acc[0] != 0)
    assert state.params[f"{base}/n_acum_step"].kind == "custom"
    fresh = accumulating_train_step()
    ckptcore_keras.restore(state, fresh)
    assert_same_bits(snapshot(model), snapshot(fresh))


def test_keras_gradient_accumulation_state():
    keras.utils.set_random_seed(1)
    model = accum4()
    _train(model, "reg5", 6)
    opt = model.optimizer
    state = ckptcore_keras.capture(model)
    assert int(opt._iterations.numpy()) == 6
    assert state.optimizer.step == 1 and state.step == 1
    acc = state.accumulation
    assert (acc.every, acc.count) == (4, 2)
    assert list(acc.buffers) == [v.path for v in model.trainable_variables]
    assert all("gradient_accumulator" not in s for d in state.optimizer.slots.values() for s in d)
    fresh = accum4()
    ckptcore_keras.restore(state, fresh)
    assert int(fresh.optimizer._iterations.numpy()) == 6
    assert_same_bits(snapshot(model), snapshot(fresh))
    # An optimizer that does not accumulate has nowhere to put the partial window: warned (the
    # update count alone is restored), never raised; other windows are a real mismatch.
    plain = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    with pytest.warns(UnappliedStateWarning, match=r"accumulation \(compile with an optimizer "
                                                   "of gradient_accumulation_steps=4"):
        ckptcore_keras.restore(state, plain, adam := keras.optimizers.Adam(0.01))
    assert int(adam._iterations.numpy()) == 1
    other = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    with pytest.raises(RestoreError, match="gradient_accumulation_steps"):
        ckptcore_keras.restore(state, other, keras.optimizers.Adam(0.01, gradient_accumulation_steps=2))


def test_loss_scale_optimizer_state():
    keras.utils.set_random_seed(1)
    model = loss_scale()
    _train(model, "reg5", 5)
    state = ckptcore_keras.capture(model)
    assert state.optimizer.kind == "adam" and state.optimizer.step == 5
    ls = state.optimizer.extra["loss_scale"]
    assert float(ls["variables"]["dynamic_scale"]) == 2.0 ** 10  # grown at steps 2 and 4
    assert int(ls["variables"]["step_counter"]) == 1
    assert ls["config"] == {"initial_scale": 256.0, "dynamic_growth_steps": 2}
    fresh = loss_scale()
    ckptcore_keras.restore(state, fresh)
    assert_same_bits(snapshot(model), snapshot(fresh))


def test_unbuilt_optimizer_is_built_and_explicit_optimizer_wins():
    keras.utils.set_random_seed(1)
    model = functional_sgd()
    _train(model, "reg5", 2)
    state = ckptcore_keras.capture(model)
    target = keras.models.clone_model(model)  # not compiled: no model.optimizer
    opt = keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True)
    ckptcore_keras.restore(state, target, opt)
    assert opt.built and int(opt.iterations.numpy()) == 2
    assert_same_bits(snapshot(model), snapshot(target, opt))


def test_strict_false_reports_and_strict_raises():
    keras.utils.set_random_seed(1)
    small = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, name="a")], name="net")
    big = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, name="a"),
                            keras.layers.Dense(2, name="b")], name="net")
    state = ckptcore_keras.capture(small, rng=False)
    with pytest.raises(RestoreError, match="net/b/kernel"):
        ckptcore_keras.restore(state, big)
    report = ckptcore_keras.restore(state, big, strict=False)
    assert report.missing == ("net/b/kernel", "net/b/bias") and report.unexpected == ()
    assert same_bits(big.layers[0].kernel.numpy(), small.layers[0].kernel.numpy())
    report = ckptcore_keras.restore(ckptcore_keras.capture(big, rng=False), small, strict=False)
    assert report.unexpected == ("net/b/kernel", "net/b/bias") and report.missing == ()


def test_shape_and_dtype_mismatch_raise_naming_the_variable():
    keras.utils.set_random_seed(1)
    a = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, name="d")], name="m")
    b = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, name="d")], name="m")
    state = ckptcore_keras.capture(a, rng=False)
    before = b.layers[0].bias.numpy()
    with pytest.raises(RestoreError, match=r"m/d/kernel.*\[5, 3\].*\[5, 4\]"):
        ckptcore_keras.restore(state, b, strict=False)
    assert same_bits(b.layers[0].bias.numpy(), before)  # nothing assigned on failure
    state.model["m/d/bias"] = state.model["m/d/bias"].astype("float64")
    with pytest.raises(RestoreError, match="m/d/bias.*float64"):
        ckptcore_keras.restore(state, a)


def test_optimizer_kind_mismatch():
    keras.utils.set_random_seed(1)
    model = functional_sgd()
    _train(model, "reg5", 1)
    state = ckptcore_keras.capture(model, rng=False)
    other = keras.models.clone_model(model)
    with pytest.raises(RestoreError, match="'sgd'.*'adam'"):
        ckptcore_keras.restore(state, other, keras.optimizers.Adam())
    report = ckptcore_keras.restore(state, other, keras.optimizers.Adam(), strict=False)
    assert report.unexpected == ("optimizer",) and report.missing == ("optimizer",)
    assert_same_bits([v.numpy() for v in model.variables], [v.numpy() for v in other.variables])


# --- RNG and cursor -----------------------------------------------------------------------

def test_global_rng_states_round_trip():
    keras.utils.set_random_seed(5)
    tf.random.set_global_generator(tf.random.Generator.from_seed(5))
    keras.random.uniform((2,))
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    state = ckptcore_keras.capture(model)

    def draws():
        return [random.random(), np.random.rand(), keras.random.uniform((3,)).numpy(),
                tf.random.get_global_generator().normal((3,)).numpy()]

    expected = draws()
    keras.utils.set_random_seed(99)
    tf.random.set_global_generator(tf.random.Generator.from_seed(99))
    keras.random.uniform((2,))
    ckptcore_keras.restore(state, model)
    got = draws()
    assert got[:2] == expected[:2]
    assert_same_bits(got[2:], expected[2:])


def test_cursor_round_trip():
    from ckptcore.cursor import DataCursor

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    cursor = DataCursor(15, 4, seed=3)
    cursor.next_batch()
    state = ckptcore_keras.capture(model, cursor=cursor, rng=False)
    assert state.data == cursor.state_dict()
    expected = cursor.next_batch()
    other = DataCursor(15, 4, seed=0)
    ckptcore_keras.restore(state, model, cursor=other)
    assert np.array_equal(other.next_batch(), expected)


def test_adapter_object():
    from ckptcore_keras import ADAPTER

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(), "mse")
    assert ADAPTER.name == "keras"
    assert ADAPTER.handles(model) and ADAPTER.handles(model.optimizer)
    assert not ADAPTER.handles(np.zeros(2)) and not ADAPTER.handles({})
    state = ADAPTER.capture(model=model, optimizer=model.optimizer)
    assert ADAPTER.restore(state, model=model).ok


@pytest.mark.parametrize("build,kind", [(seq_bn_dropout, "image3"), (loss_scale, "reg5"),
                                        (accum4, "reg5"), (accumulating_train_step, "onehot16")],
                         ids=["schedule", "loss_scale", "accumulation", "accumulating_train_step"])
def test_state_survives_ckptcore_save_and_load(tmp_path, build, kind):
    api = pytest.importorskip("ckptcore.api")
    keras.utils.set_random_seed(1)
    model = build()
    _train(model, kind, 5)
    state = ckptcore_keras.capture(model)
    api.save_state(str(tmp_path / "ck"), state)
    loaded = api.load_state(str(tmp_path / "ck"))
    keras.utils.set_random_seed(11)
    fresh = build()
    assert ckptcore_keras.restore(loaded, fresh).ok
    assert_same_bits(snapshot(model), snapshot(fresh))


# --- every optimizer family: slots found through the optimizer's structure ----------------

OPTIMIZERS = {
    "adam_ema_amsgrad": (lambda: keras.optimizers.Adam(use_ema=True, amsgrad=True),
                         {"momentum", "velocity", "velocity_hat", "average"}),
    "nadam": (keras.optimizers.Nadam, {"momentum", "velocity"}),
    "adafactor": (keras.optimizers.Adafactor, {"r", "c", "velocity"}),
    "ftrl": (keras.optimizers.Ftrl, {"accumulator", "linear"}),
    "adadelta": (keras.optimizers.Adadelta, {"accumulated_grad", "accumulated_delta_var"}),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_families_round_trip(name, tmp_path):
    make, slot_names = OPTIMIZERS[name]

    def build():
        m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(1)])
        m.compile(make(), "mse")
        return m

    model = build()
    _train(model, "reg5", 3)
    state = ckptcore_keras.capture(model, rng=False)
    assert all(set(s) == slot_names for s in state.optimizer.slots.values()), state.optimizer.slots
    if name == "nadam":  # an unnamed variable, named by the attribute that holds it
        assert list(state.optimizer.extra["variables"]) == ["u_product"]
    fresh = build()
    assert ckptcore_keras.restore(state, fresh).ok
    assert_same_bits(snapshot(model), snapshot(fresh), name)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(str(tmp_path / "c"))
    imported = ckptcore_keras.import_tf_checkpoint(path, optimizer=model.optimizer).optimizer
    assert imported.slots.keys() == state.optimizer.slots.keys()
    for p, slots in state.optimizer.slots.items():
        assert_same_bits([slots[k] for k in sorted(slots)],
                         [imported.slots[p][k] for k in sorted(imported.slots[p])], p)
    assert imported.extra.keys() == state.optimizer.extra.keys()
    for key, value in state.optimizer.extra.get("variables", {}).items():
        assert same_bits(value, imported.extra["variables"][key])
