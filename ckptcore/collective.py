"""A :class:`ckptcore.ProcessGroup` over a framework's tensor collectives, with deadlines: the part
of an adapter's ``process_group()`` that knows no framework.

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
:meth:`~TensorCollectiveGroup.all_reduce_zero`.  This module imports no framework.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import numpy as np

from .errors import GroupError, GroupTimeoutError

__all__ = ["TensorCollectiveGroup"]

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
