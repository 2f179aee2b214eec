"""Measured saves: one structured event per save, restore and backup replication.

Every :func:`ckptcore.save_state`, :func:`ckptcore.load_state`, ``CheckpointManager.save``
(sync or async), ``CheckpointManager.restore`` and every replication of a step to a backup tier
ends with one event: a :class:`SaveEvent`, :class:`RestoreEvent` or :class:`BackupEvent`.  Each
is logged once, at INFO, as one line on the ``ckptcore.events`` logger (the record's
``ckptcore_event`` attribute holds :meth:`Event.as_dict`), and handed to every callback
registered with :func:`on_event`.  A call nested in another (``save_state`` under a manager's
save) is part of the outer one: one operation, one event.

Callbacks run synchronously, once the operation is over: in the caller's thread for a
synchronous save or a restore, in the save thread when an async save commits, in the backup
thread when a replication ends.  A callback that raises is logged (ERROR, with its traceback)
and never breaks the operation; a slow one delays the thread it runs in.

Example:
    >>> import ckptcore, numpy as np
    >>> seen = []
    >>> with ckptcore.on_event(seen.append):
    ...     _ = ckptcore.save_state("memory://doc/events-1",
    ...                             ckptcore.TrainingState(model={"w": np.zeros(4)}))
    >>> seen[0].kind, seen[0].bytes, seen[0].error
    ('save', 32, None)
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Event", "SaveEvent", "RestoreEvent", "BackupEvent", "Lag", "Fallback", "on_event",
           "Subscription"]

log = logging.getLogger("ckptcore.events")


@dataclass(frozen=True)
class Lag:
    """How far one backup tier is behind the local tier: ``steps`` committed locally that it
    has no replica of yet (queued, being copied, or given up on for now), and ``seconds`` since
    the oldest of them was handed to it (0 when it has them all)."""

    url: str
    steps: int
    seconds: float


@dataclass(frozen=True)
class Fallback:
    """A restore candidate that was passed over: its step and URL, ``reason`` ("invalid": it
    did not decode or verify; "unreachable": a backup out of reach), and the error's type
    name and message."""

    step: int
    url: str
    reason: str
    error: str
    message: str = ""


@dataclass(frozen=True, kw_only=True)
class Event:
    """The figures of one operation.

    Attributes:
        kind: "save", "restore" or "backup".
        url: The checkpoint's URL (a step folder; for a backup, its replica).
        root: The manager's root (for a backup, the backup root); None for ``save_state``
            and ``load_state``.
        step: The checkpoint's step (None when a failed operation never learnt it).
        tier: "local", or the URL of the backup tier the step was restored from or copied to.
        seconds_blocked: What the caller waited: a synchronous save or a restore, all of it;
            an async save, until ``save()`` returned; a backup, 0 (nobody waits for it).
        seconds_total: From the call until the commit (or the restore's end).
        bytes: The tensors' bytes (logical: the checkpoint's size in memory).
        bytes_written: Bytes of shards this process wrote (a backup: blobs uploaded).
        bytes_deduplicated: A backup's bytes already in its content-addressed blobs, not sent.
        shards: Shard files written (a save; a backup: of the replica) or listed (a restore).
        requests: Storage operations this process issued (each read, write, listing,
            existence check or deletion of a file; a read of several ranges counts each).
        replication_lag: A :class:`Lag` per backup tier, as the operation ended.
        fallbacks: The :class:`Fallback` of every candidate a restore passed over.
        takeovers: Writer locks taken over from holders that were gone (whose, and why).
        asynchronous: An async save (written in the background after ``save()`` returned).
        error: The error's type name when the operation failed (None when it succeeded).
    """

    kind: str = field(default="", init=False)
    url: str
    root: str | None = None
    step: int | None = None
    tier: str = "local"
    seconds_blocked: float = 0.0
    seconds_total: float = 0.0
    bytes: int = 0
    bytes_written: int = 0
    bytes_deduplicated: int = 0
    shards: int = 0
    requests: int = 0
    replication_lag: tuple[Lag, ...] = ()
    fallbacks: tuple[Fallback, ...] = ()
    takeovers: tuple[str, ...] = ()
    asynchronous: bool = False
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The event as plain values (lists and dicts): what a log record carries."""
        return dataclasses.asdict(self, dict_factory=dict)

    def metrics(self, prefix: str = "ckpt_") -> dict[str, float]:
        """The figures a training loop logs beside its loss, as floats: ``ckpt_<kind>_seconds``
        (total), ``ckpt_blocked_seconds``, ``ckpt_bytes``, ``ckpt_bytes_written``,
        ``ckpt_requests``, and with backup tiers ``ckpt_backup_lag_steps`` and
        ``ckpt_backup_lag_seconds`` (the furthest behind).  What the framework callbacks add to
        their logs."""
        out = {f"{prefix}{self.kind}_seconds": float(self.seconds_total),
               f"{prefix}blocked_seconds": float(self.seconds_blocked),
               f"{prefix}bytes": float(self.bytes),
               f"{prefix}bytes_written": float(self.bytes_written),
               f"{prefix}requests": float(self.requests)}
        if self.replication_lag:
            out[f"{prefix}backup_lag_steps"] = float(max(lag.steps for lag in self.replication_lag))
            out[f"{prefix}backup_lag_seconds"] = float(max(lag.seconds
                                                          for lag in self.replication_lag))
        return out

    def summary(self) -> str:
        """One line: what the ``ckptcore.events`` log record says."""
        head = f"{self.kind} step {self.step} {self.url}"
        if self.tier != "local":
            head += f" ({'from' if self.kind == 'restore' else 'to'} {self.tier})"
        parts = [f"blocked {self.seconds_blocked:.3f} s", f"total {self.seconds_total:.3f} s",
                 f"{_size(self.bytes)} ({_size(self.bytes_written)} written"
                 + (f", {_size(self.bytes_deduplicated)} deduplicated"
                    if self.kind == "backup" else "") + f") in {self.shards} shard(s)",
                 f"{self.requests} request(s)"]
        if self.asynchronous:
            parts.append("async")
        parts += [f"{lag.url} {lag.steps} step(s) / {lag.seconds:.1f} s behind"
                  for lag in self.replication_lag]
        if self.fallbacks:
            parts.append("fell back over " + ", ".join(f"step {f.step} ({f.reason}: {f.error})"
                                                       for f in self.fallbacks))
        if self.takeovers:
            parts.append(f"{len(self.takeovers)} lock takeover(s)")
        if self.error:
            parts.append(f"failed: {self.error}")
        return f"{head}: " + ", ".join(parts)


@dataclass(frozen=True, kw_only=True)
class SaveEvent(Event):
    """A save: ``save_state`` or ``CheckpointManager.save`` (see :class:`Event`)."""

    kind: str = field(default="save", init=False)


@dataclass(frozen=True, kw_only=True)
class RestoreEvent(Event):
    """A restore: ``load_state`` or ``CheckpointManager.restore`` (see :class:`Event`)."""

    kind: str = field(default="restore", init=False)


@dataclass(frozen=True, kw_only=True)
class BackupEvent(Event):
    """A step's replication to a backup tier, after its last try (see :class:`Event`)."""

    kind: str = field(default="backup", init=False)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"  # unreachable


_hooks: list[Subscription] = []
_guard = threading.Lock()


class Subscription:
    """A callback registered by :func:`on_event`.  ``remove()`` (or calling the subscription,
    or leaving its ``with`` block) unregisters it; removing twice does nothing."""

    def __init__(self, callback: Callable[[Event], Any]) -> None:
        self.callback = callback

    def remove(self) -> None:
        with _guard:
            if self in _hooks:
                _hooks.remove(self)

    __call__ = remove

    @property
    def active(self) -> bool:
        with _guard:
            return self in _hooks

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"Subscription({self.callback!r}, active={self.active})"


def on_event(callback: Callable[[Event], Any]) -> Subscription:
    """Call ``callback(event)`` after every save, restore and backup replication (module
    docstring); returns the :class:`Subscription` that unregisters it.

    Example:
        >>> sub = ckptcore.on_event(lambda e: print(e.kind, e.step))  # doctest: +SKIP
        >>> sub.remove()                                               # doctest: +SKIP
    """
    if not callable(callback):
        raise TypeError(f"on_event(callback): callback must be callable, got "
                        f"{type(callback).__name__}")
    sub = Subscription(callback)
    with _guard:
        _hooks.append(sub)
    return sub


def emit(event: Event) -> None:
    """Log ``event`` and hand it to every callback (for ckptcore's own modules; a callback's
    error is logged, never raised)."""
    if log.isEnabledFor(logging.INFO):  # (building the record costs as much as a small save)
        log.info("%s", event.summary(), extra={"ckptcore_event": event.as_dict()})
    with _guard:
        hooks = list(_hooks)
    for sub in hooks:
        try:
            sub.callback(event)
        except Exception:  # noqa: BLE001 - a monitoring hook never breaks a save
            log.error("the ckptcore event callback %r raised on the %s event of step %s; the "
                      "%s itself is unaffected", sub.callback, event.kind, event.step,
                      event.kind, exc_info=True)


def registered() -> int:
    """How many callbacks are registered (the tests check none is left behind)."""
    with _guard:
        return len(_hooks)
