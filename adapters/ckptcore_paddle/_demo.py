"""The ``ckpt demo`` model: a tiny Paddle MLP with Dropout, trained by Adam, seeded."""

from __future__ import annotations

import numpy as np

from ckptcore.adapter import DemoProgram

__all__ = ["demo"]


def demo(*, seed: int, features: int, classes: int) -> DemoProgram:
    import paddle

    paddle.seed(seed)
    net = paddle.nn.Sequential(paddle.nn.Linear(features, 16), paddle.nn.ReLU(),
                               paddle.nn.Dropout(0.2), paddle.nn.Linear(16, classes))
    opt = paddle.optimizer.Adam(learning_rate=0.01, parameters=net.parameters())

    def train_step(x: np.ndarray, y: np.ndarray) -> None:
        loss = paddle.nn.functional.cross_entropy(net(paddle.to_tensor(x)),
                                                  paddle.to_tensor(y.astype(np.int64)))
        loss.backward()
        opt.step()
        opt.clear_grad()

    return DemoProgram(description="a Paddle MLP with Dropout and Adam",
                       objects={"model": net, "optimizer": opt}, train_step=train_step)
