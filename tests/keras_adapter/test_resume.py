"""Train k steps, capture, resume in a new process, train m more: bitwise equal to k+m steps.

Covers Sequential (Conv/BatchNorm/Dropout, Adam with ExponentialDecay), functional
(SGD Nesterov momentum, LayerNorm, Dropout), subclassed (Embedding/GRU, centered
RMSprop with momentum), Keras' ``gradient_accumulation_steps=4`` and a custom
``train_step``'s accumulation (both interrupted mid-window), and a LossScaleOptimizer
whose scale grows during the run.  The fresh process builds its models from other
seeds, so every value must come from the state; the RNG draws after the run
(Python, numpy, Keras' and TensorFlow's global generators) must match too.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorflow")

SCENARIOS = ["seq_adam_decay_bn_dropout", "functional_sgd_nesterov", "subclassed_rmsprop_gru",
             "keras_accumulation_4", "loss_scale_optimizer", "train_step_accumulation"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, run_python_module):
    out = tmp_path_factory.mktemp("resume")
    run = run_python_module
    run("_keras_resume_worker.py", "first", str(out))
    run("_keras_resume_worker.py", "second", str(out))
    return out


def _load(path) -> list[np.ndarray]:
    with np.load(path) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


@pytest.mark.parametrize("name", SCENARIOS)
def test_resume_in_new_process_is_bitwise_equal(resumed, name):
    from _keras_helpers import assert_same_bits

    first = _load(resumed / f"{name}.first.npz")
    second = _load(resumed / f"{name}.second.npz")
    assert len(first) > 8
    assert_same_bits(first, second, name)


def test_control_dropout_seed_state_matters(resumed):
    from _keras_helpers import same_bits

    name = "seq_adam_decay_bn_dropout"
    first = _load(resumed / f"{name}.first.npz")
    control = _load(resumed / f"{name}.control.npz")
    assert not all(same_bits(a, b) for a, b in zip(first, control))
