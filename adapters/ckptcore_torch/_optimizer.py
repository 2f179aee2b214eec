"""Optimizer, LR scheduler and GradScaler state: PyTorch objects <-> OptimizerState / ScheduleState.

Naming: ``state.optimizer.slots[param][slot]`` holds ``optimizer.state[p]`` keyed by the
parameter's model name (see ``_tensors.py``) instead of torch's integer index, and torch's own
slot names (``exp_avg``, ``momentum_buffer``, ``step``...).  A parameter's ``step`` tensor is the
0-d float slot ``"step"``, bit for bit.  ``extra["param_groups"]`` lists every group as
``{"params": [param names], <each hyperparameter, plain>}``; ``hyperparams`` is the first group's.
So a model whose parameters are registered in another order restores, and slots can migrate.

Only the built-in optimizers whose state keys are known are captured (a custom subclass of one
of them too, as long as its state keys are its base's): anything else is a CaptureError naming
it, since a state we cannot read back exactly would resume silently wrong.

Restoring plans through a :class:`ckptcore.adapter.RestorePlan` (report names
``optimizer/<param>/<slot>``, ``schedule``, ``grad_scaler``); the optimizer is then loaded through
its own ``load_state_dict``, which places each slot on its parameter's device as torch does.
Schedulers round-trip their own ``state_dict()`` as plain values; a ``LambdaLR``'s lambdas (and
``MultiplicativeLR``'s, ``CyclicLR``'s ``scale_fn``) are code, not state: torch saves ``None``
for a plain function, and the restore keeps the live scheduler's functions.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Any, Callable, Container

import numpy as np
import torch

from ckptcore.adapter import RestorePlan, qualified
from ckptcore.errors import CaptureError, RestoreError
from ckptcore.state import OptimizerState, ScheduleState

from ._tensors import new_tensor, numpy_dtype, to_numpy

# The state keys of each built-in optimizer (a parameter's optimizer.state[p] holds some of these).
SLOTS = {
    "SGD": ("momentum_buffer",),
    "Adam": ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "AdamW": ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "RMSprop": ("step", "square_avg", "momentum_buffer", "grad_avg"),
    "Adagrad": ("step", "sum"),
    "Adadelta": ("step", "square_avg", "acc_delta"),
    "Adamax": ("step", "exp_avg", "exp_inf"),
    "NAdam": ("step", "mu_product", "exp_avg", "exp_avg_sq"),
    "RAdam": ("step", "exp_avg", "exp_avg_sq"),
    "ASGD": ("step", "eta", "mu", "ax"),
    "Rprop": ("step", "prev", "step_size"),
}
_KINDS = {name.lower(): name for name in SLOTS}
SCALAR_SLOTS = frozenset({"step", "mu_product", "eta", "mu"})  # 0-d, whatever the parameter's shape
_NOT_HYPER = ("params", "param_names")


def builtin_class(opt: Any, error: type[Exception] = CaptureError) -> str:
    """The built-in optimizer ``opt`` is (or subclasses), by name; ``error`` when there is none."""
    for cls in type(opt).__mro__:
        if cls.__name__ in SLOTS and cls.__module__.startswith("torch.optim"):
            return cls.__name__
    raise error(f"{type(opt).__module__}.{type(opt).__name__} is not an optimizer ckptcore_torch can "
                f"capture exactly: its state keys are unknown (supported: {', '.join(sorted(SLOTS))}, "
                "and subclasses of these that keep their state keys)")


def _check_keys(opt: Any, base: str, keys: Any, error: type[Exception]) -> None:
    unknown = sorted(set(keys) - set(SLOTS[base]))
    if unknown:
        raise error(f"{type(opt).__name__} keeps optimizer state {unknown} that {base} does not "
                    f"({list(SLOTS[base])}); ckptcore_torch cannot capture a custom optimizer's "
                    "own state keys exactly")


# ----------------------------------------------------------------------------- optimizer


def capture_optimizer(opt: Any, key_of: dict[int, str], *, step: int | None, scheduler: Any,
                      copy: bool = True) -> OptimizerState:
    """``opt``'s state re-keyed by parameter name, every group's hyperparameters, its update count."""
    base = builtin_class(opt)
    slots: dict[str, dict[str, np.ndarray]] = {}
    groups = []
    for group in opt.param_groups:
        names = []
        for p in group["params"]:
            name = key_of.get(id(p))
            if name is None:
                raise CaptureError(f"the {type(opt).__name__} optimizer updates a parameter of shape "
                                   f"{list(p.shape)} that is not part of the model; pass the model "
                                   "that owns every optimized parameter")
            names.append(name)
            st = opt.state.get(p)
            if st:
                _check_keys(opt, base, st, CaptureError)
                slots[name] = {k: _slot_array(v, copy, name, k) for k, v in st.items()}
        groups.append({"params": names, **hyper_of(group)})
    extra: dict[str, Any] = {"param_groups": groups}
    if type(opt).__name__ != base:
        extra["class"] = type(opt).__name__
    if step is not None:
        step_value, extra["step_source"] = int(step), "argument"
    elif any("step" in s for s in slots.values()):
        step_value, extra["step_source"] = max(int(s["step"]) for s in slots.values() if "step" in s), "slots"
    elif scheduler is not None:
        step_value, extra["step_source"] = max(schedule_step(scheduler), 0), "scheduler"
    else:
        step_value, extra["step_source"] = 0, "none"
    return OptimizerState(kind=base.lower(), step=step_value, hyperparams={k: v for k, v in groups[0].items() if k != "params"} if groups else {},
                          slots=slots, extra=extra)


def _slot_array(v: Any, copy: bool, name: str, key: str) -> np.ndarray:
    if isinstance(v, torch.Tensor):
        return to_numpy(v, copy)
    if isinstance(v, (int, float)) and not isinstance(v, bool):  # a step kept as a number (old torch)
        return np.asarray(float(v), dtype=np.float32)
    raise CaptureError(f"optimizer state {name}/{key} is a {type(v).__name__}, not a tensor")


def hyper_of(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters as plain values (a tensor lr as its number)."""
    return {k: tree_plain(v, f"param group {k}") for k, v in group.items() if k not in _NOT_HYPER}


def plan_optimizer(plan: RestorePlan, opt: Any, state: OptimizerState | None, tensors: dict[str, Any],
                   source: Callable[[str, Container[str]], str | None] | None = None) -> None:
    """Plan loading ``state`` into ``opt``: every slot checked against its parameter now, then the
    whole state loaded through ``opt.load_state_dict`` (an action, after the model's tensors).

    ``source(name, slots)`` is the saved name target parameter ``name`` takes its state from (the
    one its values come from: a tied weight's slots are saved under whichever of its names came
    first, and the target may name it otherwise), or None when the state says nothing of it;
    without it, its own name in ``slots``.  A target parameter whose slots the state lacks keeps
    its live value for them when it has one (reported missing); a parameter the state holds
    without slots had none yet (it never got a gradient), so its state is cleared, as it was.
    Saved slots no target parameter takes are unexpected.
    """
    if state is None:
        plan.missing(qualified("optimizer"))
        return
    base = builtin_class(opt, RestoreError)
    if state.kind in _KINDS and state.kind != base.lower():
        # Adam and AdamW share slots but not semantics (decoupled_weight_decay is a group
        # hyperparameter): loading one into the other would silently change the update rule.
        raise RestoreError(f"{qualified('optimizer')}: the state holds {_KINDS[state.kind]} state but the "
                           f"optimizer given is a {type(opt).__name__}; build the same optimizer (or "
                           "convert the state with ckptcore.migrate)")
    key_of = {id(t): n for n, t in tensors.items()}
    targets = [[key_of.get(id(p)) for p in g["params"]] for g in opt.param_groups]
    if any(n is None for g in targets for n in g):
        raise RestoreError(f"the {type(opt).__name__} optimizer updates a parameter that is not part "
                           "of the model; pass the model that owns every optimized parameter")
    params = {key_of[id(p)]: p for g in opt.param_groups for p in g["params"]}
    if source is None:
        source = _own_name
    src_of = {name: source(name, state.slots) for name in params}
    # The groups compared by saved names: the state's groups list its names, not the target's.
    saved_groups = _check_groups(state, [[src_of[n] or n for n in g] for g in targets])
    known = set(SLOTS[base])
    taken = set(src_of.values())
    plan.unexpected(*(qualified("optimizer", n, s) for n in state.slots if n not in taken for s in state.slots[n]))
    new_state: dict[str, dict[str, Any]] = {}
    for name, p in params.items():
        live = opt.state.get(p) or {}
        src = src_of[name]
        saved = None if src is None else state.slots.get(src)
        if saved is None:
            if src is None:  # the state says nothing about this parameter
                plan.missing(*(qualified("optimizer", name, s) for s in live))
                if live:
                    new_state[name] = dict(live)
            continue
        entry: dict[str, Any] = {}
        for slot, value in saved.items():
            if slot not in known:
                plan.unexpected(qualified("optimizer", name, slot))
                continue
            like = live.get(slot)
            shape = () if slot in SCALAR_SLOTS else tuple(p.shape)
            dtype = (numpy_dtype(like, RestoreError) if isinstance(like, torch.Tensor)
                     else None if slot == "step" else numpy_dtype(p, RestoreError))
            plan.assign(qualified("optimizer", name, slot), value, shape=shape, dtype=dtype, put=_nothing)
            entry[slot] = (value, like)
        for slot in live:
            if slot not in saved:
                plan.missing(qualified("optimizer", name, slot))
                entry[slot] = (None, live[slot])
        new_state[name] = entry
    plan.then(functools.partial(_load, opt, params, new_state, saved_groups, state))


def _own_name(name: str, slots: Container[str]) -> str | None:
    return name if name in slots else None


def _nothing() -> None:
    """The put of a slot: checked by the plan, created by the optimizer's load (an action)."""


def _check_groups(state: OptimizerState, targets: list[list[str]]) -> list[dict[str, Any]] | None:
    saved = (state.extra or {}).get("param_groups")
    if not saved:
        return None
    if len(saved) != len(targets):
        raise RestoreError(f"{qualified('optimizer')}: the state holds {len(saved)} parameter groups, the "
                           f"optimizer has {len(targets)}; build the optimizer with the same groups")
    for i, (g, names) in enumerate(zip(saved, targets)):
        here, there = set(names), set(g.get("params") or ())
        both = set(n for t in targets for n in t) & set(n for s in saved for n in s.get("params") or ())
        if (here & both) != (there & both):
            raise RestoreError(f"{qualified('optimizer')}: parameter group {i} holds "
                               f"{sorted(there & both)[:6]} in the state but {sorted(here & both)[:6]} in "
                               "the optimizer; build the optimizer with the same groups")
    return saved


def _load(opt: Any, params: dict[str, Any], new_state: dict[str, dict[str, Any]],
          saved_groups: list[dict[str, Any]] | None, state: OptimizerState) -> None:
    index = {name: i for i, name in enumerate(params)}
    order = {id(p): i for i, p in enumerate(params.values())}
    torch_state: dict[int, dict[str, Any]] = {}
    for name, entry in new_state.items():
        p = params[name]
        out = {}
        for slot, item in entry.items():
            if isinstance(item, tuple):
                value, like = item
                if value is None:  # not saved (non-strict): the live value stays
                    out[slot] = like.clone() if isinstance(like, torch.Tensor) else like
                    continue
                device = like.device if isinstance(like, torch.Tensor) else (
                    torch.device("cpu") if slot == "step" else p.device)
                out[slot] = new_tensor(value, device=device)
            else:
                out[slot] = item
        torch_state[index[name]] = out
    groups = []
    for i, group in enumerate(opt.param_groups):
        hyper = {k: v for k, v in group.items() if k not in _NOT_HYPER}
        saved = saved_groups[i] if saved_groups else {k: v for k, v in state.hyperparams.items() if k in hyper}
        for k, v in saved.items():
            if k != "params" and k != "param_names":
                hyper[k] = revive(v, hyper.get(k))
        groups.append({**hyper, "params": [order[id(p)] for p in group["params"]]})
    try:
        opt.load_state_dict({"state": torch_state, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as e:
        raise RestoreError(f"the {type(opt).__name__} optimizer refused the saved state: {e}") from e


# ----------------------------------------------------------------------------- plain values


def tree_plain(value: Any, where: str) -> Any:
    """``value`` as msgpack-able plain data (int dict keys kept: a MultiStepLR's milestones are a
    Counter of ints).  Raises CaptureError for what has no plain form, naming where it is."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else to_numpy(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {(k if isinstance(k, (int, str)) and not isinstance(k, bool) else str(k)):
                tree_plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [tree_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise CaptureError(f"{where} is a {type(value).__name__}, which has no plain form to save")


def revive(saved: Any, live: Any) -> Any:
    """``saved`` in the type the live value has (tuple, Counter, tensor)."""
    if isinstance(live, torch.Tensor) and not isinstance(saved, (list, np.ndarray, dict)):
        return torch.tensor(saved, dtype=live.dtype, device=live.device)
    if isinstance(live, tuple) and isinstance(saved, list):
        return tuple(revive(s, l) for s, l in zip(saved, live)) if len(saved) == len(live) else tuple(saved)
    if isinstance(live, collections.Counter) and isinstance(saved, dict):
        return collections.Counter(saved)
    if isinstance(live, list) and isinstance(saved, list) and len(live) == len(saved):
        return [revive(s, l) for s, l in zip(saved, live)]
    return saved


# ----------------------------------------------------------------------------- scheduler


def capture_schedule(sch: Any) -> ScheduleState:
    """The scheduler as ScheduleState; ``state`` is its ``state_dict()``, plain, nested schedulers
    (SequentialLR, ChainedScheduler) as ``[{"kind": class name, **their state}]``."""
    last = getattr(sch, "_last_lr", None)
    last_lr = sch.get_last_lr()[0] if last else None
    return ScheduleState(kind=type(sch).__name__, config={}, step=schedule_step(sch),
                         last_lr=None if last_lr is None else float(last_lr), state=_schedule_tree(sch))


def schedule_step(sch: Any) -> int:
    """``last_epoch`` (a ChainedScheduler has none of its own: its first scheduler's)."""
    if hasattr(sch, "last_epoch"):
        return int(sch.last_epoch)
    nested = getattr(sch, "_schedulers", None)
    return schedule_step(nested[0]) if nested else 0


def _schedule_tree(sch: Any) -> dict[str, Any]:
    sd = dict(sch.state_dict())
    nested = getattr(sch, "_schedulers", None)
    if isinstance(sd.get("_schedulers"), list) and nested is not None:
        sd["_schedulers"] = [{"kind": type(s).__name__, **_schedule_tree(s)} for s in nested]
    return tree_plain(sd, f"{type(sch).__name__} state")


def plan_schedule(plan: RestorePlan, sch: Any, schedule: ScheduleState | None) -> None:
    """Plan loading ``schedule`` into ``sch`` (reported as ``schedule`` when the state has none).

    Raises:
        RestoreError: the saved schedule is of another class than ``sch`` (or a nested one is).
    """
    if schedule is None:
        plan.missing(qualified("schedule"))
        return
    if schedule.kind != type(sch).__name__:
        raise RestoreError(f"{qualified('schedule')}: the state holds a {schedule.kind} schedule but the "
                           f"scheduler given is a {type(sch).__name__}")
    if schedule.state:
        torch_sd = _torch_schedule(sch, dict(schedule.state), schedule.kind)
    else:  # a state from elsewhere (migration): its position and rate
        torch_sd = {"last_epoch": schedule.step}
        if schedule.last_lr is not None:
            torch_sd["_last_lr"] = [schedule.last_lr] * len(getattr(sch, "_last_lr", None) or [0])
    plan.then(functools.partial(_load_schedule, sch, torch_sd))


def _torch_schedule(sch: Any, state: dict[str, Any], where: str) -> dict[str, Any]:
    """A saved schedule tree back in torch's ``state_dict()`` form, values in the live types."""
    nested = getattr(sch, "_schedulers", None)
    if nested is not None and isinstance(state.get("_schedulers"), list):
        saved = state["_schedulers"]
        if len(saved) != len(nested):
            raise RestoreError(f"{qualified('schedule')}: {where} holds {len(saved)} schedulers, the target "
                               f"{len(nested)}")
        out = []
        for i, (s, live) in enumerate(zip(saved, nested)):
            s = dict(s)
            kind = s.pop("kind", type(live).__name__)
            if kind != type(live).__name__:
                raise RestoreError(f"{qualified('schedule')}: {where}'s scheduler {i} is a {kind} in the "
                                   f"state but a {type(live).__name__} in the target")
            out.append(_torch_schedule(live, s, f"{where}[{i}]"))
        state["_schedulers"] = out
    for k, v in state.items():
        if k != "_schedulers" and k in sch.__dict__:
            state[k] = revive(v, sch.__dict__[k])
    return state


def _load_schedule(sch: Any, torch_sd: dict[str, Any]) -> None:
    try:
        sch.load_state_dict(torch_sd)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise RestoreError(f"the {type(sch).__name__} scheduler does not accept the saved state: {e}") from e


# ----------------------------------------------------------------------------- GradScaler


def capture_scaler(scaler: Any) -> dict[str, Any]:
    sd = scaler.state_dict()
    if not sd:
        return {"enabled": False}
    return {**tree_plain(dict(sd), "GradScaler state"), "enabled": True}


def plan_scaler(plan: RestorePlan, scaler: Any, saved: dict[str, Any] | None) -> None:
    """Plan loading ``saved`` into ``scaler``, after checking it (reported as ``grad_scaler``)."""
    if not scaler.is_enabled():
        return  # a disabled scaler has no state (torch's own load_state_dict ignores it too)
    if not saved or not saved.get("enabled"):
        plan.missing(qualified("grad_scaler"))
        return
    sd = {k: v for k, v in saved.items() if k != "enabled"}
    scale = sd.get("scale")
    if not isinstance(scale, (int, float)) or not math.isfinite(float(scale)) or scale <= 0:
        raise RestoreError(f"grad_scaler: the saved loss scale {scale!r} is not one positive finite number")
    plan.then(functools.partial(scaler.load_state_dict, sd))
