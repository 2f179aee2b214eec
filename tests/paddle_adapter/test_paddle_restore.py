"""Single-process Paddle behaviours (run together in one worker): DataParallel names, strict mode,
typed mismatch errors, GradScaler, hapi Model, ParamInfo, step counting, optimizer lifecycle."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from _paddle_util import run_worker

SCENARIOS = ["dataparallel_names", "strict_and_report", "mismatch_errors", "grad_scaler",
             "hapi_model_and_handles", "param_info", "step_counting", "optimizer_lifecycle",
             "cursor_and_plain_values", "core_save_load", "schedule_state", "capture_error",
             # _fit_scenarios.py: DataLoaders that prefetch, and the hapi callback
             "loader_prefetch_and_workers", "fit_accumulate_resume", "fit_finished_run_trains_nothing",
             "fit_epoch_checkpoints_without_cursor"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("scenarios")
    run_worker("scenarios", d)
    return json.loads((d / "scenarios.json").read_text())


def test_every_scenario_ran(results):
    assert sorted(results) == sorted(SCENARIOS)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(results, name):
    r = results[name]
    if r["ok"] is None:
        pytest.skip(r["error"])
    assert r["ok"], r["error"]


def test_two_process_dataparallel_on_cpu(tmp_path):
    """Paddle's gloo backend runs here: 2 ranks train, capture, and share names with the plain model."""
    run_worker("dataparallel", tmp_path)
    states = [pickle.loads((tmp_path / f"dp_rank{r}.pkl").read_bytes()) for r in (0, 1)]
    assert list(states[0].model) == list(states[1].model)
    assert not any("_layers" in k for k in states[0].model)
    for k, v in states[0].model.items():
        if not k.startswith("bn._"):  # DataParallel syncs gradients, not batch-norm statistics
            assert np.array_equal(v, states[1].model[k]), k
    for p, slots in states[0].optimizer.slots.items():
        for s, v in slots.items():
            assert np.array_equal(v, states[1].optimizer.slots[p][s]), (p, s)
    out = json.loads((tmp_path / "dataparallel.json").read_text())
    assert out == {"report": [[], []], "equal": True}
