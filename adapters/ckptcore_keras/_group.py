"""``process_group(strategy)``: a ckptcore process group over TensorFlow's coordination service.

Why the coordination service and not the strategy's collectives: a distributed save moves a few
small byte strings (shard entries, a token, an outcome) and must fail on time when a worker is
gone.  ``MultiWorkerMirroredStrategy`` starts TensorFlow's coordination service on the cluster
(task 0 hosts it); its key-value store and barriers take a deadline of their own, where a
collective op of the strategy runs inside a graph and waits on a dead peer for as long as the
collective's timeout (unset by default: forever).

Facts measured with TensorFlow 2.21 on CPU, 2 workers on 127.0.0.1 (tests/keras_adapter/test_group.py):
``get_config_key_value(key, timeout_in_ms)`` and ``wait_at_barrier(id, timeout_in_ms)`` raise
``tf.errors.DeadlineExceededError`` once the deadline passes when a peer never arrives (it was
SIGKILLed), naming the missing task; values are text (UTF-8), so bytes travel base64-encoded, in
pieces of at most ``_PIECE`` bytes (the service's messages are gRPC messages, bounded in size).

Keys are ``ckptcore/<group>/<operation number>/...``: every rank runs the same operations in the
same order, so the numbers agree without any exchange; a group's number comes from the order in
which groups are made in the process (the same on every worker running the same program).
Rank 0 deletes the keys of an operation once it is over, so the service holds only what is in
flight.
"""

from __future__ import annotations

import base64
import itertools
import logging
import time
from typing import Any

from ckptcore.errors import CheckpointError, GroupError, GroupTimeoutError
from ckptcore.group import SingleProcessGroup

log = logging.getLogger("ckptcore")

_PIECE = 1 << 20  # bytes per key-value entry (base64 makes 1.33 MiB of text)
_groups = itertools.count()


def process_group(strategy: Any = None) -> Any:
    """The workers of ``strategy`` (a ``tf.distribute.MultiWorkerMirroredStrategy``; default: the
    current strategy) as a :class:`ckptcore.ProcessGroup`: rank = the worker's index in the
    cluster (chief first), size = the number of workers.  A single-worker strategy (or none)
    gives a group of one.

    On Keras' JAX and PyTorch backends (no ``tf.distribute``): the group of ``ckptcore_jax`` or
    ``ckptcore_torch`` (``torch.distributed`` ranks); a ``strategy`` there is an
    ``UnsupportedBackendError``."""
    from ._backend import UnsupportedBackendError, backend

    name = backend()
    if name != "tensorflow":
        if strategy is not None:
            raise UnsupportedBackendError(
                f"process_group(strategy) takes a tf.distribute strategy, which Keras on the "
                f"{name!r} backend does not use; call process_group() for this job's processes")
        import importlib

        return importlib.import_module("ckptcore_jax" if name == "jax" else "ckptcore_torch") \
            .process_group()
    import tensorflow as tf

    strategy = strategy if strategy is not None else tf.distribute.get_strategy()
    resolver = getattr(strategy, "cluster_resolver", None)
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    tasks = [(kind, i) for kind in ("chief", "worker") for i in range(len(spec.get(kind, ())))]
    if len(tasks) <= 1:
        return SingleProcessGroup()
    me = (resolver.task_type, int(resolver.task_id))
    if me not in tasks:
        raise CheckpointError(f"process_group: this task {me[0]}:{me[1]} is not a chief or worker "
                              f"of the cluster {sorted(spec)}; only they save checkpoints")
    from tensorflow.python.eager import context

    ctx = context.context()
    if ctx.coordination_service is None:
        raise CheckpointError("process_group: TensorFlow's coordination service is not running "
                              "(make the MultiWorkerMirroredStrategy before the group)")
    return CoordinationGroup(ctx, tasks.index(me), len(tasks), next(_groups))


class CoordinationGroup:
    """A :class:`ckptcore.ProcessGroup` over TensorFlow's coordination service."""

    def __init__(self, ctx: Any, rank: int, size: int, number: int) -> None:
        self._ctx = ctx
        self.rank, self.size = rank, size
        self._prefix = f"ckptcore/{number}"
        self._ops = itertools.count()
        self._broken: str | None = None

    # -- the protocol ---------------------------------------------------------------------------
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
        import tensorflow as tf

        who = f"rank {peer}" if peer is not None else "a rank"
        if isinstance(e, tf.errors.DeadlineExceededError):
            err: GroupError = GroupTimeoutError(
                f"{what}: {who} did not arrive in time (rank {self.rank}): {_first_line(e)}")
        else:
            err = GroupError(f"{what}: TensorFlow's coordination service failed (rank "
                             f"{self.rank}): {type(e).__name__}: {_first_line(e)}")
        self._broken = str(err)
        log.error("ckptcore: %s; the group is broken", err)
        return err

    def _put(self, key: str, data: bytes, what: str) -> None:
        pieces = [data[i:i + _PIECE] for i in range(0, len(data), _PIECE)] or [b""]
        try:
            for i, piece in enumerate(pieces):
                self._ctx.set_config_key_value(f"{key}/{i}", base64.b64encode(piece).decode())
            # The count last: a reader that sees it finds every piece already there.
            self._ctx.set_config_key_value(f"{key}/n", str(len(pieces)))
        except Exception as e:
            raise self._fail(e, what) from e

    def _get(self, key: str, deadline: float, what: str, peer: int) -> bytes:
        try:
            n = int(self._ctx.get_config_key_value(f"{key}/n", _ms(deadline)))
            return b"".join(base64.b64decode(self._ctx.get_config_key_value(f"{key}/{i}",
                                                                            _ms(deadline)))
                            for i in range(n))
        except Exception as e:
            raise self._fail(e, what, peer) from e

    def _barrier(self, barrier_id: str, deadline: float, what: str) -> None:
        try:
            self._ctx.wait_at_barrier(barrier_id, _ms(deadline))
        except Exception as e:
            raise self._fail(e, what) from e

    def _delete(self, *keys: str) -> None:
        for key in keys:
            try:
                self._ctx.delete_config_key_value(key)  # a directory: its pieces go with it
            except Exception as e:  # only memory of the service is at stake
                log.warning("ckptcore: could not delete coordination key %s: %s", key, e)


def _ms(deadline: float) -> int:
    """Milliseconds left (at least 1: 0 would mean "wait forever" to the service)."""
    return max(1, int((deadline - time.monotonic()) * 1000))


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
