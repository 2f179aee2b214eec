"""Subprocess worker for test_resume.py.

``first <dir>``: for each scenario, train k steps, capture, pickle the state, train m
more steps (the uninterrupted run) and save every value plus one draw per RNG.
``second <dir>``: for each scenario, build a fresh model from other seeds, restore
the pickled state, train the same m steps and save the same values.
"""

from __future__ import annotations

import os
import pickle
import sys

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import ckptcore_keras  # noqa: E402
from _keras_helpers import SCENARIOS, batches, draw_all, seed_everything, snapshot  # noqa: E402


def main(phase: str, out: str) -> None:
    for name, (build, kind, k, m) in SCENARIOS.items():
        data = batches(kind, k + m)
        seed_everything(1 if phase == "first" else 2)
        model = build()
        draw_all()  # creates the global generators and moves them on
        if phase == "first":
            for x, y in data[:k]:
                model.train_on_batch(x, y)
            state = ckptcore_keras.capture(model)
            with open(os.path.join(out, f"{name}.pkl"), "wb") as f:
                pickle.dump(state, f)
        else:
            with open(os.path.join(out, f"{name}.pkl"), "rb") as f:
                state = pickle.load(f)
            report = ckptcore_keras.restore(state, model)
            assert report.ok, report
        for x, y in data[k:]:
            model.train_on_batch(x, y)
        values = snapshot(model) + draw_all()
        np.savez(os.path.join(out, f"{name}.{phase}.npz"), *values)
        if phase == "second" and name == CONTROL:
            np.savez(os.path.join(out, f"{name}.control.npz"), *control(state, build, data[k:]))
        print(name, "done")


CONTROL = "seq_adam_decay_bn_dropout"


def control(state, build, data) -> list[np.ndarray]:
    """The same resume with the Dropout seed state off by one draw: it must not match."""
    state.model = dict(state.model)
    key = next(n for n in state.model if n.endswith("seed_generator_state"))
    state.model[key] = state.model[key] + np.array([0, 1], state.model[key].dtype)
    model = build()
    ckptcore_keras.restore(state, model)
    for x, y in data:
        model.train_on_batch(x, y)
    return snapshot(model)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
