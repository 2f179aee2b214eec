"""Optimizer slots and the iteration counter: capture, and restore planning.

The slots an optimizer *will* have are known before its first step (its ``slot_names`` for every
model parameter), so a fresh optimizer restores exactly like one that has already stepped.  There
is no learning-rate schedule and no gradient accumulation in this framework.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ckptcore.adapter import RestorePlan, qualified
from ckptcore.errors import RestoreError
from ckptcore.state import OptimizerState
from ckptcore.vocab import plain

from ._framework import Optimizer
from ._tensors import assign, to_numpy

__all__ = ["check_optimizer", "capture_optimizer", "plan_optimizer"]


def check_optimizer(optimizer: Any) -> None:
    if optimizer is not None and not isinstance(optimizer, Optimizer):
        raise TypeError(f"the numpy adapter needs a ckptcore_numpy optimizer (SGD, Adam), got "
                        f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")


def capture_optimizer(optimizer: Optimizer, copy: bool = True) -> OptimizerState:
    return OptimizerState(
        kind=optimizer.kind, step=optimizer.iterations, hyperparams=plain(optimizer.hyperparams),
        slots={p: {s: to_numpy(a, copy) for s, a in slots.items()}
               for p, slots in optimizer.slots.items()})


def plan_optimizer(plan: RestorePlan, saved: OptimizerState | None, optimizer: Optimizer,
                   params: dict[str, np.ndarray]) -> None:
    """Plan putting ``saved`` into ``optimizer`` for a model of ``params``."""
    if saved is None:
        plan.missing(*([qualified("optimizer", p, s) for p in params for s in optimizer.slot_names]
                       or [qualified("optimizer")]))
        return
    if saved.kind != optimizer.kind:
        raise RestoreError(f"optimizer: the checkpoint holds a {saved.kind!r} optimizer, the target "
                           f"is {optimizer.kind!r}")
    for p, target in params.items():
        for s in optimizer.slot_names:
            value = (saved.slots.get(p) or {}).get(s)
            name = qualified("optimizer", p, s)
            if value is None:
                plan.missing(name)
                continue
            plan.assign(name, value, shape=target.shape, dtype=target.dtype,
                        put=lambda p=p, s=s, v=value, t=target: _put_slot(optimizer, p, s, v, t))
    for p, slots in saved.slots.items():
        for s in slots:
            if p not in params or s not in optimizer.slot_names:
                plan.unexpected(qualified("optimizer", p, s))
    hyper = {k: float(saved.hyperparams[k]) for k in optimizer.hyperparams if k in saved.hyperparams}
    plan.then(lambda: _put_counters(optimizer, int(saved.step), hyper))


def _put_slot(optimizer: Optimizer, param: str, slot: str, value: np.ndarray,
              target: np.ndarray) -> None:
    slots = optimizer.slots.setdefault(param, {})
    if slot in slots:
        assign(slots[slot], value)  # in place: views taken with capture(copy=False) follow
    else:
        slots[slot] = np.array(value, dtype=target.dtype, copy=True)


def _put_counters(optimizer: Optimizer, step: int, hyper: dict[str, float]) -> None:
    optimizer.iterations = step
    optimizer.hyperparams.update(hyper)
