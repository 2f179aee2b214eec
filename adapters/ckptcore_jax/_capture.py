"""Capture a JAX training run as a TrainingState, and restore one bit for bit.

Naming (a contract: checkpoints written today must restore tomorrow):

* ``state.model``: every model leaf by its path (``_tensors.py``): an NNX module's variables
  (``Param``, ``BatchStat`` and any other ``Variable`` but its RNG streams) by graph path, or a
  pytree's leaves by key path.  A sharded ``jax.Array`` is a ``ckptcore.Shard``/``Chunks`` leaf
  (``_sharding.py``); a typed key its uint32 ``key_data``, its implementation in
  ``extra["jax"]["keys"]``; the names of weakly typed arrays (``jnp.asarray(0.5)``) are listed
  in ``extra["jax"]["weak"]`` (absent: none).  An NNX Variable holding no array (``None``,
  Optax's ``MaskedNode``) is no leaf (``_tensors.py``).
* ``state.optimizer``: the Optax state keyed by parameter path (``_optimizer.py``);
  ``state.schedule``: its learning-rate schedule, when it has one (``_optax.py``).
* ``state.rng``: ``"python"``, ``"numpy"`` and the NNX RNG streams (``_rng.py``).
* ``state.data``: the cursor's ``state_dict()``; ``state.step``: ``step=``, else the NNX
  optimizer's ``step``, else 0.
* ``state.params``: a ParamInfo per model leaf (``_params.py``).

Restoring plans every leaf through one :class:`ckptcore.adapter.RestorePlan` (every check
first), then puts new arrays into the targets: each with the saved bytes and the live leaf's
dtype, weak type, devices and sharding (an abstract leaf is weakly typed when its own
``weak_type`` or the saved list says so).  Report names: model leaves by their own name,
``optimizer/<param>/<slot>``, ``optimizer/<leaf>`` (a leaf of no parameter: ``0/count``),
``rng/<stream leaf>``, ``data``.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np

from ckptcore.adapter import RestorePlan, finish_restore, plan_training_parts, qualified
from ckptcore.state import RestoreReport, TrainingState

from ._optimizer import capture_optimizer, optimizer_leaves, plan_optimizer, split_name
from ._params import describe_params
from ._rng import capture_framework_rng, plan_rng, restore_framework_rng
from ._sharding import capture_leaf, is_weak, plan_leaf, template_leaf
from ._tensors import is_key, key_data, named_tensors

__all__ = ["capture", "restore", "template"]

NAME = "jax"
_log = logging.getLogger("ckptcore")


def capture(model: Any, optimizer: Any = None, *, cursor: Any = None, rng: bool = True,
            copy: bool = True, step: int | None = None) -> TrainingState:
    """Snapshot ``model``, ``optimizer``, RNG states and ``cursor``.

    ``copy=False`` returns zero-copy views of CPU buffers where JAX gives them: for a
    synchronous save straight after the capture (a jitted step that donates its inputs reuses
    their memory)."""
    leaves, streams = named_tensors(model)
    arrays, keys, weak = {}, {}, []
    for name, leaf in leaves.values.items():
        arrays[name], impl = capture_leaf(leaf, copy, name=qualified("model", name))
        if impl:
            keys[name] = impl
        if is_weak(leaf):
            weak.append(name)
    state = TrainingState(framework=NAME, model=arrays,
                          params=describe_params(leaves.values, arrays, model))
    if optimizer is not None:
        state.optimizer, state.schedule = capture_optimizer(optimizer, leaves.values, step=step, copy=copy)
        state.step = state.optimizer.step
    elif step is not None:
        state.step = int(step)
    if rng:
        state.rng = capture_framework_rng(streams, copy)
    if cursor is not None:
        state.data = dict(cursor.state_dict())
    state.metadata = {"versions": _versions(),
                      "model_class": type(model).__name__,
                      "optimizer_class": None if optimizer is None else type(optimizer).__name__}
    state.extra = {NAME: {"keys": keys, "kinds": dict(leaves.kinds)}}
    if weak:
        state.extra[NAME]["weak"] = weak
    return state


def _versions() -> dict[str, str]:
    import sys

    out = {"jax": jax.__version__, "numpy": np.__version__}
    for mod in ("flax", "optax"):
        if mod in sys.modules:
            out[mod] = getattr(sys.modules[mod], "__version__", "?")
    return out


def restore(state: TrainingState, model: Any, optimizer: Any = None, *, cursor: Any = None,
            strict: bool = True, rng: bool = True, warn_data: bool = True) -> RestoreReport:
    """Put ``state`` back into ``model`` (and the other objects given), bit for bit.

    Everything is checked before anything is put back.  A shape, dtype or key-implementation
    mismatch is a RestoreError naming the leaf, whatever ``strict`` says; names present on only
    one side raise RestoreError when ``strict`` and are returned in the RestoreReport
    otherwise.  ``rng=False`` leaves every RNG (the global ones and the model's NNX streams)
    as it is.  A ``Shard``/``Chunks`` value (a load with ``like=``) must hold the blocks the
    live leaf's devices need (:func:`template` asks for exactly those).

    Raises:
        RestoreError: a mismatch as described.
    """
    from ckptcore.adapter import convert_for

    if not isinstance(state, TrainingState):
        raise TypeError(f"restore() needs a ckptcore.TrainingState, got {type(state).__name__}")
    leaves, streams = named_tensors(model)
    if optimizer is not None:
        optimizer_leaves(optimizer)  # the type check, before anything is planned
    targets = {"model": model, "optimizer": optimizer}
    state = convert_for(state, NAME, {k: v for k, v in targets.items() if v is not None})
    saved_keys = dict((state.extra.get(NAME) or {}).get("keys") or {})
    saved_weak = set((state.extra.get(NAME) or {}).get("weak") or ())

    plan = RestorePlan()
    for name, live in leaves.values.items():
        value = state.model.get(name)
        if value is None:
            plan.missing(qualified("model", name))
            continue
        plan_leaf(plan, name, value, live, saved_impl=saved_keys.get(name),
                  saved_weak=name in saved_weak, put=lambda new, n=name: leaves.put(n, new))
    plan.unexpected_from(state.model, leaves.values)
    plan.then(leaves.commit)
    unapplied: dict[str, str] = {}
    # An Optax schedule follows the optimizer's count leaves: restored with the optimizer.
    no_slots = plan_training_parts(
        plan, state, optimizer=optimizer,
        scheduler=optimizer if state.schedule is not None else None, scaler=None, saved_scaler=False,
        strict=strict, unapplied=unapplied,
        plan_optimizer=lambda: plan_optimizer(plan, state.optimizer, optimizer, leaves.values),
        plan_schedule=lambda: None, plan_scaler=lambda: None,
        hints={"optimizer": "pass optimizer=... (an nnx.Optimizer or a ckptcore_jax.Ref of the "
                            "Optax state)",
               "schedule": "Optax schedules follow the optimizer's count leaves: pass optimizer=...",
               "grad scaler": ""})
    migrated = "migration" in (state.extra or {}) and "nnx" not in (state.rng or {})
    if rng and state.rng and not (migrated and streams.values):
        plan_rng(plan, state.rng, streams)
    elif rng and migrated and streams.values:
        _log.info("restore: the state was converted from %s, which has no NNX RNG streams; the "
                  "model's streams (%s) are left as they are", state.extra["migration"].get("from"),
                  ", ".join(sorted(streams.values)))
    return finish_restore(
        plan, state, strict, cursor=cursor, restore_rng=restore_framework_rng if rng else None,
        unapplied=unapplied, warn_data=warn_data,
        no_slots_message=("the checkpoint holds no optimizer state; the optimizer given was left "
                          "as it is") if no_slots else None)


def template(model: Any, optimizer: Any = None) -> TrainingState:
    """A ``like=`` state asking a load for the blocks the live sharded leaves of ``model`` and
    ``optimizer`` hold on this process (whole leaves are loaded whole)."""
    from ckptcore.state import OptimizerState

    leaves, streams = named_tensors(model)
    like = TrainingState(model=_templates(leaves.values))
    if optimizer is not None:
        slots: dict[str, dict[str, Any]] = {}
        others: dict[str, Any] = {}
        opt_leaves, _ = optimizer_leaves(optimizer)
        for name, live in opt_leaves.values.items():
            t = _template(live)
            if t is None:
                continue
            where = split_name(name, live, leaves.values)
            if where is None:
                others[name] = t
            else:
                slots.setdefault(where[0], {})[where[1]] = t
        like.optimizer = OptimizerState("optax", slots=slots, extra={"leaves": others})
    return like


def _template(live: Any) -> Any:
    return template_leaf(key_data(live) if is_key(live) else live)


def _templates(values: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, live in values.items():
        t = _template(live)
        if t is not None:
            out[name] = t
    return out
