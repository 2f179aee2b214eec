"""``process_group()``: the processes of a JAX job as a ``ckptcore.ProcessGroup``, over the
coordination service ``jax.distributed.initialize`` starts (process 0 hosts it).

A single process (``jax.process_count() == 1``, however many devices it drives) is a group of
one.  In a multi-process job the group moves its few small byte strings (shard entries, a token,
an outcome) through the service's key-value store and barriers, which take deadlines of their
own: no XLA collective, so a dead peer makes a call fail on time instead of hanging.  The client
is ``jax._src.distributed.global_state.client`` (what Orbax's multihost utilities use too):
``key_value_set_bytes``, ``blocking_key_value_get_bytes(key, timeout_in_ms)``,
``wait_at_barrier(id, timeout_in_ms)``, ``key_value_delete``.

The protocol over the store (keys, pieces, deadlines, errors) is ``ckptcore.collective``'s
``KeyValueGroup``; this module gives it the client's four calls.  A group's number comes from the
order in which groups are made in the process.
"""

from __future__ import annotations

import itertools
from typing import Any

from ckptcore.collective import KeyValueGroup
from ckptcore.errors import GroupError

__all__ = ["process_group", "CoordinationGroup"]

_groups = itertools.count()


def process_group() -> Any:
    """This JAX job's processes: rank ``jax.process_index()``, size ``jax.process_count()``."""
    import jax

    from ckptcore import SingleProcessGroup

    if jax.process_count() == 1:
        return SingleProcessGroup()
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise GroupError("process_group: jax.distributed is not initialised (call "
                         "jax.distributed.initialize first)")
    return CoordinationGroup(client, jax.process_index(), jax.process_count(), next(_groups))


class CoordinationGroup(KeyValueGroup):
    """A :class:`ckptcore.ProcessGroup` over JAX's distributed runtime client."""

    engine = "JAX's coordination service"

    def __init__(self, client: Any, rank: int, size: int, number: int) -> None:
        super().__init__(rank, size, number)
        self._client = client

    def put(self, key: str, value: bytes) -> None:
        self._client.key_value_set_bytes(key, value)

    def get(self, key: str, timeout_ms: int) -> bytes:
        return bytes(self._client.blocking_key_value_get_bytes(key, timeout_ms))

    def wait_at_barrier(self, barrier_id: str, timeout_ms: int) -> None:
        self._client.wait_at_barrier(barrier_id, timeout_ms)

    def delete(self, key: str) -> None:
        self._client.key_value_delete(key)  # a directory: its pieces go with it
