"""A :class:`ckptcore.ProcessGroup` over a framework's tensor collectives or over its coordination
service's key-value store, with deadlines: the part of an adapter's ``process_group()`` that knows
no framework.

A distributed save moves a few byte strings and must fail on time when a rank is gone.  The bytes
travel as ``uint8`` arrays through the job's own collectives: the lengths first (an all-gather of
one ``int64`` per rank, since every rank needs the longest to pad to), then the padded bytes,
gathered to rank 0 only or broadcast from it.  Each operation runs in a helper thread that the
caller gives up on at its deadline (``GroupTimeoutError``); an error of the engine becomes
``GroupError``.  Either way the group is then broken and later calls fail at once: an abandoned
collective may still hold the communicator, and the ranks no longer agree on which collective
comes next.

An adapter subclasses :class:`TensorCollectiveGroup`, names its engine and defines four
primitives over NumPy arrays (run in the helper thread): :meth:`~TensorCollectiveGroup.all_lengths`,
:meth:`~TensorCollectiveGroup.gather_arrays`, :meth:`~TensorCollectiveGroup.broadcast_array` and
:meth:`~TensorCollectiveGroup.all_reduce_zero`.

Where the framework has a coordination service (TensorFlow's for ``MultiWorkerMirroredStrategy``,
JAX's for ``jax.distributed``), :class:`KeyValueGroup` uses it instead: its key-value store and
barriers take deadlines of their own, so a dead peer makes a call fail on time without a helper
thread, and no collective of the job's computation is involved.  An adapter subclasses it with
four primitives: :meth:`~KeyValueGroup.put`, :meth:`~KeyValueGroup.get` (blocking, with a
deadline), :meth:`~KeyValueGroup.wait_at_barrier` and :meth:`~KeyValueGroup.delete`.

This module imports no framework.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Callable

import numpy as np

from .errors import GroupError, GroupTimeoutError

__all__ = ["TensorCollectiveGroup", "KeyValueGroup"]

_log = logging.getLogger("ckptcore")


class TensorCollectiveGroup:
    """A :class:`ckptcore.ProcessGroup` over a framework's collectives on a group of ``size``
    ranks (the job's default group unless ``group`` is given; ``root`` is the job rank of the
    group's rank 0).  Subclasses set ``engine`` (named in errors, e.g. ``"torch.distributed"``)
    and ``thread_name`` (the helper threads' name prefix) and define the primitives."""

    engine = "the framework"
    thread_name = "ckptcore-collective"

    def __init__(self, rank: int, size: int, *, group: Any = None, root: int = 0) -> None:
        self.rank, self.size = int(rank), int(size)
        self._group, self._root = group, int(root)
        self._broken: str | None = None

    # -- the primitives (run in the helper thread) ----------------------------------------------
    def all_lengths(self, n: int) -> list[int]:
        """Every rank's ``n``, in rank order (an all-gather of one ``int64`` each)."""
        raise NotImplementedError

    def gather_arrays(self, buf: np.ndarray) -> list[np.ndarray] | None:
        """Every rank's ``buf`` (``uint8``, the same length on every rank) on rank 0, in rank
        order; None on the others."""
        raise NotImplementedError

    def broadcast_array(self, arr: np.ndarray) -> np.ndarray:
        """Rank 0's ``arr`` on every rank (``arr`` has the same shape and dtype on every rank)."""
        raise NotImplementedError

    def all_reduce_zero(self) -> None:
        """An all-reduce of one number: the barrier."""
        raise NotImplementedError

    # -- the ProcessGroup -----------------------------------------------------------------------
    def gather(self, data: bytes, *, timeout: float) -> list[bytes] | None:
        return self._run(lambda: self._gather(bytes(data)), timeout, "gather")

    def broadcast(self, data: bytes | None, *, timeout: float) -> bytes:
        if self.rank == 0 and data is None:
            raise GroupError("broadcast: rank 0 must pass the data")
        return self._run(lambda: self._broadcast(data), timeout, "broadcast")

    def barrier(self, *, timeout: float) -> None:
        self._run(self.all_reduce_zero, timeout, "barrier")

    def _gather(self, data: bytes) -> list[bytes] | None:
        sizes = self.all_lengths(len(data))
        # Collectives move tensors of one shape; at least one byte keeps zero-size tensors out.
        buf = np.zeros(max(1, max(sizes)), np.uint8)
        buf[:len(data)] = np.frombuffer(data, np.uint8)
        # Only rank 0 receives the bytes (an all_gather would send every rank's to every rank).
        pieces = self.gather_arrays(buf)
        if self.rank != 0:
            return None
        return [p[:n].tobytes() for p, n in zip(pieces, sizes)]

    def _broadcast(self, data: bytes | None) -> bytes:
        n = self.broadcast_array(np.array([len(data) if self.rank == 0 else 0], np.int64))
        size = int(n[0])
        buf = np.zeros(max(1, size), np.uint8)
        if self.rank == 0:
            buf[:size] = np.frombuffer(data, np.uint8)
        return self.broadcast_array(buf)[:size].tobytes()

    # -- deadlines ------------------------------------------------------------------------------
    def _run(self, fn: Callable[[], Any], timeout: float, what: str) -> Any:
        """``fn()`` in a helper thread, given up at the deadline."""
        if self._broken:
            raise GroupError(f"{what}: the group is broken ({self._broken}; rank {self.rank})")
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # handed to the caller
                box["error"] = e

        worker = threading.Thread(target=run, name=f"{self.thread_name}-{what}", daemon=True)
        worker.start()
        worker.join(max(0.0, timeout))
        if worker.is_alive():
            raise self._broke(GroupTimeoutError(
                f"{what}: a rank did not arrive within {timeout:g} s (rank {self.rank} of {self.size})"))
        if "error" in box:
            e = box["error"]
            raise self._broke(GroupError(f"{what}: {self.engine} failed (rank {self.rank} of "
                                         f"{self.size}): {type(e).__name__}: {e}")) from e
        return box.get("value")

    def _broke(self, err: GroupError) -> GroupError:
        self._broken = str(err)
        _log.error("ckptcore: %s; the group is broken, later calls fail at once", err)
        return err


class KeyValueGroup:
    """A :class:`ckptcore.ProcessGroup` over a coordination service's key-value store and
    barriers.  Subclasses set ``engine`` (named in errors) and define the primitives; ``number``
    tells the groups of one process apart (each adapter counts the groups it makes).

    Keys are ``ckptcore/<number>/<operation number>/...``: every rank runs the same operations in
    the same order, so the numbers agree without an exchange.  Values travel in pieces of at most
    ``piece`` bytes (the services' messages are bounded gRPC messages), the count last, so a
    reader that sees the count finds every piece there.  Rank 0 deletes an operation's keys once
    every rank is past it, so the service holds only what is in flight."""

    engine = "the coordination service"
    piece = 1 << 20

    def __init__(self, rank: int, size: int, number: int) -> None:
        self.rank, self.size = int(rank), int(size)
        self._prefix = f"ckptcore/{int(number)}"
        self._ops = itertools.count()
        self._broken: str | None = None

    # -- the primitives -------------------------------------------------------------------------
    def put(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def get(self, key: str, timeout_ms: int) -> bytes:
        """The value of ``key``, waiting for it at most ``timeout_ms``."""
        raise NotImplementedError

    def wait_at_barrier(self, barrier_id: str, timeout_ms: int) -> None:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Delete ``key`` and every key under it (``key/...``)."""
        raise NotImplementedError

    def is_timeout(self, e: Exception) -> bool:
        """Whether ``e`` (raised by a primitive) is a deadline that passed."""
        text = str(e)
        return "DEADLINE_EXCEEDED" in text or "Deadline" in text or "timed out" in text.lower()

    # -- the ProcessGroup -----------------------------------------------------------------------
    def gather(self, data: bytes, *, timeout: float) -> list[bytes] | None:
        op = self._begin("gather")
        deadline = time.monotonic() + timeout
        self._put(f"{op}/{self.rank}", bytes(data), "gather")
        if self.rank != 0:
            return None
        out = [self._get(f"{op}/{r}", deadline, "gather", r) for r in range(self.size)]
        self._delete(*(f"{op}/{r}" for r in range(self.size)))
        return out

    def broadcast(self, data: bytes | None, *, timeout: float) -> bytes:
        op = self._begin("broadcast")
        deadline = time.monotonic() + timeout
        if self.rank == 0:
            if data is None:
                raise GroupError("broadcast: rank 0 must pass the data")
            self._put(f"{op}/0", bytes(data), "broadcast")
            out = bytes(data)
        else:
            out = self._get(f"{op}/0", deadline, "broadcast", 0)
        # Everyone has read it once everyone is past this barrier: then rank 0 may delete it.
        self._barrier(f"{op}/read", deadline, "broadcast")
        if self.rank == 0:
            self._delete(f"{op}/0")
        return out

    def barrier(self, *, timeout: float) -> None:
        op = self._begin("barrier")
        self._barrier(op, time.monotonic() + timeout, "barrier")

    # -- the service ----------------------------------------------------------------------------
    def _begin(self, what: str) -> str:
        if self._broken:
            raise GroupError(f"{what}: the group is broken ({self._broken}; rank {self.rank})")
        return f"{self._prefix}/{next(self._ops)}"

    def _fail(self, e: Exception, what: str, peer: int | None = None) -> GroupError:
        who = f"rank {peer}" if peer is not None else "a rank"
        text = str(e).strip()
        text = text.splitlines()[0] if text else type(e).__name__
        if self.is_timeout(e):
            err: GroupError = GroupTimeoutError(f"{what}: {who} did not arrive in time (rank "
                                                f"{self.rank}): {text}")
        else:
            err = GroupError(f"{what}: {self.engine} failed (rank {self.rank}): "
                             f"{type(e).__name__}: {text}")
        self._broken = str(err)
        _log.error("ckptcore: %s; the group is broken", err)
        return err

    def _put(self, key: str, data: bytes, what: str) -> None:
        pieces = [data[i:i + self.piece] for i in range(0, len(data), self.piece)] or [b""]
        try:
            for i, piece in enumerate(pieces):
                self.put(f"{key}/{i}", piece)
            self.put(f"{key}/n", str(len(pieces)).encode())  # the count last
        except Exception as e:
            raise self._fail(e, what) from e

    def _get(self, key: str, deadline: float, what: str, peer: int) -> bytes:
        try:
            n = int(self.get(f"{key}/n", _ms(deadline)).decode())
            return b"".join(self.get(f"{key}/{i}", _ms(deadline)) for i in range(n))
        except Exception as e:
            raise self._fail(e, what, peer) from e

    def _barrier(self, barrier_id: str, deadline: float, what: str) -> None:
        try:
            self.wait_at_barrier(barrier_id, _ms(deadline))
        except Exception as e:
            raise self._fail(e, what) from e

    def _delete(self, *keys: str) -> None:
        for key in keys:
            try:
                self.delete(key)
            except Exception as e:  # only memory of the service is at stake
                _log.warning("ckptcore: could not delete coordination key %s: %s", key, e)


def _ms(deadline: float) -> int:
    """Milliseconds left (at least 1: 0 means "wait forever" to some services)."""
    return max(1, int((deadline - time.monotonic()) * 1000))
