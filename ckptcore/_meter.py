"""The figures of one save or restore, counted by the layers that do the work.

A :class:`Meter` is made by whoever reports the operation (``api.save_state``/``load_state``,
the manager's save and restore, a backup's replication) and made current for the context that
does the work (:func:`measuring`).  The storage layer counts its requests into it, the shard
writer its bytes and shards, the writer lock its takeovers: none of them needs to know who
asked.  A call nested in another (``save_state`` under ``CheckpointManager.save``) finds the
outer meter current and counts into it, so one operation is one event.

Context variables, not globals: a backup replicating in its thread while the training thread
saves counts into its own meter.  The pools that write shards run their work in a copy of the
caller's context (``_io``), so their requests are the save's too.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from typing import Iterator

_current: contextvars.ContextVar[Meter | None] = contextvars.ContextVar("ckptcore_meter",
                                                                          default=None)


class Meter:
    """What one operation did so far; thread-safe (the shard writers count in parallel)."""

    def __init__(self, *, background: bool = False) -> None:
        self.started = time.perf_counter()
        self.background = background  # an async save: the caller went on before the commit
        self.blocked: float | None = None  # seconds the caller waited, once it stopped waiting
        self.requests = 0
        self.bytes_written = 0
        self.shards = 0
        self.takeovers: list[str] = []
        self.loaded = (0, 0)  # a load's tensor bytes and shards
        self.guard = threading.Lock()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def add(self, *, requests: int = 0, written: int = 0, shards: int = 0) -> None:
        with self.guard:
            self.requests += requests
            self.bytes_written += written
            self.shards += shards


def current() -> Meter | None:
    """The meter of the operation this context works for (None: nobody measures)."""
    return _current.get()


@contextlib.contextmanager
def measuring(meter: Meter) -> Iterator[Meter]:
    """Count what runs in this context (and the pools it hands work to) into ``meter``."""
    token = _current.set(meter)
    try:
        yield meter
    finally:
        _current.reset(token)


def request(n: int = 1) -> None:
    """The storage layer issued ``n`` requests (reads, writes, listings, checks, deletions)."""
    meter = _current.get()
    if meter is not None:
        meter.add(requests=n)


def wrote(shards: int, nbytes: int) -> None:
    """The shard writer wrote ``shards`` shards of ``nbytes`` bytes in all."""
    meter = _current.get()
    if meter is not None:
        meter.add(written=nbytes, shards=shards)


def took_over(what: str) -> None:
    """A writer lock was taken over from a holder that is gone (``what``: whose, and why)."""
    meter = _current.get()
    if meter is not None:
        with meter.guard:
            meter.takeovers.append(what)


def figures(meter: Meter) -> dict:
    """The fields of a ``ckptcore.events.Event`` the meter knows, as keywords: the seconds
    (blocked: all of them, but for an async save what ``save()`` waited), requests, bytes and
    shards written, takeovers, whether it ran in the background."""
    total = meter.elapsed()
    with meter.guard:
        return {"seconds_total": total,
                "seconds_blocked": total if meter.blocked is None else min(meter.blocked, total),
                "requests": meter.requests, "bytes_written": meter.bytes_written,
                "shards": meter.shards, "takeovers": tuple(meter.takeovers),
                "asynchronous": meter.background}


def loading(nbytes: int, shards: int) -> None:
    """A load reads ``nbytes`` bytes of tensors from a checkpoint of ``shards`` shards (the
    last one counts: a restore that falls back loads several)."""
    meter = _current.get()
    if meter is not None:
        with meter.guard:
            meter.loaded = (nbytes, shards)
