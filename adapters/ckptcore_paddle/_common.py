"""Helpers shared by capture and the file interop; none of them imports Paddle."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

# Accumulator names of Paddle's built-in optimizers (FRAMEWORKS.md §2.2), longest first so that
# "moment2_max" wins over "moment2" when a key is matched by suffix.
KNOWN_SLOTS = tuple(sorted({
    "moment1", "moment2", "moment2_max", "beta1_pow_acc", "beta2_pow_acc",  # Adam, AdamW, Lamb
    "velocity",                                                              # Momentum, Lars
    "momentum", "mean_square", "mean_grad",                                  # RMSProp
    "moment",                                                                # Adagrad, Adamax
    "inf_norm",                                                              # Adamax
    "_avg_squared_grad", "_avg_squared_update",                              # Adadelta
}, key=len, reverse=True))
MASTER_SLOT = "master_weight"  # a multi-precision optimizer's float32 copy of a low-precision parameter

# Scheduler state that Paddle's own state_dict() leaves out (FRAMEWORKS.md §4.3): restoring from
# state_dict() alone is silently wrong for these, so ScheduleState.state carries them too.
SCHEDULER_EXTRA_ATTRS = {"CosineAnnealingWarmRestarts": ("T_cur", "T_i")}

_COUNTER = re.compile(r"_\d+$")
_MASTER = re.compile(r"^fp32_master_\d+_")
# Paddle's own key for the structured-name table; it is not a parameter.
NAME_TABLE = "StructuredToParameterName@@"
BIG_PARAM_INFO = "UnpackBigParamInfor@@"  # sic: Paddle's spelling


def plain(value: Any) -> Any:
    """``value`` with numpy scalars, 1-element arrays' scalars and tuples turned into msgpack-able Python values."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if hasattr(value, "numpy") and hasattr(value, "shape"):  # a 1-element Paddle tensor
        arr = np.asarray(value.numpy())
        return plain(arr.reshape(()).item()) if arr.size == 1 else arr
    raise TypeError(f"cannot store {type(value).__qualname__} as a plain checkpoint value")


def split_accumulator_key(rest: str) -> tuple[str, str | None, bool]:
    """Parse what follows ``<param runtime name>_`` in an optimizer key.

    Returns ``(slot, optimizer_name, on_master_weight)``: ``"moment1_0"`` gives ``("moment1", None,
    False)``; ``"adam_moment1_1"`` (an optimizer built with ``name="adam"``) gives ``("moment1",
    "adam", False)``; ``"fp32_master_0_moment1_0"`` gives ``("moment1", None, True)``.
    """
    on_master = False
    m = _MASTER.match(rest)
    if m:
        on_master, rest = True, rest[m.end():]
    acc = _COUNTER.sub("", rest)
    for slot in KNOWN_SLOTS:
        if acc == slot:
            return slot, None, on_master
        if acc.endswith("_" + slot):
            return slot, acc[: -len(slot) - 1], on_master
    return acc, None, on_master


def step_from_pow(pow_value: float, beta: float, *, limit: int = 1 << 22) -> int | None:
    """The number of updates ``t`` after which Adam's ``beta_pow_acc`` holds ``pow_value``.

    Paddle starts the accumulator at ``beta`` and multiplies it by ``float32(beta)`` once per update,
    in float32, so after ``t`` updates it holds the ``t``-th element of
    ``np.multiply.accumulate([beta] * n)``: we look it up there, which stays exact long after a
    logarithm would round wrongly.  ``None`` if the value is ambiguous (it underflowed and got stuck,
    about 960 updates for 0.9) or further than ``limit`` updates away.
    """
    b, p = np.float32(beta), np.float32(pow_value)
    if not (0.0 < b < 1.0) or not (0.0 < p <= b):
        return None
    estimate = math.log(float(p)) / math.log(float(b))
    if not math.isfinite(estimate) or estimate > limit:
        return None
    n = min(limit, int(estimate * 1.01) + 64)
    seq = np.multiply.accumulate(np.full(n, b, dtype=np.float32))
    hits = np.flatnonzero(seq == p)
    if hits.size != 1 or hits[0] + 1 >= n:
        return None
    return int(hits[0])


def infer_optimizer_kind(slot_names: set[str]) -> str:
    """Guess Paddle's optimizer class from the accumulators a ``.pdopt`` holds (Adam and AdamW look alike)."""
    slot_names = slot_names - {MASTER_SLOT}
    if {"moment1", "moment2"} <= slot_names:
        return "adam"
    if slot_names == {"velocity"}:
        return "momentum"
    if {"mean_square", "mean_grad"} <= slot_names:
        return "rmsprop"
    if slot_names == {"moment"}:
        return "adagrad"
    if {"moment", "inf_norm"} <= slot_names:
        return "adamax"
    return "unknown"


def adam_step(slots: dict[str, dict[str, np.ndarray]], beta1: float, beta2: float) -> int | None:
    """The update count of an Adam-family optimizer from its ``beta{2,1}_pow_acc`` slots (beta2 first)."""
    for slot, beta in (("beta2_pow_acc", beta2), ("beta1_pow_acc", beta1)):
        steps = [step_from_pow(float(np.asarray(s[slot]).reshape(-1)[0]), beta)
                 for s in slots.values() if slot in s and np.asarray(s[slot]).size]
        if steps and all(t is not None for t in steps):
            return max(steps)  # type: ignore[type-var]
    return None
