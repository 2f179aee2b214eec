"""The batch sampler behind ``ckptcore_torch.DataLoader``: a DataCursor's batches, fetched ahead.

Fetched is not trained
----------------------
``torch.utils.data.DataLoader`` draws indices from its batch sampler ahead of the loop: with
``num_workers=k`` it keeps ``k * prefetch_factor`` batches in flight, and the sampler's iterator
runs in the training process whenever the loader refills a worker's queue.  A cursor moved by
the sampler would therefore be saved several batches ahead of the model, and a resumed run
would skip those batches.  So:

* ``iter(sampler)`` copies the cursor and yields the copy's batches (lists of sample indices),
  from the cursor's position to the end of that epoch (one epoch per ``iter()``, in the order
  :class:`~ckptcore.DataCursor` defines, which every ckptcore adapter follows).  The cursor
  itself does not move.
* :meth:`CursorBatches.advance` moves the cursor by one (global) batch; the DataLoader calls
  it as it hands each batch to the loop.  A checkpoint taken then records exactly the batches
  the loop received, whatever is prefetched; the next ``iter()`` starts at the first batch not
  received.

A pass (one ``iter()``) remembers where it expects the cursor to be: a cursor moved by anyone
else while the pass is live (``load_state_dict``, another ``iter()`` of the same loader that
advanced it) makes the old pass refuse to advance rather than count batches of the wrong epoch.

With a ``cursor.shard(rank, world_size)`` each process yields its part of every global batch
(:class:`~ckptcore.cursor.CursorShard`), and each rank advances by whole global batches, so
every rank's cursor holds the same global position and a state saved under one world size
resumes under another at the same sample.

This module does not import PyTorch: the DataLoader needs only ``iter()`` and ``len()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Mapping

from ckptcore.cursor import CursorShard, DataCursor

__all__ = ["CursorBatches"]


class _Pass:
    """One ``iter()``: how many batches it yields, how many were yielded and advanced, and the
    cursor state (epoch, position) it expects before its next advance."""

    __slots__ = ("length", "yielded", "advanced", "expect")

    def __init__(self, length: int, expect: tuple[int, int]):
        self.length, self.expect = length, expect
        self.yielded = self.advanced = 0


class CursorBatches:
    """A ``batch_sampler`` over ``cursor`` (a ``DataCursor`` or ``CursorShard``) that leaves the
    cursor alone until :meth:`advance` (see the module docstring)."""

    def __init__(self, cursor: DataCursor | CursorShard):
        if isinstance(cursor, CursorShard):
            self.cursor, self.rank, self.world_size = cursor.cursor, cursor.rank, cursor.world_size
        elif isinstance(cursor, DataCursor):
            self.cursor, self.rank, self.world_size = cursor, 0, 1
        else:
            raise TypeError(f"cursor must be a ckptcore.DataCursor or CursorShard (cursor.shard(rank, "
                            f"world_size)), got {type(cursor).__name__}")
        self._pass: _Pass | None = None

    @property
    def batch_size(self) -> int:
        """This rank's largest batch (the global batch size split over the world)."""
        return -(-self.cursor.batch_size // self.world_size)

    def _where(self) -> tuple[int, int]:
        return self.cursor.epoch, self.cursor.position

    def __iter__(self) -> Iterator[list[int]]:
        snap = DataCursor.from_state(self.cursor.state_dict())  # the cursor itself stays put
        view = snap.shard(self.rank, self.world_size) if self.world_size > 1 else snap
        self._pass = p = _Pass(snap.steps_remaining_in_epoch, self._where())
        return self._generate(view, p)

    @staticmethod
    def _generate(view: Any, p: _Pass) -> Iterator[list[int]]:
        for _ in range(p.length):
            batch = view.next_batch()
            p.yielded += 1
            yield batch.tolist()

    def __len__(self) -> int:
        # The whole epoch, as torch's own loaders (and resumable ones) report it, while a pass
        # that starts mid-epoch yields only its rest: what ``OneCycleLR(steps_per_epoch=
        # len(loader))`` must see in a resumed process too, and what Lightning counts a resumed
        # epoch against (it adds the batches already done itself).
        return self.cursor.batches_per_epoch

    def advance(self, p: _Pass | None = None) -> None:
        """The loop has received one more batch of pass ``p`` (default: the latest ``iter()``):
        move the cursor past it (rolling over to the next epoch after the last).

        Raises:
            RuntimeError: no batch of this pass is waiting to be counted (advance called twice,
                or with no ``iter()``), or the cursor was moved elsewhere while the pass was live.
        """
        p = self._pass if p is None else p
        if p is None or p.advanced >= p.yielded:
            raise RuntimeError("CursorBatches.advance: no batch of the current iter() is waiting to "
                               "be counted (advance() is called once per batch handed to the loop)")
        if p.expect != self._where():
            raise RuntimeError(
                f"the cursor moved to epoch {self.cursor.epoch}, position {self.cursor.position} while "
                f"this DataLoader iterator expected epoch {p.expect[0]}, position {p.expect[1]} "
                "(load_state_dict or another iter() of the same loader): start a new iter(loader)")
        self.cursor.next_batch()
        p.advanced += 1
        p.expect = self._where()

    def state_dict(self) -> dict[str, Any]:
        """The cursor's state (a global position: the same on every rank)."""
        return self.cursor.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Move the cursor to a saved position; the next ``iter()`` starts there."""
        self.cursor.load_state_dict(state)
        self._pass = None

    def __repr__(self) -> str:
        shard = f", rank={self.rank}, world_size={self.world_size}" if self.world_size > 1 else ""
        return f"CursorBatches({self.cursor!r}{shard})"
