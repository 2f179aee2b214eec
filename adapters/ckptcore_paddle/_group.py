"""``process_group()``: a ckptcore process group over ``paddle.distributed``'s collectives.

A distributed save moves a few byte strings and must fail on time when a rank is gone.  The
bytes travel as ``uint8`` tensors through the job's own collectives (gloo on CPU, NCCL on GPU):
the lengths first (``all_gather`` of one ``int64`` per rank, since every rank needs the longest
to pad to), then the padded bytes, ``gather``-ed to rank 0 only or ``broadcast`` from it; never
through ``all_gather_object``/``broadcast_object_list``, which pickle.  Each operation runs in a
helper thread that the caller gives up on at its deadline (``GroupTimeoutError``); an error of
the engine becomes ``GroupError``.  Either way the group is then broken and later calls fail at
once: an abandoned collective may still hold the communicator, and the ranks no longer agree on
which collective comes next.

What the engine does, measured with Paddle 3.3 on CPU (gloo), 2 and 4 processes on 127.0.0.1:

- A call takes 1-8 ms (medians of 30 gathers, broadcasts or barriers of 100 bytes, 2 and 4
  ranks on a busy 2-core machine; 11-24 ms to gather 1 MB from each).  The job's TCP key-value
  store (``core.create_or_get_global_tcp_store()``), the other candidate, answered a waiting
  ``get`` only after 40-50 ms, which made a distributed save slower than a chief-only one.
- A peer SIGKILLed while the others are in a collective: every survivor's collective raises
  ``RuntimeError: [.../gloo/transport/tcp/pair.cc:584] TIMEOUT self_rank = i pair_rank = j``
  (the word is gloo's; the cause is the closed connection) 10-30 ms after the kill on most
  ranks, up to 0.55 s on some of 4 (5 runs), never waiting for gloo's 30 s.  That is a
  ``GroupError`` here, well before any deadline.
- A peer that hangs (SIGSTOP) without closing its sockets: gloo raises the same ``TIMEOUT``
  after 30 s, gloo's own default, which Paddle 3.3 does not let a gloo group change
  (``PADDLE_PG_TIMEOUT``, 30 minutes by default, reaches NCCL groups only).  A deadline under
  30 s is therefore a ``GroupTimeoutError`` at the deadline; a longer one sees gloo's error at
  30 s; on NCCL only the deadline stands between a rank and a 30-minute wait.
- A process whose collective thread was abandoned still exits normally (``sys.exit``) at once;
  the thread is a daemon and Paddle's shutdown does not wait for it.

Tests: tests/paddle_adapter/test_group.py (2 and 4 processes, a killed and a hung peer).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ckptcore.errors import CheckpointError, GroupError, GroupTimeoutError
from ckptcore.group import SingleProcessGroup

log = logging.getLogger("ckptcore")


def process_group(group: Any = None) -> Any:
    """The ranks of the current ``paddle.distributed`` job, or of its sub-group ``group`` (from
    ``paddle.distributed.new_group``), as a :class:`ckptcore.ProcessGroup`: rank =
    ``get_rank()``, size = ``get_world_size()`` (the sub-group's own rank and size); a group of
    one outside a job.  This process must belong to ``group``."""
    import paddle.distributed as dist

    if group is None:
        size = dist.get_world_size()
        if size <= 1:
            return SingleProcessGroup()
        if not dist.is_initialized():
            raise CheckpointError(f"process_group: the job has {size} ranks but paddle.distributed "
                                  "is not initialised; call paddle.distributed.init_parallel_env() first")
        return CollectiveGroup(dist.get_rank(), size)
    if not dist.is_initialized():
        raise CheckpointError("process_group: paddle.distributed is not initialised; call "
                              "paddle.distributed.init_parallel_env() first")
    ranks = list(getattr(group, "ranks", None) or [])
    if getattr(group, "rank", -1) < 0 or not ranks:
        raise CheckpointError(f"process_group: this process (rank {dist.get_rank()} of the job) is "
                              f"not a member of the paddle group of ranks {ranks}")
    return CollectiveGroup(group.rank, len(ranks), group=group, root=ranks[0])


class CollectiveGroup:
    """A :class:`ckptcore.ProcessGroup` over a ``paddle.distributed`` group (the job's default
    group unless ``group`` is given; ``root`` is the job rank of the group's rank 0)."""

    def __init__(self, rank: int, size: int, *, group: Any = None, root: int = 0) -> None:
        self.rank, self.size = int(rank), int(size)
        self._group, self._root = group, int(root)
        self._broken: str | None = None

    def gather(self, data: bytes, *, timeout: float) -> list[bytes] | None:
        return self._run(lambda: self._gather(bytes(data)), timeout, "gather")

    def broadcast(self, data: bytes | None, *, timeout: float) -> bytes:
        if self.rank == 0 and data is None:
            raise GroupError("broadcast: rank 0 must pass the data")
        return self._run(lambda: self._broadcast(data), timeout, "broadcast")

    def barrier(self, *, timeout: float) -> None:
        self._run(self._barrier, timeout, "barrier")

    # -- the collectives (run in the helper thread) ---------------------------------------------
    def _gather(self, data: bytes) -> list[bytes] | None:
        import numpy as np
        import paddle
        import paddle.distributed as dist

        lengths: list[Any] = []
        dist.all_gather(lengths, paddle.to_tensor(np.array([len(data)], np.int64)), group=self._group)
        sizes = [int(t.numpy()[0]) for t in lengths]
        # gloo gathers tensors of one shape only; at least one byte keeps zero-size tensors out.
        buf = np.zeros(max(1, max(sizes)), np.uint8)
        buf[:len(data)] = np.frombuffer(data, np.uint8)
        pieces: list[Any] = []
        # Only rank 0 receives the bytes (an all_gather would send every rank's to every rank).
        dist.gather(paddle.to_tensor(buf), pieces if self.rank == 0 else None, dst=self._root,
                    group=self._group)
        if self.rank != 0:
            return None
        return [p.numpy()[:n].tobytes() for p, n in zip(pieces, sizes)]

    def _broadcast(self, data: bytes | None) -> bytes:
        import numpy as np
        import paddle
        import paddle.distributed as dist

        n = paddle.to_tensor(np.array([len(data) if self.rank == 0 else 0], np.int64))
        dist.broadcast(n, src=self._root, group=self._group)
        size = int(n.numpy()[0])
        buf = np.zeros(max(1, size), np.uint8)
        if self.rank == 0:
            buf[:size] = np.frombuffer(data, np.uint8)
        t = paddle.to_tensor(buf)
        dist.broadcast(t, src=self._root, group=self._group)
        return t.numpy()[:size].tobytes()

    def _barrier(self) -> None:
        import numpy as np
        import paddle
        import paddle.distributed as dist

        # An all_reduce of one number: the same call on every backend (dist.barrier works on gloo
        # too, measured, but takes another path on a GPU).
        dist.all_reduce(paddle.to_tensor(np.zeros(1, np.int64)), group=self._group)

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

        worker = threading.Thread(target=run, name=f"ckptcore-paddle-{what}", daemon=True)
        worker.start()
        worker.join(max(0.0, timeout))
        if worker.is_alive():
            raise self._broke(GroupTimeoutError(
                f"{what}: a rank did not arrive within {timeout:g} s (rank {self.rank} of {self.size})"))
        if "error" in box:
            e = box["error"]
            raise self._broke(GroupError(f"{what}: paddle.distributed failed (rank {self.rank} of "
                                         f"{self.size}): {type(e).__name__}: {e}")) from e
        return box.get("value")

    def _broke(self, err: GroupError) -> GroupError:
        self._broken = str(err)
        log.error("ckptcore: %s; the group is broken, later calls fail at once", err)
        return err
