"""JAX <-> PyTorch, JAX <-> Keras and JAX <-> Paddle migration (Flax NNX models, Optax optimizers).

Worker tests: each framework trains in its own process (``_jworker.py both`` runs its source phase,
waits while ``_tworker.py jax``, ``_kworker.py jax`` and ``_pworker.py <dir> {} jax`` run through
``_jpairs.py``, then runs its target phase; see ``conftest.jax_migration_results``).  Each twin runs 5 steps in its source framework,
is migrated, and continues for 5 more steps on the same batches in the target and in the source.
Compared: inference logits right after migration; after the 5 steps the training-mode logits (batch
statistics: every trainable weight enters them) and the inference logits.  Optimizers: Optax's
Nesterov SGD, Adam and AdamW beside PyTorch's and Paddle's counterparts, Nesterov SGD beside Keras.

Two inference comparisons after training are bounded rather than exact, each for a reason the test
states: PyTorch updates BatchNorm's moving variance with the unbiased batch variance (migration warns),
and the MobileNet's projection BatchNorms have betas whose true gradient is exactly zero (a BatchNorm
downstream removes any per-channel constant), so Adam turns float noise of ~1e-9 into steps of
±lr; training-mode logits are blind to those betas, inference logits through the moving means are not.

Unit tests: the JAX dialect in-process (pure NumPy, JAX is never imported here).
"""

from __future__ import annotations

import numpy as np
import pytest

from _common import JAX_PARTNERS, JAX_TWIN_OPT, JAX_TWINS, STEPS, jax_opt_key
from ckptcore.errors import MigrationError
from ckptcore.migrate import convert_state
from ckptcore.migrate.schedules import same
from ckptcore.state import OptimizerState, ParamInfo, ScheduleState, TrainingState

EXACT = 1e-5
# (results file, task, key format): JAX -> X is continued by X's worker, X -> JAX by the JAX worker.
DIRECTIONS = {**{f"jax->{p}": (f"{p}_jax", "jax_pairs", "{}") for p in JAX_PARTNERS},
              **{f"{p}->jax": ("jax_target", "twins_target", p + "/{}") for p in JAX_PARTNERS}}
BN_TWINS = [n for n in JAX_TWINS if n != "transformer"]


def result(results: dict, direction: str, name: str) -> dict:
    worker, task, key = DIRECTIONS[direction]
    r = results[worker][task]
    if isinstance(r, dict) and isinstance(r.get("error"), str) and "Traceback" in r["error"]:
        pytest.fail(f"{worker}.{task} failed:\n{r['error']}", pytrace=False)
    return r[key.format(name)]


@pytest.mark.parametrize("direction, name", [(d, n) for d in DIRECTIONS for n in JAX_TWINS])
def test_twin_continues_exactly(jax_migration_results, direction, name):
    r = result(jax_migration_results, direction, name)
    assert "error" not in r, r
    assert r["logits_diff"] <= EXACT, r
    assert r["after_train_diff"] <= EXACT, r
    partner = direction.replace("jax", "").strip("->")
    if partner == "torch" and name in BN_TWINS:   # the one inexact part, announced
        (w,) = r["warnings"]
        assert "unbiased" in w and "biased" in w, w
        assert r["after_eval_diff"] <= 5e-3, r
        return
    assert r["warnings"] == [], r
    adam_noise = name == "mobilenet" and jax_opt_key(name, partner) != "sgd"
    assert r["after_eval_diff"] <= (5e-3 if adam_noise else EXACT), r


@pytest.mark.parametrize("partner", JAX_PARTNERS)
def test_step_counters_continue(jax_migration_results, partner):
    """The nnx.Optimizer's step and every Optax count leaf are at the source's update count; PyTorch's
    and Paddle's SGD keep no counter, so a run migrated from them starts counting at 0 (SGD without a
    schedule does not read it)."""
    for name in JAX_TWINS:
        r = result(jax_migration_results, f"{partner}->jax", name)
        counterless = partner != "keras" and JAX_TWIN_OPT[name] == "sgd"
        want = 0 if counterless else STEPS
        assert r["step"] == want and set(r["counts"].values()) == {want}, (name, r)


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_symmetric_branches_raise_with_the_name_map(jax_migration_results, direction):
    err = result(jax_migration_results, direction, "branches")["error"]
    assert err and "neither feeds the other" in err and "name_map=" in err, err


def test_traced_structure_of_the_twins(jax_migration_results):
    s = jax_migration_results["jax_source"]["structure"]
    assert s["inputs"]["ln1"] == ["attn", "embed"] and s["inputs"]["attn"] == ["embed"]
    assert s["inputs"]["ln2"] == ["ff2", "ln1"] and s["inputs"]["head"] == ["ln2"]
    assert s["roles"]["attn/query/kernel"] == ["query_kernel", "ehd"]
    assert s["roles"]["attn/out/kernel"] == ["output_kernel", "hde"]
    kind, layout, attrs = s["up"]
    assert (kind, layout, attrs["spatially_flipped"]) == ("conv2d_transpose", "hwio", True)
    assert s["dec2_inputs"] == ["enc2_bn", "up2"] and s["dw"] == ["depthwise_conv2d", "hwio"]
    assert s["bn"] == {"momentum": 0.99, "epsilon": 1e-3, "variance_update": "biased"}


def test_optax_transformations_are_read(jax_migration_results):
    r = jax_migration_results["jax_source"]["optax_reading"]
    assert r["adam"]["kind"] == "adam" and r["adam"]["hp"]["eps"] == 1e-8 and r["adam"]["slots"] == ["0/mu", "0/nu"]
    assert r["adamw"]["kind"] == "adamw" and r["adamw"]["hp"]["weight_decay"] == 0.05
    assert r["sgd_nesterov"]["hp"] == {"learning_rate": 0.01, "momentum": 0.9, "nesterov": True, "slot_prefix": "0/"}
    assert r["sgd"]["kind"] == "sgd" and r["sgd"]["slots"] == []
    for key in ("adam", "adamw", "sgd_nesterov", "sgd"):
        assert r[key]["unsupported"] == [], r[key]
    (why,) = r["rmsprop"]["unsupported"]
    assert "scale_by_rms" in why and "optax.adamw" in why, why
    assert any("NAdam" in u for u in r["nadam"]["unsupported"]), r["nadam"]
    assert r["masked_adamw"]["kind"] == "optax" and r["masked_adamw"]["unsupported"]


def test_optax_schedules_follow_their_canonical_formula(jax_migration_results):
    r = jax_migration_results["jax_source"]["schedules"]
    assert set(r) == {"exponential", "staircase", "cosine", "piecewise", "polynomial", "warmup_cosine"}
    for key, x in r.items():
        assert x["step"] == 5 and x["form"], (key, x)
        assert x["formula_diff"] < 1e-7 and x["last_lr_diff"] < 1e-7, (key, x)   # Optax computes in float32


def test_an_optax_optimizer_without_counterpart_is_refused(jax_migration_results):
    """A real captured optax.rmsprop state, converted for a PyTorch target: MigrationError naming it."""
    import ckptcore
    from ckptcore_jax._dialect import DIALECT as J
    from ckptcore_torch._dialect import DIALECT as T

    state = ckptcore.load_state(f"{jax_migration_results['dir']}/j_rmsprop")
    assert state.framework == "jax" and state.optimizer.kind == "optax"
    template = TrainingState(framework="torch", model=dict(state.model), params=dict(state.params),
                             optimizer=OptimizerState(kind="rmsprop", hyperparams={"lr": 1e-3, "alpha": 0.9}))
    with pytest.raises(MigrationError, match="scale_by_rms") as e:
        convert_state(state, template, dialects={"jax": J, "torch": T})
    assert "supported are optax.adam, optax.adamw and optax.sgd" in str(e.value)


# ----------------------------------------------------------------------------- the dialect, in-process


def _dialects():
    from ckptcore_jax._dialect import DIALECT as J
    from ckptcore_keras._dialect import DIALECT as K
    from ckptcore_paddle._dialect import DIALECT as P
    from ckptcore_torch._dialect import DIALECT as T
    return J, T, K, P


@pytest.mark.parametrize("optax_kind, config, torch_kind, torch_state, keras, paddle", [
    ("exponential_decay", {"init_value": 0.1, "transition_steps": 3, "decay_rate": 0.5, "staircase": True,
                           "transition_begin": 0, "end_value": None},
     "StepLR", {"step_size": 3, "gamma": 0.5},
     ("ExponentialDecay", {"initial_learning_rate": 0.1, "decay_steps": 3, "decay_rate": 0.5, "staircase": True}),
     ("StepDecay", {"learning_rate": 0.1, "step_size": 3, "gamma": 0.5})),
    ("exponential_decay", {"init_value": 0.1, "transition_steps": 10, "decay_rate": 0.5, "staircase": False,
                           "transition_begin": 0, "end_value": None},
     "ExponentialLR", {"gamma": 0.5 ** 0.1},
     ("ExponentialDecay", {"initial_learning_rate": 0.1, "decay_steps": 10, "decay_rate": 0.5}),
     ("ExponentialDecay", {"learning_rate": 0.1, "gamma": 0.5 ** 0.1})),
    ("piecewise_constant_schedule", {"init_value": 0.1, "boundaries": [7, 9], "scales": [0.5, 0.5]},
     "MultiStepLR", {"milestones": {7: 1, 9: 1}, "gamma": 0.5},
     ("PiecewiseConstantDecay", {"boundaries": [6, 8], "values": [0.1, 0.05, 0.025]}),
     ("MultiStepDecay", {"learning_rate": 0.1, "milestones": [7, 9], "gamma": 0.5})),
    ("cosine_decay_schedule", {"init_value": 0.1, "decay_steps": 16, "alpha": 0.1, "exponent": 1.0},
     "CosineAnnealingLR", {"T_max": 16, "eta_min": 0.01},
     ("CosineDecay", {"initial_learning_rate": 0.1, "decay_steps": 16, "alpha": 0.1}),
     ("CosineAnnealingDecay", {"learning_rate": 0.1, "T_max": 16, "eta_min": 0.01})),
    ("polynomial_schedule", {"init_value": 0.1, "end_value": 0.0, "power": 2.0, "transition_steps": 8,
                             "transition_begin": 0},
     "PolynomialLR", {"total_iters": 8, "power": 2.0},
     ("PolynomialDecay", {"initial_learning_rate": 0.1, "decay_steps": 8, "end_learning_rate": 0.0, "power": 2.0,
                          "cycle": False}),
     ("PolynomialDecay", {"learning_rate": 0.1, "decay_steps": 8, "end_lr": 0.0, "power": 2.0, "cycle": False}))])
def test_optax_schedules_pair_with_torch_keras_and_paddle(optax_kind, config, torch_kind, torch_state, keras,
                                                          paddle):
    J, T, K, P = _dialects()
    j = J.schedule_to_canonical(ScheduleState(kind=optax_kind, config=config, step=5))
    t = T.schedule_to_canonical(ScheduleState(kind=torch_kind, config={}, step=5, state={
        "base_lrs": [0.1], "last_epoch": 5, "_last_lr": [0.1], **torch_state}))
    assert same(j, t) and same(j, K.schedule_to_canonical(ScheduleState(kind=keras[0], config=keras[1], step=5)))
    assert same(j, P.schedule_to_canonical(ScheduleState(kind=paddle[0], config=paddle[1], step=5)))


def test_warmup_cosine_pairs_with_keras_and_an_unknown_schedule_is_refused():
    J, T, K, P = _dialects()
    warm = {"boundaries": [7], "schedules": [
        {"kind": "polynomial_schedule", "config": {"init_value": 0.0, "end_value": 0.1, "power": 1, "transition_steps": 7,
                                                   "transition_begin": 0}},
        {"kind": "cosine_decay_schedule", "config": {"init_value": 0.1, "decay_steps": 8, "alpha": 0.1, "exponent": 1.0}}]}
    j = J.schedule_to_canonical(ScheduleState(kind="join_schedules", config=warm, step=3))
    k = K.schedule_to_canonical(ScheduleState(kind="CosineDecay", config={
        "initial_learning_rate": 0.0, "decay_steps": 8, "alpha": 0.1, "warmup_target": 0.1, "warmup_steps": 7}, step=3))
    assert same(j, k)
    assert J.schedule_to_canonical(ScheduleState(kind="sgdr_schedule", config={}, step=3)) is None


def _dense(framework: str, layout: str, shape: tuple, opt: OptimizerState | None) -> TrainingState:
    w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    return TrainingState(framework=framework, model={"fc/kernel": w},
                         params={"fc/kernel": ParamInfo(0, "fc", "dense", "kernel", layout, {})}, optimizer=opt)


def _optax(kind: str, step: int, slots: dict, **hp) -> OptimizerState:
    leaves = {"0/count": np.asarray(step, np.int32), "step": np.asarray(step, np.uint32)}
    return OptimizerState(kind=kind, step=step, hyperparams={"slot_prefix": "0/", **hp}, slots=slots,
                          extra={"leaves": leaves, "container": "Optimizer"})


def test_optax_adam_to_torch_and_back():
    J, T, K, P = _dialects()
    src = _dense("jax", "io", (2, 3), None)
    w = src.model["fc/kernel"]
    src.optimizer = _optax("adam", 4, {"fc/kernel": {"0/mu": w + 1, "0/nu": w + 2}}, learning_rate=1e-3, b1=0.9,
                           b2=0.999, eps=1e-8, eps_root=0.0, nesterov=False, weight_decay=0.0)
    dialects = {"jax": J, "torch": T}
    torch_t = _dense("torch", "oi", (3, 2), OptimizerState(kind="adam", hyperparams={"lr": 1e-3, "eps": 1e-8},
                                                           extra={"param_groups": [{"params": ["fc/kernel"], "lr": 1e-3}]}))
    out = convert_state(src, torch_t, dialects=dialects, warn=False)
    np.testing.assert_array_equal(out.optimizer.slots["fc/kernel"]["exp_avg"], (w + 1).T)
    assert float(out.optimizer.slots["fc/kernel"]["step"]) == 4.0
    assert out.extra["migration"]["warnings"] == []   # both add eps to the bias-corrected sqrt(v-hat)
    back = convert_state(out, _dense("jax", "io", (2, 3), _optax("adam", 0, {"fc/kernel": {
        "0/mu": np.zeros_like(w), "0/nu": np.zeros_like(w)}}, learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-8)),
        dialects=dialects, warn=False)
    np.testing.assert_array_equal(back.optimizer.slots["fc/kernel"]["0/nu"], w + 2)
    assert {k: int(v) for k, v in back.optimizer.extra["leaves"].items()} == {"0/count": 4, "step": 4}
    assert back.optimizer.extra["leaves"]["step"].dtype == np.uint32
    with pytest.warns(Warning, match="epsilon"):   # Keras adds it to the uncorrected sqrt(v): announced
        convert_state(src, _dense("keras", "io", (2, 3), OptimizerState(kind="adam", hyperparams={"learning_rate": 1e-3})),
                      dialects={"jax": J, "keras": K})


def test_optax_sgd_momentum_meets_keras_update_form():
    J, T, K, P = _dialects()
    src = _dense("keras", "io", (2, 3), None)
    m = src.model["fc/kernel"] * 0.1
    src.optimizer = OptimizerState(kind="sgd", step=3, hyperparams={"learning_rate": 0.01, "momentum": 0.9},
                                   slots={"fc/kernel": {"momentum": m}})
    tmpl = _dense("jax", "io", (2, 3), _optax("sgd", 0, {"fc/kernel": {"0/trace": np.zeros_like(m)}},
                                             learning_rate=0.01, momentum=0.9, nesterov=False))
    out = convert_state(src, tmpl, dialects={"jax": J, "keras": K}, warn=False)
    np.testing.assert_allclose(out.optimizer.slots["fc/kernel"]["0/trace"], -m / 0.01, rtol=1e-6)   # b = -m/lr
    assert int(out.optimizer.extra["leaves"]["step"]) == 3


def test_unsupported_optax_states_are_named():
    J, T, K, P = _dialects()
    bare = J.optimizer_to_neutral(OptimizerState(kind="optax"), None)
    assert "ckptcore_jax.Ref(state, tx=tx)" in bare.unsupported[0]
    assert J.optimizer_to_neutral(OptimizerState(kind="adam", hyperparams={"learning_rate": 1e-3, "eps_root": 1e-8}),
                                  None).unsupported
    rms = T.optimizer_to_neutral(OptimizerState(kind="rmsprop", hyperparams={"lr": 1e-3}), None)
    with pytest.raises(MigrationError, match="no Optax optimizer is built"):
        J.optimizer_from_neutral(rms)
