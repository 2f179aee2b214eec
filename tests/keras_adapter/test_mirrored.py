"""A MirroredStrategy custom loop on two logical CPUs, saved with ckptcore.CheckpointManager.

The logical devices must be configured before TensorFlow initializes, so the
strategy side runs in its own process; the strategy-free restore runs in another.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("tensorflow")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_python_module):
    out = tmp_path_factory.mktemp("mirrored")
    run_python_module("_keras_mirrored_worker.py", "strategy", str(out))
    run_python_module("_keras_mirrored_worker.py", "plain", str(out))
    return out


def _json(path):
    return json.loads(path.read_text())


def _npz(path):
    with np.load(path) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


def test_strategy_process_round_trips(runs):
    result = _json(runs / "strategy.json")
    assert result["same_weights"], "restore without a strategy differs (same process)"
    assert result["replicas_ok"], "a replica of a mirrored variable was not restored"
    assert result["same_after_round_trip"]
    assert result["resumed_same"], "a strategy run resumed from its mid-epoch checkpoint differs"
    assert result["accuracy"] == result["plain_accuracy"] == result["mirrored_accuracy"]


def test_restore_without_strategy_in_new_process(runs):
    from _keras_helpers import assert_same_bits

    strategy, plain = _json(runs / "strategy.json"), _json(runs / "plain.json")
    assert strategy["accuracy"] > 0.2  # learned something, so equal accuracies mean something
    assert plain["accuracy"] == strategy["accuracy"]
    assert_same_bits(_npz(runs / "strategy.npz"), _npz(runs / "plain.npz"), "weights")
    assert np.array_equal(np.load(runs / "predictions.strategy.npy"), np.load(runs / "predictions.plain.npy"))
