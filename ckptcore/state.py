"""The framework-neutral training-state schema.

A :class:`TrainingState` is everything needed to continue a run: weights,
optimizer slots, the learning-rate schedule's position, RNG states, the data
cursor and gradient-accumulation buffers in progress.  Arrays are plain
``numpy.ndarray``; every other value is a msgpack-able tree (``None``, bool,
int, float, str, bytes, list, tuple, dict with str/int keys) that may contain
arrays.  Adapters translate framework objects to and from this schema; the
codec (``_codec.py``) translates it to bytes.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

__all__ = [
    "TrainingState",
    "OptimizerState",
    "ScheduleState",
    "AccumulationState",
    "ParamInfo",
    "RestoreReport",
]


@dataclass
class OptimizerState:
    """Optimizer state keyed by the same parameter names as ``TrainingState.model``.

    Attributes:
        kind: Optimizer family in lower case, e.g. ``"adam"``, ``"sgd"``, ``"momentum"``.
        step: Number of updates applied so far.
        hyperparams: Plain values (learning rate, betas, epsilon, ...).
        slots: ``{param_name: {slot_name: ndarray}}``.
        extra: Framework-specific optimizer variables that belong to no parameter
            (loss-scale state, accumulation counters, ...).
    """

    kind: str
    step: int = 0
    hyperparams: dict[str, Any] = field(default_factory=dict)
    slots: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ScheduleState:
    """A learning-rate schedule and where it is.

    ``config`` is the schedule's own serialized configuration (e.g. what a
    schedule's ``get_config()`` returns); ``step`` is its step counter and ``last_lr``
    the rate it gave last.  ``state`` holds runtime state a framework keeps
    beyond its config and step (e.g. a recursive scheduler's current values).
    """

    kind: str
    config: dict[str, Any] = field(default_factory=dict)
    step: int = 0
    last_lr: float | None = None
    state: dict[str, Any] = field(default_factory=dict)


@dataclass
class AccumulationState:
    """Gradient accumulation in progress: ``count`` of ``every`` micro-batches summed into ``buffers``."""

    every: int
    count: int = 0
    buffers: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class ParamInfo:
    """A framework-neutral description of one parameter, for migration between frameworks.

    Attributes:
        index: Position of the parameter's layer in the model's layer order.
        layer: The layer's path in its model.
        kind: Layer kind, e.g. ``"dense"``, ``"conv2d"``, ``"batch_norm"``, ``"lstm"``.
        role: Role within the layer, e.g. ``"kernel"``, ``"bias"``, ``"moving_mean"``.
        layout: Axis layout such as ``"io"``, ``"hwio"``, ``"oihw"`` or a gate order.
        attrs: Facts a layout transform needs (e.g. the feature-map shape a dense layer flattens).
    """

    index: int
    layer: str
    kind: str
    role: str
    layout: str | None = None
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The vocabulary's enums (ckptcore.vocab) compare equal to their words; store the words, so
        # a ParamInfo encodes, compares and prints the same however it was built.
        for name in ("kind", "role", "layout"):
            value = getattr(self, name)
            if isinstance(value, str) and type(value) is not str:
                object.__setattr__(self, name, str(value))

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "layer": self.layer, "kind": self.kind, "role": self.role,
                "layout": self.layout, "attrs": dict(self.attrs)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ParamInfo:
        return cls(index=int(d["index"]), layer=str(d["layer"]), kind=str(d["kind"]),
                   role=str(d["role"]), layout=d.get("layout"), attrs=dict(d.get("attrs") or {}))


@dataclass
class TrainingState:
    """Everything a training run needs to continue exactly where it stopped.

    Only ``model`` is required; every other section may stay empty.  Each section's type is
    checked at construction (``TypeError`` naming the section): ``model``, ``rng``, ``data``,
    ``metadata``, ``extra`` and ``params`` are mappings; ``optimizer``, ``schedule`` and
    ``accumulation`` are an :class:`OptimizerState`, :class:`ScheduleState`,
    :class:`AccumulationState` or None; ``step`` and ``epoch`` ints; ``framework`` a str or None.

    Example:
        >>> import numpy as np, ckptcore
        >>> state = ckptcore.TrainingState(model={"dense/kernel": np.ones((2, 3), "float32")}, step=10)
        >>> state.model["dense/kernel"].shape
        (2, 3)
    """

    model: dict[str, np.ndarray] = field(default_factory=dict)
    optimizer: OptimizerState | None = None
    schedule: ScheduleState | None = None
    rng: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    accumulation: AccumulationState | None = None
    step: int = 0
    epoch: int = 0
    framework: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    params: dict[str, ParamInfo] = field(default_factory=dict)

    SECTIONS = ("model", "optimizer", "schedule", "rng", "data", "accumulation",
                "step", "epoch", "framework", "metadata", "extra", "params")

    def __post_init__(self) -> None:
        # Each section's own type, checked here so that a mistake (``model="x"``, a dict as
        # ``optimizer``) is a TypeError naming the section at once, not an AttributeError deep
        # in a save.  The values inside (arrays, plain trees) are checked by the save's codec.
        for name in ("model", "rng", "data", "metadata", "extra", "params"):
            value = getattr(self, name)
            if not isinstance(value, Mapping):
                what = ("a mapping of parameter names to numpy arrays" if name == "model"
                        else "a mapping of names to ckptcore.ParamInfo" if name == "params"
                        else "a mapping (dict)")
                raise TypeError(f"TrainingState.{name} must be {what}, got "
                                f"{type(value).__name__} {value!r:.60}")
        for name, cls in (("optimizer", OptimizerState), ("schedule", ScheduleState),
                          ("accumulation", AccumulationState)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, cls):
                raise TypeError(f"TrainingState.{name} must be a ckptcore.{cls.__name__} or None, "
                                f"got {type(value).__name__} {value!r:.60}")
        for name in ("step", "epoch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"TrainingState.{name} must be an int, got "
                                f"{type(value).__name__} {value!r:.60}")
        if self.framework is not None and not isinstance(self.framework, str):
            raise TypeError(f"TrainingState.framework must be a str or None, got "
                            f"{type(self.framework).__name__}")


@dataclass(frozen=True)
class RestoreReport:
    """What an adapter's ``restore`` did not place: names missing from the state or the target."""

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.missing and not self.unexpected
