"""Capture a Paddle training run as a TrainingState, and restore one bit for bit.

Naming (a contract: checkpoints written today must restore tomorrow):

* ``state.model``: the tensors by structured name (see ``_tensors.py``); a tensor reachable under
  several names is stored once, and ``extra["paddle"]["aliases"]`` maps the others to it.
* ``state.optimizer.slots[name][slot]``: accumulators by structured name and slot (see
  ``_optimizer.py``).
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

Restoring goes through one :class:`ckptcore.adapter.RestorePlan`: every check first, then every
assignment and action.  RestoreReport names follow :func:`ckptcore.adapter.qualified`: model
tensors by their own name, ``optimizer/<param>/<slot>``, ``optimizer``, ``schedule``,
``grad_scaler``, ``data``.
* ``state.params``: a ParamInfo per entry of ``state.model`` (see ``_params.py``);
  ``extra["paddle"]["param_names"]`` maps structured names to runtime names, which
  :func:`~ckptcore_paddle.export_paddle_files` needs for ``.pdopt`` keys.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from typing import Any, Callable

import numpy as np
import paddle

from ckptcore.adapter import RestorePlan, any_bit, finish_restore, plan_training_parts, qualified
from ckptcore.errors import RestoreError
from ckptcore.rng import capture_rng, restore_rng
from ckptcore.state import AccumulationState, RestoreReport, TrainingState

from ._data import check_not_stale
from ._optimizer import (attached_scheduler, capture_optimizer, capture_scaler, capture_schedule, plan_optimizer,
                         plan_scaler, plan_schedule)
from ._params import describe_params
from ._rng import capture_framework_rng, restore_framework_rng
from ._sharding import dist_block, dist_leaf, is_dist, shard_slots, unwrap_optimizer, whole_slots
from ._tensors import Copies, assign, named_tensors, numpy_dtype, to_numpy, unwrap, values, views


def capture(model: Any, optimizer: Any = None, *, cursor: Any = None, rng: bool = True, copy: bool = True,
            scheduler: Any = None, scaler: Any = None, step: int | None = None,
            accumulate_every: int | None = None, accumulated: int | None = None) -> TrainingState:
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
    outer = optimizer
    tensors, aliases = named_tensors(layer)
    grads = _GradScan(tensors, copy)  # looked at in a helper thread while the rest is captured
    try:
        state, extra = _capture_model(layer, tensors, aliases, copy)
        _capture_training(state, extra, optimizer, tensors, step=step, scheduler=scheduler,
                          scaler=scaler, copy=copy)
    except BaseException:
        grads.join()  # (result() joins it on success, after taking its own end of the queue)
        raise
    buffers, extra["zero_grads"] = grads.result()
    if buffers or accumulate_every or accumulated:
        state.accumulation = AccumulationState(every=int(accumulate_every or 0), count=int(accumulated or 0),
                                               buffers=buffers)
    if rng:
        state.rng = {**capture_rng(), **capture_framework_rng()}
    if cursor is not None:
        check_not_stale(cursor)  # before anything is saved: a sampler never advanced holds position 0
        state.data = dict(cursor.state_dict())
    state.metadata = {"versions": {"paddle": paddle.__version__, "numpy": np.__version__},
                      "model_class": type(layer).__name__,
                      "optimizer_class": None if outer is None else type(outer).__name__}
    state.extra = {"paddle": extra}
    return state


def _capture_model(layer: Any, tensors: dict[str, Any], aliases: dict[str, str],
                   copy: bool) -> tuple[TrainingState, dict[str, Any]]:
    """The model's tensors and ParamInfo as a new state, and the start of its ``extra``."""
    dist = {n for n, t in tensors.items() if is_dist(t)}  # shard_tensor: this rank's blocks
    plain_names = [n for n in tensors if n not in dist]
    arrays = dict(zip(plain_names, values(layer, [tensors[n] for n in plain_names], copy)))
    model = {n: dist_leaf(tensors[n], n, copy) if n in dist else arrays[n] for n in tensors}
    state = TrainingState(framework="paddle", model=model, params=describe_params(layer, tensors))
    extra: dict[str, Any] = {"param_names": {s: t.name for s, t in tensors.items()}}
    if aliases:
        extra["aliases"] = aliases
    return state, extra


def _capture_training(state: TrainingState, extra: dict[str, Any], optimizer: Any,
                      tensors: dict[str, Any], *, step: int | None, scheduler: Any, scaler: Any,
                      copy: bool) -> None:
    """The optimizer (and the step), the LR schedule and the GradScaler, into ``state``."""
    optimizer, sharding = unwrap_optimizer(optimizer)
    runtime = {t.name: s for s, t in tensors.items()}
    sch = scheduler if scheduler is not None else (attached_scheduler(optimizer) if optimizer else None)
    if optimizer is not None:
        state.optimizer = capture_optimizer(optimizer, runtime, step=step, scheduler=sch, copy=copy)
        if sharding is not None:  # this rank's slots, as the same tree on every rank
            state.optimizer = shard_slots(state.optimizer, sharding, runtime, list(tensors))
        state.step = state.optimizer.step
    elif step is not None:
        state.step = int(step)
    if sch is not None:
        state.schedule = capture_schedule(sch)
    if scaler is not None:
        (state.optimizer.extra if state.optimizer else extra)["grad_scaler"] = capture_scaler(scaler)


class _GradScan:
    """Which gradients are in flight (any bit set: saved as ``state.accumulation``) and which
    are all zero (what ``clear_grad()`` leaves: listed in ``zero_grads``).

    Telling them apart reads every gradient's bytes: 100 MB for resnet50, 10 ms.  From
    :data:`_SCAN_AHEAD` bytes on, a helper thread starts reading them, largest first (numpy's
    reductions release the GIL for those: the capture goes on with the optimizer meanwhile),
    and :meth:`result` reads along with it from the other end of the same queue, smallest
    first; :meth:`join` waits for the helper (after a failure)."""

    def __init__(self, tensors: dict[str, Any], copy: bool) -> None:
        self._copy = copy
        self._grads: list[tuple[str, np.ndarray]] = []
        for name, t in tensors.items():
            g = None if t.stop_gradient else t.grad
            if g is not None:
                self._grads.append((name, to_numpy(g, copy=False)))  # looked at before any copy
        sizes = [v.nbytes for _, v in self._grads]
        # largest first: popleft (the helper) and pop (the capturing thread) are atomic
        self._todo = collections.deque(sorted(range(len(sizes)), key=sizes.__getitem__, reverse=True))
        self._bits: list[bool | None] = [None] * len(self._grads)
        self._errors: list[BaseException] = []
        self._thread: threading.Thread | None = None
        if sum(sizes) >= _SCAN_AHEAD:
            self._thread = threading.Thread(target=self._work, args=(self._todo.popleft,),
                                            name="ckptcore-paddle-grads", daemon=True)
            self._thread.start()

    def _work(self, take: Callable[[], int]) -> None:
        try:
            while True:
                try:
                    k = take()
                except IndexError:
                    return
                self._bits[k] = any_bit(self._grads[k][1])
        except Exception as e:  # noqa: BLE001 - raised by result(), in the capturing thread
            self._errors.append(e)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def result(self) -> tuple[dict[str, np.ndarray], list[str]]:
        """``(buffers, zero_grads)``, in the model's order, once every gradient is looked at."""
        try:
            self._work(self._todo.pop)  # from the small end, while the helper takes the large
        finally:
            self.join()
        if self._errors:
            raise self._errors[0]
        buffers: dict[str, np.ndarray] = {}
        zero: list[str] = []
        for (name, view), bit in zip(self._grads, self._bits):
            if bit:
                buffers[name] = view.copy() if self._copy else view
            else:
                zero.append(name)
        return buffers, zero


_SCAN_AHEAD = 4 << 20  # gradient bytes from which a helper thread reads them


def restore(state: TrainingState, model: Any, optimizer: Any = None, *, cursor: Any = None,
            strict: bool = True, rng: bool = True, scheduler: Any = None, scaler: Any = None,
            warn_data: bool = True) -> RestoreReport:
    """Put ``state`` back into ``model`` (and the other objects given), bit for bit.

    Everything is checked before anything is assigned.  A shape or dtype mismatch is a RestoreError
    naming the tensor, whatever ``strict`` says; names present on only one side raise RestoreError
    when ``strict`` and are returned in the RestoreReport otherwise.  ``rng=False`` leaves every
    RNG as it is.  Objects not passed are left alone.

    Saved parts with no target at all are the caller's choice, not a mismatch: they warn
    (:class:`ckptcore.errors.UnappliedStateWarning`, through :func:`ckptcore.adapter.warn_unapplied`)
    and never raise, as in every adapter: a data position without ``cursor`` (unless
    ``warn_data=False``: ``load_state`` and the manager warn about it themselves), an optimizer
    section without an optimizer, a schedule without a scheduler, a GradScaler state without
    ``scaler``.  A non-strict report still names them.  The reverse warns too: a state saved
    without an optimizer leaves a target optimizer entirely as it is (no RestoreError).
    Gradients in flight (``state.accumulation``) live on the model's parameters, so they are
    always restored.

    Raises:
        RestoreError: a mismatch as described.
        MigrationError: a state captured from another framework (it is converted first, through
            ``ckptcore.adapter.convert_for``) that cannot be converted.
    """
    from ckptcore.adapter import convert_for

    layer, hapi_opt = unwrap(model)
    optimizer = hapi_opt if optimizer is None else optimizer
    state = convert_for(state, "paddle", {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    optimizer, sharding = unwrap_optimizer(optimizer)
    extra = (state.extra or {}).get("paddle") or {}
    plan = RestorePlan()
    tensors, aliases = named_tensors(layer)
    if state.optimizer is not None and optimizer is not None:
        # Whole slots only; under sharding, those of the parameters this rank owns now (the
        # checkpoint holds every slot whole, whatever the sharding degree that saved it).
        owned = None if sharding is None else {s for s, t in tensors.items()
                                               if sharding.owner.get(t.name) == sharding.rank}
        state = dataclasses.replace(state, optimizer=whole_slots(state.optimizer, owned))
    copies = Copies(plan, helper=True)  # the model's and the slots' copies, in groups
    try:
        _plan_model(plan, state, extra, layer, tensors, aliases, copies)
        _plan_grads(plan, state, extra, tensors)
        unapplied: dict[str, str] = {}  # saved parts with no target: warned once the restore is done
        no_slots = _plan_optimizer_part(plan, state, extra, optimizer, scheduler, scaler, tensors,
                                        strict=strict, unapplied=unapplied, copies=copies)
        return finish_restore(plan, state, strict, cursor=cursor, restore_rng=_restore_rng if rng else None,
                              unapplied=unapplied, warn_data=warn_data,
                              no_slots_message=_no_slots_message(optimizer) if no_slots else None)
    finally:
        copies.close()


def _plan_optimizer_part(plan: RestorePlan, state: TrainingState, extra: dict, optimizer: Any,
                         scheduler: Any, scaler: Any, tensors: dict[str, Any], *, strict: bool,
                         unapplied: dict[str, str], copies: Copies | None = None) -> bool:
    """The optimizer's slots, the LR scheduler and the GradScaler into the targets given; saved
    ones with no target go in ``unapplied``.  Returns whether the state holds no optimizer
    section for a target optimizer: that optimizer, and its scheduler unless a schedule was
    saved, are then left as they are."""
    sch = scheduler if scheduler is not None else (attached_scheduler(optimizer) if optimizer else None)
    saved_scaler = (state.optimizer.extra if state.optimizer else {}).get("grad_scaler", extra.get("grad_scaler"))
    return plan_training_parts(
        plan, state, optimizer=optimizer, scheduler=sch, scaler=scaler, saved_scaler=saved_scaler,
        strict=strict, unapplied=unapplied,
        plan_optimizer=lambda: plan_optimizer(plan, optimizer, state.optimizer, tensors,
                                              saved_params=set(state.model), copies=copies),
        plan_schedule=lambda: plan_schedule(plan, sch, state.schedule, extra.get("scheduler")),
        plan_scaler=lambda: plan_scaler(plan, scaler, saved_scaler),
        hints={"optimizer": "pass optimizer=... (or restore into a paddle.Model prepared with one)",
               "schedule": "pass scheduler=... (or an optimizer whose learning_rate is the LRScheduler)",
               "grad scaler": "pass scaler=... (the paddle.amp.GradScaler)"})


def _no_slots_message(opt: Any) -> str:
    return (f"the checkpoint holds no optimizer slots (it was saved without its optimizer), so the "
            f"{type(opt).__name__} optimizer keeps its own accumulators and schedule: the run does not "
            "continue where it stopped. Save with the optimizer (optimizer=... or a prepared "
            "paddle.Model) to resume it; load with keys=['model'] to restore the model alone on purpose.")


def _restore_rng(rng: dict[str, Any]) -> None:
    restore_framework_rng(rng)  # checks its entries before it sets anything
    restore_rng({k: v for k, v in rng.items() if k in ("python", "numpy")})


def _plan_model(plan: RestorePlan, state: TrainingState, extra: dict, layer: Any, tensors: dict[str, Any],
                aliases: dict[str, str], copies: Copies) -> None:
    """Pair each target tensor with the saved array under any of its names (copies on ``copies``)."""
    saved = state.model
    saved_alias = {a: c for a, c in (extra.get("aliases") or {}).items() if c in saved}
    names_of: dict[str, list[str]] = {c: [c] for c in tensors}
    for a, c in aliases.items():
        names_of[c].append(a)
    used: set[str] = set()
    for (canonical, names), view in zip(names_of.items(), views(layer, list(tensors.values()))):
        # Saved under its own name (nearly always): no search through the aliases.
        src = canonical if canonical in saved else next(
            (n if n in saved else saved_alias[n] for n in names if n in saved or n in saved_alias), None)
        if src is None:
            plan.missing(qualified("model", canonical))
            continue
        t, value = tensors[canonical], saved[src]
        if is_dist(t):  # this rank's block of the saved tensor, into the local value
            local = t._local_value()
            block = dist_block(t, canonical, value)
            plan.assign(qualified("model", canonical), block, shape=tuple(local.shape),
                        dtype=numpy_dtype(local), put=functools.partial(assign, local, block))
            used.add(src)
            continue
        # A view carries the target's shape and dtype: no Paddle call per tensor to ask for them.
        copies.add(qualified("model", canonical), t, view, value)
        used.add(src)
    copies.flush()
    plan.unexpected_from(saved, used)


def _plan_grads(plan: RestorePlan, state: TrainingState, extra: dict, tensors: dict[str, Any]) -> None:
    """Gradients as captured: saved buffers, zero gradients, and None for every other parameter;
    a saved gradient no target parameter takes is unexpected (``accumulation/<param>``: a
    strict restore refuses it, ``strict=False`` reports it, as it does the parameter)."""
    buffers = state.accumulation.buffers if state.accumulation else {}
    zero = extra.get("zero_grads")
    if zero is None and not buffers:
        return  # not captured by this adapter: leave the gradients alone
    plan.unexpected_from(buffers, tensors, "accumulation")
    for name, arr in buffers.items():
        if name not in tensors:
            continue
        # Checked here, set by an action: the gradient tensor may not exist until then.
        plan.assign(qualified("accumulation", name), arr, shape=tensors[name].shape,
                    dtype=numpy_dtype(tensors[name]), put=lambda: None)
    zero = set(zero or ())
    for name, t in tensors.items():
        if t.stop_gradient:
            continue
        if name in buffers:
            plan.then(functools.partial(_set_grad, t, buffers[name]))
        elif name in zero:
            plan.then(functools.partial(_zero_grad, t))
        else:
            plan.then(functools.partial(t.clear_gradient, False))


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
