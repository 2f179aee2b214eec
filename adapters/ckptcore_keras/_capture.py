"""Capture a Keras training state as a :class:`~ckptcore.TrainingState` and restore it.

What lands where:

* ``state.model``: every variable of ``model.variables`` under its Keras path
  (``sequential/dense/kernel``, ``seed_generator/seed_generator_state``), plus raw
  ``tf.Variable`` attributes of the model or its layers as ``<owner path>/<attr>[/<i>]``.
* ``state.params``: a :class:`~ckptcore.ParamInfo` for each of those names (``_params.py``).
* ``state.optimizer`` / ``state.schedule`` / ``state.accumulation``: see ``_optimizer.py``.
* ``state.rng``: ckptcore's ``"python"``/``"numpy"`` plus ``"tensorflow"``/``"keras"`` (``_rng.py``).
* ``state.data``: ``cursor.state_dict()``.
* ``state.extra["keras"]``: this adapter's section: ``"variables"``, the names of
  ``state.model`` in model order (``BackupAndRestore`` adds ``"fit"``, its progress).

Restore plans everything in one :class:`ckptcore.adapter.RestorePlan` before it
assigns anything, so a failed restore leaves the model, optimizer, RNGs and
cursor untouched.  Report names are :func:`ckptcore.adapter.qualified`: model
variables by their own name, ``optimizer/<param>/<slot>`` and the rest (see
``_optimizer.py``), ``data`` for a cursor the state does not position.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any, Callable

from ckptcore.adapter import RestorePlan, qualified, warn_unapplied
from ckptcore.errors import RestoreError, UnappliedStateWarning
from ckptcore.state import RestoreReport, TrainingState

from ._backend import fit_integers
from ._optimizer import (capture_optimizer, capture_schedule, ensure_built, plan_optimizer,
                         plan_schedule, slot_variables)
from ._params import describe_params
from ._rng import capture_framework_rng, restore_framework_rng
from ._tensors import assign, match_names, named_tensors, np_dtype, shape_of, to_numpy

__all__ = ["capture", "restore"]

_NAME = "keras"
log = logging.getLogger("ckptcore")


def _optimizer_of(model: Any, optimizer: Any) -> Any:
    return optimizer if optimizer is not None else getattr(model, "optimizer", None)


def check_arguments(model: Any, objects: dict[str, Any], verb: str) -> None:
    """A ``TypeError`` for a model that is not a Keras one, or keyword objects this adapter does
    not know (never ignored)."""
    if objects:
        raise TypeError(f"ckptcore_keras.{verb}() got objects it does not know: {sorted(objects)}; "
                        "it takes model, optimizer and cursor")
    from . import ADAPTER

    if not ADAPTER.handles(model):
        raise TypeError(f"ckptcore_keras.{verb}() needs a Keras model, got "
                        f"{type(model).__module__}.{type(model).__qualname__}")


def capture(model: Any, optimizer: Any = None, *, cursor: Any = None, rng: bool = True,
            copy: bool = True, **objects: Any) -> TrainingState:
    """Snapshot everything needed to continue training ``model`` exactly.

    Args:
        model: A built Keras model (Sequential, functional or subclassed), with or
            without a ``tf.distribute`` strategy; mirrored variables are stored once.
        optimizer: The optimizer; defaults to ``model.optimizer`` when compiled.  An
            optimizer that has not taken a step yet is built first (zero slots).
        cursor: A ``ckptcore.DataCursor`` (anything with ``state_dict()``).
        rng: Include Python, numpy, TensorFlow and Keras global RNG states
            (``False``: ``state.rng`` stays empty).
        copy: Accepted for the adapter contract; ``True`` and ``False`` behave alike.
            The arrays are always read-only views of TensorFlow's copy-on-write
            buffers: training on writes new buffers and never changes them, so they
            are snapshots (safe for an asynchronous save) that cost no copy
            (``np.array(a)`` for a writable one).  Hence ``ADAPTER.capture_views``
            is False.

    Raises:
        TypeError: ``model`` is not a Keras model, or an object other than model,
            optimizer and cursor is passed.
        ValueError: the model has no variables yet (build it first).

    Example:
        >>> state = ckptcore_keras.capture(model, cursor=cursor)   # doctest: +SKIP
        >>> state.optimizer.slots["dense/kernel"]["momentum"].shape  # doctest: +SKIP
        (10, 1)
    """
    check_arguments(model, objects, "capture")
    import keras

    named = named_tensors(model)
    if not named:
        raise ValueError("the model has no variables yet: build it first "
                         "(call it on a batch, or model.build(input_shape))")
    names = {id(var): name for name, var in named}
    state = TrainingState(framework=_NAME,
                          model={name: to_numpy(var, copy=copy) for name, var in named},
                          params=describe_params(model, names, [var for _, var in named]))
    opt = _optimizer_of(model, optimizer)
    if opt is not None:
        ensure_built(opt, model)
        state.optimizer, state.accumulation = capture_optimizer(opt, names)
        state.schedule = capture_schedule(opt)
        state.step = state.optimizer.step
    if rng:
        from ckptcore.rng import capture_rng
        state.rng = {**capture_rng(), **capture_framework_rng()}
    if cursor is not None:
        state.data = dict(cursor.state_dict())
    name = keras.backend.backend()
    state.metadata = {
        "versions": {"keras": keras.__version__,
                     name: getattr(sys.modules.get(name), "__version__", None)},
        "backend": name,
        "model_class": type(model).__name__,
        "optimizer_class": None if opt is None else type(opt).__name__,
    }
    state.extra = {_NAME: {"variables": [name for name, _ in named]}}
    return state


def _saved_order(state: TrainingState) -> list[str]:
    order = ((state.extra or {}).get(_NAME) or {}).get("variables")
    if isinstance(order, (list, tuple)) and set(order) == set(state.model):
        return list(order)
    return list(state.model)


def restore(state: TrainingState, model: Any, optimizer: Any = None, *, cursor: Any = None,
            strict: bool = True, rng: bool = True, warn_data: bool = True,
            **objects: Any) -> RestoreReport:
    """Put ``state`` back into ``model``, its optimizer, the RNGs and ``cursor``.

    Works into a freshly built model whose optimizer has not been built (it is
    built here), into the same architecture built in another process, and into a
    second copy built in the same process (auto-generated names such as
    ``dense_1`` are then matched in model order).  Values are assigned bit for bit.
    A state of another framework is converted first (``ckptcore.adapter.convert_for``).

    Args:
        state: A state captured by :func:`capture` (or imported from a TF checkpoint).
        model: The model to restore into; it must be built.
        optimizer: Defaults to ``model.optimizer`` when compiled.
        cursor: A ``DataCursor`` to position, if the state has data.
        strict: Raise on missing or unexpected names instead of reporting them.
        rng: Restore the global RNG states saved in the state (``False``: every RNG
            is left as it is).
        warn_data: Warn when the state holds a data position and no ``cursor`` is given
            (``ADAPTER.restore`` passes False: ``load_state`` and the manager warn about the
            data position themselves, once per restore).

    Saved parts with no target are not a mismatch but the caller's choice, so they warn
    (:class:`ckptcore.errors.UnappliedStateWarning`, through
    :func:`ckptcore.adapter.warn_unapplied`) and never raise: a data position without
    ``cursor``, an optimizer section without an optimizer (nor a compiled model), Keras'
    accumulation buffers restored into an optimizer that does not accumulate (the update
    count is still restored), a learning-rate schedule into an optimizer without one.  A
    non-strict report still names them (``unexpected``).  The reverse also warns: a state
    that holds no optimizer slots (saved without its optimizer) leaves a target optimizer
    entirely as it is, its iteration count included, since moments at zero with the count
    at n would not be the run that was saved.

    Returns:
        The names in the target that the state did not cover (``missing``) and the
        saved names nothing in the target took (``unexpected``).

    Raises:
        TypeError: ``model`` is not a Keras model, or an object other than model,
            optimizer and cursor is passed.
        RestoreError: A shape or dtype differs (names the variable), the optimizer
            kind differs, the target accumulates gradients over other windows than the
            state, the model is not built, or, with
            ``strict``, a name is missing or unexpected (lists them).
    """
    check_arguments(model, objects, "restore")
    from ckptcore.adapter import convert_for
    opt = _optimizer_of(model, optimizer)
    state = convert_for(state, _NAME, {"model": model, "optimizer": opt})
    plan = RestorePlan()
    variable_of = _plan_model(plan, state, model)
    unapplied: dict[str, str] = {}  # saved parts with no target: warned once the restore is done
    no_slots = _plan_optimizer_part(plan, state, opt, model, variable_of, strict, unapplied)
    _plan_rng_and_data(plan, state, rng, cursor, warn_data, unapplied)
    report = plan.apply(strict)
    warn_unapplied(unapplied, stacklevel=_user_level())
    if opt is not None and (state.optimizer is None or no_slots):
        _warn_no_slots(opt)
    return report


def _plan_model(plan: RestorePlan, state: TrainingState, model: Any) -> Callable[[str], Any]:
    """Each saved variable into the model's variable it matches (``match_names``: names, then
    model order for auto-generated ones).  Returns the target variable of a saved name (None
    for none): the optimizer's slots follow their parameters there."""
    named = named_tensors(model)
    if not named:
        raise RestoreError("the model has no variables yet: build it first "
                           "(call it on a batch, or model.build(input_shape))")
    target = dict(named)
    order = _saved_order(state)
    mapping = match_names(order, [n for n, _ in named])
    taken = set(mapping.values())
    plan.missing(*(qualified("model", n) for n in target if n not in taken))
    plan.unexpected_from(order, mapping)
    other_backend = _saved_backend(state) not in (None, _backend_now())
    for saved, name in mapping.items():
        var, value = target[name], state.model[saved]
        if other_backend:  # integers another backend keeps in another dtype (seed states)
            value = fit_integers(qualified("model", name), value, np_dtype(var),
                                 seed=name.endswith("seed_generator_state"))
        plan.assign(qualified("model", name), value, shape=shape_of(var), dtype=np_dtype(var),
                    put=lambda var=var, value=value: assign(var, value))
    return lambda n: target.get(mapping.get(n, ""))


def _saved_backend(state: TrainingState) -> str | None:
    backend = (state.metadata or {}).get("backend")
    return backend if isinstance(backend, str) else None


def _backend_now() -> str:
    import keras

    return keras.backend.backend()


def _plan_optimizer_part(plan: RestorePlan, state: TrainingState, opt: Any, model: Any,
                         variable_of: Callable[[str], Any], strict: bool,
                         unapplied: dict[str, str]) -> bool:
    """The optimizer's slots, accumulation and schedule into ``opt``; saved ones without an
    optimizer to take them go in ``unapplied``.  Returns whether the state holds no slots
    although ``opt`` keeps some (``_holds_no_slots``: ``opt`` is then left as it is)."""
    fix = "pass optimizer=... (or restore into a model compiled with one)"
    no_slots = _holds_no_slots(state, opt, model)
    if state.optimizer is not None and opt is not None and not no_slots:
        ensure_built(opt, model)
        plan_optimizer(plan, state.optimizer, state.accumulation, opt, variable_of,
                       strict=strict, unapplied=unapplied)
        plan_schedule(plan, state.schedule, opt, strict=strict, unapplied=unapplied)
    elif state.optimizer is not None and opt is None:
        # No optimizer target at all is the caller's choice, not a mismatch: warn, do not raise
        # (the same rule in every adapter); a non-strict report still names it.
        unapplied["optimizer"] = fix
        if state.accumulation is not None:
            unapplied["accumulation"] = fix
        if state.schedule is not None:
            unapplied["schedule"] = fix
        if not strict:
            plan.unexpected(qualified("optimizer"))
    elif opt is not None and (state.optimizer is None or no_slots):
        if not strict:
            plan.missing(qualified("optimizer"))
    return no_slots


def _plan_rng_and_data(plan: RestorePlan, state: TrainingState, rng: bool, cursor: Any,
                       warn_data: bool, unapplied: dict[str, str]) -> None:
    """The RNG states, then the cursor, as actions once every assignment has been checked."""
    if rng and state.rng:
        plan.then(lambda: _restore_rng(state.rng))
    if cursor is not None:
        if state.data:
            plan.then(lambda: cursor.load_state_dict(state.data))
        else:
            plan.missing(qualified("data"))
    elif state.data and warn_data:
        unapplied["data"] = ("pass cursor=... (the run's DataCursor) to continue at the saved "
                             "sample")


def _holds_no_slots(state: TrainingState, opt: Any, model: Any) -> bool:
    """Whether the state has no optimizer slots although the target optimizer keeps some: a
    checkpoint saved without its optimizer.  Its iteration count alone would put a schedule and
    Adam's bias correction at step n over zero moments, so the optimizer is left as it is."""
    if state.optimizer is None or opt is None or state.optimizer.slots:
        return False
    ensure_built(opt, model)
    return bool(slot_variables(opt))


def _warn_no_slots(opt: Any) -> None:
    message = (f"the checkpoint holds no optimizer slots (it was saved without its optimizer), so "
               f"the {type(opt).__name__} optimizer keeps its own slots and iteration count: the "
               "run does not continue where it stopped. Save with the optimizer (save_state(..., "
               "optimizer=...) or a compiled model) to resume it; load with keys=['model'] to "
               "restore the model alone on purpose.")
    log.warning("%s", message)
    warnings.warn(message, UnappliedStateWarning, stacklevel=_user_level())


def _user_level() -> int:
    """The ``stacklevel``, seen from a function this module calls, of the first frame outside
    ckptcore and its adapters: the user's ``restore``/``load_state`` line, or Keras' ``fit``."""
    frame, level = sys._getframe(2), 3
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("ckptcore"):
        frame, level = frame.f_back, level + 1
    return level


def _restore_rng(rng: dict[str, Any]) -> None:
    restore_framework_rng(rng)  # before Python's: creating Keras' generator draws from Python's random
    from ckptcore.rng import restore_rng
    restore_rng(rng)
