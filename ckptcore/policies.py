"""Retention policies: which checkpoints of a run to keep.

A policy looks at the committed checkpoints of a run, as
:class:`CheckpointEntry` objects sorted by step, and returns the steps it wants
kept.  The manager deletes what no policy keeps, except that it always keeps
the newest committed checkpoint, so policies need not.  Policies combine with
``|`` (or :class:`KeepAny`): a checkpoint is kept if any of them keeps it.

Example:
    >>> entries = [CheckpointEntry(step=s, created=60.0 * s) for s in range(0, 1000, 100)]
    >>> sorted((KeepLast(2) | KeepEvery(500)).keep(entries))
    [0, 500, 800, 900]

A custom policy subclasses :class:`RetentionPolicy` and implements ``keep``.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "CheckpointEntry",
    "RetentionPolicy",
    "KeepLast",
    "KeepEvery",
    "KeepBest",
    "KeepEveryDuration",
    "KeepAll",
    "KeepAny",
    "as_policy",
    "check_metrics",
    "saved_metrics",
]

log = logging.getLogger("ckptcore")


@dataclass(frozen=True)
class CheckpointEntry:
    """What a policy may know about one committed checkpoint.

    Attributes:
        step: The checkpoint's training step.
        created: When it was committed, as a Unix time in seconds.
        metrics: The metrics saved with it, if any.
    """

    step: int
    created: float
    metrics: Mapping[str, float] | None = None


class RetentionPolicy:
    """Base class of retention policies: ``keep(entries)`` returns the steps to keep."""

    def keep(self, entries: Sequence[CheckpointEntry]) -> set[int]:
        raise NotImplementedError

    def __or__(self, other: object) -> KeepAny:
        if not isinstance(other, RetentionPolicy):
            return NotImplemented
        return KeepAny(self, other)


def _positive_int(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class KeepLast(RetentionPolicy):
    """Keep the ``n`` checkpoints with the highest steps.

    Example:
        >>> sorted(KeepLast(2).keep([CheckpointEntry(s, 0.0) for s in (1, 2, 3)]))
        [2, 3]
    """

    n: int

    def __post_init__(self) -> None:
        _positive_int(self.n, "n")

    def keep(self, entries: Sequence[CheckpointEntry]) -> set[int]:
        return set(sorted(e.step for e in entries)[-self.n:])


@dataclass(frozen=True)
class KeepEvery(RetentionPolicy):
    """Keep every checkpoint whose step is a multiple of ``n_steps`` (step 0 included).

    Example:
        >>> sorted(KeepEvery(10).keep([CheckpointEntry(s, 0.0) for s in (5, 10, 15, 20)]))
        [10, 20]
    """

    n_steps: int

    def __post_init__(self) -> None:
        _positive_int(self.n_steps, "n_steps")

    def keep(self, entries: Sequence[CheckpointEntry]) -> set[int]:
        return {e.step for e in entries if e.step % self.n_steps == 0}


@dataclass(frozen=True)
class KeepBest(RetentionPolicy):
    """Keep the ``n`` checkpoints with the best value of ``metric``.

    ``mode="min"`` keeps the lowest values, ``"max"`` the highest.  Checkpoints
    without the metric, or with a NaN, are not kept by this policy.  Among
    equal values the newer checkpoint wins.

    Example:
        >>> entries = [CheckpointEntry(s, 0.0, {"loss": l}) for s, l in ((1, 0.5), (2, 0.2), (3, 0.9))]
        >>> sorted(KeepBest("loss", n=2).keep(entries))
        [1, 2]
    """

    metric: str
    mode: str = "min"
    n: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise TypeError(f"metric must be a non-empty str, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {self.mode!r}")
        _positive_int(self.n, "n")

    def keep(self, entries: Sequence[CheckpointEntry]) -> set[int]:
        scored = []
        for e in entries:
            # Entries built by hand may carry anything: only a mapping's real number ranks a step.
            value = e.metrics.get(self.metric) if isinstance(e.metrics, Mapping) else None
            if isinstance(value, numbers.Real) and not isinstance(value, bool) \
                    and not math.isnan(value):
                scored.append((value if self.mode == "max" else -value, e.step))
        scored.sort(reverse=True)  # best first; on a tie, the higher step first
        return {step for _, step in scored[:self.n]}


@dataclass(frozen=True)
class KeepEveryDuration(RetentionPolicy):
    """Keep one checkpoint per period, like ``keep_checkpoint_every_n_hours``.

    Walking the checkpoints in step order, keep the first, then each one
    created at least the duration after the last one kept.  The choice is
    stable: re-applying the policy after others' checkpoints were deleted
    keeps the same ones.  Give exactly one of ``seconds`` or ``hours``.

    Example:
        >>> entries = [CheckpointEntry(s, 1800.0 * s) for s in range(5)]
        >>> sorted(KeepEveryDuration(hours=1).keep(entries))
        [0, 2, 4]
    """

    seconds: float | None = None
    hours: float | None = None

    def __post_init__(self) -> None:
        given = [v for v in (self.seconds, self.hours) if v is not None]
        if len(given) != 1:
            raise TypeError("give exactly one of seconds= or hours=")
        if isinstance(given[0], bool) or not isinstance(given[0], (int, float)):
            raise TypeError(f"duration must be a number, got {type(given[0]).__name__}")
        if not (0 < given[0] < math.inf):
            raise ValueError(f"duration must be positive and finite, got {given[0]}")

    @property
    def duration(self) -> float:
        """The period in seconds."""
        return float(self.seconds) if self.seconds is not None else float(self.hours) * 3600.0

    def keep(self, entries: Sequence[CheckpointEntry]) -> set[int]:
        kept: set[int] = set()
        last: float | None = None
        for e in sorted(entries, key=lambda e: e.step):
            if last is None or e.created - last >= self.duration:
                kept.add(e.step)
                last = e.created
        return kept


@dataclass(frozen=True)
class KeepAll(RetentionPolicy):
    """Keep every checkpoint.

    Example:
        >>> KeepAll().keep([CheckpointEntry(1, 0.0), CheckpointEntry(2, 0.0)])
        {1, 2}
    """

    def keep(self, entries: Sequence[CheckpointEntry]) -> set[int]:
        return {e.step for e in entries}


class KeepAny(RetentionPolicy):
    """Keep what any of ``policies`` keeps (also written ``a | b``).

    Example:
        >>> KeepAny(KeepLast(1), KeepEvery(2)) == KeepLast(1) | KeepEvery(2)
        True
    """

    __slots__ = ("policies",)

    def __init__(self, *policies: RetentionPolicy):
        if not policies:
            raise ValueError("KeepAny needs at least one policy")
        flat: list[RetentionPolicy] = []
        for p in policies:
            if not isinstance(p, RetentionPolicy):
                raise TypeError(f"KeepAny takes retention policies, got {type(p).__name__}; "
                                "use as_policy() to convert ints and lists")
            flat.extend(p.policies if isinstance(p, KeepAny) else (p,))
        self.policies: tuple[RetentionPolicy, ...] = tuple(flat)

    def keep(self, entries: Sequence[CheckpointEntry]) -> set[int]:
        return set().union(*(p.keep(entries) for p in self.policies))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KeepAny) and self.policies == other.policies

    def __hash__(self) -> int:
        return hash(self.policies)

    def __repr__(self) -> str:
        return f"KeepAny({', '.join(map(repr, self.policies))})"


def as_policy(keep: Any) -> RetentionPolicy:
    """Turn the manager's ``keep=`` argument into a policy.

    ``None`` keeps everything, an int ``n`` keeps the last ``n``, a list or
    tuple combines its items with :class:`KeepAny`, a policy stays itself.

    Example:
        >>> as_policy([3, KeepEvery(1000)])
        KeepAny(KeepLast(n=3), KeepEvery(n_steps=1000))
    """
    if keep is None:
        return KeepAll()
    if isinstance(keep, RetentionPolicy):
        return keep
    if isinstance(keep, int) and not isinstance(keep, bool):
        return KeepLast(keep)
    if isinstance(keep, Sequence) and not isinstance(keep, (str, bytes)):
        return KeepAny(*(as_policy(k) for k in keep))
    raise TypeError(f"keep= takes None, an int, a retention policy or a list of them, "
                    f"got {type(keep).__name__}")


def check_metrics(metrics: Any) -> dict[str, float] | None:
    """``metrics`` as ``{name: float}``; ``TypeError``/``ValueError`` for anything else (None passes)."""
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a mapping of names to numbers, got {type(metrics).__name__}")
    out = {}
    for k, v in metrics.items():
        if not isinstance(k, str):
            raise TypeError(f"metrics: names must be str, got {type(k).__name__} {k!r:.40}")
        if isinstance(v, bool) or not isinstance(v, (numbers.Real, np.ndarray)) or np.ndim(v) != 0:
            raise TypeError(f"metrics[{k!r}] must be a number, got {type(v).__name__}")
        f = float(v)
        if not math.isfinite(f):
            raise ValueError(f"metrics[{k!r}] is {f}; metrics must be finite (a NaN loss usually "
                             "means the run diverged; leave it out of metrics= to save anyway)")
        out[k] = f
    return out


def saved_metrics(step: int, metadata: Any) -> dict[str, float] | None:
    """The metrics a checkpoint carries, for retention; None (logged) when they are unusable.

    A user may have put anything under ``state.metadata["metrics"]``: a policy must not fail on
    it after the step is committed, it just cannot rank that step.
    """
    value = metadata.get("metrics") if isinstance(metadata, Mapping) else None
    if value is None:
        return None
    try:
        return check_metrics(value)
    except (TypeError, ValueError) as e:
        log.warning("checkpoint step %d: metadata['metrics'] is not usable for retention (%s); "
                    "metric-based policies ignore this step", step, e)
        return None
