"""An Optax optimizer state, keyed by parameter path: capture and restore planning.

Optax states are pytrees in which every per-parameter statistic is a subtree shaped like the
parameters (Adam's ``mu``/``nu``, SGD's ``trace``, ``MultiSteps``' ``acc_grads``), beside scalar
leaves (``count``, ``mini_step``, injected hyperparameters).  A leaf whose path ends with a model
parameter's name and whose shape is that parameter's is a *slot* of that parameter: its slot
name is the rest of the path (``0/mu``: ``optax.chain``'s first transformation's ``mu``).  Every
other leaf is kept by its whole path in ``OptimizerState.extra["leaves"]`` (an array, with its
dtype), and the names of weakly typed leaves in ``extra["weak"]`` (when there are some).  A
Variable holding no array (the ``MaskedNode`` that ``optax.masked`` and ``optax.multi_transform``
leave for the parameters a transformation does not touch) is no leaf.  An ``nnx.Optimizer``'s
leaves are named without the leading ``opt_state``, so a state captured from one restores into
a bare Optax state (a :class:`~ckptcore_jax.Ref`) and back; its ``step`` is
``OptimizerState.step`` (and, as a leaf, ``extra["leaves"]["step"]``).

An Optax transformation is code, not state, so the restore target's own ``tx`` is kept; a state
whose slots do not fit its leaves is a RestoreError.  ``OptimizerState.kind`` and
``hyperparams`` say which optimizer the transformation is, read from it by ``_optax.py``
(``adam``, ``adamw``, ``sgd``; ``optax`` when it is none of those or there is no ``tx``), for
migration; a restore never reads them.  An Optax schedule is a function of a ``count`` leaf,
which is restored with the optimizer; its description (``state.schedule``) serves migration.
"""

from __future__ import annotations

from typing import Any

from ckptcore.adapter import RestorePlan, qualified
from ckptcore.state import OptimizerState, ScheduleState

from ._optax import describe
from ._sharding import capture_leaf, is_weak, plan_leaf
from ._tensors import Leaves, nnx_leaves, pytree_leaves

__all__ = ["optimizer_leaves", "capture_optimizer", "plan_optimizer", "split_name"]

KIND = "optax"


def optimizer_leaves(optimizer: Any) -> tuple[Leaves, Any]:
    """The optimizer's leaves by name, and its NNX ``step`` variable's value (None: no NNX)."""
    from ckptcore_jax import Ref

    if isinstance(optimizer, Ref):
        return pytree_leaves(optimizer.value, optimizer), None
    from flax import nnx

    if isinstance(optimizer, nnx.Optimizer):
        leaves, _ = nnx_leaves(optimizer, skip=("opt_state",))
        return leaves, leaves.values.get("step")
    raise TypeError(f"ckptcore_jax needs an nnx.Optimizer or a ckptcore_jax.Ref(optax state) as "
                    f"the optimizer, got {type(optimizer).__module__}.{type(optimizer).__qualname__}")


def split_name(name: str, leaf: Any, params: dict[str, Any]) -> tuple[str, str] | None:
    """(parameter, slot) when leaf ``name`` is a per-parameter statistic of a parameter in
    ``params`` (the longest parameter name the path ends with, of the same shape), else None."""
    parts = name.split("/")
    for i in range(1, len(parts)):  # the longest parameter path first
        param, slot = "/".join(parts[i:]), "/".join(parts[:i])
        target = params.get(param)
        if target is not None and tuple(getattr(target, "shape", ())) == tuple(getattr(leaf, "shape", ())):
            return param, slot
    return None


def capture_optimizer(optimizer: Any, params: dict[str, Any], *, step: int | None,
                      copy: bool = True) -> tuple[OptimizerState, ScheduleState | None]:
    """The optimizer's state, and its learning-rate schedule when the Optax transformation (an
    ``nnx.Optimizer``'s ``tx``, a Ref's ``tx=``) has one (``_optax.py``)."""
    leaves, nnx_step = optimizer_leaves(optimizer)
    slots: dict[str, dict[str, Any]] = {}
    others: dict[str, Any] = {}
    keys: dict[str, str] = {}
    weak: list[str] = []
    for name, leaf in leaves.values.items():
        value, impl = capture_leaf(leaf, copy, name=qualified("optimizer", name))
        if impl:
            keys[name] = impl
        if is_weak(leaf):
            weak.append(name)
        where = split_name(name, leaf, params)
        if where is None:
            others[name] = value
        else:
            slots.setdefault(where[0], {})[where[1]] = value
    if step is None:
        step = int(nnx_step) if nnx_step is not None else 0
    extra: dict[str, Any] = {"leaves": others, "container": type(optimizer).__name__}
    if keys:
        extra["keys"] = keys
    if weak:
        extra["weak"] = weak
    kind, hyperparams, schedule = KIND, {}, None
    tx = getattr(optimizer, "tx", None)
    if tx is not None:
        kind, hyperparams, schedule = describe(tx, others)
    return OptimizerState(kind=kind, step=int(step), hyperparams=hyperparams, slots=slots,
                          extra=extra), schedule


def plan_optimizer(plan: RestorePlan, saved: OptimizerState, optimizer: Any,
                   params: dict[str, Any]) -> None:
    """Plan putting ``saved`` into ``optimizer`` (for a model whose live leaves are ``params``);
    every leaf is replaced at once when the plan is applied."""
    leaves, _ = optimizer_leaves(optimizer)
    others = dict(saved.extra.get("leaves") or {})
    keys = dict(saved.extra.get("keys") or {})
    weak = set(saved.extra.get("weak") or ())
    taken_slots: set[tuple[str, str]] = set()
    taken_others: set[str] = set()
    # A checkpoint written before Variables holding nothing were left out (Optax's MaskedNode)
    # holds an empty array under each of their names, where a capture put it: taken, not
    # unexpected, so that such a checkpoint restores.
    for name, nothing in leaves.empty.items():
        where = split_name(name, nothing, params)
        old = others.get(name) if where is None else (saved.slots.get(where[0]) or {}).get(where[1])
        if old is not None and int(getattr(old, "size", -1)) == 0:
            if where is None:
                taken_others.add(name)
            else:
                taken_slots.add(where)
    for name, live in leaves.values.items():
        where = split_name(name, live, params)
        if where is None:
            value, qname = others.get(name), qualified("optimizer", name)
            taken_others.add(name)
        else:
            value = (saved.slots.get(where[0]) or {}).get(where[1])
            qname = qualified("optimizer", *where)
            taken_slots.add(where)
        if value is None:
            plan.missing(qname)
            continue
        plan_leaf(plan, qname, value, live, saved_impl=keys.get(name), saved_weak=name in weak,
                  put=lambda new, n=name: leaves.put(n, new))
    for p, slots in saved.slots.items():
        plan.unexpected(*(qualified("optimizer", p, s) for s in slots if (p, s) not in taken_slots))
    plan.unexpected(*(qualified("optimizer", n) for n in others if n not in taken_others))
    plan.then(leaves.commit)
