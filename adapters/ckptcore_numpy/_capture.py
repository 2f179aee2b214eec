"""``capture()`` and ``restore()``: a NumPy model, its optimizer, RNGs and data cursor.

What lands where:

* ``state.model``: ``model.params`` by name; ``state.params``: their ParamInfo (``_params.py``).
* ``state.optimizer``: kind, iteration counter, hyperparameters, slots (``_optimizer.py``).
* ``state.rng``: ckptcore's ``"python"``/``"numpy"`` states plus the named ``generators``.
* ``state.data``: ``cursor.state_dict()``.

Restore plans everything through a :class:`ckptcore.adapter.RestorePlan` before it writes
anything, so a restore that fails leaves every object as it was.
"""

from __future__ import annotations

import copy as _copy
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckptcore.adapter import RestorePlan, qualified
from ckptcore.state import RestoreReport, TrainingState

from ._optimizer import capture_optimizer, check_optimizer, plan_optimizer
from ._params import describe_params
from ._rng import capture_framework_rng, plan_rng
from ._tensors import assign, named_tensors, to_numpy

__all__ = ["capture", "restore", "NAME"]

NAME = "numpy"


def _check_generators(generators: Any) -> None:
    if generators is not None and not isinstance(generators, Mapping):
        raise TypeError(f"generators must be a mapping of names to numpy.random.Generator, got "
                        f"{type(generators).__name__}")


def capture(model: Any, optimizer: Any = None, *, cursor: Any = None, rng: bool = True,
            copy: bool = True, generators: Mapping[str, Any] | None = None) -> TrainingState:
    """Snapshot ``model``, ``optimizer``, RNG states and ``cursor``.

    With ``copy=False`` the arrays are the live ones (they change as training goes on); save them
    before the next step.
    """
    tensors = named_tensors(model)
    check_optimizer(optimizer)
    _check_generators(generators)
    return TrainingState(
        model={n: to_numpy(t, copy) for n, t in tensors.items()},
        optimizer=None if optimizer is None else capture_optimizer(optimizer, copy),
        rng=capture_framework_rng(generators) if rng else {},
        data=dict(cursor.state_dict()) if cursor is not None else {},
        step=optimizer.iterations if optimizer is not None else 0,
        framework=NAME, metadata={"versions": {"numpy": np.__version__}},
        params=describe_params(model, tensors))


def restore(state: TrainingState, model: Any, optimizer: Any = None, *, cursor: Any = None,
            strict: bool = True, rng: bool = True,
            generators: Mapping[str, Any] | None = None) -> RestoreReport:
    """Put ``state`` back into the objects.  With ``strict`` a state that does not fit raises
    :class:`~ckptcore.errors.RestoreError` listing every mismatch; otherwise what fits is
    restored and the rest reported."""
    from ckptcore.adapter import convert_for

    if not isinstance(state, TrainingState):
        raise TypeError(f"restore() needs a ckptcore.TrainingState, got {type(state).__name__}")
    tensors = named_tensors(model)
    check_optimizer(optimizer)
    _check_generators(generators)
    objects = {"model": model, "optimizer": optimizer}
    state = convert_for(state, NAME, {k: v for k, v in objects.items() if v is not None})

    plan = RestorePlan()
    for name, target in tensors.items():
        value = state.model.get(name)
        if value is None:
            plan.missing(qualified("model", name))
        else:
            plan.assign(name, value, shape=target.shape, dtype=target.dtype,
                        put=lambda t=target, v=value: assign(t, v))
    plan.unexpected_from(state.model, tensors)
    if optimizer is not None:
        plan_optimizer(plan, state.optimizer, optimizer, tensors)
    if cursor is not None:
        if not state.data:
            plan.missing(qualified("data"))
        else:
            _copy.deepcopy(cursor).load_state_dict(state.data)  # validate now, apply with the rest
            plan.then(lambda: cursor.load_state_dict(state.data))
    if rng:
        missing, put_rng = plan_rng(state.rng, generators)
        plan.missing(*(qualified("rng", name) for name in missing))
        plan.then(put_rng)
    return plan.apply(strict)
