"""Both halves of the round trips in test_paddle_roundtrip.py.

``python _roundtrip.py DIR`` is the first half, in a fresh process: for every optimizer and
scheduler, K steps, a capture (pickled to ``DIR/<key>.pkl``), then N more steps whose learning
rates, losses, RNG draws and final values go to ``DIR/<key>.json`` / ``DIR/<key>.npz``.  The tests
then restore each capture in the pytest process, whose runtime names differ, and compare.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import sys

import numpy as np
import paddle

import ckptcore_paddle as cp
from _models import OPTIMIZERS, SCHEDULERS, Tiny, make, shift_name_counters, snapshot, train_step

K, N = 3, 3  # steps before the capture, steps after it
COMBOS = [(o, s) for o in OPTIMIZERS for s in SCHEDULERS]
SPECIAL = ["accumulation", "branch"]


def batches(idx: int, n: int = K + N) -> list[np.ndarray]:
    rs = np.random.RandomState(1000 + idx)
    return [rs.randn(6, 4).astype("float32") for _ in range(n)]


def draws() -> dict[str, list]:
    """Values that depend on every RNG the adapter captures (DataLoader order = numpy's legacy RNG)."""
    ds = paddle.io.TensorDataset([paddle.arange(10, dtype="float32")])
    order = [b[0].numpy().astype(int).tolist() for b in paddle.io.DataLoader(ds, batch_size=3, shuffle=True)]
    return {"paddle": paddle.rand([3]).numpy().tolist(), "numpy": np.random.rand(3).tolist(),
            "python": [random.random() for _ in range(3)], "loader": order,
            "dropout": paddle.nn.functional.dropout(paddle.ones([8]), 0.5).numpy().tolist()}


def combo(o: str, s: str, idx: int, state=None) -> tuple[dict, dict]:
    """Train (``state`` None: K steps, capture) or resume (restore ``state``), then N more steps."""
    xs = batches(idx)
    paddle.seed(idx if state is None else idx + 5000)  # the restore must overwrite everything
    if state is not None:
        shift_name_counters(o)
    model, opt, sch = make(o, s)
    info: dict = {}
    if state is None:
        for x in xs[:K]:
            train_step(model, opt, sch, x)
        state = cp.capture(model, opt)
        info["state"] = state
        info["step"], info["step_source"] = state.optimizer.step, state.optimizer.extra["step_source"]
        info["schedule"] = None if state.schedule is None else [state.schedule.kind, state.schedule.step]
    else:
        report = cp.restore(state, model, opt)
        info["report"] = [list(report.missing), list(report.unexpected)]
    info["draws"] = draws()
    info["lrs"], info["losses"] = [], []
    for x in xs[K:]:
        info["lrs"].append(opt.get_lr())
        info["losses"].append(train_step(model, opt, sch, x))
    info["last_lr"] = None if sch is None else sch.last_lr
    return info, snapshot(model, opt)


def accumulation(idx: int, state=None) -> tuple[dict, dict]:
    """Captured inside a 4-batch gradient-accumulation window, after its second micro-batch."""
    xs = batches(idx, 16)
    if state is not None:
        shift_name_counters("momentum")
    model, opt, sch = make("momentum", "PolynomialDecay")
    info: dict = {}
    arrays: dict = {}
    if state is not None:
        report = cp.restore(state, model, opt)
        info["report"] = [list(report.missing), list(report.unexpected)]
        for k, p in model.state_dict().items():
            if k in state.accumulation.buffers:
                arrays[f"grad/{k}"] = p.grad.numpy()
    for i in range(6, 16) if state is not None else range(16):
        (model(paddle.to_tensor(xs[i])).square().mean() / 4).backward()
        if (i + 1) % 4 == 0:
            opt.step()
            opt.clear_grad()
            sch.step()
        if state is None and i == 5:
            info["state"] = captured = cp.capture(model, opt, accumulate_every=4, accumulated=2)
            acc = captured.accumulation
            info["accumulation"] = [acc.every, acc.count, sorted(acc.buffers)]
            arrays.update({f"grad/{k}": v for k, v in acc.buffers.items()})
    arrays.update(snapshot(model, opt))
    return info, arrays


def branch(idx: int, state=None) -> tuple[dict, dict]:
    """A layer that stops being used after the capture keeps being updated by Adam through its
    zero gradient (so the zero gradients must be restored as zeros, not as None)."""
    xs = batches(idx, 16)
    if state is not None:
        shift_name_counters("adam")
    model, opt, sch = make("adam", "constant", model=Tiny(extra=True))
    info: dict = {}
    if state is not None:
        cp.restore(state, model, opt)
    for i in range(K, 2 * K) if state is not None else range(2 * K):
        model.use_extra = i < K
        train_step(model, opt, sch, xs[i])
        if state is None and i == K - 1:
            info["state"] = cp.capture(model, opt)
    return info, snapshot(model, opt)


def run(key: str, idx: int, state=None) -> tuple[dict, dict]:
    if key == "accumulation":
        return accumulation(idx, state)
    if key == "branch":
        return branch(idx, state)
    o, s = key.split("+")
    return combo(o, s, idx, state)


def keys() -> list[str]:
    return [f"{o}+{s}" for o, s in COMBOS] + SPECIAL


def train_all(d: str) -> None:
    for idx, key in enumerate(keys()):
        info, arrays = run(key, idx)
        with open(os.path.join(d, f"{key}.pkl"), "wb") as f:
            pickle.dump(info.pop("state"), f)
        with open(os.path.join(d, f"{key}.json"), "w") as f:
            json.dump(info, f)
        np.savez(os.path.join(d, f"{key}.npz"), **arrays)


if __name__ == "__main__":
    train_all(sys.argv[1])
