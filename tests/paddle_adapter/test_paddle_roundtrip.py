"""Capture after K steps in one process, restore in another (this one) whose runtime names differ,
train on: parameters, optimizer accumulators, learning rates, losses and RNG draws are bitwise equal."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

pytest.importorskip("paddle", reason="paddlepaddle is not installed")

import _roundtrip  # noqa: E402
from _roundtrip import K, keys  # noqa: E402

KEYS = keys()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, run_python_module):
    d = tmp_path_factory.mktemp("roundtrip")
    run_python_module("_roundtrip.py", d, timeout=900)
    return d


def _first_half(d, key):
    with np.load(d / f"{key}.npz") as z:
        arrays = {k: z[k] for k in z.files}
    return (json.loads((d / f"{key}.json").read_text()), arrays,
            pickle.loads((d / f"{key}.pkl").read_bytes()))


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)), f"{k} differs"


@pytest.mark.parametrize("key", [k for k in KEYS if "+" in k])
def test_resume_in_new_process_is_bitwise(trained, key):
    a, final_a, state = _first_half(trained, key)
    b, final_b = _roundtrip.run(key, KEYS.index(key), state)
    assert b["report"] == [[], []]
    assert a["lrs"] == b["lrs"] and a["losses"] == b["losses"] and a["last_lr"] == b["last_lr"]
    assert a["draws"] == b["draws"]  # paddle, numpy (DataLoader order), python, dropout
    assert any(k.startswith("slot/") for k in final_a)
    _assert_bitwise(final_a, final_b)


@pytest.mark.parametrize("opt", sorted({k.split("+")[0] for k in KEYS if "+" in k}))
def test_step_count_is_recorded(trained, opt):
    for key in KEYS:
        if not key.startswith(opt + "+"):
            continue
        sch = key.split("+")[1]
        info = json.loads((trained / f"{key}.json").read_text())
        if opt in ("adam", "adamw"):
            assert (info["step"], info["step_source"]) == (K, "beta_pow_acc")
        elif sch == "constant":
            assert (info["step"], info["step_source"]) == (0, "none")
        else:
            assert (info["step"], info["step_source"]) == (K, "scheduler")
        if sch != "constant":
            assert info["schedule"] == [sch, K]


def test_gradient_accumulation_window_resumes_bitwise(trained):
    a, arrays_a, state = _first_half(trained, "accumulation")
    assert a["accumulation"][:2] == [4, 2] and "fc1.weight" in a["accumulation"][2]
    b, arrays_b = _roundtrip.run("accumulation", KEYS.index("accumulation"), state)
    assert b["report"] == [[], []]
    assert any(k.startswith("grad/") for k in arrays_a)
    _assert_bitwise(arrays_a, arrays_b)  # the restored p.grad values and the final state


def test_zero_gradients_keep_updating_an_unused_layer(trained):
    _, a, state = _first_half(trained, "branch")
    _, b = _roundtrip.run("branch", KEYS.index("branch"), state)
    _assert_bitwise(a, b)
