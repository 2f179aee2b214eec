"""``ckptcore.migrate`` on synthetic states: no framework is imported here.

The states mimic what the adapters capture (their ParamInfo vocabulary, slot names and
hyperparameters); the cross-framework runs in ``test_migration.py`` check the same code against
the real frameworks.
"""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

import ckptcore
from ckptcore import AccumulationState, OptimizerState, ParamInfo, ScheduleState, TrainingState
from ckptcore.errors import MigrationError
from ckptcore.migrate import MigrationWarning, convert_state
from ckptcore.migrate.rng import convert_rng, derive_seed, mt19937_64_text
from ckptcore.migrate.schedules import same, value
from ckptcore_keras._dialect import DIALECT as KERAS
from ckptcore_paddle._dialect import DIALECT as PADDLE

RS = np.random.RandomState(0)


def rand(*shape):
    return RS.randn(*shape).astype("float32")


class Builder:
    """A state under construction: ``add(name, index, kind, role, layout, array, **attrs)``."""

    def __init__(self, framework: str):
        self.state = TrainingState(framework=framework)

    def add(self, name, index, kind, role, layout, arr, **attrs):
        self.state.model[name] = arr
        self.state.params[name] = ParamInfo(index, name.rsplit("/", 1)[0].rsplit(".", 1)[0], kind, role,
                                            layout, attrs)
        return self

    def keras_done(self):
        self.state.extra = {"keras": {"variables": list(self.state.model)}}
        return self.state

    def paddle_done(self):
        self.state.extra = {"paddle": {"param_names": {k: f"p_{i}" for i, k in enumerate(self.state.model)}}}
        return self.state


def cnn_pair():
    """Keras conv(hwio) -> Flatten over a 2x3x4 map -> Dense, and the Paddle counterpart's template."""
    k = (Builder("keras")
         .add("c/kernel", 0, "conv2d", "kernel", "hwio", rand(3, 3, 1, 4))
         .add("c/bias", 0, "conv2d", "bias", "o", rand(4))
         .add("d/kernel", 1, "dense", "kernel", "io", rand(24, 5), input_shape=[2, 3, 4], input_order="channels_last")
         .add("d/bias", 1, "dense", "bias", "o", rand(5), input_shape=[2, 3, 4], input_order="channels_last")
         .keras_done())
    facts = dict(input_order="channels_first", input_channels=4, inferred=True, input_shape=[4, 2, 3])
    p = (Builder("paddle")
         .add("conv.weight", 0, "conv2d", "kernel", "oihw", np.zeros((4, 1, 3, 3), "float32"))
         .add("conv.bias", 0, "conv2d", "bias", "o", np.zeros(4, "float32"))
         .add("fc.weight", 1, "dense", "kernel", "io", np.zeros((24, 5), "float32"), **facts)
         .add("fc.bias", 1, "dense", "bias", "o", np.zeros(5, "float32"), **facts)
         .paddle_done())
    return k, p


def convert(state, template, **kw):
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = convert_state(state, template, **kw)
    return out, [str(w.message) for w in caught if issubclass(w.category, MigrationWarning)]


@pytest.mark.slow
def test_import_stays_framework_free():
    code = ("import sys, ckptcore, ckptcore.migrate; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras', 'paddle')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_conv_and_flatten_layouts_both_ways():
    k, p = cnn_pair()
    out, warns = convert(k, p)
    assert warns == [] and out.framework == "paddle" and set(out.model) == set(p.model)
    np.testing.assert_array_equal(out.model["conv.weight"], k.model["c/kernel"].transpose(3, 2, 0, 1))
    # Keras rows (h, w, c) -> Paddle rows (c, h, w): docs/MIGRATION.md, "Framework facts migration relies on"
    expect = k.model["d/kernel"].reshape(2, 3, 4, 5).transpose(2, 0, 1, 3).reshape(24, 5)
    np.testing.assert_array_equal(out.model["fc.weight"], expect)
    back, _ = convert(out, k)
    for name in k.model:
        np.testing.assert_array_equal(back.model[name], k.model[name])


def test_paddle_default_flatten_order_is_assumed_and_said():
    k, p = cnn_pair()
    for name in ("fc.weight", "fc.bias"):   # Paddle's adapter could not infer the map
        info = p.params[name]
        p.params[name] = ParamInfo(info.index, info.layer, info.kind, info.role, info.layout, {})
    out, warns = convert(k, p)
    expect = k.model["d/kernel"].reshape(2, 3, 4, 5).transpose(2, 0, 1, 3).reshape(24, 5)
    np.testing.assert_array_equal(out.model["fc.weight"], expect)
    assert any("channels_first (the paddle default) assumed" in w for w in warns)


@pytest.mark.parametrize("kind,klayout,playout,kshape,perm", [
    ("conv1d", "kio", "oik", (3, 2, 5), (2, 1, 0)),
    ("conv2d_transpose", "hwoi", "iohw", (3, 3, 2, 6), (3, 2, 0, 1)),
])
def test_letter_layouts(kind, klayout, playout, kshape, perm):
    arr = rand(*kshape)
    k = Builder("keras").add("l/kernel", 0, kind, "kernel", klayout, arr).keras_done()
    p = Builder("paddle").add("l.weight", 0, kind, "kernel", playout,
                              np.zeros(arr.transpose(perm).shape, "float32")).paddle_done()
    out, _ = convert(k, p)
    np.testing.assert_array_equal(out.model["l.weight"], arr.transpose(perm))


def test_depthwise_channel_order():
    arr = rand(3, 3, 2, 3)   # (h, w, in=2, M=3): output channel c*M+m in both frameworks
    k = Builder("keras").add("dw/kernel", 0, "depthwise_conv2d", "kernel", "hwim", arr).keras_done()
    p = Builder("paddle").add("dw.weight", 0, "depthwise_conv2d", "kernel", "oihw",
                              np.zeros((6, 1, 3, 3), "float32"), depth_multiplier=3).paddle_done()
    out, _ = convert(k, p)
    for c in range(2):
        for m in range(3):
            np.testing.assert_array_equal(out.model["dw.weight"][c * 3 + m, 0], arr[:, :, c, m])
    back, _ = convert(out, k)
    np.testing.assert_array_equal(back.model["dw/kernel"], arr)


def rnn_pair(kind: str, *, reset_after: bool = True):
    u, i = 3, 4
    g = 4 if kind == "lstm" else 3
    kg = "ifco" if kind == "lstm" else "zrh"
    pg = "ifco" if kind == "lstm" else "rzc"
    bias = rand(2, g * u) if kind == "gru" and reset_after else rand(g * u)
    k = (Builder("keras")
         .add("r/cell/kernel", 0, kind, "kernel", kg, rand(i, g * u), axes="io", reset_after=reset_after)
         .add("r/cell/recurrent_kernel", 0, kind, "recurrent_kernel", kg, rand(u, g * u), axes="io")
         .add("r/cell/bias", 0, kind, "bias", kg, bias)
         .add("r/seed_generator_state", -1, kind, "seed_state", None, np.array([1, 2], "int64"))
         .keras_done())
    p = (Builder("paddle")
         .add("r.weight_ih_l0", 0, kind, "kernel", pg, np.zeros((g * u, i), "float32"), axes="oi")
         .add("r.weight_hh_l0", 0, kind, "recurrent_kernel", pg, np.zeros((g * u, u), "float32"), axes="oi")
         .add("r.bias_ih_l0", 0, kind, "bias", pg, np.zeros(g * u, "float32"), axes="oi")
         .add("r.bias_hh_l0", 0, kind, "recurrent_bias", pg, np.zeros(g * u, "float32"), axes="oi")
         .paddle_done())
    return k, p


def test_gru_gate_order_and_biases():
    k, p = rnn_pair("gru")
    out, _ = convert(k, p)

    def zrh_to_rzh(a, axis):   # the two GRU gate orders (docs/MIGRATION.md, "Framework facts ...")
        z, r, h = np.split(a, 3, axis=axis)
        return np.concatenate([r, z, h], axis=axis)
    np.testing.assert_array_equal(out.model["r.weight_ih_l0"], zrh_to_rzh(k.model["r/cell/kernel"], 1).T)
    np.testing.assert_array_equal(out.model["r.bias_hh_l0"], zrh_to_rzh(k.model["r/cell/bias"][1], 0))
    back, _ = convert(out, k)
    for name in ("r/cell/kernel", "r/cell/recurrent_kernel", "r/cell/bias"):
        np.testing.assert_array_equal(back.model[name], k.model[name])
    assert back.model["r/seed_generator_state"].dtype == np.int64   # reseeded, not dropped


def test_gru_reset_before_is_refused():
    k, p = rnn_pair("gru", reset_after=False)
    with pytest.raises(MigrationError, match=r"reset_after=False"):
        convert_state(k, p)


def test_lstm_bias_split_and_its_training_caveat():
    k, p = rnn_pair("lstm")
    k.optimizer = OptimizerState("adam", 3, {"learning_rate": 1e-3, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7},
                                 {n: {"momentum": rand(*k.model[n].shape), "velocity": np.abs(rand(*k.model[n].shape))}
                                  for n in ("r/cell/kernel", "r/cell/recurrent_kernel", "r/cell/bias")})
    out, warns = convert(k, p)
    np.testing.assert_array_equal(out.model["r.bias_ih_l0"], k.model["r/cell/bias"])
    assert not out.model["r.bias_hh_l0"].any()
    bias_m = k.optimizer.slots["r/cell/bias"]["momentum"]
    for b in ("r.bias_ih_l0", "r.bias_hh_l0"):   # both Paddle biases saw the Keras bias' gradients
        np.testing.assert_array_equal(out.optimizer.slots[b]["moment1"], bias_m)
    assert any("twice as fast" in w for w in warns)
    back, _ = convert(out, k)
    np.testing.assert_array_equal(back.model["r/cell/bias"], k.model["r/cell/bias"])
    np.testing.assert_allclose(back.optimizer.slots["r/cell/bias"]["momentum"], bias_m)


def test_paddle_multilayer_rnn_pairs_with_stacked_keras_layers():
    u, i = 3, 4
    p = Builder("paddle")
    for layer, width in ((0, i), (1, u)):
        facts = dict(axes="oi", layer_index=layer, direction="forward")
        p.add(f"r.weight_ih_l{layer}", 0, "lstm", "kernel", "ifco", rand(4 * u, width), **facts)
        p.add(f"r.weight_hh_l{layer}", 0, "lstm", "recurrent_kernel", "ifco", rand(4 * u, u), **facts)
        p.add(f"r.bias_ih_l{layer}", 0, "lstm", "bias", "ifco", rand(4 * u), **facts)
        p.add(f"r.bias_hh_l{layer}", 0, "lstm", "recurrent_bias", "ifco", rand(4 * u), **facts)
    p = p.paddle_done()
    k = Builder("keras")
    for index, (name, width) in enumerate((("a", i), ("b", u))):
        k.add(f"{name}/cell/kernel", index, "lstm", "kernel", "ifco", np.zeros((width, 4 * u), "float32"), axes="io")
        k.add(f"{name}/cell/recurrent_kernel", index, "lstm", "recurrent_kernel", "ifco",
              np.zeros((u, 4 * u), "float32"), axes="io")
        k.add(f"{name}/cell/bias", index, "lstm", "bias", "ifco", np.zeros(4 * u, "float32"))
    out, _ = convert(p, k.keras_done())
    np.testing.assert_array_equal(out.model["b/cell/kernel"], p.model["r.weight_ih_l1"].T)
    np.testing.assert_array_equal(out.model["b/cell/bias"], p.model["r.bias_ih_l1"] + p.model["r.bias_hh_l1"])


def test_every_unplaced_parameter_is_named():
    k, p = cnn_pair()
    k.model["extra/kernel"] = rand(5, 5)
    k.params["extra/kernel"] = ParamInfo(2, "extra", "dense", "kernel", "io", {})
    k.model["step_counter"] = np.zeros((), "int64")
    k.params["step_counter"] = ParamInfo(-1, "model", "custom", "step_counter")
    del p.model["conv.bias"], p.params["conv.bias"]
    with pytest.raises(MigrationError) as e:
        convert_state(k, p)
    msg = str(e.value)
    for name in ("extra/kernel", "step_counter", "c/bias"):
        assert name in msg, msg
    assert "name_map" in msg


def test_name_map_pins_layers():
    a, b = rand(4, 3), rand(4, 3)
    # a -> b and x -> y: a chain, so the structure pairs the two same-sized layers in run order
    k = (Builder("keras").add("a/kernel", 0, "dense", "kernel", "io", a, inputs=[], order=0)
         .add("b/kernel", 1, "dense", "kernel", "io", b, inputs=["a"], order=1).keras_done())
    p = (Builder("paddle").add("x.weight", 0, "dense", "kernel", "io", np.zeros((4, 3), "float32"),
                               inputs=[], order=0)
         .add("y.weight", 1, "dense", "kernel", "io", np.zeros((4, 3), "float32"), inputs=["x"], order=1)
         .paddle_done())
    out, _ = convert(k, p)
    np.testing.assert_array_equal(out.model["x.weight"], a)
    out, _ = convert(k, p, name_map={"a/kernel": "y.weight"})
    np.testing.assert_array_equal(out.model["y.weight"], a)
    np.testing.assert_array_equal(out.model["x.weight"], b)


def _unstructured(k: TrainingState) -> TrainingState:
    for info in k.params.values():
        info.attrs.pop("inputs", None)
        info.attrs.pop("order", None)
    return k


def test_unknown_structure_and_same_sized_layers_raise_with_the_name_map():
    k = (Builder("keras").add("a/kernel", 0, "dense", "kernel", "io", rand(4, 3))
         .add("b/kernel", 1, "dense", "kernel", "io", rand(4, 3)).keras_done())
    p = (Builder("paddle").add("x.weight", 0, "dense", "kernel", "io", np.zeros((4, 3), "float32"), inputs=[])
         .add("y.weight", 1, "dense", "kernel", "io", np.zeros((4, 3), "float32"), inputs=["x"]).paddle_done())
    with pytest.raises(MigrationError) as e:
        convert_state(k, p)
    assert "name_map={'a': 'x', 'b': 'y'}" in str(e.value) and "structure is unknown" in str(e.value)
    out, _ = convert(k, p, name_map={"a": "x", "b": "y"})
    np.testing.assert_array_equal(out.model["x.weight"], k.model["a/kernel"])


def residual(framework: str, main_first: bool):
    """stem conv -> [main: conv3x3 -> bn] + [shortcut: conv1x1 -> bn] -> dense; the two BatchNorms
    have one size.  ``main_first`` lists the main branch first (else the shortcut)."""
    b = Builder(framework)
    sep = "/" if framework == "keras" else "."
    conv = "hwio" if framework == "keras" else "oihw"
    k3 = (3, 3, 2, 4) if framework == "keras" else (4, 2, 3, 3)
    k1 = (1, 1, 2, 4) if framework == "keras" else (4, 2, 1, 1)
    ks = (3, 3, 1, 2) if framework == "keras" else (2, 1, 3, 3)
    b.add(f"stem{sep}kernel", 0, "conv2d", "kernel", conv, rand(*ks), inputs=[], order=0)
    main = [("mconv", "conv2d", k3, ["stem"]), ("mbn", "batch_norm", None, ["mconv"])]
    short = [("sconv", "conv2d", k1, ["stem"]), ("sbn", "batch_norm", None, ["sconv"])]
    for n, (layer, kind, shape, ins) in enumerate(main + short if main_first else short + main, 1):
        if kind == "conv2d":
            b.add(f"{layer}{sep}kernel", n, kind, "kernel", conv, rand(*shape), inputs=ins, order=n)
        else:
            for role in ("gamma", "beta", "moving_mean", "moving_variance"):
                b.add(f"{layer}{sep}{role}", n, kind, role, None, rand(4), inputs=ins, order=n)
    b.add(f"fc{sep}kernel", 5, "dense", "kernel", "io", rand(4, 3), inputs=["mbn", "sbn"], order=5)
    return b.keras_done() if framework == "keras" else b.paddle_done()


def test_residual_branches_are_told_apart_by_what_feeds_them():
    k = residual("keras", main_first=True)
    p = residual("paddle", main_first=False)
    for name in list(p.model):
        p.model[name] = np.zeros_like(p.model[name])
    out, _ = convert(k, p)
    for role in ("gamma", "moving_mean"):
        np.testing.assert_array_equal(out.model[f"mbn.{role}"], k.model[f"mbn/{role}"])
        np.testing.assert_array_equal(out.model[f"sbn.{role}"], k.model[f"sbn/{role}"])
    # Without the structure, the same two models are refused, not paired by order (which swaps them).
    with pytest.raises(MigrationError) as e:
        convert_state(_unstructured(k), p)
    assert "'mbn'" in str(e.value) and "'sbn'" in str(e.value) and "name_map={" in str(e.value)


def test_symmetric_branches_are_ambiguous_even_with_structure():
    def two_branches(framework: str):
        b, sep = Builder(framework), "/" if framework == "keras" else "."
        b.add(f"stem{sep}kernel", 0, "dense", "kernel", "io", rand(3, 4), inputs=[], order=0)
        b.add(f"left{sep}kernel", 1, "dense", "kernel", "io", rand(4, 4), inputs=["stem"], order=1)
        b.add(f"right{sep}kernel", 2, "dense", "kernel", "io", rand(4, 4), inputs=["stem"], order=2)
        b.add(f"head{sep}kernel", 3, "dense", "kernel", "io", rand(4, 2), inputs=["left", "right"], order=3)
        return b.keras_done() if framework == "keras" else b.paddle_done()
    with pytest.raises(MigrationError) as e:
        convert_state(two_branches("keras"), two_branches("paddle"))
    msg = str(e.value)
    assert "neither feeds the other" in msg and "name_map={'left': 'left', 'right': 'right'}" in msg
    assert msg.count("\n  - ") == 1, msg     # one problem, not a list of unplaced parameters
    out, _ = convert(two_branches("keras"), two_branches("paddle"), name_map={"left": "right"})
    assert set(out.extra["migration"]["pairs"]["right.kernel"]) == {"left/kernel"}


def test_normalization_hyperparameters_are_recorded_and_warned():
    k = (Builder("keras").add("bn/gamma", 0, "batch_norm", "gamma", None, rand(3), momentum=0.99, epsilon=1e-3)
         .add("bn/moving_mean", 0, "batch_norm", "moving_mean", None, rand(3), momentum=0.99, epsilon=1e-3)
         .keras_done())
    p = (Builder("paddle").add("bn.weight", 0, "batch_norm", "gamma", None, np.zeros(3, "float32"),
                               momentum=0.9, epsilon=1e-5)
         .add("bn._mean", 0, "batch_norm", "moving_mean", None, np.zeros(3, "float32"), momentum=0.9, epsilon=1e-5)
         .paddle_done())
    out, warns = convert(k, p)
    np.testing.assert_array_equal(out.model["bn._mean"], k.model["bn/moving_mean"])
    assert out.extra["migration"]["layers"]["bn"] == {"source_layer": "bn", "momentum": 0.99, "epsilon": 1e-3}
    assert len(warns) == 2 and all("bn" in w for w in warns)


def test_sgd_momentum_velocity_and_adam_step_counters():
    k, p = cnn_pair()
    m = {n: {"momentum": rand(*a.shape)} for n, a in k.model.items()}
    k.optimizer = OptimizerState("sgd", 7, {"learning_rate": 0.05, "momentum": 0.9, "nesterov": True}, m)
    p.optimizer = OptimizerState("momentum", 0, {"learning_rate": 0.05, "momentum": 0.9, "use_nesterov": True})
    out, warns = convert(k, p)
    assert warns == [] and out.optimizer.kind == "momentum" and out.optimizer.step == 7
    np.testing.assert_allclose(out.optimizer.slots["conv.bias"]["velocity"],
                               -m["c/bias"]["momentum"] / 0.05, rtol=1e-6)
    k.optimizer = OptimizerState("adam", 7, {"learning_rate": 1e-3, "beta_1": 0.9, "beta_2": 0.999,
                                             "epsilon": 1e-7},
                                 {n: {"momentum": rand(*a.shape), "velocity": np.abs(rand(*a.shape))}
                                  for n, a in k.model.items()})
    p.optimizer = OptimizerState("kerasadam", 0, {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.999,
                                                  "epsilon": 1e-7})
    out, warns = convert(k, p)
    assert warns == []
    slots = out.optimizer.slots["fc.weight"]
    assert slots["beta1_pow_acc"].dtype == np.float32 and slots["beta1_pow_acc"].shape == (1,)
    assert slots["beta2_pow_acc"][0] == np.float32(0.999) ** np.float32(8)   # β^(t+1)
    perm = k.optimizer.slots["d/kernel"]["velocity"].reshape(2, 3, 4, 5).transpose(2, 0, 1, 3).reshape(24, 5)
    np.testing.assert_array_equal(slots["moment2"], perm)   # slots follow the Flatten permutation
    p.optimizer = OptimizerState("adam", 0, {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8})
    _, warns = convert(k, p)
    assert len(warns) == 1 and "epsilon enters the update differently" in warns[0]


def test_optimizer_families_and_coupled_decay():
    k, p = cnn_pair()
    k.optimizer = OptimizerState("adam", 1, {"learning_rate": 1e-3}, {})
    p.optimizer = OptimizerState("momentum", 0, {"learning_rate": 1e-3, "momentum": 0.9})
    with pytest.raises(MigrationError, match="cannot continue as a paddle momentum"):
        convert_state(k, p)
    p.optimizer = OptimizerState("adam", 0, {"learning_rate": 1e-3, "epsilon": 1e-7,
                                             "regularization": {"kind": "L2Decay", "coeff": 0.01}})
    with pytest.raises(MigrationError, match="decoupled"):
        convert_state(k, p)
    _, warns = convert(k, p, approximate=True)
    assert any("decoupled" in w for w in warns)


def test_gradient_accumulation_buffers():
    k, p = cnn_pair()
    k.optimizer = OptimizerState("sgd", 3, {"learning_rate": 0.1, "momentum": 0.0}, {})
    raw = {n: rand(*a.shape) for n, a in k.model.items()}
    k.accumulation = AccumulationState(every=4, count=2, buffers=raw)   # Keras: raw sums
    out, _ = convert(k, p)
    assert (out.accumulation.every, out.accumulation.count) == (4, 2)
    np.testing.assert_allclose(out.accumulation.buffers["conv.bias"], raw["c/bias"] / 4, rtol=1e-6)
    k2 = TrainingState(**{**k.__dict__, "accumulation": None})
    k2.accumulation = AccumulationState(every=4, count=0, buffers={n: np.zeros_like(a) for n, a in k.model.items()})
    back, _ = convert(out, k2)
    np.testing.assert_allclose(back.accumulation.buffers["c/bias"], raw["c/bias"], rtol=1e-6)


KERAS_PADDLE_PAIRS = [
    (("ExponentialDecay", {"initial_learning_rate": 0.1, "decay_steps": 10, "decay_rate": 0.5}),
     ("ExponentialDecay", {"learning_rate": 0.1, "gamma": 0.5 ** 0.1})),
    (("ExponentialDecay", {"initial_learning_rate": 0.1, "decay_steps": 1, "decay_rate": math.exp(-0.3)}),
     ("NaturalExpDecay", {"learning_rate": 0.1, "gamma": 0.3})),
    (("ExponentialDecay", {"initial_learning_rate": 0.1, "decay_steps": 3, "decay_rate": 0.5, "staircase": True}),
     ("StepDecay", {"learning_rate": 0.1, "step_size": 3, "gamma": 0.5})),
    (("PiecewiseConstantDecay", {"boundaries": [10, 20], "values": [0.1, 0.05, 0.01]}),
     ("PiecewiseDecay", {"boundaries": [11, 21], "values": [0.1, 0.05, 0.01]})),
    (("PiecewiseConstantDecay", {"boundaries": [9, 24], "values": [0.1, 0.05, 0.025]}),
     ("MultiStepDecay", {"learning_rate": 0.1, "milestones": [10, 25], "gamma": 0.5})),
    (("InverseTimeDecay", {"initial_learning_rate": 0.1, "decay_steps": 4, "decay_rate": 0.5}),
     ("InverseTimeDecay", {"learning_rate": 0.1, "gamma": 0.125})),
    (("CosineDecayRestarts", {"initial_learning_rate": 0.1, "first_decay_steps": 3, "t_mul": 2.0, "m_mul": 1.0,
                              "alpha": 0.1}),
     ("CosineAnnealingWarmRestarts", {"learning_rate": 0.1, "T_0": 3, "T_mult": 2, "eta_min": 0.01})),
]


@pytest.mark.parametrize("keras,paddle", KERAS_PADDLE_PAIRS, ids=lambda x: x[0])
def test_schedule_pairs_are_the_same_formula(keras, paddle):
    a, b = KERAS.schedule_to_canonical(ScheduleState(*keras)), PADDLE.schedule_to_canonical(ScheduleState(*paddle))
    assert same(a, b)
    assert all(abs(value(a, t, KERAS.cosine_past_end) - value(b, t, PADDLE.cosine_past_end)) < 1e-12
               for t in range(40))


def test_piecewise_boundaries_shift_by_one():
    c = KERAS.schedule_to_canonical(ScheduleState("PiecewiseConstantDecay", {"boundaries": [10], "values": [1.0, 2.0]}))
    assert value(c, 10) == 1.0 and value(c, 11) == 2.0   # Keras: step <= b inclusive
    assert not same(c, PADDLE.schedule_to_canonical(ScheduleState("PiecewiseDecay", {"boundaries": [10],
                                                                                       "values": [1.0, 2.0]})))


def test_schedule_without_counterpart_and_cosine_horizon():
    k, p = cnn_pair()
    k.optimizer = OptimizerState("sgd", 20, {"learning_rate": 0.05, "momentum": 0.0}, {})
    k.schedule = ScheduleState("CosineDecay", {"initial_learning_rate": 0.1, "decay_steps": 16, "alpha": 0.0},
                               step=20)
    p.optimizer = OptimizerState("sgd", 0, {"learning_rate": 0.1})
    p.schedule = ScheduleState("CosineAnnealingDecay", {"learning_rate": 0.1, "T_max": 16, "eta_min": 0.0})
    with pytest.raises(MigrationError, match="past the cosine's end"):
        convert_state(k, p)
    p.schedule = None
    with pytest.raises(MigrationError, match="constant learning rate"):
        convert_state(k, p)
    out, warns = convert(k, p, approximate=True)
    assert out.optimizer.hyperparams["learning_rate"] == pytest.approx(0.0)   # cosine at its end
    assert any("keeps the current rate" in w for w in warns)


def test_paddle_schedule_state_for_recursive_and_nested_schedulers():
    k, p = cnn_pair()
    k.optimizer = OptimizerState("sgd", 9, {"learning_rate": 0.05, "momentum": 0.0}, {})
    k.schedule = ScheduleState("CosineDecay", {"initial_learning_rate": 0.0, "decay_steps": 8, "alpha": 0.1,
                                               "warmup_target": 0.1, "warmup_steps": 7}, step=9)
    p.optimizer = OptimizerState("sgd", 0, {"learning_rate": 0.0})
    p.schedule = ScheduleState("LinearWarmup", {"learning_rate": {"kind": "CosineAnnealingDecay", "config": {
        "learning_rate": 0.1, "T_max": 8, "eta_min": 0.01}}, "warmup_steps": 7, "start_lr": 0.0, "end_lr": 0.1})
    out, _ = convert(k, p)
    state = out.extra["paddle"]["scheduler"]["state"]
    assert state["last_epoch"] == 9 and state["LinearWarmup_LR"]["last_epoch"] == 2
    expect = 0.01 + 0.09 * (1 + math.cos(math.pi * 2 / 8)) / 2
    assert state["last_lr"] == pytest.approx(expect) == out.schedule.last_lr


def test_rng_is_carried_or_reseeded_deterministically():
    rng = {"python": {"version": 3}, "numpy": {"state": 1}, "tensorflow": {"state": [5, 0, 0], "algorithm": 1}}
    out = convert_rng(rng, PADDLE, 10)
    assert out["python"] == rng["python"] and out["numpy"] == rng["numpy"] and "tensorflow" not in out
    assert out == convert_rng(rng, PADDLE, 10)
    assert derive_seed(rng, 10) != derive_seed(rng, 11)
    back = convert_rng(out, KERAS, 10)
    assert back["keras"]["state"][1] == 0 and back["tensorflow"]["algorithm"] == 1
    # paddle.seed(12345)'s engine, as Paddle 3.3 reports it (std::seed_seq then std::mt19937_64)
    words = mt19937_64_text(12345).split()
    assert words[:3] == ["15338284682538164300", "4911453945226291543", "2365407917846515199"]
    assert len(words) == 313 and words[-1] == "312"


def test_public_names():
    assert ckptcore.convert is ckptcore.api.convert
    assert issubclass(ckptcore.MigrationError, ValueError)
    assert issubclass(ckptcore.MigrationWarning, UserWarning)
    assert ckptcore.migrate.MigrationWarning is ckptcore.errors.MigrationWarning


def test_a_dropped_source_layer_is_bypassed_in_the_graph():
    k = residual("keras", main_first=True)
    k.model["aux/kernel"] = rand(4, 4)
    k.params["aux/kernel"] = ParamInfo(6, "aux", "dense", "kernel", "io", {"inputs": ["mbn"], "order": 6})
    for name, info in k.params.items():   # the head now reads the extra layer instead of mbn
        if info.layer == "fc":
            info.attrs["inputs"] = ["aux", "sbn"]
    p = residual("paddle", main_first=False)
    out, _ = convert(k, p, name_map={"aux": None})
    np.testing.assert_array_equal(out.model["mbn.gamma"], k.model["mbn/gamma"])
    np.testing.assert_array_equal(out.model["sbn.gamma"], k.model["sbn/gamma"])
