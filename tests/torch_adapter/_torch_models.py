"""Shared helpers of the torch suite: tiny models, fixed data, the optimizers and schedulers the
adapter supports, a deterministic training step, and bitwise snapshots of live objects (read from
torch itself, never through the adapter).

Importing this imports torch: torch tests only (never in a process that imports Paddle or TF).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

torch.set_num_threads(1)

FEATURES, CLASSES, VOCAB, SEQ = 6, 3, 11, 4
X = torch.from_numpy(np.random.default_rng(0).standard_normal((8, FEATURES)).astype(np.float32))
Y = torch.from_numpy(np.random.default_rng(1).integers(0, CLASSES, 8).astype(np.int64))
TOKENS = torch.from_numpy(np.random.default_rng(2).integers(0, VOCAB, (8, SEQ)).astype(np.int64))


class Mixed(torch.nn.Module):
    """Linear + BatchNorm + Dropout + Embedding + LSTM + a tied output weight: every kind of state
    (buffers, num_batches_tracked, RNG-driven dropout, a tensor under two names)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 5)
        self.lstm = torch.nn.LSTM(5, 5, batch_first=True)
        self.fc = torch.nn.Linear(FEATURES, 5)
        self.bn = torch.nn.BatchNorm1d(5)
        self.drop = torch.nn.Dropout(0.3)
        self.out = torch.nn.Linear(5, VOCAB, bias=False)
        self.out.weight = self.emb.weight  # tied: one tensor, two state_dict names
        self.head = torch.nn.Linear(VOCAB, CLASSES)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn(self.fc(x))))
        if tokens is not None:
            seq, _ = self.lstm(self.emb(tokens))
            h = h + seq[:, -1]
        return self.head(self.out(h))


class Reordered(Mixed):
    """The same state_dict names as :class:`Mixed`, its parameters registered in another order."""

    def __init__(self) -> None:
        torch.nn.Module.__init__(self)
        self.head = torch.nn.Linear(VOCAB, CLASSES)
        self.drop = torch.nn.Dropout(0.3)
        self.bn = torch.nn.BatchNorm1d(5)
        self.fc = torch.nn.Linear(FEATURES, 5)
        self.lstm = torch.nn.LSTM(5, 5, batch_first=True)
        self.emb = torch.nn.Embedding(VOCAB, 5)
        self.out = torch.nn.Linear(5, VOCAB, bias=False)
        self.out.weight = self.emb.weight


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                               torch.nn.Linear(8, CLASSES))


def mixed(seed: int = 0, cls: type = Mixed) -> torch.nn.Module:
    torch.manual_seed(seed)
    return cls()


# Every optimizer the adapter supports, by the name tests parametrize over, with two parameter
# groups of different lr/weight_decay where the optimizer takes weight decay.
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9),
    "sgd_nesterov": lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda g: torch.optim.Adam(g, lr=0.01),
    "adam_amsgrad": lambda g: torch.optim.Adam(g, lr=0.01, amsgrad=True),
    "adamw": lambda g: torch.optim.AdamW(g, lr=0.01),
    "rmsprop": lambda g: torch.optim.RMSprop(g, lr=0.01, centered=True, momentum=0.5),
    "adagrad": lambda g: torch.optim.Adagrad(g, lr=0.05),
    "adadelta": lambda g: torch.optim.Adadelta(g, lr=1.0),
    "adamax": lambda g: torch.optim.Adamax(g, lr=0.01),
    "nadam": lambda g: torch.optim.NAdam(g, lr=0.01),
    "radam": lambda g: torch.optim.RAdam(g, lr=0.01),
    "asgd": lambda g: torch.optim.ASGD(g, lr=0.01, t0=1),
    "rprop": lambda g: torch.optim.Rprop(g, lr=0.01),
}


def groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Two parameter groups: the head with its own lr and weight decay, everything else."""
    head = [p for n, p in model.named_parameters() if n.startswith("head.") or n.startswith("3.")]
    ids = {id(p) for p in head}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [{"params": rest}, {"params": head, "lr": 0.003, "weight_decay": 0.01}]


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    return OPTIMIZERS[name](groups(model))


# Every built-in LR scheduler, built on an optimizer (steps: one scheduler step per train step).
SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.9 ** e),
    "MultiplicativeLR": lambda o: torch.optim.lr_scheduler.MultiplicativeLR(o, lambda e: 0.95),
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[2, 4, 5], gamma=0.5),
    "ConstantLR": lambda o: torch.optim.lr_scheduler.ConstantLR(o, factor=0.5, total_iters=4),
    "LinearLR": lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.2, total_iters=5),
    "ExponentialLR": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
    "PolynomialLR": lambda o: torch.optim.lr_scheduler.PolynomialLR(o, total_iters=8, power=2.0),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5, eta_min=1e-4),
    "CosineAnnealingWarmRestarts": lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(
        o, T_0=2, T_mult=2, eta_min=1e-4),
    "CyclicLR": lambda o: torch.optim.lr_scheduler.CyclicLR(o, base_lr=0.001, max_lr=0.01, step_size_up=2,
                                                           cycle_momentum=False),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.02, total_steps=10),
    "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8)], milestones=[2]),
    "ChainedScheduler": lambda o: torch.optim.lr_scheduler.ChainedScheduler(
        [torch.optim.lr_scheduler.ConstantLR(o, factor=0.5, total_iters=3),
         torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9)]),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5,
                                                                              threshold=10.0),
}


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, scheduler: Any = None,
          tokens: bool = False) -> list[float]:
    """``steps`` deterministic steps on the fixed data; the scheduler steps once per step."""
    model.train()
    losses = []
    for _ in range(steps):
        out = model(X, TOKENS) if tokens else model(X)
        loss = torch.nn.functional.cross_entropy(out, Y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                scheduler.step(loss.item())
            else:
                scheduler.step()
        losses.append(loss.item())
    return losses


def model_arrays(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Every state_dict tensor, as torch itself holds it (bitwise copies)."""
    return {k: v.detach().cpu().clone().numpy() for k, v in model.state_dict().items()}


def optimizer_arrays(opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """Every optimizer state tensor by (index, key), in torch's own order, and every group's lr."""
    sd = opt.state_dict()
    out = {f"{i}/{k}": v.detach().cpu().clone().numpy() for i, st in sorted(sd["state"].items())
           for k, v in sorted(st.items()) if isinstance(v, torch.Tensor)}
    for i, g in enumerate(sd["param_groups"]):
        out[f"group{i}/lr"] = np.asarray(float(g["lr"]), dtype=np.float64)
    return out


def assert_same(expected: dict[str, np.ndarray], got: dict[str, np.ndarray], what: str) -> None:
    assert list(expected) == list(got), f"{what}: names differ: {list(expected)} vs {list(got)}"
    for k in expected:
        e, g = np.asarray(expected[k]), np.asarray(got[k])
        assert e.dtype == g.dtype and e.shape == g.shape, f"{what}: {k} {e.dtype}{e.shape} vs {g.dtype}{g.shape}"
        assert e.tobytes() == g.tobytes(), f"{what}: {k} differs"
