"""Optimizer, LR scheduler and GradScaler state: Paddle objects <-> OptimizerState / ScheduleState.

Naming: ``state.optimizer.slots[name][slot]`` holds the accumulators keyed by the parameter's
structured name (see ``_tensors.py``) and Paddle's accumulator name without the runtime prefix and
counter (``linear_0.w_0_moment1_0`` of ``fc.weight`` becomes ``slots["fc.weight"]["moment1"]``);
``"master_weight"`` is a multi-precision optimizer's float32 copy.  The mapping goes through the
live ``param.name``, so a process whose name counters differ restores correctly.

Restoring plans through a :class:`ckptcore.adapter.RestorePlan`; report names are
``optimizer/<param>/<slot>``, ``schedule`` and ``grad_scaler``.

Paddle is imported only by the functions that need a live object, so that the file interop
(``_files.py``), which shares the accumulator-name parsing and step counting below, runs without it.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from typing import Any, Callable

import numpy as np

from ckptcore.adapter import RestorePlan, qualified
from ckptcore.errors import CaptureError, RestoreError
from ckptcore.state import OptimizerState, ScheduleState
from ckptcore.vocab import plain

from ._tensors import Copies, to_numpy, values, views

# Accumulator names of Paddle's built-in optimizers (the names their _add_accumulator calls use),
# longest first so that "moment2_max" wins over "moment2" when a key is matched by suffix.
KNOWN_SLOTS = tuple(sorted({
    "moment1", "moment2", "moment2_max", "beta1_pow_acc", "beta2_pow_acc",  # Adam, AdamW, Lamb
    "velocity",                                                              # Momentum, Lars
    "momentum", "mean_square", "mean_grad",                                  # RMSProp
    "moment",                                                                # Adagrad, Adamax
    "inf_norm",                                                              # Adamax
    "_avg_squared_grad", "_avg_squared_update",                              # Adadelta
}, key=len, reverse=True))
MASTER_SLOT = "master_weight"  # a multi-precision optimizer's float32 copy of a low-precision parameter

# Scheduler state that Paddle's own state_dict() leaves out (CosineAnnealingWarmRestarts keeps its
# position in the current cycle in T_cur/T_i, which state_dict() omits): restoring from state_dict()
# alone is silently wrong for these, so ScheduleState.state carries them too.
SCHEDULER_EXTRA_ATTRS = {"CosineAnnealingWarmRestarts": ("T_cur", "T_i")}

_COUNTER = re.compile(r"_\d+$")
_MASTER = re.compile(r"^fp32_master_\d+_")
_HYPER = (("_beta1", "beta1"), ("_beta2", "beta2"), ("_epsilon", "epsilon"), ("_momentum", "momentum"),
          ("_use_nesterov", "use_nesterov"), ("_rho", "rho"), ("_centered", "centered"),
          ("initial_accumulator_value", "initial_accumulator_value"), ("_weight_decay", "weight_decay"),
          ("_lazy_mode", "lazy_mode"), ("_amsgrad", "amsgrad"), ("_multi_precision", "multi_precision"),
          ("_rescale_grad", "rescale_grad"), ("_regularization_method", "regularization_method"),
          ("_regularization_coeff", "regularization_coeff"))
# Constructor argument -> attribute, where Paddle stores it under another name.
# Constructor arguments that have a plain form; anything else (a callable, an object) is not config.
_CONFIG_TYPES = (int, float, str, bool, list, tuple, dict, np.generic, np.ndarray, type(None))
_CTOR_ALIASES = {"learning_rate": "base_lr", "base_learning_rate": "base_lr",
                 "max_learning_rate": "max_lr", "exp_gamma": "gamma"}


def optimizer_params(opt: Any) -> list[Any]:
    """The optimizer's parameters in order, flattening parameter groups."""
    out: list[Any] = []
    for entry in opt._parameter_list or []:
        out.extend(entry["params"] if isinstance(entry, dict) else [entry])
    return out


def _is_scheduler(obj: Any) -> bool:
    from paddle.optimizer.lr import LRScheduler
    return isinstance(obj, LRScheduler)


def attached_scheduler(opt: Any) -> Any:
    """The ``LRScheduler`` an optimizer was built with, or None for a float learning rate."""
    lr = getattr(opt, "_learning_rate", None)
    return lr if _is_scheduler(lr) else None


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
        keys, tensors = [], []
        for acc, per_param in opt._accumulators.items():
            slot = acc[len(prefix):] if prefix and acc.startswith(prefix) else acc
            for pname, var in per_param.items():
                # A plain lookup for the common case (hundreds of accumulators); struct_of raises.
                struct = runtime_to_struct.get(pname) if not owner else None
                keys.append((struct if struct is not None else struct_of(pname), slot))
                tensors.append(var)
        for (struct, slot), value in zip(keys, values(opt, tensors, copy)):
            slots.setdefault(struct, {})[slot] = value
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
    """Paddle optimizers keep no update counter: for Adam-family optimizers the count implied by
    ``beta2_pow_acc`` (then ``beta1_pow_acc``), else the scheduler's ``last_epoch``, else 0."""
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


def plan_optimizer(plan: RestorePlan, opt: Any, state: OptimizerState | None,
                   struct_to_param: dict[str, Any], saved_params: Any = (),
                   copies: Copies | None = None) -> None:
    """Plan restoring ``state``'s slots into ``opt``'s accumulators (and its float learning rate).

    Accumulators the optimizer has not created yet (it never stepped) are created here: the only
    change made before the plan is applied, and the one its first step would make anyway.
    Accumulators the state does not have are dropped when the plan is applied (they did not exist
    when it was captured: a parameter without slots in the state had none yet).  They are also
    reported missing where the state has slots for that parameter but not this one, or does not
    hold the parameter itself (``saved_params``: the state's model names), since then the state
    says nothing about them.  Shape and dtype are checked by ``plan.assign``.  The copies go on
    ``copies`` (the restore's, see ``_tensors.Copies``; by default groups copied in this thread).
    """
    if state is None:
        plan.missing(qualified("optimizer"))
        return
    prefix = f"{opt._name}_" if opt._name else ""
    params = {p.name: p for p in optimizer_params(opt)}
    runtime_struct = {p.name: s for s, p in struct_to_param.items() if p.name in params}
    ours = set(runtime_struct.values())
    plan.unexpected(*(qualified("optimizer", s, slot) for s in sorted(set(state.slots) - ours)
                      for slot in state.slots[s]))
    wanted = [struct_to_param[s] for s in state.slots if s in ours]
    opt._accumulators_holder = {}
    if wanted:
        import paddle
        block = paddle.static.default_main_program().global_block()
        opt._create_accumulators(block, wanted)
    master = dict(getattr(opt, "_master_weights", None) or {})
    owner = {v.name: k for k, v in master.items()}
    seen: set[tuple[str, str]] = set()
    copies = Copies(plan) if copies is None else copies
    put = _accumulator_putter(opt, copies)
    slots = state.slots
    for acc, per_param in list(opt._accumulators.items()):
        slot = acc[len(prefix):] if prefix and acc.startswith(prefix) else acc
        for pname, var in list(per_param.items()):
            param = owner.get(pname, pname) if owner else pname
            struct = runtime_struct.get(param)
            if struct is None:  # a parameter outside the model: not ours to change
                plan.missing(qualified("optimizer", param, slot))
                continue
            saved = slots.get(struct)
            if saved is None or slot not in saved:
                if saved is not None or struct not in saved_params:
                    plan.missing(qualified("optimizer", struct, slot))
                plan.then(functools.partial(_drop_accumulator, opt, acc, pname, param))
                continue
            put(qualified("optimizer", struct, slot), var, saved[slot])
            seen.add((struct, slot))
    for pname, var in master.items():
        struct = runtime_struct.get(pname)
        if struct is not None and MASTER_SLOT in state.slots.get(struct, {}):
            put(qualified("optimizer", struct, MASTER_SLOT), var, state.slots[struct][MASTER_SLOT])
            seen.add((struct, MASTER_SLOT))
    copies.flush()
    for struct, per_slot in state.slots.items():
        if struct in ours:
            plan.unexpected(*(qualified("optimizer", struct, slot) for slot in per_slot
                              if (struct, slot) not in seen))
    plan.then(functools.partial(restore_learning_rate, opt, state))


def _accumulator_putter(opt: Any, copies: Copies) -> Callable[[str, Any, np.ndarray], None]:
    """``put(name, var, value)``: plan ``value`` into the accumulator ``var`` (on ``copies``).
    The views of every accumulator are taken at once, once they all exist: a view carries the
    target's shape and dtype, so no Paddle call per accumulator asks for them."""
    accumulators = [var for per_param in opt._accumulators.values() for var in per_param.values()]
    view_of = dict(zip(map(id, accumulators), views(opt, accumulators)))

    def put(name: str, var: Any, value: np.ndarray) -> None:
        copies.add(name, var, view_of.get(id(var)), value)
    return put


def _drop_accumulator(opt: Any, acc: str, pname: str, param_name: str) -> None:
    opt._accumulators[acc].pop(pname, None)
    opt._already_create_accumulator.discard(param_name)


def restore_learning_rate(opt: Any, state: OptimizerState) -> None:
    """A float learning rate changed with ``set_lr`` is state too; a scheduler's is restored with it."""
    lr = state.hyperparams.get("learning_rate")
    if lr is not None and not _is_scheduler(opt._learning_rate):
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
                if _is_scheduler(value):
                    config[name] = {"kind": type(value).__name__, "config": scheduler_config(value)}
                elif isinstance(value, _CONFIG_TYPES):  # callables and other objects are left out
                    config[name] = plain(value)
                break
    return config


def schedule_fits(sch: Any, schedule: ScheduleState) -> bool:
    """Whether ``schedule`` was captured from a scheduler of ``sch``'s class (or its class is unknown)."""
    return schedule.kind in (type(sch).__name__, "LRScheduler")


def plan_schedule(plan: RestorePlan, sch: Any, schedule: ScheduleState | None,
                  legacy: dict[str, Any] | None = None) -> None:
    """Plan loading ``schedule`` into ``sch`` (reported as ``schedule`` when the state has none).

    Raises:
        RestoreError: the state's schedule is of another class than ``sch``.
    """
    if schedule is None:
        plan.missing(qualified("schedule"))
    elif not schedule_fits(sch, schedule):
        raise RestoreError(f"{qualified('schedule')}: the state holds a {schedule.kind} schedule but the "
                           f"scheduler given is a {type(sch).__name__}")
    else:
        plan.then(functools.partial(restore_schedule, sch, schedule, legacy))


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
        from ckptcore.migrate.schedules import sgdr_position  # pure integer arithmetic
        sch.T_cur, sch.T_i = sgdr_position(int(sch.last_epoch), int(sch.T_0), int(sch.T_mult))


# ----------------------------------------------------------------------------- GradScaler


def capture_scaler(scaler: Any) -> dict[str, Any]:
    sd = scaler.state_dict()
    if not sd:
        return {"enabled": False}
    out = {k: plain(v) for k, v in sd.items() if k != "scale"}
    out["scale"] = np.asarray(sd["scale"], dtype=np.float32).reshape(-1)
    out["enabled"] = True
    return out


def plan_scaler(plan: RestorePlan, scaler: Any, saved: dict[str, Any] | None) -> None:
    """Plan loading ``saved`` into ``scaler``, after checking it (reported as ``grad_scaler``)."""
    if not getattr(scaler, "_enable", False):
        return  # a disabled scaler has no state (Paddle's own load_state_dict ignores it too)
    if not saved or not saved.get("enabled"):
        plan.missing(qualified("grad_scaler"))
        return
    sd = {k: v for k, v in saved.items() if k != "enabled"}
    sd["scale"] = np.asarray(sd["scale"], dtype=np.float32).reshape(-1)
    if sd["scale"].size != 1 or not math.isfinite(float(sd["scale"][0])):
        raise RestoreError(f"grad_scaler: the saved loss scale {sd['scale'].tolist()} is not one finite number")
    plan.then(functools.partial(scaler.load_state_dict, sd))


# ----------------------------------------------------------------------------- accumulator names and step counts


def split_accumulator_key(rest: str) -> tuple[str, str | None, bool]:
    """Parse what follows ``<param runtime name>_`` in an optimizer key.

    Returns ``(slot, optimizer_name, on_master_weight)``: ``"moment1_0"`` gives ``("moment1", None,
    False)``; ``"adam_moment1_1"`` (an optimizer built with ``name="adam"``) gives ``("moment1",
    "adam", False)``; ``"fp32_master_0_moment1_0"`` gives ``("moment1", None, True)``.
    """
    on_master = False
    m = _MASTER.match(rest)
    if m:
        on_master, rest = True, rest[m.end():]
    acc = _COUNTER.sub("", rest)
    for slot in KNOWN_SLOTS:
        if acc == slot:
            return slot, None, on_master
        if acc.endswith("_" + slot):
            return slot, acc[: -len(slot) - 1], on_master
    return acc, None, on_master


def step_from_pow(pow_value: float, beta: float, *, limit: int = 1 << 22) -> int | None:
    """The number of updates ``t`` after which Adam's ``beta_pow_acc`` holds ``pow_value``.

    Paddle starts the accumulator at ``beta`` and multiplies it by ``float32(beta)`` once per update,
    in float32, so after ``t`` updates it holds the ``t``-th element of
    ``np.multiply.accumulate([beta] * n)``: we look it up there, which stays exact long after a
    logarithm would round wrongly.  ``None`` if the value is ambiguous (it underflowed and got stuck,
    about 960 updates for 0.9) or further than ``limit`` updates away.
    """
    b, p = np.float32(beta), np.float32(pow_value)
    if not (0.0 < b < 1.0) or not (0.0 < p <= b):
        return None
    estimate = math.log(float(p)) / math.log(float(b))
    if not math.isfinite(estimate) or estimate > limit:
        return None
    n = min(limit, int(estimate * 1.01) + 64)
    seq = np.multiply.accumulate(np.full(n, b, dtype=np.float32))
    hits = np.flatnonzero(seq == p)
    if hits.size != 1 or hits[0] + 1 >= n:
        return None
    return int(hits[0])


def infer_optimizer_kind(slot_names: set[str]) -> str:
    """Guess Paddle's optimizer class from the accumulators a ``.pdopt`` holds (Adam and AdamW look alike)."""
    slot_names = slot_names - {MASTER_SLOT}
    if {"moment1", "moment2"} <= slot_names:
        return "adam"
    if slot_names == {"velocity"}:
        return "momentum"
    if {"mean_square", "mean_grad"} <= slot_names:
        return "rmsprop"
    if slot_names == {"moment"}:
        return "adagrad"
    if {"moment", "inf_norm"} <= slot_names:
        return "adamax"
    return "unknown"


def adam_step(slots: dict[str, dict[str, np.ndarray]], beta1: float, beta2: float) -> int | None:
    """The update count of an Adam-family optimizer from its ``beta{2,1}_pow_acc`` slots (beta2 first)."""
    for slot, beta in (("beta2_pow_acc", beta2), ("beta1_pow_acc", beta1)):
        # Every parameter usually holds the same power: look each distinct value up once.
        found = [s[slot] for s in slots.values() if slot in s]
        found = [a if type(a) is np.ndarray else np.asarray(a) for a in found]
        pows = {float(a.item(0)) for a in found if a.size}
        steps = [step_from_pow(p, beta) for p in pows]
        if steps and all(t is not None for t in steps):
            return max(steps)  # type: ignore[type-var]
    return None
