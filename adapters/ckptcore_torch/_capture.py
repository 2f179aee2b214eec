"""Capture a PyTorch training run as a TrainingState, and restore one bit for bit.

Naming (a contract: checkpoints written today must restore tomorrow; the layout is the one the
torch file import/export produce and consume too):

* ``state.model``: every ``state_dict()`` entry by its key without wrapper components (see
  ``_tensors.py``); a tensor reachable under several names (tied weights) is stored once, and
  ``extra["torch"]["aliases"]`` maps the others to it.  A module's extra state
  (``get_extra_state()``) is ``<module path>._extra_state`` there when it is a tensor, else
  ``extra["torch"]["extra_states"][<module path>._extra_state]`` as plain data (numbers,
  strings, bytes, lists, tuples, dicts, tensors as arrays); restore gives it back through the
  module's ``set_extra_state``.  An extra state with no plain form is a CaptureError.
* ``state.optimizer``: slots keyed by parameter name and torch's slot names, every param group's
  hyperparameters in ``extra["param_groups"]`` (see ``_optimizer.py``).  ``state.optimizer.step``
  (and ``state.step``): the ``step`` argument; else the largest per-parameter ``step`` slot
  (Adam and the like); else the scheduler's ``last_epoch``; else 0.  ``extra["step_source"]``
  says which.
* ``state.schedule``: ``ScheduleState(kind=<class name>, config={}, step=last_epoch,
  last_lr=get_last_lr()[0], state=<its state_dict(), plain>)``.
* ``optimizer.extra["grad_scaler"]``: a ``GradScaler``'s ``state_dict()`` (or
  ``extra["torch"]["grad_scaler"]`` without an optimizer).
* ``state.optimizer`` slots and ``state.accumulation`` buffers are keyed by the name the
  parameter has in ``state.model``; restore finds a target parameter's the way it finds its
  values (under any of its names, or one the checkpoint records as an alias), so a tied model
  whose submodules are registered in another order resumes exactly, and an untied one gives each
  copy the tied tensor's values, slots and gradient.
* ``state.accumulation``: gradients in flight (``param.grad``) with any bit set, with
  ``every``/``count`` from the ``accumulate_every``/``accumulated`` hints (0 when not given).
  ``extra["torch"]["zero_grads"]`` lists parameters whose gradient exists but is all zero
  (``zero_grad(set_to_none=False)``); restore recreates those and sets every other gradient to
  None: None and zeros differ (an optimizer skips a parameter whose grad is None, but applies
  weight decay and momentum to one with a zero gradient).
* ``state.rng``: ckptcore's ``"python"`` and ``"numpy"`` plus ``"torch"`` (and ``"cuda"``), see
  ``_rng.py``.
* ``state.params``: a ParamInfo per entry of ``state.model`` (see ``_params.py``).

Restoring goes through one :class:`ckptcore.adapter.RestorePlan`: every check first, then every
assignment and action.  RestoreReport names follow :func:`ckptcore.adapter.qualified`: model
tensors by their own name, ``optimizer/<param>/<slot>``, ``optimizer``, ``schedule``,
``grad_scaler``, ``accumulation/<param>``, ``data``.
"""

from __future__ import annotations

import functools
from typing import Any, Container

import numpy as np
import torch

from ckptcore.adapter import RestorePlan, any_bit, finish_restore, plan_training_parts, qualified
from ckptcore.errors import CaptureError, RestoreError
from ckptcore.rng import capture_rng, restore_rng
from ckptcore.state import AccumulationState, RestoreReport, TrainingState

from ._optimizer import (capture_optimizer, capture_schedule, capture_scaler, plan_optimizer, plan_schedule,
                         plan_scaler, schedule_step)
from ._params import describe_params
from ._rng import capture_framework_rng, restore_framework_rng
from ._sharding import has_dtensors, is_dtensor, reshard_optimizer, restore_target, set_grad  # [sharding hook]
from ._tensors import (Entries, assign, foreign_message, named_tensors, new_tensor, numpy_check, numpy_dtype,
                       plain_extra_state, revive_extra_state, to_numpy, unwrap)


def capture(model: Any, optimizer: Any = None, *, cursor: Any = None, rng: bool = True, copy: bool = True,
            scheduler: Any = None, scaler: Any = None, step: int | None = None,
            accumulate_every: int | None = None, accumulated: int | None = None) -> TrainingState:
    """Snapshot a PyTorch module, optimizer, LR scheduler, GradScaler, gradients, RNGs and a cursor.

    ``model`` may be wrapped (DDP, DataParallel, ``torch.compile``): names are the plain
    module's.  ``step`` overrides the derived update count; ``accumulate_every`` and
    ``accumulated`` describe a gradient-accumulation window in progress.  ``copy=False`` returns
    views of CPU tensors' own buffers instead of copies: for a synchronous save straight after
    the capture, before training changes them; never for an asynchronous save.

    Raises:
        CaptureError: an optimizer ckptcore_torch cannot capture exactly (e.g. ``LBFGS``, or a
            custom subclass with its own state keys), or one updating parameters outside the model;
            a tensor of a dtype with no exact NumPy form (``complex32``); a module's extra state
            with no plain form, or a ``state_dict()`` entry that is no parameter, buffer or extra
            state (see ``_tensors.py``).

    Example:
        >>> state = ckptcore_torch.capture(net, opt, scheduler=sched, cursor=cursor)  # doctest: +SKIP
        >>> ckptcore_torch.restore(state, new_net, new_opt, scheduler=new_sched)      # doctest: +SKIP
    """
    found = named_tensors(model)
    tensors, aliases = found.tensors, found.aliases
    if found.foreign:
        raise CaptureError(foreign_message(found.foreign, "saved"))
    for name, t in tensors.items():
        _check_materialised(name, t, CaptureError)
        numpy_check(t, name)
    arrays = {n: to_numpy(t, copy) for n, t in tensors.items()}
    extra: dict[str, Any] = {}
    for name, (module, value) in found.extra.items():
        if isinstance(value, torch.Tensor):
            arrays[name] = to_numpy(numpy_check(value, name), copy)
        else:
            extra.setdefault("extra_states", {})[name] = plain_extra_state(
                value, f"{name} (the extra state of a {type(module).__name__})")
    state = TrainingState(framework="torch", model=arrays, params=describe_params(unwrap(model), tensors, aliases))
    if aliases:
        extra["aliases"] = aliases
    if optimizer is not None:
        key_of = {id(t): n for n, t in tensors.items()}
        state.optimizer = capture_optimizer(optimizer, key_of, step=step, scheduler=scheduler, copy=copy)
        state.step = state.optimizer.step
    elif step is not None:
        state.step = int(step)
    elif scheduler is not None:
        state.step = max(schedule_step(scheduler), 0)
    if scheduler is not None:
        state.schedule = capture_schedule(scheduler)
    if scaler is not None:
        (state.optimizer.extra if state.optimizer else extra)["grad_scaler"] = capture_scaler(scaler)
    buffers, extra["zero_grads"] = _capture_grads(tensors, copy)
    if buffers or accumulate_every or accumulated:
        state.accumulation = AccumulationState(every=int(accumulate_every or 0), count=int(accumulated or 0),
                                               buffers=buffers)
    if rng:
        state.rng = {**capture_rng(), **capture_framework_rng()}
    if cursor is not None:
        state.data = dict(cursor.state_dict())
    state.metadata = {"versions": {"torch": torch.__version__, "numpy": np.__version__},
                      "model_class": type(unwrap(model)).__name__,
                      "optimizer_class": None if optimizer is None else type(optimizer).__name__}
    state.extra = {"torch": extra}
    return state


def _capture_grads(tensors: dict[str, Any], copy: bool = True) -> tuple[dict[str, np.ndarray], list[str]]:
    buffers: dict[str, np.ndarray] = {}
    zero: list[str] = []
    for name, t in tensors.items():
        g = t.grad if isinstance(t, torch.nn.Parameter) else None
        if g is None:
            continue
        if g.is_sparse:
            g = g.to_dense()
        if is_dtensor(g):  # [sharding hook] every rank lists a DTensor's gradient (its block), zero or not
            buffers[name] = to_numpy(g, copy)
            continue
        view = to_numpy(g, copy=False)  # look before copying: cleared gradients are all zero
        if any_bit(view):
            buffers[name] = view.copy() if copy else view
        else:
            zero.append(name)
    return buffers, zero


def restore(state: TrainingState, model: Any, optimizer: Any = None, *, cursor: Any = None,
            strict: bool = True, rng: bool = True, scheduler: Any = None, scaler: Any = None,
            warn_data: bool = True) -> RestoreReport:
    """Put ``state`` back into ``model`` (and the other objects given), bit for bit, each tensor in
    place on the live tensor's device.

    Everything is checked before anything is assigned.  A shape or dtype mismatch is a RestoreError
    naming the tensor, whatever ``strict`` says; names present on only one side raise RestoreError
    when ``strict`` and are returned in the RestoreReport otherwise (a saved gradient or optimizer
    slot of a parameter the target lacks too: ``accumulation/<param>``,
    ``optimizer/<param>/<slot>``).  Modules' extra states go back through their
    ``set_extra_state``.  ``rng=False`` leaves every RNG as it is.  Objects not passed are left
    alone.  A ``LambdaLR``'s (``MultiplicativeLR``'s) lambdas are code, not state: the live
    scheduler's own are kept.

    Saved parts with no target warn (:class:`ckptcore.errors.UnappliedStateWarning`) and never
    raise: a data position without ``cursor`` (unless ``warn_data=False``), an optimizer section
    without an optimizer, a schedule without a scheduler, a GradScaler state without ``scaler``.
    A state saved without an optimizer leaves a target optimizer as it is (and warns).

    Raises:
        RestoreError: a mismatch as described.
        MigrationError: a state captured from another framework that cannot be converted.
    """
    from ckptcore.adapter import convert_for

    state = convert_for(state, "torch", {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                                         "scaler": scaler})
    extra = (state.extra or {}).get("torch") or {}
    plan = RestorePlan()
    found = named_tensors(model)
    if found.foreign and strict:
        raise RestoreError(foreign_message(found.foreign, "restored"))
    sources = _Sources(found, state, extra)
    _plan_model(plan, state, extra, found, sources, strict)
    _plan_grads(plan, state, extra, found.tensors, sources)
    unapplied: dict[str, str] = {}
    no_slots = _plan_optimizer_part(plan, state, extra, optimizer, scheduler, scaler, found.tensors,
                                    sources, strict=strict, unapplied=unapplied)
    return finish_restore(plan, state, strict, cursor=cursor, restore_rng=_restore_rng if rng else None,
                          unapplied=unapplied, warn_data=warn_data,
                          no_slots_message=_no_slots_message(optimizer) if no_slots else None)


def _plan_optimizer_part(plan: RestorePlan, state: TrainingState, extra: dict, optimizer: Any,
                         scheduler: Any, scaler: Any, tensors: dict[str, Any], sources: _Sources, *,
                         strict: bool, unapplied: dict[str, str]) -> bool:
    """The optimizer, LR scheduler and GradScaler into the targets given; saved ones with no
    target go in ``unapplied``.  Returns whether the state holds no optimizer section for a
    target optimizer (which, and its scheduler unless a schedule was saved, stay as they are)."""
    saved_scaler = (state.optimizer.extra if state.optimizer else {}).get("grad_scaler", extra.get("grad_scaler"))

    def optimizer_part() -> None:
        plan_optimizer(plan, optimizer, state.optimizer, tensors, source=sources.of)
        if has_dtensors(tensors.values()):  # [sharding hook] whole slots -> this rank's DTensor blocks
            plan.then(functools.partial(reshard_optimizer, optimizer))

    return plan_training_parts(
        plan, state, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
        saved_scaler=bool(saved_scaler and saved_scaler.get("enabled")), strict=strict,
        unapplied=unapplied, plan_optimizer=optimizer_part,
        plan_schedule=lambda: plan_schedule(plan, scheduler, state.schedule),
        plan_scaler=lambda: plan_scaler(plan, scaler, saved_scaler),
        hints={"optimizer": "pass optimizer=... (the torch.optim optimizer)",
               "schedule": "pass scheduler=... (the torch.optim.lr_scheduler object)",
               "grad scaler": "pass scaler=... (the torch.amp.GradScaler)"})


def _no_slots_message(opt: Any) -> str:
    return (f"the checkpoint holds no optimizer state (it was saved without its optimizer), so the "
            f"{type(opt).__name__} optimizer keeps its own state and schedule: the run does not "
            "continue where it stopped. Save with optimizer=... to resume it; load with "
            "keys=['model'] to restore the model alone on purpose.")


def _restore_rng(rng: dict[str, Any]) -> None:
    restore_framework_rng(rng)  # checks its entries before it sets anything
    restore_rng({k: v for k, v in rng.items() if k in ("python", "numpy", "numpy_generators")})


class _Sources:
    """Which saved name each target tensor takes its values from: the first of its own names
    (canonical, then the target's aliases of it) the checkpoint holds, directly or as a name the
    checkpoint records as an alias (a tied checkpoint into an untied model: each copy takes the
    tied tensor).  Its optimizer slots and gradient are saved under the same name as its values,
    so they are found through the same one (see :meth:`of`)."""

    def __init__(self, found: Entries, state: TrainingState, extra: dict) -> None:
        self.model = set(state.model) | set(extra.get("extra_states") or {})
        self.saved_alias = dict(extra.get("aliases") or {})
        self.names_of: dict[str, list[str]] = {c: [c] for c in (*found.tensors, *found.extra)}
        for a, c in found.aliases.items():
            self.names_of[c].append(a)

    def find(self, name: str, present: Container[str]) -> str | None:
        for n in self.names_of.get(name, (name,)):
            if n in present:
                return n
            c = self.saved_alias.get(n)
            if c is not None and c in present:
                return c
        return None

    def of(self, name: str, section: Container[str] = ()) -> str | None:
        """The saved name of target tensor ``name``'s values, else (a state without its model
        section) the one ``section`` holds it under; None: the state says nothing of it."""
        src = self.find(name, self.model)
        return src if src is not None else self.find(name, section)


def _plan_model(plan: RestorePlan, state: TrainingState, extra: dict, found: Entries, sources: _Sources,
                strict: bool) -> None:
    """Pair each target tensor (and extra state) with the saved value under any of its names."""
    saved = state.model
    plain = extra.get("extra_states") or {}
    used: set[str] = set()
    for canonical, target in found.tensors.items():
        src = sources.find(canonical, saved)
        if src is None:
            plan.missing(qualified("model", canonical))
            continue
        _check_materialised(canonical, target, RestoreError)
        t, value = restore_target(target, canonical, saved[src])  # [sharding hook]
        plan.assign(qualified("model", canonical), value, shape=tuple(t.shape), dtype=numpy_dtype(t, RestoreError),
                    put=functools.partial(assign, t, value))
        used.add(src)
    left_out: list[str] = []  # plain extra states, and the state has no extra section at all
    for canonical, (module, live) in found.extra.items():
        src = sources.find(canonical, saved)
        if src is not None:
            # Any shape and dtype: set_extra_state takes what get_extra_state gave, as torch's
            # load_state_dict hands it (an fp8 layer's serialised state varies in length).
            plan.assign(qualified("model", canonical), saved[src], shape=None, dtype=None,
                        put=functools.partial(_set_extra_tensor, module, saved[src], live))
        elif (src := sources.find(canonical, plain)) is not None:
            plan.then(functools.partial(_set_extra_plain, module, plain[src]))  # after every put
        else:
            if not isinstance(live, torch.Tensor) and not state.extra:
                left_out.append(canonical)
            plan.missing(qualified("model", canonical))
            continue
        used.add(src)
    if left_out and strict:
        raise RestoreError(f"{', '.join(left_out[:6])}: the state holds no extra section, where a module's "
                           "extra state that is not a tensor is kept: if a load left it out, load with "
                           "keys=[..., 'extra'] too (or strict=False to keep the live extra state)")
    for name in found.foreign:  # (strict raised already) reported, not written into a throwaway
        if name not in saved:
            plan.missing(qualified("model", name))
    plan.unexpected_from(saved, used)
    plan.unexpected_from(plain, used)


def _set_extra_tensor(module: torch.nn.Module, value: np.ndarray, live: Any) -> None:
    """``module.set_extra_state`` with the saved tensor, on the device of the live extra state."""
    device = live.device if isinstance(live, torch.Tensor) and not is_dtensor(live) else None
    module.set_extra_state(new_tensor(value, device=device))


def _set_extra_plain(module: torch.nn.Module, value: Any) -> None:
    module.set_extra_state(revive_extra_state(value))


def _check_materialised(name: str, t: torch.Tensor, error: type[Exception]) -> None:
    if torch.nn.parameter.is_lazy(t):
        raise error(f"{name} is an uninitialised lazy tensor (nn.LazyLinear and the like): run one "
                    "forward pass first, so it has a shape")
    if t.is_meta:
        raise error(f"{name} is on the meta device (no values): materialise the model (e.g. "
                    "to_empty(device=...)) first")


def _plan_grads(plan: RestorePlan, state: TrainingState, extra: dict, tensors: dict[str, Any],
                sources: _Sources) -> None:
    """Gradients as captured: saved buffers, zero gradients, and None for every other parameter;
    a saved gradient no target parameter takes is unexpected (``accumulation/<param>``)."""
    buffers = dict(state.accumulation.buffers) if state.accumulation else {}
    zero = extra.get("zero_grads")
    if zero is None and not buffers:
        return  # not captured by this adapter: leave the gradients alone
    zero = set(zero or ())
    present = buffers.keys() | zero
    used: set[str] = set()
    for name, t in tensors.items():
        if not isinstance(t, torch.nn.Parameter):
            continue
        src = sources.of(name, present)
        used.add(src)
        if src in buffers:
            target, value = restore_target(t, name, buffers[src])  # [sharding hook]
            # Checked here, set by an action: the gradient tensor may not exist until then.
            plan.assign(qualified("accumulation", name), value, shape=tuple(target.shape),
                        dtype=numpy_dtype(target, RestoreError), put=lambda: None)
            plan.then(functools.partial(_set_grad, t, value))
        elif src in zero:
            plan.then(functools.partial(_zero_grad, t))
        else:
            plan.then(functools.partial(setattr, t, "grad", None))
    plan.unexpected_from(buffers, used, "accumulation")


def _set_grad(t: torch.Tensor, value: np.ndarray) -> None:
    if is_dtensor(t):  # [sharding hook] value is this rank's block
        return set_grad(t, value)
    g = t.grad
    if g is not None and not g.is_sparse and g.shape == t.shape and g.dtype == t.dtype:
        assign(g, value)  # in place: no new tensor of the parameter's size
    else:
        t.grad = new_tensor(value, t, dtype=t.dtype)


def _zero_grad(t: torch.Tensor) -> None:
    if t.grad is not None and not t.grad.is_sparse:
        t.grad.detach().zero_()
    else:
        t.grad = torch.zeros_like(t, memory_format=torch.preserve_format)
