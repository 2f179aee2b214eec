"""The dialect contract: what a framework tells migration about its own conventions.

Migration converts a state of framework A into one of framework B through a *neutral form*:
A's dialect translates its optimizer, schedule and random state into neutral terms, and B's
dialect translates them back.  The core (:mod:`ckptcore.migrate`) only compares and moves
neutral values, so adding a framework means writing one dialect (its adapter's ``_dialect.py``,
reached as ``get_adapter(name).dialect``), never editing the core, and never a rule per pair.

The neutral vocabulary
----------------------

An optimizer in neutral terms is a :class:`Neutral`: its ``family`` and hyperparameters under
these names (absent keys mean "not applicable"):

==========================  =================================================================
``family``                  ``adam``, ``momentum`` (plain SGD is momentum 0), ``rmsprop``,
                            ``adagrad``
``beta1``, ``beta2``        Adam's decay rates
``epsilon``                 the ε of Adam, RMSprop and Adagrad
``eps_mode``                Adam: ``uncorrected`` (ε added to √v, the bias correction folded
                            into the step size) or ``corrected`` (ε added to √v̂ = √(v/(1-β2ᵗ)));
                            Adagrad: ``inside_sqrt`` (√(acc+ε)) or ``outside_sqrt`` (√acc+ε)
``amsgrad``                 Adam keeps the running maximum of v
``momentum``, ``nesterov``  SGD momentum (and RMSprop's momentum)
``momentum_form``           where SGD momentum keeps the learning rate: ``gradient``
                            (b ← μb + g; w ← w − lr·b) or ``update`` (b ← μb − lr·g; w ← w + b).
                            The two agree exactly only while the rate is constant.
``rho``, ``centered``       RMSprop
``initial_accumulator_value``  Adagrad
``decoupled_wd``            weight decay applied to the weights (w ← w − lr·λ·w)
``coupled_wd``              L2 decay added to the gradient (g ← g + λ·w)
``clip``                    a description of gradient clipping, compared as text
==========================  =================================================================

Neutral slot names (per parameter, in the parameter's own layout):

=============  ====================================================================
``m``, ``v``   Adam's first and second moments (uncorrected)
``vmax``       AMSGrad's running maximum of ``v``
``momentum``   the SGD momentum buffer in ``gradient`` form (b ← μb + g)
``ms``         RMSprop's mean square
``mom``        RMSprop's momentum buffer
``mg``         centered RMSprop's mean gradient
``acc``        Adagrad's accumulator
=============  ====================================================================

A learning-rate schedule in neutral terms is a *canonical form* (:mod:`.schedules`): a tuple
naming a formula and its parameters, ``("exp", lr0, q)`` for ``lr0·qᵗ`` and so on.  Two schedules
continue each other exactly when their canonical forms are equal.

Every ``OptimizerState.hyperparams`` keeps the current learning rate under ``learning_rate`` (a
rule of :class:`~ckptcore.OptimizerState` for all adapters), which is where the core writes the
rate a target continues with when the source's schedule ends in a constant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import logging
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import numpy as np

from ..errors import MigrationError
from ..state import OptimizerState, ScheduleState, TrainingState

__all__ = ["Dialect", "BaseDialect", "Neutral", "Canon", "NEUTRAL_SLOTS", "FAMILIES", "cast_like",
           "number", "pick", "read_hyperparams", "slots_by_table"]

_log = logging.getLogger("ckptcore")

Canon = tuple
"""A schedule's canonical form: ``(tag, *parameters)``; see :mod:`.schedules`."""

FAMILIES = ("adam", "momentum", "rmsprop", "adagrad")
NEUTRAL_SLOTS = ("m", "v", "vmax", "momentum", "ms", "mom", "mg", "acc")


@dataclass
class Neutral:
    """An optimizer in neutral terms (see the module docstring for the vocabulary).

    Attributes:
        family: One of :data:`FAMILIES`.
        framework: The dialect's name (for messages).
        kind: The framework's own optimizer kind (for messages).
        lr: The current learning rate.
        step: Updates applied so far (the dialect recovers it where its framework keeps no counter).
        hp: Hyperparameters under neutral names.
        unsupported: Why this optimizer cannot be migrated (each becomes a problem).
        counterparts: ``{eps_mode: optimizer}``: this framework's optimizer that adds Adam's ε in
            that way, named in the warning when the two sides' conventions differ.
    """

    family: str
    framework: str
    kind: str
    lr: float | None
    step: int = 0
    hp: dict[str, Any] = field(default_factory=dict)
    unsupported: list[str] = field(default_factory=list)
    counterparts: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class Dialect(Protocol):
    """What a framework's adapter supplies for migration (``ADAPTER.dialect``).

    All methods are pure NumPy/Python: a dialect never imports its framework.
    """

    name: str
    """The framework's name, equal to ``TrainingState.framework`` of its states."""

    default_flatten_order: str | None
    """``"channels_first"``/``"channels_last"``: the order in which the framework flattens a feature
    map when its adapter could not record it in ``ParamInfo.attrs["input_order"]``; ``None`` when
    its adapter always records it."""

    cosine_past_end: str
    """What the framework's cosine decay does after its last step: ``"hold"`` (stays at the final
    rate) or ``"rise"`` (the cosine continues, so the rate rises again)."""

    schedule_follows_optimizer: bool
    """Whether the framework evaluates a schedule at the optimizer's own update count (counting
    micro-steps under gradient accumulation) rather than at a position of the schedule's own."""

    accumulation_in_optimizer: bool
    """Whether gradient accumulation is part of the framework's optimizer: the target's number of
    micro-batches then comes from the target itself, and its schedule counts micro-steps."""

    accumulation_form: str
    """How accumulated gradients are kept: ``"sum"`` (raw sums) or ``"mean"`` (each micro-batch's
    gradient divided by the number of micro-batches)."""

    def optimizer_to_neutral(self, opt: OptimizerState, schedule: ScheduleState | None) -> Neutral:
        """``opt`` in neutral terms (``schedule`` helps to recover a missing step counter)."""

    def optimizer_from_neutral(self, n: Neutral) -> tuple[str, dict[str, Any]]:
        """The framework's optimizer ``(kind, hyperparams)`` that continues ``n``, when the target
        has no optimizer of its own."""

    def slots_to_neutral(self, n: Neutral, slots: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One parameter's slots (native names) under neutral names and conventions.  Slots with
        no neutral meaning (e.g. counters the step already carries) are left out."""

    def slots_from_neutral(self, n: Neutral, slots: Mapping[str, np.ndarray], *, source: Neutral,
                           like: np.ndarray, current: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        """One target parameter's native slots from neutral ones (already in the target layout).

        ``n`` describes the target optimizer, ``source`` the source's (its ``lr`` and ``step`` are
        the ones the slots were accumulated with); ``like`` is the target parameter (shape and
        dtype); ``current`` the template's slots of that parameter, if it has any.
        """

    def finish_optimizer(self, out: OptimizerState, template: OptimizerState | None) -> OptimizerState:
        """The converted optimizer state with the framework's own bookkeeping (``extra``, slots the
        framework keeps for every variable) taken from the template."""

    def schedule_to_canonical(self, schedule: ScheduleState) -> Canon | None:
        """The schedule's canonical form, or ``None`` when it has none."""

    def schedule_from_canonical(self, form: Canon, template: ScheduleState, step: int,
                                last_lr: float) -> tuple[ScheduleState, dict[str, Any] | None]:
        """The template's schedule positioned at ``step`` (its rate there is ``last_lr``), and
        private state for :meth:`extra` (``None`` when there is none)."""

    def rng_from_seed(self, seed: int) -> dict[str, Any]:
        """``TrainingState.rng`` entries for the framework's own generators, as seeding them with
        ``seed`` would leave them (the portable ``python``/``numpy`` entries are carried apart)."""

    def layer_seed_state(self, seed: int, like: np.ndarray) -> np.ndarray:
        """A per-layer generator's state (a ``seed_state`` parameter shaped like ``like``) seeded
        with ``seed``."""

    def extra(self, template: TrainingState, produced: Mapping[str, Any]) -> dict[str, Any]:
        """The converted state's ``extra``: the framework's own section, built from the template's
        and what the conversion produced (``{"scheduler": <schedule_from_canonical's state>}``)."""


def cast_like(arr: np.ndarray, like: np.ndarray) -> np.ndarray:
    """``arr`` as a contiguous array of ``like``'s dtype (every converted value ends so)."""
    return np.ascontiguousarray(arr, dtype=like.dtype)


# A neutral slot that stands in for a missing one: AMSGrad's running maximum starts as ``v``.
FALLBACK = {"vmax": "v"}


def pick(slots: Mapping[str, np.ndarray], name: str) -> np.ndarray | None:
    """Neutral slot ``name`` from ``slots``, else the one that stands in for it, else ``None``
    (a dialect then starts the slot at zeros)."""
    if name in slots:
        return slots[name]
    alt = FALLBACK.get(name)
    return slots.get(alt) if alt else None


def slots_by_table(table: Mapping[str, str], neutral: Mapping[str, np.ndarray], like: np.ndarray,
                   convert: Callable[[str, np.ndarray], np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Native slots ``{native: neutral name}`` of ``table`` from ``neutral`` ones, each cast like the
    parameter; ``convert(name, value)`` changes a value's convention first.  A slot the source does
    not have starts at zeros (e.g. a centered RMSprop's mean gradient after an uncentered one)."""
    out: dict[str, np.ndarray] = {}
    for native, name in table.items():
        value = pick(neutral, name)
        if value is None:
            _log.debug("migration: slot %s (%s) is not in the source; it starts at zeros", native, name)
            out[native] = np.zeros(like.shape, like.dtype)
        else:
            out[native] = cast_like(convert(name, value) if convert else value, like)
    return out


def read_hyperparams(hp: Mapping[str, Any], table: Mapping[str, tuple[str, Any]]) -> dict[str, Any]:
    """Neutral hyperparameters from a framework's: ``table`` maps each neutral name to the
    framework's key and its default (a bool default reads a flag, anything else a number)."""
    return {neutral: bool(hp.get(key, default)) if isinstance(default, bool) else number(hp.get(key), default)
            for neutral, (key, default) in table.items()}


def number(x: Any, default: float | None = None) -> float | None:
    """A hyperparameter as a float (``default`` for ``None``, booleans and non-numbers)."""
    if isinstance(x, bool) or x is None:
        return default
    return float(x) if isinstance(x, (int, float)) else default


class BaseDialect:
    """Defaults a dialect may inherit: no framework generators, no schedules, neutral slot names,
    no ``extra`` section beyond the template's own, gradient accumulation kept as sums."""

    name = ""
    default_flatten_order: str | None = None
    cosine_past_end = "hold"
    schedule_follows_optimizer = False
    accumulation_in_optimizer = False
    accumulation_form = "sum"

    def slots_to_neutral(self, n: Neutral, slots: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: v for k, v in slots.items() if k in NEUTRAL_SLOTS}

    def finish_optimizer(self, out: OptimizerState, template: OptimizerState | None) -> OptimizerState:
        if template is not None:
            out.extra = dict(template.extra)
        return out

    def schedule_to_canonical(self, schedule: ScheduleState) -> Canon | None:
        raise MigrationError(f"the {self.name} dialect has no learning-rate schedules "
                             f"(got {schedule.kind})")

    def schedule_from_canonical(self, form: Canon, template: ScheduleState, step: int,
                                last_lr: float) -> tuple[ScheduleState, dict[str, Any] | None]:
        raise MigrationError(f"the {self.name} dialect has no learning-rate schedules "
                             f"(got {template.kind})")

    def rng_from_seed(self, seed: int) -> dict[str, Any]:
        return {}

    def layer_seed_state(self, seed: int, like: np.ndarray) -> np.ndarray:
        # The common two-word form (seed, counter), zero-padded to the parameter's shape.
        out = np.zeros(like.size, like.dtype)
        out[0] = seed
        return out.reshape(like.shape)

    def extra(self, template: TrainingState, produced: Mapping[str, Any]) -> dict[str, Any]:
        own = (template.extra or {}).get(self.name)
        return {self.name: dict(own)} if isinstance(own, Mapping) else {}

    def __repr__(self) -> str:
        return f"<{self.name} migration dialect>"
