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

from typing import Any

from ckptcore.collective import TensorCollectiveGroup
from ckptcore.errors import CheckpointError
from ckptcore.group import SingleProcessGroup


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


class CollectiveGroup(TensorCollectiveGroup):
    """A :class:`ckptcore.ProcessGroup` over a ``paddle.distributed`` group (the job's default
    group unless ``group`` is given; ``root`` is the job rank of the group's rank 0): the byte
    protocol and the deadlines are :class:`ckptcore.collective.TensorCollectiveGroup`'s."""

    engine = "paddle.distributed"
    thread_name = "ckptcore-paddle"

    # -- the collectives (run in the helper thread) ---------------------------------------------
    def all_lengths(self, n: int) -> list[int]:
        import numpy as np
        import paddle
        import paddle.distributed as dist

        lengths: list[Any] = []
        dist.all_gather(lengths, paddle.to_tensor(np.array([n], np.int64)), group=self._group)
        return [int(t.numpy()[0]) for t in lengths]

    def gather_arrays(self, buf: Any) -> list[Any] | None:
        import paddle
        import paddle.distributed as dist

        # gloo gathers tensors of one shape only (the caller pads to the longest).
        pieces: list[Any] = []
        dist.gather(paddle.to_tensor(buf), pieces if self.rank == 0 else None, dst=self._root,
                    group=self._group)
        return [p.numpy() for p in pieces] if self.rank == 0 else None

    def broadcast_array(self, arr: Any) -> Any:
        import paddle
        import paddle.distributed as dist

        t = paddle.to_tensor(arr)
        dist.broadcast(t, src=self._root, group=self._group)
        return t.numpy()

    def all_reduce_zero(self) -> None:
        import numpy as np
        import paddle
        import paddle.distributed as dist

        # An all_reduce of one number: the same call on every backend (dist.barrier works on gloo
        # too, measured, but takes another path on a GPU).
        dist.all_reduce(paddle.to_tensor(np.zeros(1, np.int64)), group=self._group)
