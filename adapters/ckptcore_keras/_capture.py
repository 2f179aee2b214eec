"""Capture a Keras training state as a :class:`~ckptcore.TrainingState` and restore it.

What lands where:

* ``state.model``: every variable of ``model.variables`` under its Keras path
  (``sequential/dense/kernel``, ``seed_generator/seed_generator_state``), plus raw
  ``tf.Variable`` attributes of the model or its layers as ``<owner path>/<attr>[/<i>]``.
* ``state.params``: a :class:`~ckptcore.ParamInfo` for each of those names (``_params.py``).
* ``state.optimizer`` / ``state.schedule`` / ``state.accumulation``: see ``_optimizer.py``.
* ``state.rng``: ckptcore's ``"python"``/``"numpy"`` plus ``"tensorflow"``/``"keras"`` (``_rng.py``).
* ``state.data``: ``cursor.state_dict()``.
* ``state.extra["keras"]["variables"]``: the names of ``state.model`` in model order.

Restore checks everything before it assigns anything, so a failed restore leaves
the model and optimizer untouched.
"""

from __future__ import annotations

from typing import Any

from ckptcore.errors import RestoreError
from ckptcore.state import RestoreReport, TrainingState

from ._optimizer import capture_optimizer, ensure_built, plan_optimizer
from ._params import describe_params
from ._rng import capture_framework_rng, restore_framework_rng
from ._variables import check_value, match_names, named_variables, read

__all__ = ["capture", "restore", "restore_objects"]


def _optimizer_of(model: Any, optimizer: Any) -> Any:
    return optimizer if optimizer is not None else getattr(model, "optimizer", None)


def capture(model: Any, optimizer: Any = None, *, cursor: Any = None,
            rng: bool = True) -> TrainingState:
    """Snapshot everything needed to continue training ``model`` exactly.

    Args:
        model: A built Keras model (Sequential, functional or subclassed), with or
            without a ``tf.distribute`` strategy; mirrored variables are stored once.
        optimizer: The optimizer; defaults to ``model.optimizer`` when compiled.  An
            optimizer that has not taken a step yet is built first (zero slots).
        cursor: A ``ckptcore.DataCursor`` (anything with ``state_dict()``).
        rng: Include Python, numpy, TensorFlow and Keras global RNG states.

    Variables are captured without copying: the arrays are read-only views of
    TensorFlow's copy-on-write buffers, so training on never changes them
    (``np.array(a)`` for a writable copy).

    Example:
        >>> state = ckptcore_keras.capture(model, cursor=cursor)   # doctest: +SKIP
        >>> state.optimizer.slots["dense/kernel"]["momentum"].shape  # doctest: +SKIP
        (10, 1)
    """
    import keras
    import tensorflow as tf

    named = named_variables(model)
    if not named:
        raise ValueError("the model has no variables yet: build it first "
                         "(call it on a batch, or model.build(input_shape))")
    names = {id(var): name for name, var in named}
    state = TrainingState(framework="keras",
                          model={name: read(var) for name, var in named},
                          params=describe_params(model, names))
    opt = _optimizer_of(model, optimizer)
    if opt is not None:
        ensure_built(opt, model)
        state.optimizer, state.schedule, state.accumulation = capture_optimizer(opt, names)
        state.step = state.optimizer.step
    if rng:
        from ckptcore.rng import capture_rng
        state.rng = {**capture_rng(), **capture_framework_rng()}
    if cursor is not None:
        state.data = dict(cursor.state_dict())
    state.metadata = {
        "versions": {"keras": keras.__version__, "tensorflow": tf.__version__},
        "backend": keras.backend.backend(),
        "model_class": type(model).__name__,
        "optimizer_class": None if opt is None else type(opt).__name__,
    }
    state.extra = {"keras": {"variables": [name for name, _ in named]}}
    return state


def _saved_order(state: TrainingState) -> list[str]:
    order = ((state.extra or {}).get("keras") or {}).get("variables")
    if isinstance(order, (list, tuple)) and set(order) == set(state.model):
        return list(order)
    return list(state.model)


def restore(state: TrainingState, model: Any, optimizer: Any = None, *, cursor: Any = None,
            strict: bool = True) -> RestoreReport:
    """Put ``state`` back into ``model``, its optimizer, the RNGs and ``cursor``.

    Works into a freshly built model whose optimizer has not been built (it is
    built here), into the same architecture built in another process, and into a
    second copy built in the same process (auto-generated names such as
    ``dense_1`` are then matched in model order).  Values are assigned bit for bit.

    Args:
        state: A state captured by :func:`capture` (or imported from a TF checkpoint).
        model: The model to restore into; it must be built.
        optimizer: Defaults to ``model.optimizer`` when compiled.
        cursor: A ``DataCursor`` to position, if the state has data.
        strict: Raise on missing or unexpected names instead of reporting them.

    Returns:
        The names in the target that the state did not cover (``missing``) and the
        saved names nothing in the target took (``unexpected``).

    Raises:
        RestoreError: A shape or dtype differs (names the variable), the optimizer
            kind or gradient accumulation differs, or, with ``strict``, a name is
            missing or unexpected (lists them).
    """
    if state.framework not in (None, "keras"):  # another framework's state: migrate it first
        from ckptcore.api import convert
        state = convert(state, "keras", model, _optimizer_of(model, optimizer))
    missing, unexpected = restore_objects(state, model, optimizer, strict=strict,
                                          expect_data=cursor is not None)
    if state.rng:
        restore_framework_rng(state.rng)  # before Python's: it may draw from Python's random
        from ckptcore.rng import restore_rng
        restore_rng(state.rng)
    if cursor is not None and state.data:
        cursor.load_state_dict(state.data)
    return RestoreReport(missing=tuple(missing), unexpected=tuple(unexpected))


def restore_objects(state: TrainingState, model: Any, optimizer: Any = None, *,
                    strict: bool = True, expect_data: bool = False) -> tuple[list[str], list[str]]:
    """:func:`restore` for the model and optimizer only (no RNG, no cursor)."""
    if state.framework not in (None, "keras"):
        raise RestoreError(f"the state comes from {state.framework!r}; convert it first "
                           "(ckptcore.load_state migrates when given Keras objects)")
    named = named_variables(model)
    if not named:
        raise RestoreError("the model has no variables yet: build it first "
                           "(call it on a batch, or model.build(input_shape))")
    target = dict(named)
    order = _saved_order(state)
    mapping = match_names(order, [n for n, _ in named])
    taken = set(mapping.values())
    missing = [n for n in target if n not in taken]
    unexpected = [n for n in order if n not in mapping]
    plan = [(t, target[t], check_value(t, target[t], state.model[n]))
            for n, t in mapping.items()]
    opt = _optimizer_of(model, optimizer)
    if state.optimizer is not None and opt is not None:
        ensure_built(opt, model)
        plan += plan_optimizer(state.optimizer, state.accumulation, opt,
                               lambda n: target.get(mapping.get(n, "")), strict=strict,
                               missing=missing, unexpected=unexpected)
    elif state.optimizer is not None:
        unexpected.append("optimizer")
    elif opt is not None:
        missing.append("optimizer")
    if expect_data and not state.data:
        missing.append("data")
    if strict and (missing or unexpected):
        raise RestoreError(_mismatch_message(missing, unexpected))
    # Each assign copies the array into a new TensorFlow buffer (conversion never aliases numpy
    # memory), then swaps it in.  Converting on several threads was measured slower: each
    # thread's allocations take fresh pages instead of the buffers the swaps just freed.
    for _, var, value in plan:
        var.assign(value)
    return missing, unexpected


def _mismatch_message(missing: list[str], unexpected: list[str]) -> str:
    def show(names: list[str]) -> str:
        head = ", ".join(names[:20])
        return head + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
    parts = []
    if missing:
        parts.append(f"missing from the state: {show(missing)}")
    if unexpected:
        parts.append(f"not in the target: {show(unexpected)}")
    return ("the state does not fit the model: " + "; ".join(parts)
            + ". Pass strict=False to restore what matches and get a RestoreReport.")

