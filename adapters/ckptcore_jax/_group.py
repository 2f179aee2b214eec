"""``process_group()``: the processes of a JAX job as a ``ckptcore.ProcessGroup``, over the
coordination service ``jax.distributed.initialize`` starts (process 0 hosts it).

A single process (``jax.process_count() == 1``, however many devices it drives) is a group of
one.  In a multi-process job the group moves its few small byte strings (shard entries, a token,
an outcome) through the service's key-value store and barriers, which take deadlines of their
own: no XLA collective, so a dead peer makes a call fail on time instead of hanging.  The client
is ``jax._src.distributed.global_state.client`` (what Orbax's multihost utilities use too):
``key_value_set_bytes``, ``blocking_key_value_get_bytes(key, timeout_in_ms)``,
``wait_at_barrier(id, timeout_in_ms)``, ``key_value_delete``.

Keys are ``ckptcore/<group>/<operation number>/...``: every process runs the same operations in
the same order, so the numbers agree without an exchange; a group's number comes from the order
in which groups are made in the process.  Process 0 deletes an operation's keys once it is over.
Values travel in pieces of at most ``_PIECE`` bytes (the service's messages are gRPC messages).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from ckptcore.errors import GroupError, GroupTimeoutError

__all__ = ["process_group", "CoordinationGroup"]

log = logging.getLogger("ckptcore")

_PIECE = 1 << 20
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


class CoordinationGroup:
    """A :class:`ckptcore.ProcessGroup` over JAX's distributed runtime client."""

    def __init__(self, client: Any, rank: int, size: int, number: int) -> None:
        self._client = client
        self.rank, self.size = rank, size
        self._prefix = f"ckptcore/{number}"
        self._ops = itertools.count()
        self._broken: str | None = None

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
        self._barrier(f"{op}/read", deadline, "broadcast")  # all have read it: rank 0 may delete
        if self.rank == 0:
            self._delete(f"{op}/0")
        return out

    def barrier(self, *, timeout: float) -> None:
        op = self._begin("barrier")
        self._barrier(op, time.monotonic() + timeout, "barrier")

    def _begin(self, what: str) -> str:
        if self._broken:
            raise GroupError(f"{what}: the group is broken ({self._broken}; rank {self.rank})")
        return f"{self._prefix}/{next(self._ops)}"

    def _fail(self, e: Exception, what: str, peer: int | None = None) -> GroupError:
        who = f"rank {peer}" if peer is not None else "a rank"
        text = _first_line(e)
        if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower() or "Deadline" in str(e):
            err: GroupError = GroupTimeoutError(f"{what}: {who} did not arrive in time (rank "
                                                f"{self.rank}): {text}")
        else:
            err = GroupError(f"{what}: JAX's coordination service failed (rank {self.rank}): "
                             f"{type(e).__name__}: {text}")
        self._broken = str(err)
        log.error("ckptcore: %s; the group is broken", err)
        return err

    def _put(self, key: str, data: bytes, what: str) -> None:
        pieces = [data[i:i + _PIECE] for i in range(0, len(data), _PIECE)] or [b""]
        try:
            for i, piece in enumerate(pieces):
                self._client.key_value_set_bytes(f"{key}/{i}", piece)
            # The count last: a reader that sees it finds every piece already there.
            self._client.key_value_set(f"{key}/n", str(len(pieces)))
        except Exception as e:
            raise self._fail(e, what) from e

    def _get(self, key: str, deadline: float, what: str, peer: int) -> bytes:
        try:
            n = int(self._client.blocking_key_value_get(f"{key}/n", _ms(deadline)))
            return b"".join(self._client.blocking_key_value_get_bytes(f"{key}/{i}", _ms(deadline))
                            for i in range(n))
        except Exception as e:
            raise self._fail(e, what, peer) from e

    def _barrier(self, barrier_id: str, deadline: float, what: str) -> None:
        try:
            self._client.wait_at_barrier(barrier_id, _ms(deadline))
        except Exception as e:
            raise self._fail(e, what) from e

    def _delete(self, *keys: str) -> None:
        for key in keys:
            try:
                self._client.key_value_delete(key)  # a directory: its pieces go with it
            except Exception as e:  # only memory of the service is at stake
                log.warning("ckptcore: could not delete coordination key %s: %s", key, e)


def _ms(deadline: float) -> int:
    """Milliseconds left (at least 1)."""
    return max(1, int((deadline - time.monotonic()) * 1000))


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
