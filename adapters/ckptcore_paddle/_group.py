"""``process_group()``: a ckptcore process group over ``paddle.distributed``'s own store.

Why the store and not collectives: a distributed save moves a few small byte strings and must
fail on time when a rank is gone.  ``paddle.distributed.init_parallel_env()`` starts a TCP
key-value store on rank 0 (``core.create_or_get_global_tcp_store()``) that every rank of the job
reaches; it moves bytes as they are (its object collectives, ``all_gather_object`` and
``broadcast_object_list``, would pickle them).  Its ``get`` waits for a key for as long as the
store's own timeout (15 minutes by default), so every wait here runs in a helper thread that
the caller gives up on at the deadline: the result is ``GroupTimeoutError`` on every surviving
rank, and the group is then broken (later calls fail at once).  Measured with Paddle 3.3 on CPU
(gloo), 2 and 4 processes on 127.0.0.1 (tests/paddle_adapter/test_group.py).

Keys are ``ckptcore/<group>/<operation number>/...``: every rank runs the same operations in the
same order, so the numbers agree without an exchange.  The store cannot delete keys: each
operation leaves its (small) values on rank 0's store for the life of the job.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

from ckptcore.errors import CheckpointError, GroupError, GroupTimeoutError
from ckptcore.group import SingleProcessGroup

log = logging.getLogger("ckptcore")

_groups = itertools.count()


def process_group() -> Any:
    """The ranks of the current ``paddle.distributed`` job as a :class:`ckptcore.ProcessGroup`
    (rank = ``get_rank()``, size = ``get_world_size()``); a group of one outside a job."""
    import paddle.distributed as dist

    size = dist.get_world_size()
    if size <= 1:
        return SingleProcessGroup()
    if not dist.is_initialized():
        raise CheckpointError("process_group: paddle.distributed is not initialised; call "
                              "paddle.distributed.init_parallel_env() first")
    from paddle.distributed import collective

    store = collective._default_store
    if store is None:
        from paddle.base import core

        store = core.create_or_get_global_tcp_store()
    return StoreGroup(store, dist.get_rank(), size, next(_groups))


class StoreGroup:
    """A :class:`ckptcore.ProcessGroup` over a Paddle ``Store`` (``set``/``get``/``add``)."""

    def __init__(self, store: Any, rank: int, size: int, number: int) -> None:
        self._store = store
        self.rank, self.size = int(rank), int(size)
        self._prefix = f"ckptcore/{number}"
        self._ops = itertools.count()
        self._broken: str | None = None

    def gather(self, data: bytes, *, timeout: float) -> list[bytes] | None:
        op = self._begin("gather")
        deadline = time.monotonic() + timeout
        self._call(lambda: self._store.set(f"{op}/{self.rank}", bytes(data)), deadline, "gather")
        if self.rank != 0:
            return None
        return [self._get(f"{op}/{r}", deadline, "gather", r) for r in range(self.size)]

    def broadcast(self, data: bytes | None, *, timeout: float) -> bytes:
        op = self._begin("broadcast")
        deadline = time.monotonic() + timeout
        if self.rank == 0:
            if data is None:
                raise GroupError("broadcast: rank 0 must pass the data")
            self._call(lambda: self._store.set(f"{op}/0", bytes(data)), deadline, "broadcast")
            return bytes(data)
        return self._get(f"{op}/0", deadline, "broadcast", 0)

    def barrier(self, *, timeout: float) -> None:
        op = self._begin("barrier")
        deadline = time.monotonic() + timeout
        self._call(lambda: self._store.add(f"{op}/count", 1), deadline, "barrier")
        if self.rank == 0:
            # Rank 0 waits for everyone's arrival, then releases them with one key.
            while self._call(lambda: self._store.add(f"{op}/count", 0), deadline,
                             "barrier") < self.size:
                if time.monotonic() > deadline:
                    raise self._broke(GroupTimeoutError(
                        f"barrier: not every rank arrived within the deadline (rank 0)"))
                time.sleep(0.005)
            self._call(lambda: self._store.set(f"{op}/go", b"1"), deadline, "barrier")
        else:
            self._get(f"{op}/go", deadline, "barrier", 0)

    # -- plumbing -------------------------------------------------------------------------------
    def _begin(self, what: str) -> str:
        if self._broken:
            raise GroupError(f"{what}: the group is broken ({self._broken}; rank {self.rank})")
        return f"{self._prefix}/{next(self._ops)}"

    def _broke(self, err: GroupError) -> GroupError:
        self._broken = str(err)
        log.error("ckptcore: %s; the group is broken", err)
        return err

    def _get(self, key: str, deadline: float, what: str, peer: int) -> bytes:
        try:
            return bytes(self._call(lambda: self._store.get(key), deadline, what))
        except GroupTimeoutError as e:
            raise self._broke(GroupTimeoutError(
                f"{what}: rank {peer} did not arrive in time (rank {self.rank})")) from e

    def _call(self, fn: Any, deadline: float, what: str) -> Any:
        """``fn()`` in a helper thread, given up at the deadline (the store's own waits last
        as long as its timeout, 15 minutes by default)."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # handed to the caller
                box["error"] = e

        worker = threading.Thread(target=run, name="ckptcore-paddle-store", daemon=True)
        worker.start()
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            raise self._broke(GroupTimeoutError(f"{what}: timed out (rank {self.rank})"))
        if "error" in box:
            e = box["error"]
            raise self._broke(GroupError(f"{what}: paddle's store failed (rank {self.rank}): "
                                         f"{type(e).__name__}: {e}")) from e
        return box.get("value")
