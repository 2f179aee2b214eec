"""Tiny models and a short training loop for the torch file tests."""

from __future__ import annotations

import torch


def build(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 3, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
