"""Tiny Paddle models, optimizers and schedulers shared by the tests and their subprocesses (imports Paddle)."""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn
from paddle.optimizer import lr as L

OPTIMIZERS = {
    "adam": lambda lr, ps: paddle.optimizer.Adam(lr, parameters=ps),
    "adamw": lambda lr, ps: paddle.optimizer.AdamW(lr, parameters=ps, weight_decay=0.05),
    "momentum": lambda lr, ps: paddle.optimizer.Momentum(lr, momentum=0.9, parameters=ps, use_nesterov=True),
    "rmsprop": lambda lr, ps: paddle.optimizer.RMSProp(lr, parameters=ps, momentum=0.5, centered=True),
    "adagrad": lambda lr, ps: paddle.optimizer.Adagrad(lr, parameters=ps, initial_accumulator_value=0.1),
}


def _decay(epoch: int) -> float:
    return 0.9 ** epoch


def _factor(epoch: int) -> float:
    return 0.9


# Every built-in LRScheduler of Paddle 3, including the two built on a callable (LambdaDecay and
# MultiplicativeDecay, whose function cannot be saved: only their position is).
SCHEDULERS = {
    "constant": lambda: None,
    "ExponentialDecay": lambda: L.ExponentialDecay(0.1, 0.9),
    "StepDecay": lambda: L.StepDecay(0.1, 2, 0.5),
    "NaturalExpDecay": lambda: L.NaturalExpDecay(0.1, 0.3),
    "PiecewiseDecay": lambda: L.PiecewiseDecay([2, 4], [0.1, 0.05, 0.01]),
    "MultiStepDecay": lambda: L.MultiStepDecay(0.1, [2, 4], 0.5),
    "PolynomialDecay": lambda: L.PolynomialDecay(0.1, 3, 0.01, 2.0, cycle=True),
    "CosineAnnealingDecay": lambda: L.CosineAnnealingDecay(0.1, 4, 0.01),
    "LinearWarmup": lambda: L.LinearWarmup(L.CosineAnnealingDecay(0.1, 4, 0.01), 2, 0.0, 0.1),
    "InverseTimeDecay": lambda: L.InverseTimeDecay(0.1, 0.5),
    "CosineAnnealingWarmRestarts": lambda: L.CosineAnnealingWarmRestarts(0.1, 2, 2, 0.01),
    "OneCycleLR": lambda: L.OneCycleLR(0.1, 10),
    "CyclicLR": lambda: L.CyclicLR(0.01, 0.1, 2),
    "NoamDecay": lambda: L.NoamDecay(16, 2, 1.0),
    "LinearLR": lambda: L.LinearLR(0.1, 5),
    "ReduceOnPlateau": lambda: L.ReduceOnPlateau(0.1, patience=0, factor=0.5),
    "LambdaDecay": lambda: L.LambdaDecay(0.1, _decay),
    "MultiplicativeDecay": lambda: L.MultiplicativeDecay(0.1, _factor),
}


class Tiny(nn.Layer):
    def __init__(self, extra: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1D(8)
        self.extra = nn.Linear(8, 8) if extra else None
        self.fc2 = nn.Linear(8, 3)
        self.use_extra = extra

    def forward(self, x):
        h = paddle.nn.functional.relu(self.bn(self.fc1(x)))
        if self.use_extra:
            h = paddle.tanh(self.extra(h))
        return self.fc2(h)


class Mnist(nn.Layer):
    """Seed 004's CNN, shrunk to 8x8 inputs: conv, pool, conv, pool, linear."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2D(1, 4, 5, padding=2)
        self.max_pool1 = nn.MaxPool2D(2, 2)
        self.conv2 = nn.Conv2D(4, 4, 5, padding=2)
        self.max_pool2 = nn.MaxPool2D(2, 2)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = self.max_pool1(paddle.nn.functional.relu(self.conv1(x)))
        x = self.max_pool2(paddle.nn.functional.relu(self.conv2(x)))
        return self.fc(paddle.reshape(x, [x.shape[0], 16]))


class SeedCNN(nn.Layer):
    """A small MNIST CNN: conv 1->20 5x5 pad 2, max-pool 2, conv 20->20, max-pool 2, linear 980->10."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2D(in_channels=1, out_channels=20, kernel_size=5, stride=1, padding=2)
        self.max_pool1 = nn.MaxPool2D(kernel_size=2, stride=2)
        self.conv2 = nn.Conv2D(in_channels=20, out_channels=20, kernel_size=5, stride=1, padding=2)
        self.max_pool2 = nn.MaxPool2D(kernel_size=2, stride=2)
        self.fc = nn.Linear(in_features=980, out_features=10)

    def forward(self, x):
        x = self.max_pool1(paddle.nn.functional.relu(self.conv1(x)))
        x = self.max_pool2(paddle.nn.functional.relu(self.conv2(x)))
        return self.fc(paddle.reshape(x, [x.shape[0], 980]))


class Zoo(nn.Layer):
    """One of each layer kind ParamInfo describes."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.conv1d = nn.Conv1D(4, 6, 3)
        self.lstm = nn.LSTM(6, 5, num_layers=2, direction="bidirect")
        self.gru = nn.GRU(10, 3)
        self.ln = nn.LayerNorm([3])
        self.dw = nn.Conv2D(3, 6, 3, groups=3)
        self.convt = nn.Conv2DTranspose(6, 2, 3)
        self.bn = nn.BatchNorm2D(2)


def make(opt_name: str, sch_name: str, *, model: nn.Layer | None = None):
    model = model if model is not None else Tiny()
    sch = SCHEDULERS[sch_name]()
    opt = OPTIMIZERS[opt_name](sch if sch is not None else 0.05, model.parameters())
    return model, opt, sch


def train_step(model, opt, sch, x: np.ndarray) -> float:
    loss = model(paddle.to_tensor(x)).square().mean()
    loss.backward()
    opt.step()
    opt.clear_grad()
    if isinstance(sch, L.ReduceOnPlateau):
        sch.step(float(loss))
    elif sch is not None:
        sch.step()
    return float(loss)


def shift_name_counters(opt_name: str) -> None:
    """Make this process's runtime names differ from a fresh one's (parameters and accumulators)."""
    junk = Tiny()
    OPTIMIZERS[opt_name](0.1, junk.parameters())._create_accumulators(
        paddle.static.default_main_program().global_block(), list(junk.parameters()))
    nn.Linear(3, 3)


def snapshot(model, opt) -> dict[str, np.ndarray]:
    """Model values and optimizer accumulators by structured name, through Paddle's own APIs only."""
    out = {f"model/{k}": v.numpy() for k, v in model.state_dict().items()}
    names = {p.name: k for k, p in model.state_dict().items()}
    for acc, per_param in opt._accumulators.items():
        for pname, var in per_param.items():
            out[f"slot/{names[pname]}/{acc}"] = var.numpy()
    return out
