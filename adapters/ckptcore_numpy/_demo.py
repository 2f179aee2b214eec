"""The ``ckpt demo`` model: softmax regression trained by SGD with momentum on batches augmented
with noise from a ``numpy.random.Generator`` whose state is part of the checkpoint."""

from __future__ import annotations

import numpy as np

from ckptcore.adapter import DemoProgram

from ._framework import SGD, Model

__all__ = ["demo"]

NOISE = np.float32(0.1)


def demo(*, seed: int, features: int, classes: int) -> DemoProgram:
    model = Model({"dense/kernel": np.zeros((features, classes), np.float32),
                   "dense/bias": np.zeros(classes, np.float32)})
    optimizer = SGD(0.1, momentum=0.9)
    aug = np.random.default_rng(seed + 116)  # augmentation noise: restored with the checkpoint
    w, b = model.params["dense/kernel"], model.params["dense/bias"]

    def train_step(x: np.ndarray, y: np.ndarray) -> None:
        x = x + aug.standard_normal(x.shape).astype(np.float32) * NOISE
        logits = x @ w + b
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(len(y)), y] -= 1
        optimizer.step(model, {"dense/kernel": x.T @ p / np.float32(len(y)), "dense/bias": p.mean(0)})

    return DemoProgram(
        description="softmax regression in NumPy with SGD momentum and augmentation noise",
        objects={"model": model, "optimizer": optimizer, "generators": {"aug": aug}},
        train_step=train_step)
