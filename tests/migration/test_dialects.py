"""The dialect contract (``ckptcore.migrate.dialect``), in-process: no framework is imported.

Each adapter's dialect must carry its optimizers and schedules to the neutral form and back
without loss, and a dialect defined here, for a framework ckptcore has never heard of, must
convert to and from the existing ones: a new framework needs no edit of ``ckptcore.migrate``.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from typing import Any, Mapping

import numpy as np
import pytest

from ckptcore import OptimizerState, ParamInfo, ScheduleState, TrainingState
from ckptcore.errors import MigrationError
from ckptcore.migrate import BaseDialect, Dialect, MigrationWarning, Neutral, convert_state, dialect_for
from ckptcore.migrate.dialect import number, slots_by_table
from ckptcore.migrate.schedules import same, value
from ckptcore.registry import get_adapter
from ckptcore_keras._dialect import DIALECT as KERAS
from ckptcore_numpy._dialect import DIALECT as NUMPY
from ckptcore_paddle._dialect import DIALECT as PADDLE

from _common import SCHEDULES

RS = np.random.RandomState(1)
DIALECTS = {"keras": KERAS, "paddle": PADDLE, "numpy": NUMPY}
# Passed to convert_state explicitly, so these tests do not depend on the NumPy adapter's registration.
EXTRA: dict[str, Any] = {"numpy": NUMPY}


def rand(*shape: int) -> np.ndarray:
    return RS.randn(*shape).astype("float32")


def test_every_dialect_satisfies_the_protocol_and_imports_no_framework():
    for name, d in DIALECTS.items():
        assert isinstance(d, Dialect) and d.name == name
        assert d.cosine_past_end in ("hold", "rise") and d.accumulation_form in ("sum", "mean")
    assert not {"tensorflow", "keras", "paddle"} & {m.split(".")[0] for m in sys.modules}


@pytest.mark.slow
def test_dialect_modules_import_no_framework_in_a_fresh_interpreter():
    import subprocess

    code = ("import sys, json; import ckptcore_keras._dialect as k, ckptcore_paddle._dialect as p, "
            "ckptcore_numpy._dialect as n, ckptcore_torch._dialect as t, ckptcore_jax._dialect as j; "
            "[d.DIALECT.rng_from_seed(1) for d in (k, p, n, t, j)]; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert not ({"tensorflow", "keras", "paddle", "torch", "jax", "flax", "optax"}
                & set(json.loads(out.stdout.strip().splitlines()[-1])))


def test_adapters_hand_out_their_dialects():
    from ckptcore_jax._dialect import DIALECT as JAX

    assert get_adapter("keras").dialect is KERAS
    assert get_adapter("paddle").dialect is PADDLE
    assert get_adapter("jax").dialect is JAX and JAX.name == "jax"
    assert dialect_for("keras") is KERAS


def test_unknown_framework_is_a_migration_error():
    with pytest.raises(MigrationError, match="no migration dialect for 'nosuchframework'"):
        dialect_for("nosuchframework")
    state = TrainingState(framework="nosuchframework")
    with pytest.raises(MigrationError):
        convert_state(state, TrainingState(framework="keras"))


# ----------------------------------------------------------------------------- optimizer round trips

# (dialect, kind, hyperparams, native slot names) for every optimizer a dialect supports.
OPTIMIZERS = [
    ("keras", "adam", {"learning_rate": 1e-3, "beta_1": 0.8, "beta_2": 0.99, "epsilon": 1e-6},
     ["momentum", "velocity"]),
    ("keras", "adam", {"learning_rate": 1e-3, "amsgrad": True}, ["momentum", "velocity", "velocity_hat"]),
    ("keras", "adamw", {"learning_rate": 1e-3, "weight_decay": 0.05}, ["momentum", "velocity"]),
    ("keras", "sgd", {"learning_rate": 0.05, "momentum": 0.9, "nesterov": True}, ["momentum"]),
    ("keras", "sgd", {"learning_rate": 0.05, "momentum": 0.0}, []),
    ("keras", "rmsprop", {"learning_rate": 1e-3, "rho": 0.8, "momentum": 0.5, "centered": True},
     ["velocity", "momentum", "average_gradient"]),
    ("keras", "adagrad", {"learning_rate": 0.01, "initial_accumulator_value": 0.2}, ["accumulator"]),
    ("paddle", "adam", {"learning_rate": 1e-3, "beta1": 0.8, "beta2": 0.99, "epsilon": 1e-8},
     ["moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc"]),
    ("paddle", "adamw", {"learning_rate": 1e-3, "weight_decay": 0.01, "amsgrad": True},
     ["moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc", "moment2_max"]),
    ("paddle", "momentum", {"learning_rate": 0.05, "momentum": 0.9, "use_nesterov": True}, ["velocity"]),
    ("paddle", "sgd", {"learning_rate": 0.05}, []),
    ("paddle", "rmsprop", {"learning_rate": 1e-3, "rho": 0.9, "momentum": 0.5, "centered": True},
     ["momentum", "mean_square", "mean_grad"]),
    ("paddle", "adagrad", {"learning_rate": 0.01}, ["moment"]),
    ("numpy", "sgd", {"learning_rate": 0.05, "momentum": 0.9}, ["momentum"]),
    ("numpy", "sgd", {"learning_rate": 0.05, "momentum": 0.0}, []),
    ("numpy", "adam", {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8}, ["m", "v"]),
    ("numpy", "adam", {"learning_rate": 1e-3, "amsgrad": True, "epsilon_mode": "uncorrected"}, ["m", "v", "vmax"]),
]


@pytest.mark.parametrize("fw,kind,hyper,slot_names", OPTIMIZERS,
                         ids=[f"{o[0]}-{o[1]}-{i}" for i, o in enumerate(OPTIMIZERS)])
def test_optimizer_round_trips_through_the_neutral_form(fw, kind, hyper, slot_names):
    d = DIALECTS[fw]
    step = 6
    like = np.zeros((3, 2), "float32")
    native = {}
    for s in slot_names:
        if s.endswith("_pow_acc"):
            beta = hyper.get("beta1" if s.startswith("beta1") else "beta2", 0.9 if s.startswith("beta1") else 0.999)
            native[s] = np.array([np.float32(beta) ** np.float32(step + 1)], np.float32)
        else:
            native[s] = np.abs(rand(3, 2)) if s in ("velocity", "moment2", "v", "accumulator", "moment") else rand(3, 2)
    opt = OptimizerState(kind, step, dict(hyper), {"w": native})
    n = d.optimizer_to_neutral(opt, None)
    assert n.unsupported == [] and n.step == step and n.framework == fw
    # Hyperparameters: the optimizer the dialect builds from the neutral form reads back the same.
    kind2, hyper2 = d.optimizer_from_neutral(n)
    n2 = d.optimizer_to_neutral(OptimizerState(kind2, step, hyper2), None)
    assert (n2.family, n2.lr) == (n.family, n.lr)
    assert {k: v for k, v in n2.hp.items() if v is not None} == {k: v for k, v in n.hp.items() if v is not None}
    # Slots: native -> neutral -> native gives the same arrays (the beta powers from the step).
    neutral = d.slots_to_neutral(n, native)
    assert set(neutral) <= {"m", "v", "vmax", "momentum", "ms", "mom", "mg", "acc"}
    back = d.slots_from_neutral(n, neutral, source=n, like=like, current=None)
    assert set(back) == set(native)
    for s, arr in native.items():
        np.testing.assert_allclose(back[s], arr, rtol=1e-6, err_msg=s)
        assert back[s].dtype == arr.dtype


def test_momentum_conventions_meet_in_the_neutral_form():
    m = rand(4)
    k = OptimizerState("sgd", 3, {"learning_rate": 0.1, "momentum": 0.9}, {"w": {"momentum": m}})
    kn = KERAS.optimizer_to_neutral(k, None)
    neutral = KERAS.slots_to_neutral(kn, k.slots["w"])
    np.testing.assert_allclose(neutral["momentum"], -m / 0.1, rtol=1e-6)     # gradient form: b = -m/lr
    pn = PADDLE.optimizer_to_neutral(OptimizerState("momentum", 0, {"learning_rate": 0.1, "momentum": 0.9}), None)
    np.testing.assert_array_equal(PADDLE.slots_from_neutral(pn, neutral, source=kn, like=m, current=None)["velocity"],
                                  neutral["momentum"])
    assert (kn.hp["momentum_form"], pn.hp["momentum_form"]) == ("update", "gradient")


def test_paddle_step_from_scheduler_when_no_counter():
    opt = OptimizerState("momentum", 0, {"learning_rate": 0.1, "momentum": 0.9}, {}, extra={"step_source": "none"})
    assert PADDLE.optimizer_to_neutral(opt, ScheduleState("StepDecay", {}, step=12)).step == 12
    assert PADDLE.optimizer_to_neutral(opt, None).step == 0


def test_unsupported_optimizers_are_named():
    assert "nadam" in KERAS.optimizer_to_neutral(OptimizerState("nadam"), None).unsupported[0]
    assert "lamb" in PADDLE.optimizer_to_neutral(OptimizerState("lamb"), None).unsupported[0]
    assert "rmsprop" in NUMPY.optimizer_to_neutral(OptimizerState("rmsprop"), None).unsupported[0]


# ----------------------------------------------------------------------------- schedule round trips


def _config(fw: str, kind: str, kwargs: dict) -> dict:
    """A schedule's config as the adapter captures it: every argument, nested schedulers as dicts."""
    out = dict(kwargs)
    if kind == "PolynomialDecay":
        out.setdefault("cycle", False)
    if fw == "paddle" and kind == "LinearWarmup":
        inner_kind, inner = kwargs["learning_rate"]
        out["learning_rate"] = {"kind": inner_kind, "config": inner}
    return out


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("fw", ["keras", "paddle"])
def test_schedule_round_trips_through_its_canonical_form(name, fw):
    d = DIALECTS[fw]
    kind, kwargs = SCHEDULES[name][0 if fw == "keras" else 1]
    sched = ScheduleState(kind, _config(fw, kind, kwargs))
    form = d.schedule_to_canonical(sched)
    assert form is not None
    for step in (0, 3, 7):
        out, extra = d.schedule_from_canonical(form, sched, step, value(form, step, d.cosine_past_end))
        assert (out.kind, out.config, out.step) == (sched.kind, sched.config, step)
        assert same(d.schedule_to_canonical(out), form)
        assert out.last_lr == pytest.approx(value(form, step, d.cosine_past_end))
        if fw == "paddle":
            assert extra["state"]["last_epoch"] == step
        else:
            assert extra is None


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_exact_schedule_pairs_share_a_canonical_form(name):
    (kk, kw), (pk, pw) = SCHEDULES[name]
    a = KERAS.schedule_to_canonical(ScheduleState(kk, _config("keras", kk, kw)))
    b = PADDLE.schedule_to_canonical(ScheduleState(pk, _config("paddle", pk, pw)))
    assert same(a, b), (a, b)


def test_numpy_dialect_has_no_schedules():
    with pytest.raises(MigrationError, match="no learning-rate schedules"):
        NUMPY.schedule_to_canonical(ScheduleState("ExponentialDecay", {}))
    k = _keras_dense_state()
    k.optimizer = OptimizerState("sgd", 4, {"learning_rate": 0.1, "momentum": 0.0}, {})
    k.schedule = ScheduleState("ExponentialDecay", {"initial_learning_rate": 0.1, "decay_steps": 2,
                                                    "decay_rate": 0.5}, step=4)
    t = _numpy_template(OptimizerState("sgd", 0, {"learning_rate": 0.1, "momentum": 0.0}))
    with pytest.raises(MigrationError, match="constant learning rate"):
        convert_state(k, t, dialects=EXTRA)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = convert_state(k, t, approximate=True, dialects=EXTRA)
    assert out.optimizer.hyperparams["learning_rate"] == pytest.approx(0.1 * 0.5 ** 2)
    assert any("keeps the current rate" in str(w.message) for w in caught if w.category is MigrationWarning)


def test_rng_reseeding_is_deterministic_per_dialect():
    for d in DIALECTS.values():
        assert d.rng_from_seed(123) == d.rng_from_seed(123)
    assert PADDLE.rng_from_seed(5)["paddle"][0]["seed"] == 5
    assert KERAS.rng_from_seed(5) == {"tensorflow": {"state": [5, 0, 0], "algorithm": 1},
                                      "keras": {"state": [5, 0], "seed": 5}}
    assert NUMPY.rng_from_seed(5) == {}


# ----------------------------------------------------------------------------- numpy <-> keras


def _keras_dense_state() -> TrainingState:
    s = TrainingState(framework="keras")
    for name, role, arr in (("d/kernel", "kernel", rand(4, 3)), ("d/bias", "bias", rand(3))):
        s.model[name] = arr
        s.params[name] = ParamInfo(0, "d", "dense", role, "io" if role == "kernel" else "o")
    s.extra = {"keras": {"variables": list(s.model)}}
    return s


def _numpy_template(opt: OptimizerState | None = None) -> TrainingState:
    t = TrainingState(framework="numpy", optimizer=opt)
    for name, role, shape in (("fc.w", "kernel", (4, 3)), ("fc.b", "bias", (3,))):
        t.model[name] = np.zeros(shape, "float32")
        t.params[name] = ParamInfo(0, "fc", "dense", role, "io" if role == "kernel" else "o")
    return t


def _quiet(state, template, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MigrationWarning)
        return convert_state(state, template, **{"dialects": EXTRA, **kw})


def test_numpy_sgd_momentum_and_adam_to_keras_and_back():
    k = _keras_dense_state()
    m = {n: {"momentum": rand(*a.shape)} for n, a in k.model.items()}
    k.optimizer = OptimizerState("sgd", 5, {"learning_rate": 0.1, "momentum": 0.9}, m)
    out = _quiet(k, _numpy_template())          # no target optimizer: the dialect builds one
    assert out.framework == "numpy" and out.optimizer.kind == "sgd" and out.optimizer.step == 5
    np.testing.assert_allclose(out.optimizer.slots["fc.w"]["momentum"], -m["d/kernel"]["momentum"] / 0.1, rtol=1e-6)
    back = _quiet(out, _keras_dense_state())
    np.testing.assert_allclose(back.optimizer.slots["d/kernel"]["momentum"], m["d/kernel"]["momentum"], rtol=1e-6)

    k.optimizer = OptimizerState("adam", 5, {"learning_rate": 1e-3, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7},
                                 {n: {"momentum": rand(*a.shape), "velocity": np.abs(rand(*a.shape))}
                                  for n, a in k.model.items()})
    t = _numpy_template(OptimizerState("adam", 0, {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.999,
                                                   "epsilon": 1e-7, "epsilon_mode": "uncorrected"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", MigrationWarning)   # same conventions: exact, no warning
        out = convert_state(k, t, dialects=EXTRA)
    np.testing.assert_array_equal(out.optimizer.slots["fc.b"]["v"], k.optimizer.slots["d/bias"]["velocity"])
    t.optimizer.hyperparams["epsilon_mode"] = "corrected"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_state(k, t, dialects=EXTRA)
    assert any("epsilon enters the update differently" in str(w.message) for w in caught)


# ----------------------------------------------------------------------------- a third framework


class ToyDialect(BaseDialect):
    """A framework ckptcore does not know: its own slot names, an update-form SGD momentum, an
    exponential schedule with its own parameter names, a generator of its own, and an ``extra``
    section it needs back."""

    name = "toy"
    schedule_follows_optimizer = False
    accumulation_form = "mean"

    _ADAM = {"first": "m", "second": "v"}

    def optimizer_to_neutral(self, opt: OptimizerState, schedule: ScheduleState | None) -> Neutral:
        hp = opt.hyperparams
        n = Neutral(family={"toyadam": "adam", "toysgd": "momentum"}.get(opt.kind, opt.kind), framework=self.name,
                    kind=opt.kind, lr=number(hp.get("learning_rate")), step=int(hp.get("updates", opt.step)))
        if n.family == "adam":
            n.hp = {"beta1": hp.get("b1", 0.9), "beta2": hp.get("b2", 0.999), "epsilon": hp.get("eps", 1e-7),
                    "eps_mode": "uncorrected", "amsgrad": False}
        elif n.family == "momentum":
            n.hp = {"momentum": hp.get("mu", 0.0), "nesterov": False, "momentum_form": "update"}
        else:
            n.unsupported.append(f"toy optimizer {opt.kind!r}")
        n.hp.update(decoupled_wd=0.0, coupled_wd=0.0)
        return n

    def optimizer_from_neutral(self, n: Neutral) -> tuple[str, dict[str, Any]]:
        if n.family == "adam":
            return "toyadam", {"learning_rate": n.lr, "b1": n.hp["beta1"], "b2": n.hp["beta2"], "eps": n.hp["epsilon"]}
        return "toysgd", {"learning_rate": n.lr, "mu": n.hp.get("momentum", 0.0)}

    def slots_to_neutral(self, n: Neutral, slots: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if n.family == "adam":
            return {self._ADAM[k]: v for k, v in slots.items() if k in self._ADAM}
        return {"momentum": slots["delta"] * np.float32(-1.0 / n.lr)} if "delta" in slots else {}

    def slots_from_neutral(self, n: Neutral, slots: Mapping[str, np.ndarray], *, source: Neutral,
                           like: np.ndarray, current: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        if n.family == "adam":
            return slots_by_table({"first": "m", "second": "v"}, slots, like)
        return slots_by_table({"delta": "momentum"}, slots, like, lambda _, v: v * np.float32(-source.lr))

    def schedule_to_canonical(self, schedule: ScheduleState) -> tuple | None:
        c = schedule.config
        return ("exp", float(c["start"]), float(c["factor"])) if schedule.kind == "Exp" else None

    def schedule_from_canonical(self, form, template, step, last_lr):
        return ScheduleState(template.kind, dict(template.config), step, last_lr), {"position": step}

    def rng_from_seed(self, seed: int) -> dict[str, Any]:
        return {"toy": {"seed": seed}}

    def extra(self, template: TrainingState, produced: Mapping[str, Any]) -> dict[str, Any]:
        return {"toy": {**template.extra.get("toy", {}), "schedule": produced.get("scheduler")}}


TOY = ToyDialect()


def _toy_template(opt: OptimizerState | None, sched: ScheduleState | None = None) -> TrainingState:
    t = TrainingState(framework="toy", optimizer=opt, schedule=sched, extra={"toy": {"run": "x"}})
    for name, role, shape in (("L0.weight", "kernel", (4, 3)), ("L0.bias", "bias", (3,))):
        t.model[name] = np.zeros(shape, "float32")
        t.params[name] = ParamInfo(0, "L0", "dense", role, "io" if role == "kernel" else "o")
    return t


def test_a_third_dialect_converts_to_and_from_an_existing_one():
    k = _keras_dense_state()
    k.optimizer = OptimizerState("adam", 9, {"learning_rate": 1e-3, "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7},
                                 {n: {"momentum": rand(*a.shape), "velocity": np.abs(rand(*a.shape))}
                                  for n, a in k.model.items()})
    k.schedule = ScheduleState("ExponentialDecay", {"initial_learning_rate": 0.1, "decay_steps": 10,
                                                    "decay_rate": 0.5}, step=9)
    k.rng = {"numpy": {"state": 1}, "tensorflow": {"state": [3, 0, 0], "algorithm": 1}}
    tmpl = _toy_template(OptimizerState("toyadam", 0, {"learning_rate": 0.1, "b1": 0.9, "b2": 0.999, "eps": 1e-7}),
                         ScheduleState("Exp", {"start": 0.1, "factor": 0.5 ** 0.1}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", MigrationWarning)    # every convention matches: exact
        toy = convert_state(k, tmpl, dialects={**EXTRA, "toy": TOY})
    assert toy.framework == "toy" and toy.optimizer.step == 9 and toy.schedule.step == 9
    np.testing.assert_array_equal(toy.model["L0.weight"], k.model["d/kernel"])
    np.testing.assert_array_equal(toy.optimizer.slots["L0.bias"]["second"], k.optimizer.slots["d/bias"]["velocity"])
    assert toy.schedule.last_lr == pytest.approx(0.1 * 0.5 ** 0.9)
    assert toy.extra["toy"] == {"run": "x", "schedule": {"position": 9}}
    assert toy.rng["numpy"] == {"state": 1} and set(toy.rng) == {"numpy", "toy"}

    back = convert_state(toy, _with_keras_opt(k), dialects={**EXTRA, "toy": TOY})
    for name in k.model:
        np.testing.assert_array_equal(back.model[name], k.model[name])
        for slot in ("momentum", "velocity"):
            np.testing.assert_array_equal(back.optimizer.slots[name][slot], k.optimizer.slots[name][slot])
    assert back.schedule.step == 9 and back.framework == "keras" and "keras" in back.rng


def _with_keras_opt(k: TrainingState) -> TrainingState:
    t = _keras_dense_state()
    zeros = {n: {s: np.zeros_like(a) for s, a in slots.items()} for n, slots in k.optimizer.slots.items()}
    t.optimizer = OptimizerState("adam", 0, dict(k.optimizer.hyperparams), zeros)
    t.schedule = ScheduleState(k.schedule.kind, dict(k.schedule.config))
    return t


def test_a_third_dialect_with_its_own_momentum_convention_and_accumulation():
    """Toy (update-form momentum, mean accumulation) -> Paddle (gradient form, mean) -> NumPy (sums)."""
    from ckptcore import AccumulationState

    toy = _toy_template(OptimizerState("toysgd", 4, {"learning_rate": 0.5, "mu": 0.9}, {}))
    delta = {n: rand(*a.shape) for n, a in toy.model.items()}
    toy.model = {n: rand(*a.shape) for n, a in toy.model.items()}
    toy.optimizer.slots = {n: {"delta": d} for n, d in delta.items()}
    toy.accumulation = AccumulationState(every=4, count=1, buffers={n: rand(*a.shape) for n, a in toy.model.items()})
    paddle = TrainingState(framework="paddle", optimizer=OptimizerState("momentum", 0, {"learning_rate": 0.5,
                                                                                        "momentum": 0.9}))
    for name, role, shape in (("fc.weight", "kernel", (4, 3)), ("fc.bias", "bias", (3,))):
        paddle.model[name] = np.zeros(shape, "float32")
        paddle.params[name] = ParamInfo(0, "fc", "dense", role, "io" if role == "kernel" else "o")
    out = _quiet(toy, paddle, dialects={**EXTRA, "toy": TOY})
    np.testing.assert_allclose(out.optimizer.slots["fc.weight"]["velocity"], -delta["L0.weight"] / 0.5, rtol=1e-6)
    np.testing.assert_array_equal(out.accumulation.buffers["fc.bias"], toy.accumulation.buffers["L0.bias"])
    num = _quiet(toy, _numpy_template(), dialects={**EXTRA, "toy": TOY})
    np.testing.assert_allclose(num.accumulation.buffers["fc.b"], toy.accumulation.buffers["L0.bias"] * 4, rtol=1e-6)
    back = _quiet(num, _toy_template(OptimizerState("toysgd", 0, {"learning_rate": 0.5, "mu": 0.9})),
                  dialects={**EXTRA, "toy": TOY})
    np.testing.assert_allclose(back.optimizer.slots["L0.weight"]["delta"], delta["L0.weight"], rtol=1e-6)
    assert math.isclose(back.optimizer.hyperparams["learning_rate"], 0.5)
