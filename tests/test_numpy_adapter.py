"""The NumPy reference adapter: the conformance suite, plus what only this adapter has (its
optimizers' arithmetic, named ``numpy.random.Generator`` objects, its demo program)."""

from __future__ import annotations

import numpy as np
import pytest

import ckptcore
import ckptcore_numpy as cn
from ckptcore.adapter import DemoProgram, qualified
from ckptcore.errors import RestoreError, SchemaError
pytest.register_assert_rewrite("ckptcore.testing")  # before the import: its asserts explain themselves
from ckptcore.testing import AdapterTests, assert_bitwise  # noqa: E402

X = np.random.default_rng(42).standard_normal((16, 4)).astype(np.float32)
Y = np.random.default_rng(43).integers(0, 3, 16)


def model(seed: int) -> cn.Model:
    g = np.random.default_rng(seed)
    return cn.Model({"hidden/kernel": g.standard_normal((4, 5)).astype(np.float32),
                     "hidden/bias": np.zeros(5, np.float32),
                     "out/kernel": g.standard_normal((5, 3)).astype(np.float32),
                     "out/bias": np.zeros(3, np.float32)})


def grads(m: cn.Model, noise: np.ndarray) -> dict[str, np.ndarray]:
    """A deterministic, parameter-dependent pseudo-gradient (enough to exercise the optimizers)."""
    h = np.tanh((X + noise) @ m.params["hidden/kernel"] + m.params["hidden/bias"])
    p = h @ m.params["out/kernel"] + m.params["out/bias"]
    p[np.arange(len(Y)), Y] -= 1
    gh = (p @ m.params["out/kernel"].T) * (1 - h * h)
    return {"hidden/kernel": X.T @ gh, "hidden/bias": gh.mean(0),
            "out/kernel": h.T @ p, "out/bias": p.mean(0)}


class TestNumpyConformance(AdapterTests):
    adapter_name = "numpy"

    def make(self, seed):
        objects = {"model": model(seed), "optimizer": cn.Adam(0.01)}
        self.train(objects, 1)
        return objects

    def train(self, objects, steps):
        for _ in range(steps):
            noise = (np.random.standard_normal(X.shape) * 0.01).astype(np.float32)  # global RNG
            objects["optimizer"].step(objects["model"], grads(objects["model"], noise))

    def model_arrays(self, objects):
        return dict(objects["model"].params)

    def optimizer_arrays(self, objects):
        return {f"{p}/{s}": a for p, slots in objects["optimizer"].slots.items() for s, a in slots.items()}

    def draw_rng(self):
        return np.random.random(4)


class TestNumpyConformanceSGDWithGenerators(TestNumpyConformance):
    """The same contract with SGD momentum and a named Generator among the objects."""

    def make(self, seed):
        objects = {"model": model(seed), "optimizer": cn.SGD(0.05, momentum=0.9),
                   "generators": {"aug": np.random.default_rng(seed)}}
        self.train(objects, 1)
        return objects

    def train(self, objects, steps):
        for _ in range(steps):
            noise = (objects["generators"]["aug"].standard_normal(X.shape) * 0.01).astype(np.float32)
            noise += np.float32(np.random.random())
            objects["optimizer"].step(objects["model"], grads(objects["model"], noise))


# --- the framework's own behaviour ----------------------------------------------------------------

def test_sgd_momentum_arithmetic():
    m = cn.Model({"w": np.array([1.0, 2.0], np.float32)})
    opt = cn.SGD(0.5, momentum=0.5)
    g = np.array([1.0, -1.0], np.float32)
    opt.step(m, {"w": g})
    opt.step(m, {"w": g})
    # v1 = g, p1 = p0 - 0.5 g; v2 = 0.5 g + g, p2 = p1 - 0.75 g
    assert m.params["w"].tolist() == [1.0 - 1.25, 2.0 + 1.25]
    assert opt.slots["w"]["momentum"].tolist() == [1.5, -1.5]
    assert opt.iterations == 2 and m.params["w"].dtype == np.float32


def test_adam_first_step_moves_by_lr():
    m = cn.Model({"w": np.zeros(3, np.float64)})
    opt = cn.Adam(0.1, epsilon=1e-12)
    opt.step(m, {"w": np.array([2.0, -3.0, 0.5])})
    np.testing.assert_allclose(m.params["w"], [-0.1, 0.1, -0.1], rtol=1e-9)
    assert set(opt.slots["w"]) == {"m", "v"}


def test_sgd_without_momentum_keeps_no_slot():
    m = cn.Model({"w": np.ones(2, np.float32)})
    opt = cn.SGD(0.1)
    opt.step(m, {"w": np.ones(2, np.float32)})
    assert opt.slots == {"w": {}}
    state = cn.capture(m, opt)
    fresh = cn.SGD(0.1)
    assert cn.restore(state, cn.Model({"w": np.zeros(2, np.float32)}), fresh).ok
    assert fresh.iterations == 1


@pytest.mark.parametrize("bad, error", [
    ({"w": np.arange(3)}, TypeError),  # integer parameters
    ({"": np.zeros(2)}, TypeError),
    ([np.zeros(2)], TypeError),
])
def test_model_refuses_what_is_not_named_float_arrays(bad, error):
    with pytest.raises(error):
        cn.Model(bad)


def test_optimizers_refuse_bad_hyperparameters():
    with pytest.raises(ValueError, match="momentum"):
        cn.SGD(0.1, momentum=1.5)
    with pytest.raises(ValueError, match="learning_rate"):
        cn.Adam(float("nan"))
    with pytest.raises(ValueError, match="gradients for parameters"):
        cn.SGD(0.1).step(model(0), {"nope": np.zeros(1)})


def test_wrong_objects_are_type_errors():
    with pytest.raises(TypeError, match="ckptcore_numpy.Model"):
        cn.capture({"w": np.zeros(2)})
    with pytest.raises(TypeError, match="optimizer"):
        cn.capture(model(0), optimizer="adam")
    with pytest.raises(TypeError, match="generators"):
        cn.capture(model(0), generators=[np.random.default_rng()])
    with pytest.raises(TypeError, match="TrainingState"):
        cn.restore({"model": {}}, model(0))


# --- restore planning specific to this adapter ----------------------------------------------------

def test_params_describe_dense_layers_in_the_shared_vocabulary():
    state = cn.capture(model(0))
    k, b = state.params["out/kernel"], state.params["out/bias"]
    assert (k.kind, k.role, k.layout, k.index, k.layer) == ("dense", "kernel", "io", 1, "out")
    assert (b.kind, b.role) == ("dense", "bias")
    custom = cn.capture(cn.Model({"scale": np.ones(1, np.float32)})).params["scale"]
    assert custom.kind == "custom" and custom.role == "scale"


def test_shape_and_dtype_mismatches_name_the_tensor_and_change_nothing():
    state = cn.capture(model(0))
    target = cn.Model({**model(1).params, "out/bias": np.zeros(4, np.float32)})
    before = {k: v.copy() for k, v in target.params.items()}
    with pytest.raises(RestoreError, match="out/bias"):
        cn.restore(state, target)
    assert_bitwise(before, target.params, "after a refused restore")
    state.model["out/bias"] = state.model["out/bias"].astype(np.float64)
    with pytest.raises(RestoreError, match="out/bias: the checkpoint holds float64"):
        cn.restore(state, model(1))


def test_optimizer_kind_mismatch_is_a_restore_error():
    objects = {"model": model(0), "optimizer": cn.Adam(0.01)}
    objects["optimizer"].step(objects["model"], grads(objects["model"], 0))
    state = cn.capture(**objects)
    with pytest.raises(RestoreError, match="'adam' optimizer, the target is 'sgd'"):
        cn.restore(state, model(1), cn.SGD(0.1, 0.9))


def test_state_without_optimizer_reports_every_slot_missing():
    state = cn.capture(model(0))
    report = cn.restore(state, model(1), cn.SGD(0.1, momentum=0.9), strict=False)
    assert report.missing == tuple(qualified("optimizer", p, "momentum") for p in model(0).params)


def test_fresh_optimizer_gets_slots_restore_keeps_live_views():
    objects = {"model": model(0), "optimizer": cn.Adam(0.01)}
    objects["optimizer"].step(objects["model"], grads(objects["model"], 0))
    state = cn.capture(**objects)
    target = model(1)
    live = target.params["out/kernel"]
    cn.restore(state, target, cn.Adam(0.01))
    assert target.params["out/kernel"] is live  # written in place: views follow the restore
    assert_bitwise(state.model, target.params, "model")


def test_named_generators_round_trip_and_missing_ones_are_reported():
    gen = np.random.default_rng(5)
    gen.random(3)
    state = cn.capture(model(0), generators={"aug": gen})
    expected = gen.random(4)
    other = np.random.default_rng(99)
    cn.restore(state, model(1), generators={"aug": other})
    assert other.random(4).tobytes() == expected.tobytes()
    with pytest.raises(RestoreError, match=r"rng/shuffle"):
        cn.restore(state, model(1), generators={"aug": other, "shuffle": np.random.default_rng()})
    report = cn.restore(state, model(1), strict=False, generators={"shuffle": np.random.default_rng()})
    assert report.missing == ("rng/shuffle",)


def test_rng_false_leaves_named_generators_alone():
    gen = np.random.default_rng(5)
    state = cn.capture(model(0), generators={"aug": gen})
    gen.random(10)
    probe = np.random.default_rng(0)
    probe.bit_generator.state = gen.bit_generator.state
    cn.restore(state, model(1), rng=False, generators={"aug": gen})
    assert gen.random(2).tobytes() == probe.random(2).tobytes()


def test_a_bad_cursor_state_fails_before_anything_is_written():
    state = cn.capture(model(0), cursor=ckptcore.DataCursor(64, 8, seed=1))
    state.data = {**state.data, "position": 3}  # not a batch boundary
    target = model(1)
    before = {k: v.copy() for k, v in target.params.items()}
    with pytest.raises(SchemaError):
        cn.restore(state, target, cursor=ckptcore.DataCursor(64, 8, seed=1))
    assert_bitwise(before, target.params, "after a refused restore")


def test_a_cursor_without_saved_position_is_missing():
    report = cn.restore(cn.capture(model(0)), model(1), cursor=ckptcore.DataCursor(64, 8),
                        strict=False)
    assert report.missing == ("data",)


def test_neutral_state_restores_without_conversion():
    state = ckptcore.TrainingState(model={k: v.copy() for k, v in model(3).params.items()})
    target = model(1)
    assert cn.restore(state, target).ok
    assert_bitwise(model(3).params, target.params, "a neutral state")


def test_formats_are_empty_and_demo_is_a_program():
    assert cn.ADAPTER.formats == ()
    program = cn.ADAPTER.demo(seed=7, features=8, classes=3)
    assert isinstance(program, DemoProgram)
    x = np.ones((4, 8), np.float32)
    program.train_step(x, np.array([0, 1, 2, 0]))
    assert program.objects["optimizer"].iterations == 1
    assert set(program.objects) == {"model", "optimizer", "generators"}
