"""PyTorch <-> Keras and PyTorch <-> Paddle migration (the triangle's torch sides).

Worker tests: each framework trains in its own process (``_tworker.py``, ``_kworker.py torch``,
``_pworker.py <dir> {} torch``; see ``conftest.torch_migration_results``).  Each twin runs 5 steps in
its source framework, is migrated, and continues for 5 more steps on the same batches in the
target and in the source.  Compared: inference logits right after migration, and after the 5 steps
the training-mode logits (batch statistics: every trainable weight enters them) and, for the
Transformer (no BatchNorm), the inference logits.  With BatchNorm, inference logits after more
training drift slightly because torch updates running_var with the unbiased batch variance and
Keras/Paddle with the biased one: migration says so in a warning, and the drift is bounded here.

Unit tests: the torch dialect in-process (pure NumPy, torch is never imported here).
"""

from __future__ import annotations

import numpy as np
import pytest

from _common import TORCH_TWINS
from ckptcore.errors import MigrationError
from ckptcore.migrate import convert_state
from ckptcore.migrate.rng import mt19937_state
from ckptcore.state import OptimizerState, ParamInfo, ScheduleState, TrainingState

BN_TWINS = [n for n in TORCH_TWINS if n != "transformer"]
# (results file, task, key format): torch -> Keras/Paddle are continued by those workers,
# Keras/Paddle -> torch by the torch worker.
DIRECTIONS = {"torch->keras": ("keras_torch", "torch_pairs", "{}"),
              "torch->paddle": ("paddle_torch", "torch_pairs", "{}"),
              "keras->torch": ("torch_target", "twins_target", "keras/{}"),
              "paddle->torch": ("torch_target", "twins_target", "paddle/{}")}
EXACT = 1e-5


def result(results: dict, direction: str, name: str) -> dict:
    worker, task, key = DIRECTIONS[direction]
    r = results[worker][task]
    if isinstance(r, dict) and isinstance(r.get("error"), str) and "Traceback" in r["error"]:
        pytest.fail(f"{worker}.{task} failed:\n{r['error']}", pytrace=False)
    return r[key.format(name)]


def _pairs():
    for direction in DIRECTIONS:
        for name in TORCH_TWINS:
            if name == "transformer" and "paddle" in direction:
                continue   # Paddle's MultiHeadAttention is four Linear layers to its adapter: see below
            yield direction, name


@pytest.mark.parametrize("direction, name", list(_pairs()))
def test_twin_continues_exactly(torch_migration_results, direction, name):
    r = result(torch_migration_results, direction, name)
    assert "error" not in r, r
    assert r["logits_diff"] <= EXACT, r
    assert r["after_train_diff"] <= EXACT, r
    if name == "transformer":
        assert r["after_eval_diff"] <= EXACT, r
        assert r["warnings"] == []
    else:   # the one inexact part, announced: BatchNorm's variance estimator
        (w,) = r["warnings"]
        assert "unbiased batch variance" in w and "biased one" in w or "biased batch variance" in w, w
        assert r["after_eval_diff"] <= 5e-3, r


@pytest.mark.parametrize("direction", ["torch->paddle", "paddle->torch"])
def test_transformer_with_paddle_attention_raises(torch_migration_results, direction):
    err = result(torch_migration_results, direction, "transformer")["error"]
    assert "attn (multi_head_attention) has no counterpart" in err or "attn.q_proj (dense)" in err, err
    assert "q_proj" in err and "in_proj_weight" in err, err


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_symmetric_branches_raise_with_the_name_map(torch_migration_results, direction):
    err = result(torch_migration_results, direction, "branches")["error"]
    assert err and "neither feeds the other" in err and "name_map=" in err, err


def test_torch_schedulers_follow_their_canonical_formula(torch_migration_results):
    r = torch_migration_results["torch_source"]["schedules"]
    assert set(r) >= {"StepLR", "ExponentialLR", "MultiStepLR", "CosineAnnealingLR", "PolynomialLR",
                      "CosineAnnealingWarmRestarts"}
    for kind, x in r.items():
        assert x["formula_diff"] < 1e-12 and x["restored_diff"] < 1e-12, (kind, x)


def test_reseeded_torch_generator_is_manual_seed(torch_migration_results):
    assert torch_migration_results["torch_source"]["rng"] == {"state_equal": True}


def test_torch_trace_records_the_transformer_block(torch_migration_results):
    s = torch_migration_results["torch_source"]["structure"]
    assert s["inputs"]["ln1"] == ["attn", "embed"] and s["inputs"]["attn"] == ["embed"]
    assert s["inputs"]["ln2"] == ["ff2", "ln1"] and s["inputs"]["head"] == ["ln2"]
    assert s["roles"]["attn.in_proj_weight"] == "qkv_kernel"
    assert s["roles"]["attn.out_proj.weight"] == "output_kernel"
    assert s["bn"] == {"momentum": 0.99, "torch_momentum": 0.01, "variance_update": "unbiased"}


def test_ckpt_convert_keras_to_torch(torch_migration_results):
    r = torch_migration_results["torch_target"]["cli"]
    assert r["rc"] == 0 and r["step"] == 5 and r["logits_diff"] <= EXACT, r


# ----------------------------------------------------------------------------- the dialect, in-process


def _dialects():
    from ckptcore_keras._dialect import DIALECT as K
    from ckptcore_paddle._dialect import DIALECT as P
    from ckptcore_torch._dialect import DIALECT as T
    return T, K, P


def _torch_sched(kind, **state):
    return ScheduleState(kind=kind, config={}, step=5, last_lr=0.1, state={"base_lrs": [0.1], "last_epoch": 5,
                                                                         "_last_lr": [0.1], **state})


@pytest.mark.parametrize("torch_kind, state, keras, paddle", [
    ("StepLR", {"step_size": 3, "gamma": 0.5},
     ("ExponentialDecay", {"initial_learning_rate": 0.1, "decay_steps": 3, "decay_rate": 0.5, "staircase": True}),
     ("StepDecay", {"learning_rate": 0.1, "step_size": 3, "gamma": 0.5})),
    ("ExponentialLR", {"gamma": 0.5 ** 0.1},
     ("ExponentialDecay", {"initial_learning_rate": 0.1, "decay_steps": 10, "decay_rate": 0.5}),
     ("ExponentialDecay", {"learning_rate": 0.1, "gamma": 0.5 ** 0.1})),
    ("MultiStepLR", {"milestones": {7: 1, 9: 1}, "gamma": 0.5},
     ("PiecewiseConstantDecay", {"boundaries": [6, 8], "values": [0.1, 0.05, 0.025]}),
     ("MultiStepDecay", {"learning_rate": 0.1, "milestones": [7, 9], "gamma": 0.5})),
    ("CosineAnnealingLR", {"T_max": 16, "eta_min": 0.01},
     ("CosineDecay", {"initial_learning_rate": 0.1, "decay_steps": 16, "alpha": 0.1}),
     ("CosineAnnealingDecay", {"learning_rate": 0.1, "T_max": 16, "eta_min": 0.01})),
    ("PolynomialLR", {"total_iters": 8, "power": 2.0},
     ("PolynomialDecay", {"initial_learning_rate": 0.1, "decay_steps": 8, "end_learning_rate": 0.0, "power": 2.0,
                          "cycle": False}),
     ("PolynomialDecay", {"learning_rate": 0.1, "decay_steps": 8, "end_lr": 0.0, "power": 2.0, "cycle": False})),
    ("CosineAnnealingWarmRestarts", {"T_0": 3, "T_mult": 2, "eta_min": 0.01},
     ("CosineDecayRestarts", {"initial_learning_rate": 0.1, "first_decay_steps": 3, "t_mul": 2.0, "m_mul": 1.0,
                              "alpha": 0.1}),
     ("CosineAnnealingWarmRestarts", {"learning_rate": 0.1, "T_0": 3, "T_mult": 2, "eta_min": 0.01}))])
def test_torch_schedulers_pair_with_keras_and_paddle(torch_kind, state, keras, paddle):
    from ckptcore.migrate.schedules import same
    T, K, P = _dialects()
    t = T.schedule_to_canonical(_torch_sched(torch_kind, **state))
    assert same(t, K.schedule_to_canonical(ScheduleState(kind=keras[0], config=keras[1], step=5)))
    assert same(t, P.schedule_to_canonical(ScheduleState(kind=paddle[0], config=paddle[1], step=5)))
    moved, _ = T.schedule_from_canonical(t, _torch_sched(torch_kind, **state), 9, 0.07)
    assert moved.state["last_epoch"] == 9 and moved.state["_last_lr"] == [0.07] and moved.state["base_lrs"] == [0.1]


def _torch_opt(kind, **hp):
    return OptimizerState(kind=kind, step=4, hyperparams={"lr": 0.01, **hp}, slots={}, extra={"param_groups": [
        {"params": ["w"], "lr": 0.01, **hp}], "step_source": "slots"})


def test_torch_optimizer_conventions():
    T, K, P = _dialects()
    adam = T.optimizer_to_neutral(_torch_opt("adam", betas=[0.9, 0.999], eps=1e-8), None)
    assert adam.family == "adam" and adam.hp["eps_mode"] == "corrected" and adam.hp["coupled_wd"] == 0.0
    kadam = T.optimizer_to_neutral(_torch_opt("adam", eps=1e-7, eps_mode="uncorrected"), None)
    assert kadam.hp["eps_mode"] == "uncorrected"
    adamw = T.optimizer_to_neutral(_torch_opt("adamw", weight_decay=0.05), None)
    assert adamw.hp["decoupled_wd"] == 0.05 and adamw.hp["coupled_wd"] == 0.0
    l2 = T.optimizer_to_neutral(_torch_opt("sgd", momentum=0.9, weight_decay=1e-4), None)
    assert l2.hp["coupled_wd"] == 1e-4 and l2.hp["momentum_form"] == "gradient"
    assert T.optimizer_to_neutral(_torch_opt("sgd", momentum=0.9, dampening=0.1), None).unsupported
    assert T.optimizer_to_neutral(_torch_opt("adagrad", lr_decay=0.1), None).unsupported
    assert T.optimizer_to_neutral(_torch_opt("adam", maximize=True), None).unsupported
    assert T.optimizer_to_neutral(_torch_opt("lbfgs"), None).unsupported
    rms = T.optimizer_to_neutral(_torch_opt("rmsprop", alpha=0.99, momentum=0.5, eps=1e-8), None)
    assert rms.hp["rho"] == 0.99 and rms.hp["eps_mode"] == "outside_sqrt"
    buf = np.arange(3, dtype=np.float32)
    neutral = T.slots_to_neutral(rms, {"square_avg": buf, "momentum_buffer": buf, "step": np.float32(4)})
    np.testing.assert_allclose(neutral["mom"], buf * 0.01)    # Keras/Paddle fold lr into RMSprop momentum
    back = T.slots_from_neutral(rms, neutral, source=rms, like=buf, current=None)
    np.testing.assert_allclose(back["momentum_buffer"], buf, rtol=1e-6)
    assert back["step"].dtype == np.float32 and back["step"] == 4


def _one_dense(framework: str, layout: str, shape: tuple, opt: OptimizerState | None) -> TrainingState:
    w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    info = ParamInfo(0, "fc", "dense", "kernel", layout, {})
    return TrainingState(framework=framework, model={"fc.w": w}, params={"fc.w": info}, optimizer=opt)


def test_torch_linear_and_adam_slots_to_paddle_and_back():
    src = _one_dense("torch", "oi", (3, 2), None)
    src.optimizer = OptimizerState(kind="adam", step=4, hyperparams={"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8},
                                   slots={"fc.w": {"exp_avg": src.model["fc.w"] + 1, "exp_avg_sq": src.model["fc.w"] + 2,
                                                   "step": np.asarray(4.0, np.float32)}},
                                   extra={"step_source": "slots"})
    tmpl = _one_dense("paddle", "io", (2, 3), OptimizerState(kind="adam", hyperparams={"learning_rate": 1e-3,
                                                                                        "epsilon": 1e-8}))
    out = convert_state(src, tmpl, warn=False)
    np.testing.assert_array_equal(out.model["fc.w"], src.model["fc.w"].T)
    np.testing.assert_array_equal(out.optimizer.slots["fc.w"]["moment1"], (src.model["fc.w"] + 1).T)
    assert out.extra["migration"]["warnings"] == []   # torch Adam and Paddle Adam add eps alike
    back = convert_state(out, _one_dense("torch", "oi", (3, 2), OptimizerState(
        kind="adam", hyperparams={"lr": 1e-3, "eps": 1e-8}, extra={"param_groups": [{"params": ["fc.w"], "lr": 1e-3}]})),
        warn=False)
    np.testing.assert_array_equal(back.model["fc.w"], src.model["fc.w"])
    assert float(back.optimizer.slots["fc.w"]["step"]) == 4.0
    with pytest.warns(Warning, match="epsilon"):   # torch Adam -> Keras Adam: announced, with a bound
        convert_state(src, _one_dense("keras", "io", (2, 3), OptimizerState(kind="adam", hyperparams={
            "learning_rate": 1e-3})))


def test_unmatched_layers_raise():
    src = _one_dense("torch", "oi", (3, 2), None)
    tmpl = _one_dense("keras", "io", (5, 3), None)
    with pytest.raises(MigrationError, match="fc"):
        convert_state(src, tmpl)


def test_mt19937_state_reference_words():
    # std::mt19937(5489): the reference implementation's default seed; its state's second word
    words = mt19937_state(5489)
    assert len(words) == 624 and words[0] == 5489 and words[1] == 1301868182
