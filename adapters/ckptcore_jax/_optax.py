"""What an Optax optimizer is, read from its transformation (for migration).

An Optax state holds moments and counters, not hyperparameters: those live in the closures of the
transformation's functions (``optax.adam(1e-3)`` is ``chain(scale_by_adam(b1, b2, eps, ...),
scale(-1e-3))``).  Migration needs them, so the capture of an ``nnx.Optimizer`` (or of a
:class:`~ckptcore_jax.Ref` given ``tx=``) reads them here, from the closure variables Optax's own
constructors keep, and names the optimizer in ``OptimizerState.kind``/``hyperparams``:

* ``adam``/``adamw``: ``optax.adam``/``optax.adamw`` (``scale_by_adam``, ``add_decayed_weights``
  without a mask, a learning rate): ``b1``, ``b2``, ``eps``, ``eps_root``, ``nesterov``,
  ``weight_decay``;
* ``sgd``: ``optax.sgd`` (``trace`` or nothing, a learning rate): ``momentum``, ``nesterov``;
* ``learning_rate``: the rate of the current step; ``slot_prefix``: where the moments sit in the
  state (``"0/"``: the chain's first transformation);
* anything else is kind ``optax`` with ``hyperparams["transforms"]`` naming what was found, which
  migration refuses with that list.

A learning rate that is an Optax schedule becomes a :class:`~ckptcore.ScheduleState` (its
constructor's name and arguments, the step it is at, its current rate): ``exponential_decay``,
``cosine_decay_schedule``, ``piecewise_constant_schedule``, ``polynomial_schedule``/
``linear_schedule`` and ``warmup_cosine_decay_schedule``; others keep their name and no config
(migration says it cannot continue them).  Reading never changes the optimizer; anything
unexpected gives kind ``optax``, never an exception.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import numpy as np

from ckptcore.state import ScheduleState

__all__ = ["describe"]

_log = logging.getLogger("ckptcore")
_RATE = ("scale", "scale_by_schedule", "scale_by_learning_rate")


def _closure(fn: Any) -> dict[str, Any]:
    code = getattr(fn, "__code__", None)
    out: dict[str, Any] = {}
    for name, cell in zip(getattr(code, "co_freevars", ()), getattr(fn, "__closure__", None) or ()):
        try:
            out[name] = cell.cell_contents
        except ValueError:   # a cell not filled yet
            pass
    return out


def _owner(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", "")).split(".")[0]


def _transforms(tx: Any) -> list[tuple[str, dict[str, Any]]]:
    """``[(constructor name, closure variables of its update function)]`` of a chain, in order."""
    update = getattr(tx, "update", None)
    owner = _owner(update)
    if owner == "with_extra_args_support":
        return _transforms(_closure(update).get("tx"))
    if owner == "chain":
        out: list[tuple[str, dict[str, Any]]] = []
        for fn in _closure(update).get("update_fns", ()):
            inner = _closure(fn).get("tx")
            found = _transforms(inner) if inner is not None else [(_owner(fn), _closure(fn))]
            if len(found) != 1:
                return [("nested chain", {})]   # its moments are not at "<i>/": not read
            out.extend(found)
        return out
    return [(owner, _closure(update))]


def describe(tx: Any, leaves: Mapping[str, Any]) -> tuple[str, dict[str, Any], ScheduleState | None]:
    """``(kind, hyperparams, schedule)`` of the Optax transformation ``tx`` whose state's other
    leaves (counters) are ``leaves``."""
    try:
        return _describe(tx, leaves)
    except Exception as e:  # noqa: BLE001 - an Optax version this reader does not know
        _log.info("ckptcore_jax: cannot read the Optax transformation's hyperparameters: %s", e)
        return "optax", {"transforms": ["unreadable"]}, None


def _describe(tx: Any, leaves: Mapping[str, Any]) -> tuple[str, dict[str, Any], ScheduleState | None]:
    steps = _transforms(tx)
    names = [n for n, _ in steps]
    unknown = ("optax", {"transforms": [n for n in names if n != "identity"]}, None)
    core = [(i, n, c) for i, (n, c) in enumerate(steps) if n != "identity"]
    if not core or core[-1][1] not in _RATE:
        return unknown
    rate_index, _, rate = core[-1]
    lr, schedule = _rate(rate, leaves.get(f"{rate_index}/count" if len(steps) > 1 else "count"))
    if lr is None:
        return unknown
    body = core[:-1]
    prefix = lambda i: f"{i}/" if len(steps) > 1 else ""   # noqa: E731
    shape = [n for _, n, _ in body]
    if shape in (["scale_by_adam"], ["scale_by_adam", "add_decayed_weights"]):
        i, _, c = body[0]
        hp: dict[str, Any] = {"learning_rate": lr, "b1": float(c["b1"]), "b2": float(c["b2"]),
                              "eps": float(c["eps"]), "eps_root": float(c["eps_root"]),
                              "nesterov": bool(c.get("nesterov", False)), "weight_decay": 0.0,
                              "slot_prefix": prefix(i)}
        kind = "adam"
        if len(body) == 2:
            decay = body[1][2]
            if decay.get("mask") is not None or not isinstance(decay.get("weight_decay"), (int, float)):
                return unknown
            kind, hp["weight_decay"] = "adamw", float(decay["weight_decay"])
        return kind, hp, schedule
    if shape == ["trace"]:
        i, _, c = body[0]
        return "sgd", {"learning_rate": lr, "momentum": float(c["decay"]), "nesterov": bool(c["nesterov"]),
                       "slot_prefix": prefix(i)}, schedule
    if not shape:
        return "sgd", {"learning_rate": lr, "momentum": 0.0, "nesterov": False, "slot_prefix": ""}, schedule
    return unknown


def _rate(closure: dict[str, Any], count: Any) -> tuple[float | None, ScheduleState | None]:
    """The current learning rate, and the schedule when the rate is one."""
    if "step_size" in closure:   # scale(-lr)
        value = closure["step_size"]
        return (-float(value), None) if isinstance(value, (int, float)) else (None, None)
    fn = closure.get("step_size_fn")
    inner = _closure(fn)
    if _owner(fn) != "scale_by_learning_rate" or inner.get("m") != -1 or not callable(inner.get("learning_rate")):
        return None, None
    sched = inner["learning_rate"]
    step = int(np.asarray(count)) if count is not None else 0
    last = float(np.asarray(sched(step)))
    kind, config = _schedule(sched)
    return last, ScheduleState(kind=kind, config=config, step=step, last_lr=last)


def _schedule(fn: Callable) -> tuple[str, dict[str, Any]]:
    """An Optax schedule's constructor name and arguments (``{}`` when they cannot be read)."""
    kind, c = _owner(fn), _closure(fn)
    nums = {k: v for k, v in c.items() if isinstance(v, (int, float, bool)) or v is None}
    if kind == "piecewise_constant_schedule":
        bs = c.get("boundaries_and_scales") or {}
        return kind, {"init_value": float(c["init_value"]), "boundaries": [int(b) for b in bs],
                      "scales": [float(s) for s in bs.values()]}
    if kind == "join_schedules":
        parts = [_schedule(s) for s in c.get("schedules", ())]
        return kind, {"boundaries": [int(b) for b in c.get("boundaries", ())],
                      "schedules": [{"kind": k, "config": cfg} for k, cfg in parts]}
    if kind in ("exponential_decay", "cosine_decay_schedule", "polynomial_schedule", "constant_schedule"):
        return kind, nums
    return kind, {}
