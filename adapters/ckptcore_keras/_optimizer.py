"""Keras 3 optimizer state <-> :class:`OptimizerState`, :class:`ScheduleState`, :class:`AccumulationState`.

Slots are found through the optimizer's own structure, not by parsing names:
every list attribute with one entry per ``optimizer._trainable_variables``
(``_momentums``, ``_velocities``, ``momentums``, ``_velocity_hats``, EMA
averages...) holds, at index ``i``, a slot of the ``i``-th trainable variable.
The slot name is the variable name with the parameter's prefix removed
(``dense_kernel_momentum`` -> ``momentum``).

* ``OptimizerState.step`` is the number of updates applied (``optimizer.iterations``).
  With ``gradient_accumulation_steps=N`` the stored counter counts micro-batches;
  it is split into ``step`` and ``AccumulationState.count`` (``raw = step*N + count``)
  and the accumulators (raw sums) become ``AccumulationState.buffers``.
* ``hyperparams`` are the plain values of ``get_config()``; ``learning_rate`` is the
  current rate as a float (exact for a float32 variable).
* ``extra["loss_scale"]``: a ``LossScaleOptimizer``'s own variables and config; the
  wrapped optimizer is described by the other fields.  ``extra["variables"]``: any
  other optimizer variable, by name (e.g. Nadam's ``u_product``).
* A ``LearningRateSchedule`` is a function of the iteration counter, so its state is that
  counter: restoring the optimizer positions the schedule; :func:`plan_schedule` only checks
  that the target has the same schedule.

Restore reports name entries with :func:`ckptcore.adapter.qualified`: ``optimizer/<param>/<slot>``,
``optimizer/iterations``, ``optimizer/learning_rate``, ``optimizer/<extra variable>``,
``optimizer/loss_scale/<variable>``, ``accumulation/<param>`` and ``schedule``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import numpy as np

from ckptcore.adapter import RestorePlan, qualified
from ckptcore.errors import RestoreError
from ckptcore.state import AccumulationState, OptimizerState, ScheduleState
from ckptcore.vocab import plain

from ._backend import fit_integers
from ._tensors import assign, np_dtype, shape_of, to_numpy

__all__ = ["capture_optimizer", "plan_optimizer", "capture_schedule", "plan_schedule", "slot_variables",
           "ensure_built", "unwrap", "variable_roles"]

_NOT_SLOTS = ("_variables", "_trainable_variables", "_accumulated_gradients")


def unwrap(optimizer: Any) -> tuple[Any, Any]:
    """``(inner, loss_scale_wrapper_or_None)``."""
    inner = getattr(optimizer, "inner_optimizer", None)
    return (inner, optimizer) if inner is not None else (optimizer, None)


def ensure_built(optimizer: Any, model: Any) -> None:
    """Build an optimizer that has not taken a step yet, as its first ``apply`` would."""
    if optimizer.built:
        return
    variables = model.trainable_variables
    if not variables:
        raise RestoreError("the model has no trainable variables yet, so its optimizer cannot be "
                           "built: build the model first (call it on a batch or model.build())")
    strategy = getattr(optimizer, "_distribution_strategy", None)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        optimizer.build(variables)


def _is_variable(x: Any) -> bool:
    import keras
    return isinstance(x, keras.Variable)


def _slot_table(inner: Any) -> tuple[dict[int, dict[str, Any]], dict[int, Any]]:
    """``({param index: {slot name: var}}, {param index: gradient accumulator})``."""
    params = list(inner._trainable_variables)
    slots: dict[int, dict[str, Any]] = {}
    seen: set[int] = set()
    for attr, value in list(vars(inner).items()):
        if attr in _NOT_SLOTS or not isinstance(value, (list, tuple)) or len(value) != len(params):
            continue
        if not value or not all(x is None or _is_variable(x) for x in value):
            continue
        for i, var in enumerate(value):
            if var is None or id(var) in seen:
                continue
            seen.add(id(var))
            prefix = params[i].path.replace("/", "_") + "_"
            name = var.name[len(prefix):] if var.name.startswith(prefix) else attr.strip("_")
            slots.setdefault(i, {})[name] = var
    acc = {i: v for i, v in enumerate(getattr(inner, "_accumulated_gradients", None) or ())}
    return slots, acc


def _param_names(inner: Any, names: dict[int, str]) -> list[str]:
    """The state name of each ``inner._trainable_variables[i]`` (its path if not a model variable)."""
    return [names.get(id(p)) or p.path for p in inner._trainable_variables]


def _other_variables(inner: Any, slots: dict, acc: dict, lr_var: Any) -> dict[str, Any]:
    """Optimizer variables that are no slot, accumulator, counter or rate, by stable name.

    The attribute holding a variable names it (Nadam's ``_u_product`` -> ``u_product``):
    unnamed variables get per-process names (``variable_3``) that would not match.
    """
    known = {id(inner._iterations), id(lr_var)} | {id(v) for v in acc.values()}
    known |= {id(v) for d in slots.values() for v in d.values()}
    by_attr = {id(v): a.strip("_") for a, v in vars(inner).items() if _is_variable(v)}
    return {by_attr.get(id(v), v.name): v for v in inner.variables if id(v) not in known}


def variable_roles(inner: Any) -> list[tuple[Any, ...]]:
    """What each of ``inner.variables`` is, in order: ``("iteration",)``, ``("learning_rate",)``,
    ``("slot", param_index, name)``, ``("accumulator", param_index)`` or ``("extra", name)``."""
    slots, acc = _slot_table(inner)
    lr_var = _lr_variable(inner)
    roles: dict[int, tuple[Any, ...]] = {id(inner._iterations): ("iteration",), id(lr_var): ("learning_rate",)}
    roles.update({id(v): ("slot", i, name) for i, d in slots.items() for name, v in d.items()})
    roles.update({id(v): ("accumulator", i) for i, v in acc.items()})
    roles.update({id(v): ("extra", name) for name, v in _other_variables(inner, slots, acc, lr_var).items()})
    return [roles[id(v)] for v in inner.variables]


def _lr_variable(inner: Any) -> Any:
    return inner._learning_rate if _is_variable(inner._learning_rate) else None


def _schedule_of(inner: Any) -> Any:
    from keras.optimizers.schedules import LearningRateSchedule

    sched = inner._learning_rate
    return sched if isinstance(sched, LearningRateSchedule) else None


def capture_optimizer(optimizer: Any, names: dict[int, str]) -> tuple[
        OptimizerState, AccumulationState | None]:
    """The optimizer's state; ``names`` maps ``id(model variable)`` to its state name."""
    inner, wrapper = unwrap(optimizer)
    slots, acc = _slot_table(inner)
    pnames = _param_names(inner, names)
    raw = int(inner._iterations.numpy())
    every = inner.gradient_accumulation_steps or 0
    lr_var = _lr_variable(inner)
    hyper = plain(inner.get_config())
    hyper["learning_rate"] = float(np.asarray(inner.learning_rate))
    extra: dict[str, Any] = {}
    others = {name: to_numpy(v) for name, v in _other_variables(inner, slots, acc, lr_var).items()}
    if others:
        extra["variables"] = others
    if wrapper is not None:
        extra["loss_scale"] = {
            "variables": {v.name: to_numpy(v) for v in wrapper._variables},
            "config": {"initial_scale": float(wrapper.initial_scale),
                       "dynamic_growth_steps": int(wrapper.dynamic_growth_steps)}}
    state = OptimizerState(
        kind=type(inner).__name__.lower(), step=raw // every if every else raw,
        hyperparams=hyper, extra=extra,
        slots={pnames[i]: {k: to_numpy(v) for k, v in d.items()} for i, d in sorted(slots.items())})
    accumulation = None
    if every:
        accumulation = AccumulationState(every=every, count=raw % every,
                                         buffers={pnames[i]: to_numpy(v) for i, v in sorted(acc.items())})
    return state, accumulation


def capture_schedule(optimizer: Any) -> ScheduleState | None:
    """The learning-rate schedule, if the optimizer has one: its config and position."""
    inner, _ = unwrap(optimizer)
    sched = _schedule_of(inner)
    if sched is None:
        return None
    return ScheduleState(kind=type(sched).__name__, config=plain(sched.get_config()),
                         step=int(inner._iterations.numpy()),
                         last_lr=float(np.asarray(inner.learning_rate)))


def slot_variables(optimizer: Any) -> list[Any]:
    """Every slot variable of a built optimizer (moments, momentums...), in no particular order."""
    slots, _ = _slot_table(unwrap(optimizer)[0])
    return [v for d in slots.values() for v in d.values()]


def plan_schedule(plan: RestorePlan, schedule: ScheduleState | None, optimizer: Any, *,
                  strict: bool = True, unapplied: dict[str, str] | None = None) -> None:
    """Check a saved schedule against the target optimizer's; there is nothing to assign.

    The schedule's position is the optimizer's iteration counter, which :func:`plan_optimizer`
    restores.  A saved schedule the target does not have goes to ``unapplied`` (warned: the run
    would go on at a constant rate; ``unexpected`` in a non-strict report); a state without one
    restores into an optimizer with one (the counter positions it).

    Raises:
        RestoreError: the target's schedule is of another class than the saved one.
    """
    if schedule is None:
        return
    sched = _schedule_of(unwrap(optimizer)[0])
    if sched is None:
        if unapplied is not None:
            unapplied["schedule"] = (f"give the optimizer the saved {schedule.kind} "
                                     "learning-rate schedule")
        if not strict or unapplied is None:
            plan.unexpected(qualified("schedule"))
    elif type(sched).__name__ != schedule.kind:
        raise RestoreError(f"the state holds a {schedule.kind} learning-rate schedule but the target "
                           f"optimizer's is a {type(sched).__name__}")


def _put(plan: RestorePlan, name: str, var: Any, value: Any) -> None:
    value = np.asarray(value)
    plan.assign(name, value, shape=shape_of(var), dtype=np_dtype(var),
                put=lambda: assign(var, value))


def plan_optimizer(plan: RestorePlan, state: OptimizerState, accumulation: AccumulationState | None,
                   optimizer: Any, to_target: Callable[[str], Any | None], *, strict: bool,
                   unapplied: dict[str, str] | None = None) -> None:
    """Plan restoring ``state`` (and ``accumulation``) into a built ``optimizer``.

    ``to_target`` maps a saved parameter name to the live model variable (or None).
    Names that do not fit go to the plan's missing / unexpected lists; shape and dtype
    mismatches raise :class:`RestoreError` (through ``plan.assign``).  Accumulation buffers
    saved for a target that does not accumulate have nowhere to go: they are added to
    ``unapplied`` (warned by the caller) and the update count is restored alone.

    Raises:
        RestoreError: the optimizer class differs (with ``strict``; otherwise the whole
            optimizer is reported missing and unexpected), or the target accumulates gradients
            over another window than the state (or the state did not accumulate).
    """
    inner, wrapper = unwrap(optimizer)
    slots, acc = _slot_table(inner)
    kind = type(inner).__name__.lower()
    if state.kind != kind:
        if strict:
            raise RestoreError(f"the state holds {state.kind!r} optimizer state but the target "
                               f"optimizer is {kind!r}; use a {state.kind} optimizer, or "
                               "strict=False to restore the model alone")
        plan.unexpected(qualified("optimizer"))
        plan.missing(qualified("optimizer"))
        return
    index = {inner._var_key(p): i for i, p in enumerate(inner._trainable_variables)}
    paths = [p.path for p in inner._trainable_variables]

    def position(pname: str) -> int | None:
        var = to_target(pname)
        return index.get(inner._var_key(var)) if var is not None else None

    done: set[int] = set()
    for pname, saved in state.slots.items():
        i = position(pname)
        if i is None:
            plan.unexpected(*(qualified("optimizer", pname, s) for s in saved))
            continue
        done.add(i)
        _plan_named(plan, saved, slots.get(i, {}), ("optimizer", pname), ("optimizer", paths[i]))
    for i in sorted(set(slots) - done):
        plan.missing(*(qualified("optimizer", paths[i], s) for s in slots[i]))

    _plan_iterations(plan, state, accumulation, inner, acc, position, paths, strict=strict,
                     unapplied=unapplied)

    lr_var = _lr_variable(inner)
    if lr_var is not None and "learning_rate" in state.hyperparams:
        value = np.asarray(state.hyperparams["learning_rate"], dtype=np_dtype(lr_var))
        _put(plan, qualified("optimizer", "learning_rate"), lr_var, value)
    elif lr_var is not None:
        plan.missing(qualified("optimizer", "learning_rate"))
    others = _other_variables(inner, slots, acc, lr_var)
    _plan_named(plan, state.extra.get("variables", {}), others, ("optimizer",))
    saved_ls = (state.extra.get("loss_scale") or {}).get("variables", {})
    target_ls = {v.name: v for v in wrapper._variables} if wrapper is not None else {}
    _plan_named(plan, saved_ls, target_ls, ("optimizer", "loss_scale"))


def _plan_iterations(plan: RestorePlan, state: OptimizerState,
                     accumulation: AccumulationState | None, inner: Any, acc: dict[int, Any],
                     position: Callable[[str], int | None], paths: list[str], *, strict: bool,
                     unapplied: dict[str, str] | None) -> None:
    """The iteration counter (micro-batches under gradient accumulation: ``step*N + count``)
    and the accumulators, once the target's accumulation window is checked against the state's
    (``acc``: the target's accumulators by trainable index, ``position`` a saved parameter's)."""
    every = inner.gradient_accumulation_steps or 0
    if not every and accumulation is not None and unapplied is not None:
        # Nowhere to put the buffers: the partial window is dropped, the update count kept.
        unapplied["accumulation"] = (f"compile with an optimizer of gradient_accumulation_steps="
                                     f"{accumulation.every} to resume the partial window")
        if not strict:
            plan.unexpected(*(qualified("accumulation", p) for p in accumulation.buffers))
        accumulation = None
    elif every != (accumulation.every if accumulation is not None else 0):
        raise RestoreError(f"the state was captured with gradient_accumulation_steps="
                           f"{accumulation.every if accumulation else None} but the target "
                           f"optimizer has {every or None}")
    raw = state.step * every + accumulation.count if every else state.step
    # int64 on TensorFlow, int32 on JAX and PyTorch: the count in the target's dtype, if it fits.
    name = qualified("optimizer", "iterations")
    _put(plan, name, inner._iterations,
         fit_integers(name, np.int64(raw), np_dtype(inner._iterations)))
    if every:
        done = set()
        for pname, value in accumulation.buffers.items():
            i = position(pname)
            if i is None or i not in acc:
                plan.unexpected(qualified("accumulation", pname))
                continue
            done.add(i)
            _put(plan, qualified("accumulation", pname), acc[i], value)
        plan.missing(*(qualified("accumulation", paths[i]) for i in sorted(set(acc) - done)))


def _plan_named(plan: RestorePlan, saved: dict[str, Any], targets: dict[str, Any],
                prefix: tuple[str, ...], target_prefix: tuple[str, ...] | None = None) -> None:
    """Pair ``saved`` and ``targets`` by name; what only the state has is reported under the
    state's names (``prefix``), what only the target has under the target's (``target_prefix``)."""
    for name, value in saved.items():
        if name in targets:
            _put(plan, qualified(*prefix, name), targets[name], value)
        else:
            plan.unexpected(qualified(*prefix, name))
    target_prefix = prefix if target_prefix is None else target_prefix
    plan.missing(*(qualified(*target_prefix, n) for n in targets if n not in saved))
