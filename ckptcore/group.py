"""The process-group protocol a distributed save and load use, and two groups of the core's own.

Why a protocol of our own and not a framework's: the core imports no framework.  Each adapter
wraps its framework's engine (``ckptcore_paddle.process_group()`` over ``paddle.distributed``,
``ckptcore_keras.process_group(strategy)`` over ``MultiWorkerMirroredStrategy``); the core only
needs the few operations below.  What travels is small (a rank's list of shard entries, a token,
an outcome): ``bytes``, which every implementation moves as bytes (never pickled: a group's
peers are other processes, and their bytes are decoded by the caller with ``_codec``/msgpack).

Every operation takes a ``timeout`` (seconds): a peer that died or hangs must become an error on
every surviving rank, not a wait of the framework's own collective timeout (often 30 minutes).
An implementation raises :class:`ckptcore.errors.GroupTimeoutError` when it passes, and
:class:`ckptcore.errors.GroupError` when the engine itself fails.  Rank 0 is the coordinator.

:class:`SingleProcessGroup` (size 1) is what a save without ``group=`` behaves like;
:class:`ThreadGroup` runs N ranks as threads of one process, for tests of the core and for
trying the protocol without a framework.
"""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable

from .errors import GroupError, GroupTimeoutError

__all__ = ["ProcessGroup", "SingleProcessGroup", "ThreadGroup"]


@runtime_checkable
class ProcessGroup(Protocol):
    """What ckptcore needs of a group of processes that save or load one checkpoint together."""

    @property
    def rank(self) -> int:
        """This process's rank, ``0 <= rank < size``; rank 0 coordinates."""

    @property
    def size(self) -> int:
        """How many ranks take part."""

    def gather(self, data: bytes, *, timeout: float) -> list[bytes] | None:
        """Every rank's ``data``, in rank order, on rank 0; ``None`` on the others."""

    def broadcast(self, data: bytes | None, *, timeout: float) -> bytes:
        """Rank 0's ``data`` on every rank (the others pass ``None``)."""

    def barrier(self, *, timeout: float) -> None:
        """Return once every rank has called it."""


class SingleProcessGroup:
    """A group of one: every collective returns at once."""

    rank = 0
    size = 1

    def gather(self, data: bytes, *, timeout: float) -> list[bytes]:
        return [bytes(data)]

    def broadcast(self, data: bytes | None, *, timeout: float) -> bytes:
        if data is None:
            raise GroupError("broadcast: rank 0 must pass the data")
        return bytes(data)

    def barrier(self, *, timeout: float) -> None:
        return None


class _Rendezvous:
    """The state the ranks of one :class:`ThreadGroup` share: one slot per rank per round."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.round = 0
        self.slots: dict[int, bytes | None] = {}
        self.result: list[bytes | None] | None = None
        self.broken: str | None = None
        self.timed_out = False  # the group broke because a rank did not arrive in time


class ThreadGroup:
    """``size`` ranks as threads of one process: ``ThreadGroup.create(4)`` returns the four
    rank handles, one for each thread.  Collectives must be called in the same order on every
    rank (as with any process group); a rank that never arrives makes the others raise
    :class:`GroupTimeoutError` after ``timeout`` and breaks the group for good."""

    def __init__(self, rendezvous: _Rendezvous, rank: int) -> None:
        self._rv = rendezvous
        self.rank = rank
        self.size = rendezvous.size
        self._round = 0

    @classmethod
    def create(cls, size: int) -> list[ThreadGroup]:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"ThreadGroup.create: size must be a positive int, got {size!r}")
        rv = _Rendezvous(size)
        return [cls(rv, r) for r in range(size)]

    def _exchange(self, data: bytes | None, what: str, timeout: float) -> list[bytes | None]:
        rv = self._rv
        with rv.cond:
            if rv.broken:
                raise self._broken(what)
            my_round = self._round
            self._round += 1
            # Wait for the previous round's results to have been taken by everyone.
            if not rv.cond.wait_for(lambda: rv.round == my_round or rv.broken, timeout):
                self._break(f"rank {self.rank} timed out waiting to enter {what}")
                raise GroupTimeoutError(f"{what}: timed out after {timeout:g} s (rank {self.rank})")
            if rv.broken:
                raise self._broken(what)
            rv.slots[self.rank] = data
            if len(rv.slots) == rv.size:
                rv.result = [rv.slots[r] for r in range(rv.size)]
                rv.cond.notify_all()
            elif not rv.cond.wait_for(lambda: rv.result is not None and rv.round == my_round
                                      or rv.broken, timeout):
                missing = sorted(set(range(rv.size)) - set(rv.slots))
                self._break(f"ranks {missing} did not reach {what}")
                raise GroupTimeoutError(f"{what}: ranks {missing} did not arrive within "
                                        f"{timeout:g} s (rank {self.rank})")
            if rv.broken:
                raise self._broken(what)
            result = rv.result
            rv.slots.pop(self.rank, None)
            if not rv.slots:  # the last to leave opens the next round
                rv.result = None
                rv.round += 1
                rv.cond.notify_all()
            return result

    def _break(self, why: str) -> None:
        self._rv.broken = why
        self._rv.timed_out = True
        self._rv.cond.notify_all()

    def _broken(self, what: str) -> GroupError:
        kind = GroupTimeoutError if self._rv.timed_out else GroupError
        return kind(f"{what}: the group is broken ({self._rv.broken}; rank {self.rank})")

    def gather(self, data: bytes, *, timeout: float) -> list[bytes] | None:
        out = self._exchange(bytes(data), "gather", timeout)
        return [bytes(d) for d in out] if self.rank == 0 else None  # type: ignore[arg-type]

    def broadcast(self, data: bytes | None, *, timeout: float) -> bytes:
        if self.rank == 0 and data is None:
            raise GroupError("broadcast: rank 0 must pass the data")
        out = self._exchange(None if self.rank else bytes(data), "broadcast", timeout)  # type: ignore[arg-type]
        return bytes(out[0])  # type: ignore[arg-type]

    def barrier(self, *, timeout: float) -> None:
        self._exchange(b"", "barrier", timeout)
