"""Capture after k steps in one process, restore in another whose name counters differ, train on:
parameters, optimizer accumulators, learning rates, losses and RNG draws are bitwise equal."""

from __future__ import annotations

import json

import numpy as np
import pytest

from _paddle_util import run_worker

OPTIMIZERS = ["adam", "adamw", "momentum", "rmsprop", "adagrad"]
SCHEDULERS = ["constant", "ExponentialDecay", "StepDecay", "NaturalExpDecay", "PiecewiseDecay",
              "MultiStepDecay", "PolynomialDecay", "CosineAnnealingDecay", "LinearWarmup", "InverseTimeDecay",
              "CosineAnnealingWarmRestarts", "OneCycleLR", "CyclicLR", "NoamDecay", "LinearLR",
              "ReduceOnPlateau", "LambdaDecay", "MultiplicativeDecay"]
K = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("roundtrip")
    run_worker("train", d)
    run_worker("resume", d)
    return d, json.loads((d / "train.json").read_text()), json.loads((d / "resume.json").read_text())


def _arrays(d, key, phase):
    with np.load(d / "states" / f"{key}.{phase}.npz") as z:
        return {k: z[k] for k in z.files}


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)), f"{k} differs"


@pytest.mark.parametrize("sch", SCHEDULERS)
@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_resume_in_new_process_is_bitwise(runs, opt, sch):
    d, train, resume = runs
    key = f"{opt}+{sch}"
    a, b = train[key], resume[key]
    assert "error" not in a, a.get("error")
    assert "error" not in b, b.get("error")
    assert b["report"] == [[], []]
    assert a["lrs"] == b["lrs"] and a["losses"] == b["losses"] and a["last_lr"] == b["last_lr"]
    assert a["draws"] == b["draws"]  # paddle, numpy (DataLoader order), python, dropout
    final_a, final_b = _arrays(d, key, "train"), _arrays(d, key, "resume")
    assert any(k.startswith("final/slot/") for k in final_a)
    _assert_bitwise(final_a, final_b)


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_step_count_is_recorded(runs, opt):
    _, train, _ = runs
    for sch in SCHEDULERS:
        info = train[f"{opt}+{sch}"]
        if opt in ("adam", "adamw"):
            assert (info["step"], info["step_source"]) == (K, "beta_pow_acc")
        elif sch == "constant":
            assert (info["step"], info["step_source"]) == (0, "none")
        else:
            assert (info["step"], info["step_source"]) == (K, "scheduler")
        if sch != "constant":
            assert info["schedule"] == [sch, K]


def test_gradient_accumulation_window_resumes_bitwise(runs):
    d, train, resume = runs
    a, b = train["special+accumulation"], resume["special+accumulation"]
    assert "error" not in a and "error" not in b, (a.get("error"), b.get("error"))
    assert a["accumulation"][:2] == [4, 2] and "fc1.weight" in a["accumulation"][2]
    assert b["report"] == [[], []]
    arrays_a, arrays_b = _arrays(d, "special+accumulation", "train"), _arrays(d, "special+accumulation", "resume")
    assert any(k.startswith("grad/") for k in arrays_a)
    _assert_bitwise(arrays_a, arrays_b)  # the restored p.grad values and the final state


def test_zero_gradients_keep_updating_an_unused_layer(runs):
    d, train, resume = runs
    assert "error" not in train["special+branch"] and "error" not in resume["special+branch"]
    a, b = _arrays(d, "special+branch", "train"), _arrays(d, "special+branch", "resume")
    _assert_bitwise(a, b)
