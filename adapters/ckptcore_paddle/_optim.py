"""Optimizer, LR scheduler and GradScaler state: Paddle objects <-> OptimizerState / ScheduleState."""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable

import numpy as np
import paddle

from ckptcore.errors import CaptureError, RestoreError
from ckptcore.state import OptimizerState, ScheduleState

from ._common import MASTER_SLOT, SCHEDULER_EXTRA_ATTRS, adam_step, plain, split_accumulator_key
from ._tensors import check_fits, to_numpy

LRScheduler = paddle.optimizer.lr.LRScheduler

_HYPER = (("_beta1", "beta1"), ("_beta2", "beta2"), ("_epsilon", "epsilon"), ("_momentum", "momentum"),
          ("_use_nesterov", "use_nesterov"), ("_rho", "rho"), ("_centered", "centered"),
          ("initial_accumulator_value", "initial_accumulator_value"), ("_weight_decay", "weight_decay"),
          ("_lazy_mode", "lazy_mode"), ("_amsgrad", "amsgrad"), ("_multi_precision", "multi_precision"),
          ("_rescale_grad", "rescale_grad"), ("_regularization_method", "regularization_method"),
          ("_regularization_coeff", "regularization_coeff"))
# Constructor argument -> attribute, where Paddle stores it under another name.
_CTOR_ALIASES = {"learning_rate": "base_lr", "base_learning_rate": "base_lr",
                 "max_learning_rate": "max_lr", "exp_gamma": "gamma"}


def optimizer_params(opt: Any) -> list[Any]:
    """The optimizer's parameters in order, flattening parameter groups."""
    out: list[Any] = []
    for entry in opt._parameter_list or []:
        out.extend(entry["params"] if isinstance(entry, dict) else [entry])
    return out


def attached_scheduler(opt: Any) -> Any:
    lr = getattr(opt, "_learning_rate", None)
    return lr if isinstance(lr, LRScheduler) else None


# ----------------------------------------------------------------------------- optimizer


def capture_optimizer(opt: Any, runtime_to_struct: dict[str, str], *, step: int | None,
                      scheduler: Any, copy: bool = True) -> OptimizerState:
    """``opt``'s accumulators re-keyed by structured parameter name, its hyperparameters and update count."""
    prefix = f"{opt._name}_" if opt._name else ""
    master = dict(getattr(opt, "_master_weights", None) or {})
    owner = {v.name: k for k, v in master.items()}  # master weight name -> its parameter's name
    slots: dict[str, dict[str, np.ndarray]] = {}

    def struct_of(pname: str) -> str:
        pname = owner.get(pname, pname)
        if pname not in runtime_to_struct:
            raise CaptureError(f"the optimizer updates parameter {pname!r}, which is not part of the model; "
                               "pass the model that owns every optimized parameter")
        return runtime_to_struct[pname]

    if opt._accumulators:
        for acc, per_param in opt._accumulators.items():
            slot = acc[len(prefix):] if prefix and acc.startswith(prefix) else acc
            for pname, var in per_param.items():
                slots.setdefault(struct_of(pname), {})[slot] = to_numpy(var, copy)
    else:  # set_state_dict() was called but no step taken yet: the values wait in the holder
        for key, value in (opt._accumulators_holder or {}).items():
            pname = _longest_prefix(key, runtime_to_struct)
            if pname is not None:
                slot, _, _ = split_accumulator_key(key[len(pname) + 1:])
                slots.setdefault(runtime_to_struct[pname], {})[slot] = to_numpy(value, copy)
    for pname, var in master.items():
        slots.setdefault(struct_of(pname), {})[MASTER_SLOT] = to_numpy(var, copy)

    hyper = hyperparams(opt, runtime_to_struct)
    source = "argument"
    if step is None:
        step, source = _derive_step(opt, slots, scheduler)
    extra: dict[str, Any] = {"step_source": source}
    if opt._name:
        extra["name"] = opt._name
    return OptimizerState(kind=type(opt).__name__.lower(), step=int(step), hyperparams=hyper,
                          slots=slots, extra=extra)


def _longest_prefix(key: str, names: dict[str, str]) -> str | None:
    i = len(key)
    while (i := key.rfind("_", 0, i)) > 0:
        if key[:i] in names:
            return key[:i]
    return None


def _derive_step(opt: Any, slots: dict, scheduler: Any) -> tuple[int, str]:
    """Paddle optimizers keep no update counter; ``_capture.py``'s docstring gives the order tried here."""
    if any("beta2_pow_acc" in s for s in slots.values()):
        t = adam_step(slots, float(_scalar(opt._beta1)), float(_scalar(opt._beta2)))
        if t is not None:
            return t, "beta_pow_acc"
    sch = attached_scheduler(opt) or scheduler
    if sch is not None and slots:
        return max(int(sch.last_epoch), 0), "scheduler"
    return 0, "none"


def _scalar(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v


_SKIP = object()


def _plain_value(v: Any) -> Any:
    """``v`` as a plain number/string/bool, or ``_SKIP`` for what has no such form (callables, objects)."""
    try:
        v = _scalar(v)
    except (TypeError, ValueError):
        return _SKIP
    return v if isinstance(v, (int, float, str, bool)) or v is None else _SKIP


def hyperparams(opt: Any, runtime_to_struct: dict[str, str]) -> dict[str, Any]:
    """Plain-valued hyperparameters, for inspection and migration; restore only uses the learning rate."""
    hp: dict[str, Any] = {"learning_rate": float(opt.get_lr())}
    for attr, key in _HYPER:
        value = _plain_value(getattr(opt, attr, _SKIP))
        if value is not _SKIP:
            hp[key] = value
    for attr, key in (("regularization", "regularization"), ("_grad_clip", "grad_clip")):
        obj = getattr(opt, attr, None)
        if obj is not None:
            hp[key] = {"kind": type(obj).__name__, **{k.lstrip("_"): v for k, v in vars(obj).items()
                                                      if isinstance(v, (int, float)) and not isinstance(v, bool)}}
    if opt._parameter_list and isinstance(opt._parameter_list[0], dict):
        hp["param_groups"] = [
            {"params": [runtime_to_struct.get(p.name, p.name) for p in g["params"]],
             **{k: v for k, v in ((k, _plain_value(v)) for k, v in g.items() if k != "params") if v is not _SKIP}}
            for g in opt._parameter_list]
    return hp


def plan_optimizer(opt: Any, state: OptimizerState, struct_to_param: dict[str, Any],
                   report: Callable[[str, str], None]) -> tuple[list[tuple[Any, np.ndarray]], list[Callable[[], None]]]:
    """Match ``state``'s slots to ``opt``'s accumulators, creating them if the optimizer never stepped.

    Returns ``(variable, value)`` pairs to assign and the actions that drop accumulators the state
    does not have (they did not exist when it was captured); records missing/unexpected names
    through ``report``; raises RestoreError on a shape or dtype mismatch.  Creating accumulators is
    the only change made here, and it is the one the optimizer's first step would make anyway.
    """
    prefix = f"{opt._name}_" if opt._name else ""
    params = {p.name: p for p in optimizer_params(opt)}
    runtime_struct = {p.name: s for s, p in struct_to_param.items() if p.name in params}
    for s in sorted(set(state.slots) - set(runtime_struct.values())):
        report("unexpected", f"optimizer/{s}")
    wanted = [struct_to_param[s] for s in state.slots if s in struct_to_param and s in runtime_struct.values()]
    opt._accumulators_holder = {}
    if wanted:
        block = paddle.static.default_main_program().global_block()
        opt._create_accumulators(block, wanted)
    master = dict(getattr(opt, "_master_weights", None) or {})
    owner = {v.name: k for k, v in master.items()}
    pairs: list[tuple[Any, np.ndarray]] = []
    drops: list[Callable[[], None]] = []
    seen: set[tuple[str, str]] = set()
    for acc, per_param in list(opt._accumulators.items()):
        slot = acc[len(prefix):] if prefix and acc.startswith(prefix) else acc
        for pname in list(per_param):
            struct = runtime_struct.get(owner.get(pname, pname))
            if struct is None:  # a parameter outside the model: not ours to change
                report("missing", f"optimizer/{owner.get(pname, pname)}/{slot}")
                continue
            saved = state.slots.get(struct, {})
            if slot not in saved:
                if struct in state.slots:
                    report("missing", f"optimizer/{struct}/{slot}")
                drops.append(functools.partial(_drop_accumulator, opt, acc, pname, owner.get(pname, pname)))
                continue
            check_fits(f"optimizer/{struct}/{slot}", saved[slot], per_param[pname])
            pairs.append((per_param[pname], saved[slot]))
            seen.add((struct, slot))
    for pname, var in master.items():
        struct = runtime_struct.get(pname)
        if struct is not None and MASTER_SLOT in state.slots.get(struct, {}):
            check_fits(f"optimizer/{struct}/{MASTER_SLOT}", state.slots[struct][MASTER_SLOT], var)
            pairs.append((var, state.slots[struct][MASTER_SLOT]))
            seen.add((struct, MASTER_SLOT))
    for struct, per_slot in state.slots.items():
        if struct in runtime_struct.values():
            for slot in per_slot:
                if (struct, slot) not in seen:
                    report("unexpected", f"optimizer/{struct}/{slot}")
    return pairs, drops


def _drop_accumulator(opt: Any, acc: str, pname: str, param_name: str) -> None:
    opt._accumulators[acc].pop(pname, None)
    opt._already_create_accumulator.discard(param_name)


def restore_learning_rate(opt: Any, state: OptimizerState) -> None:
    """A float learning rate changed with ``set_lr`` is state too; a scheduler's is restored with it."""
    lr = state.hyperparams.get("learning_rate")
    if lr is not None and not isinstance(opt._learning_rate, LRScheduler):
        opt.set_lr(float(lr))


# ----------------------------------------------------------------------------- scheduler


def capture_schedule(sch: Any) -> ScheduleState:
    """The scheduler as ScheduleState; ``state`` is its ``state_dict()`` plus what that lacks."""
    state = plain(sch.state_dict())
    for attr in SCHEDULER_EXTRA_ATTRS.get(type(sch).__name__, ()):
        if hasattr(sch, attr):
            state[attr] = plain(getattr(sch, attr))
    last_lr = _scalar(sch.last_lr)
    return ScheduleState(kind=type(sch).__name__, config=scheduler_config(sch), step=int(sch.last_epoch),
                         last_lr=None if last_lr is None else float(last_lr), state=state)


def scheduler_config(sch: Any) -> dict[str, Any]:
    """The constructor arguments that can be read back from ``sch`` (callables are left out)."""
    config: dict[str, Any] = {}
    for name in list(inspect.signature(type(sch).__init__).parameters)[1:]:
        if name in ("last_epoch", "verbose"):
            continue
        for attr in (name, f"_{name}", _CTOR_ALIASES.get(name, "")):
            if attr and hasattr(sch, attr):
                value = getattr(sch, attr)
                if isinstance(value, LRScheduler):
                    config[name] = {"kind": type(value).__name__, "config": scheduler_config(value)}
                elif not callable(value):
                    try:
                        config[name] = plain(_scalar(value))
                    except TypeError:
                        pass
                break
    return config


def schedule_fits(sch: Any, schedule: ScheduleState) -> bool:
    """Whether ``schedule`` was captured from a scheduler of ``sch``'s class (or its class is unknown)."""
    return schedule.kind in (type(sch).__name__, "LRScheduler")


def restore_schedule(sch: Any, schedule: ScheduleState, legacy: dict[str, Any] | None = None) -> None:
    """Load ``schedule.state`` (else just its step and last rate) into ``sch``.

    ``legacy`` is ``extra["paddle"]["scheduler"]``, where states captured before
    ``ScheduleState.state`` existed kept the same values as ``{"state": ..., "attrs": ...}``.
    """
    kind = type(sch).__name__
    state = dict(schedule.state or {})
    if not state and legacy:
        state = {**(legacy.get("state") or {}), **(legacy.get("attrs") or {})}
    if not state:
        state = {"last_epoch": schedule.step, "last_lr": schedule.last_lr}
    extra_names = SCHEDULER_EXTRA_ATTRS.get(kind, ())
    attrs = {k: state.pop(k) for k in extra_names if k in state}
    try:
        sch.set_state_dict(state)
    except (RuntimeError, KeyError) as e:
        raise RestoreError(f"the {kind} scheduler does not accept the saved schedule state: {e}") from e
    for name, value in attrs.items():
        setattr(sch, name, value)
    if extra_names and not attrs and sch.last_epoch >= 0:
        # Saved by Paddle itself (a .pdopt): T_cur/T_i are not in it, so replay the wrap-arounds that
        # step() does, in integers (step(epoch) uses a float logarithm that misses exact boundaries).
        sch.T_cur, sch.T_i = _warm_restart_position(int(sch.last_epoch), int(sch.T_0), int(sch.T_mult))


def _warm_restart_position(epoch: int, t0: int, t_mult: int) -> tuple[int, int]:
    if t_mult == 1:
        return epoch % t0, t0
    t_cur, t_i = epoch, t0
    while t_cur >= t_i:
        t_cur, t_i = t_cur - t_i, t_i * t_mult
    return t_cur, t_i


# ----------------------------------------------------------------------------- GradScaler


def capture_scaler(scaler: Any) -> dict[str, Any]:
    sd = scaler.state_dict()
    if not sd:
        return {"enabled": False}
    out = {k: plain(v) for k, v in sd.items() if k != "scale"}
    out["scale"] = np.asarray(sd["scale"], dtype=np.float32).reshape(-1)
    out["enabled"] = True
    return out


def plan_scaler(scaler: Any, saved: dict[str, Any] | None,
                report: Callable[[str, str], None]) -> Callable[[], None] | None:
    """The action that loads ``saved`` into ``scaler``, after checking it; None if there is nothing to do."""
    if not getattr(scaler, "_enable", False):
        return None  # a disabled scaler has no state (Paddle's own load_state_dict ignores it too)
    if not saved or not saved.get("enabled"):
        report("missing", "grad_scaler")
        return None
    sd = {k: v for k, v in saved.items() if k != "enabled"}
    sd["scale"] = np.asarray(sd["scale"], dtype=np.float32).reshape(-1)
    if sd["scale"].size != 1 or not math.isfinite(float(sd["scale"][0])):
        raise RestoreError(f"grad_scaler: the saved loss scale {sd['scale'].tolist()} is not one finite number")
    return functools.partial(scaler.load_state_dict, sd)
