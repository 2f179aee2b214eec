"""Capture a Paddle training run as a TrainingState, and restore one bit for bit.

Naming (a contract: checkpoints written today must restore tomorrow):

* ``state.model``: the layer's ``state_dict()`` keys (structured names such as ``conv1.weight``,
  ``bn._mean``), without a ``paddle.DataParallel`` wrapper's ``_layers.`` prefix.  A tensor reachable
  under several names (``nn.LSTM`` lists each weight both as ``weight_ih_l0`` and
  ``0.cell.weight_ih``) is stored once, under its first name; ``extra["paddle"]["aliases"]`` maps
  the others to it.
* ``state.optimizer.slots[name][slot]``: accumulators keyed by that structured name and Paddle's
  accumulator name without the runtime prefix and counter (``linear_0.w_0_moment1_0`` of
  ``fc.weight`` becomes ``slots["fc.weight"]["moment1"]``); ``"master_weight"`` is a multi-precision
  optimizer's float32 copy.  The mapping goes through the live ``param.name``, so a process whose
  name counters differ restores correctly.
* ``state.optimizer.step``: Paddle optimizers keep no update counter.  In order: the ``step``
  argument; for Adam-family optimizers the count implied by ``beta2_pow_acc`` (then
  ``beta1_pow_acc``), looked up exactly in the float32 product sequence; the attached (or given)
  scheduler's ``last_epoch``; else 0.  ``optimizer.extra["step_source"]`` says which one was used.
  ``state.step`` is the same number.
* ``state.schedule``: ``ScheduleState(kind=<class name>, config=<constructor arguments that can be
  read back>, step=last_epoch, last_lr=last_lr, state=...)``; ``state`` is Paddle's own
  ``state_dict()`` (plain values, e.g. ``LinearWarmup_LR`` nested) plus the attributes it lacks
  (``T_cur``/``T_i`` of ``CosineAnnealingWarmRestarts``), all at the top level.  States captured
  before ``ScheduleState.state`` existed kept this in ``extra["paddle"]["scheduler"]``; restore
  still reads it there.
* ``optimizer.extra["grad_scaler"]``: a ``GradScaler``'s ``state_dict()`` (or
  ``extra["paddle"]["grad_scaler"]`` without an optimizer).
* ``state.accumulation``: gradients in flight (``param.grad``) that are not all zero, with
  ``every``/``count`` from the ``accumulate_every``/``accumulated`` hints (0 when not given).
  ``extra["paddle"]["zero_grads"]`` lists parameters whose gradient exists but is all zero (what
  ``clear_grad()`` leaves); restore recreates those and sets every other gradient to None, because
  an optimizer updates a parameter with a zero gradient but skips one without.
* ``state.rng``: ckptcore's ``"python"`` and ``"numpy"`` plus ``"paddle"`` (see ``_rng.py``).
* ``state.params``: a ParamInfo per entry of ``state.model`` (see ``_describe.py``);
  ``extra["paddle"]["param_names"]`` maps structured names to runtime names, which
  :func:`~ckptcore_paddle.export_paddle_files` needs for ``.pdopt`` keys.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import paddle

from ckptcore.errors import RestoreError
from ckptcore.state import AccumulationState, RestoreReport, TrainingState

from ._describe import describe
from ._optim import (attached_scheduler, capture_optimizer, capture_schedule, capture_scaler, plan_optimizer,
                     plan_scaler, restore_learning_rate, restore_schedule, schedule_fits)
from ._rng import capture_all_rng, restore_all_rng
from ._tensors import assign, check_fits, numpy_dtype, to_numpy

_PREFIX = "_layers."


def unwrap(model: Any) -> tuple[Any, Any]:
    """The plain layer inside a hapi ``Model`` and/or ``DataParallel``, and a hapi model's optimizer."""
    opt = None
    if type(model).__name__ == "Model" and hasattr(model, "network"):
        model, opt = model.network, getattr(model, "_optimizer", None)
    while type(model).__name__ == "DataParallel" and hasattr(model, "_layers"):
        model = model._layers
    return model, opt


def named_tensors(layer: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """``state_dict()`` tensors by structured name, each tensor once, and the aliases of repeated ones."""
    first: dict[int, str] = {}
    tensors: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for name, t in layer.state_dict().items():
        while name.startswith(_PREFIX):
            name = name[len(_PREFIX):]
        if id(t) in first:
            aliases[name] = first[id(t)]
        else:
            first[id(t)] = name
            tensors[name] = t
    return tensors, aliases


def capture(model: Any, optimizer: Any = None, *, scheduler: Any = None, cursor: Any = None,
            scaler: Any = None, rng: bool = True, step: int | None = None,
            accumulate_every: int | None = None, accumulated: int | None = None,
            copy: bool = True) -> TrainingState:
    """Snapshot a Paddle model, optimizer, LR scheduler, GradScaler, RNGs, gradients and a data cursor.

    ``scheduler`` defaults to the optimizer's own ``LRScheduler``; a hapi ``paddle.Model`` brings its
    network and optimizer.  ``step`` overrides the derived update count; ``accumulate_every`` and
    ``accumulated`` describe a gradient-accumulation window in progress.  ``copy=False`` returns
    views of the tensors' own buffers instead of copies: for a synchronous save straight after the
    capture (``save_state(url, capture(..., copy=False))``), before training changes them; never for
    an asynchronous save.

    Example:
        >>> state = ckptcore_paddle.capture(net, opt, cursor=cursor)      # doctest: +SKIP
        >>> ckptcore_paddle.restore(state, new_net, new_opt, cursor=cursor)  # doctest: +SKIP
    """
    layer, hapi_opt = unwrap(model)
    optimizer = hapi_opt if optimizer is None else optimizer
    tensors, aliases = named_tensors(layer)
    runtime = {t.name: s for s, t in tensors.items()}
    state = TrainingState(framework="paddle", model={s: to_numpy(t, copy) for s, t in tensors.items()},
                          params=describe(layer, tensors))
    extra: dict[str, Any] = {"param_names": {s: t.name for s, t in tensors.items()}}
    if aliases:
        extra["aliases"] = aliases
    sch = scheduler if scheduler is not None else (attached_scheduler(optimizer) if optimizer else None)
    if optimizer is not None:
        state.optimizer = capture_optimizer(optimizer, runtime, step=step, scheduler=sch, copy=copy)
        state.step = state.optimizer.step
    elif step is not None:
        state.step = int(step)
    if sch is not None:
        state.schedule = capture_schedule(sch)
    if scaler is not None:
        (state.optimizer.extra if state.optimizer else extra)["grad_scaler"] = capture_scaler(scaler)
    buffers, extra["zero_grads"] = _capture_grads(tensors, copy)
    if buffers or accumulate_every or accumulated:
        state.accumulation = AccumulationState(every=int(accumulate_every or 0), count=int(accumulated or 0),
                                               buffers=buffers)
    if rng:
        state.rng = capture_all_rng()
    if cursor is not None:
        state.data = dict(cursor.state_dict())
    state.metadata = {"versions": {"paddle": paddle.__version__, "numpy": np.__version__},
                      "model_class": type(layer).__name__,
                      "optimizer_class": None if optimizer is None else type(optimizer).__name__}
    state.extra = {"paddle": extra}
    return state


def _capture_grads(tensors: dict[str, Any], copy: bool = True) -> tuple[dict[str, np.ndarray], list[str]]:
    buffers: dict[str, np.ndarray] = {}
    zero: list[str] = []
    for name, t in tensors.items():
        g = None if t.stop_gradient else t.grad
        if g is None:
            continue
        view = to_numpy(g, copy=False)  # look before copying: cleared gradients are all zero
        if _any_bit(view):
            buffers[name] = view.copy() if copy else view
        else:
            zero.append(name)
    return buffers, zero


def _any_bit(arr: np.ndarray) -> bool:
    """Whether any bit is set (so -0.0 counts as a value), reading words rather than bytes."""
    flat = arr.reshape(-1).view(np.uint8)
    n = flat.size - flat.size % 8
    return bool(flat[:n].view(np.uint64).any() or flat[n:].any())


def restore(state: TrainingState, model: Any, optimizer: Any = None, *, scheduler: Any = None,
            cursor: Any = None, scaler: Any = None, strict: bool = True, rng: bool = True) -> RestoreReport:
    """Put ``state`` back into ``model`` (and the other objects given), bit for bit.

    Everything is checked before anything is assigned.  A shape or dtype mismatch is a RestoreError
    naming the tensor, whatever ``strict`` says; names present on only one side raise RestoreError
    when ``strict`` and are returned in the RestoreReport otherwise.  Optimizer slots are reported
    as ``optimizer/<param>/<slot>``.  Objects not passed are left alone.

    Raises:
        RestoreError: a mismatch as described.
        MigrationError: a state captured from another framework (it is converted first, see
            ``ckptcore.convert``) that cannot be converted.
    """
    layer, hapi_opt = unwrap(model)
    optimizer = hapi_opt if optimizer is None else optimizer
    if state.framework not in (None, "paddle"):  # another framework's state: migrate it first
        from ckptcore.api import convert
        state = convert(state, "paddle", model, optimizer, scheduler=scheduler)
    extra = (state.extra or {}).get("paddle") or {}
    missing: list[str] = []
    unexpected: list[str] = []

    def report(kind: str, name: str) -> None:
        (missing if kind == "missing" else unexpected).append(name)

    tensors, aliases = named_tensors(layer)
    actions: list[Callable[[], None]] = []
    pairs = _plan_model(state, extra, tensors, aliases, report)
    actions += _plan_grads(state, extra, tensors)
    sch = scheduler if scheduler is not None else (attached_scheduler(optimizer) if optimizer else None)
    if optimizer is not None:
        if state.optimizer is None:
            report("missing", "optimizer")
        else:
            opt_pairs, drops = plan_optimizer(optimizer, state.optimizer, tensors, report)
            pairs += opt_pairs
            actions += drops
            actions.append(lambda: restore_learning_rate(optimizer, state.optimizer))
    if sch is not None:
        if state.schedule is None:
            report("missing", "schedule")
        elif not schedule_fits(sch, state.schedule):
            raise RestoreError(f"the state holds a {state.schedule.kind} schedule but the scheduler given "
                               f"is a {type(sch).__name__}")
        else:
            actions.append(lambda: restore_schedule(sch, state.schedule, extra.get("scheduler")))
    if scaler is not None:
        saved = (state.optimizer.extra if state.optimizer else {}).get("grad_scaler", extra.get("grad_scaler"))
        act = plan_scaler(scaler, saved, report)
        actions += [act] if act else []
    if cursor is not None:
        if state.data:
            actions.append(lambda: cursor.load_state_dict(state.data))
        else:
            report("missing", "data")
    if strict and (missing or unexpected):
        raise RestoreError(_mismatch_message(missing, unexpected))
    for target, value in pairs:
        assign(target, value)
    for act in actions:
        act()
    if rng and state.rng:
        restore_all_rng(state.rng)
    return RestoreReport(missing=tuple(missing), unexpected=tuple(unexpected))


def _mismatch_message(missing: list[str], unexpected: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {', '.join(missing[:20])}" + (" ..." if len(missing) > 20 else ""))
    if unexpected:
        parts.append(f"in the checkpoint but not in the target: {', '.join(unexpected[:20])}"
                     + (" ..." if len(unexpected) > 20 else ""))
    return "; ".join(parts) + " (pass strict=False to restore the rest and get a report)"


def _plan_model(state: TrainingState, extra: dict, tensors: dict[str, Any], aliases: dict[str, str],
                report: Callable[[str, str], None]) -> list[tuple[Any, np.ndarray]]:
    """Pair each target tensor with the saved array under any of its names; check shapes and dtypes."""
    saved = state.model
    saved_alias = {a: c for a, c in (extra.get("aliases") or {}).items() if c in saved}
    names_of: dict[str, list[str]] = {c: [c] for c in tensors}
    for a, c in aliases.items():
        names_of[c].append(a)
    used: set[str] = set()
    pairs = []
    for canonical, names in names_of.items():
        src = next((n if n in saved else saved_alias[n] for n in names if n in saved or n in saved_alias), None)
        if src is None:
            report("missing", canonical)
            continue
        check_fits(canonical, saved[src], tensors[canonical])
        used.add(src)
        pairs.append((tensors[canonical], saved[src]))
    for name in saved:
        if name not in used:
            report("unexpected", name)
    return pairs


def _plan_grads(state: TrainingState, extra: dict, tensors: dict[str, Any]) -> list[Callable[[], None]]:
    """Gradients as captured: saved buffers, zero gradients, and None for every other parameter."""
    buffers = state.accumulation.buffers if state.accumulation else {}
    zero = extra.get("zero_grads")
    if zero is None and not buffers:
        return []  # not captured by this adapter: leave the gradients alone
    for name, arr in buffers.items():
        if name not in tensors:
            raise RestoreError(f"accumulated gradient {name}: the target model has no such parameter")
        check_fits(f"gradient of {name}", arr, tensors[name])
    zero = set(zero or ())
    actions: list[Callable[[], None]] = []
    for name, t in tensors.items():
        if t.stop_gradient:
            continue
        if name in buffers:
            actions.append(lambda t=t, a=buffers[name]: _set_grad(t, a))
        elif name in zero:
            actions.append(lambda t=t: _zero_grad(t))
        else:
            actions.append(lambda t=t: t.clear_gradient(False))
    return actions


def _set_grad(t: Any, value: np.ndarray) -> None:
    g = t.grad
    if g is not None and list(g.shape) == list(t.shape) and g.dtype == t.dtype:
        assign(g, value)  # in place: no new tensor of the parameter's size
    else:
        t.grad = paddle.to_tensor(np.ascontiguousarray(value), dtype=t.dtype, place=t.place)


def _zero_grad(t: Any) -> None:
    if t.grad is not None:
        t.clear_gradient(True)  # zeroes the existing gradient in place
    else:
        t.grad = paddle.to_tensor(np.zeros(t.shape, dtype=numpy_dtype(t)), dtype=t.dtype, place=t.place)
