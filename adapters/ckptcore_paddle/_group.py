"""``process_group()``: a ckptcore process group over ``paddle.distributed``'s collectives.

A distributed save moves a few small byte strings and must fail on time when a rank is gone.
The bytes travel as ``uint8`` tensors through the job's own collectives (gloo on CPU, NCCL on
GPU): lengths first (``all_gather``/``broadcast`` of one ``int64``), then the bytes, padded to
the longest; never through ``all_gather_object``/``broadcast_object_list``, which pickle.  A
collective waits on a dead peer for as long as the engine lets it, so each operation runs in a
helper thread that the caller gives up on at the deadline: the result is ``GroupTimeoutError``
on every surviving rank, and the group is then broken (later calls fail at once, since the
abandoned collective may still hold the communicator).

Measured with Paddle 3.3 on CPU (gloo), 2 processes on 127.0.0.1: a collective round trip takes
about 1 ms; the job's TCP key-value store (``core.create_or_get_global_tcp_store()``), the other
candidate, answered a waiting ``get`` only after 40-50 ms, which made a distributed save slower
than a chief-only one.  A collective whose peer was SIGKILLed fails within milliseconds (gloo:
``RuntimeError ... Read error ... Connection reset by peer``), which becomes ``GroupError``; the
deadline covers a peer that hangs instead.  Tests: tests/paddle_adapter/test_group.py (2 and 4
processes).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ckptcore.errors import CheckpointError, GroupError, GroupTimeoutError
from ckptcore.group import SingleProcessGroup

log = logging.getLogger("ckptcore")

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
    return CollectiveGroup(dist.get_rank(), size)


class CollectiveGroup:
    """A :class:`ckptcore.ProcessGroup` over ``paddle.distributed``'s default group."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = int(rank), int(size)
        self._broken: str | None = None

    def gather(self, data: bytes, *, timeout: float) -> list[bytes] | None:
        got = self._run(lambda: self._all_gather(bytes(data)), timeout, "gather")
        return got if self.rank == 0 else None

    def broadcast(self, data: bytes | None, *, timeout: float) -> bytes:
        if self.rank == 0 and data is None:
            raise GroupError("broadcast: rank 0 must pass the data")
        return self._run(lambda: self._broadcast(data), timeout, "broadcast")

    def barrier(self, *, timeout: float) -> None:
        self._run(self._barrier, timeout, "barrier")

    # -- the collectives (run in the helper thread) ---------------------------------------------
    @staticmethod
    def _all_gather(data: bytes) -> list[bytes]:
        import numpy as np
        import paddle
        import paddle.distributed as dist

        lengths: list[Any] = []
        dist.all_gather(lengths, paddle.to_tensor(np.array([len(data)], np.int64)))
        sizes = [int(t.numpy()[0]) for t in lengths]
        buf = np.zeros(max(1, max(sizes)), np.uint8)
        buf[:len(data)] = np.frombuffer(data, np.uint8)
        pieces: list[Any] = []
        dist.all_gather(pieces, paddle.to_tensor(buf))
        return [p.numpy()[:n].tobytes() for p, n in zip(pieces, sizes)]

    def _broadcast(self, data: bytes | None) -> bytes:
        import numpy as np
        import paddle
        import paddle.distributed as dist

        n = paddle.to_tensor(np.array([len(data) if self.rank == 0 else 0], np.int64))
        dist.broadcast(n, src=0)
        size = int(n.numpy()[0])
        buf = np.zeros(max(1, size), np.uint8)
        if self.rank == 0:
            buf[:size] = np.frombuffer(data, np.uint8)
        t = paddle.to_tensor(buf)
        dist.broadcast(t, src=0)
        return t.numpy()[:size].tobytes()

    @staticmethod
    def _barrier() -> None:
        import numpy as np
        import paddle
        import paddle.distributed as dist

        dist.all_reduce(paddle.to_tensor(np.zeros(1, np.int64)))

    # -- deadlines ------------------------------------------------------------------------------
    def _run(self, fn: Any, timeout: float, what: str) -> Any:
        """``fn()`` in a helper thread, given up at the deadline."""
        if self._broken:
            raise GroupError(f"{what}: the group is broken ({self._broken}; rank {self.rank})")
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # handed to the caller
                box["error"] = e

        worker = threading.Thread(target=run, name="ckptcore-paddle-group", daemon=True)
        worker.start()
        worker.join(max(0.0, timeout))
        if worker.is_alive():
            raise self._broke(GroupTimeoutError(
                f"{what}: a rank did not arrive within {timeout:g} s (rank {self.rank})"))
        if "error" in box:
            e = box["error"]
            raise self._broke(GroupError(f"{what}: paddle.distributed failed (rank {self.rank}): "
                                         f"{type(e).__name__}: {e}")) from e
        return box.get("value")

    def _broke(self, err: GroupError) -> GroupError:
        self._broken = str(err)
        log.error("ckptcore: %s; the group is broken", err)
        return err
