"""The ``ckpt demo`` model: a tiny PyTorch MLP with Dropout, trained by Adam, seeded."""

from __future__ import annotations

import numpy as np

from ckptcore.adapter import DemoProgram

__all__ = ["demo"]


def demo(*, seed: int, features: int, classes: int) -> DemoProgram:
    import torch

    torch.set_num_threads(1)  # a demo on a laptop: no thread pool to spin up, same bits either way
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(features, 16), torch.nn.ReLU(),
                              torch.nn.Dropout(0.2), torch.nn.Linear(16, classes))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)

    def train_step(x: np.ndarray, y: np.ndarray) -> None:
        net.train()
        loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(np.ascontiguousarray(x))),
                                                 torch.from_numpy(y.astype(np.int64)))
        loss.backward()
        opt.step()
        opt.zero_grad()

    return DemoProgram(description="a PyTorch MLP with Dropout and Adam",
                       objects={"model": net, "optimizer": opt}, train_step=train_step)
