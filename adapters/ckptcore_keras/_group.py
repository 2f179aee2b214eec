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
SIGKILLed), naming the missing task; values are text (UTF-8), so bytes travel base64-encoded.

The protocol over the store (keys, pieces, deadlines, errors) is ``ckptcore.collective``'s
``KeyValueGroup``, shared with ``ckptcore_jax``; this module gives it the service's four calls.  A
group's number comes from the order in which groups are made in the process (the same on every
worker running the same program).
"""

from __future__ import annotations

import base64
import itertools
from typing import Any

from ckptcore.collective import KeyValueGroup
from ckptcore.errors import CheckpointError
from ckptcore.group import SingleProcessGroup

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


class CoordinationGroup(KeyValueGroup):
    """A :class:`ckptcore.ProcessGroup` over TensorFlow's coordination service (values are text
    there: bytes travel base64-encoded, a 1 MiB piece as 1.33 MiB of text)."""

    engine = "TensorFlow's coordination service"

    def __init__(self, ctx: Any, rank: int, size: int, number: int) -> None:
        super().__init__(rank, size, number)
        self._ctx = ctx

    def put(self, key: str, value: bytes) -> None:
        self._ctx.set_config_key_value(key, base64.b64encode(value).decode())

    def get(self, key: str, timeout_ms: int) -> bytes:
        return base64.b64decode(self._ctx.get_config_key_value(key, timeout_ms))

    def wait_at_barrier(self, barrier_id: str, timeout_ms: int) -> None:
        self._ctx.wait_at_barrier(barrier_id, timeout_ms)

    def delete(self, key: str) -> None:
        self._ctx.delete_config_key_value(key)  # a directory: its pieces go with it

    def is_timeout(self, e: Exception) -> bool:
        import tensorflow as tf

        return isinstance(e, tf.errors.DeadlineExceededError)
