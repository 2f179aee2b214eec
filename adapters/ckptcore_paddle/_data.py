"""ResumableBatchSampler: a ``paddle.io.DataLoader`` batch sampler that follows a DataCursor.

Fetched is not trained
----------------------
A DataLoader asks its batch sampler for indices ahead of training: a buffer thread does so even
with ``num_workers=0`` (``use_buffer_reader=True``, the default), and worker processes keep
``prefetch_factor`` batches per worker in flight.  A cursor advanced by the sampler would therefore
be saved several batches ahead of the model, and a resumed run would skip those batches.  So:

* ``iter(sampler)`` copies the cursor and yields the copy's batches, from the cursor's position to
  the end of that epoch (one epoch per ``iter()``, the order :class:`~ckptcore.DataCursor` defines,
  which every ckptcore adapter follows).  The cursor itself does not move.
* :meth:`ResumableBatchSampler.advance` moves the cursor by one (global) batch.
  :class:`ckptcore_paddle.DataLoader` calls it as it hands each batch to the loop (so a plain
  ``for x, y in loader:`` needs nothing else); with a ``paddle.io.DataLoader`` of your own, a
  custom loop calls it after its optimizer step (after every micro-batch when accumulating
  gradients).  A checkpoint taken then records exactly the batches handed to the loop, whatever
  the loader has prefetched; the next ``iter()`` starts at the first batch not handed out.

Forgetting ``advance()``
------------------------
A sampler that has handed out batches but was never advanced would save position 0 all through
its first epoch.  Capturing its cursor therefore raises ``ValueError`` (at the first save, naming
the two fixes), and when such a sampler is iterated again after a whole epoch it rolls the cursor
over to the next epoch (logged) rather than repeating the same one.

Sharding
--------
With ``rank``/``world_size`` (or a ``cursor.shard(rank, world_size)`` view) each process yields
its part of every global batch (:class:`~ckptcore.cursor.CursorShard`); each rank still calls
``advance()`` once per global step, so every rank's cursor holds the same global position, and a
state saved under one world size resumes under another at the same global sample.

This module does not import Paddle: the DataLoader needs only ``iter()`` and ``len()``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from typing import Any, Mapping

from ckptcore.cursor import CursorShard, DataCursor

__all__ = ["ResumableBatchSampler", "check_not_stale"]

_log = logging.getLogger("ckptcore")

_live: weakref.WeakSet[ResumableBatchSampler] = weakref.WeakSet()


class _Pass:
    """One ``iter()``: its epoch, how many batches it yields, and how many were yielded/advanced."""

    __slots__ = ("epoch", "length", "yielded", "advanced", "done")

    def __init__(self, epoch: int, length: int):
        self.epoch, self.length = epoch, length
        self.yielded = self.advanced = 0
        self.done = False


class ResumableBatchSampler:
    """Batches of a :class:`~ckptcore.DataCursor` for ``paddle.io.DataLoader(batch_sampler=...)``.

    Args:
        cursor: A ``DataCursor``, or a ``CursorShard`` (``cursor.shard(rank, world_size)``).
        rank: This process's rank for data parallelism (with ``world_size``).
        world_size: Number of data-parallel processes; each yields its part of every global
            batch (``np.array_split`` order), so pass the *global* batch size to the cursor.

    Each ``iter()`` yields the rest of the cursor's current epoch as lists of sample indices and
    leaves the cursor where it is; call :meth:`advance` after training on each batch (the
    :class:`~ckptcore_paddle.Checkpoint` callback does it in ``paddle.Model.fit``).
    ``len(sampler)`` is the number of batches the current (or next) ``iter()`` yields.
    ``state_dict()``/``load_state_dict()`` are the cursor's, so the sampler can be saved as the
    ``cursor=`` of ``save_state``/``CheckpointManager``.

    Example:
        >>> cursor = ckptcore.DataCursor(len(dataset), 32, seed=0)                 # doctest: +SKIP
        >>> sampler = ckptcore_paddle.ResumableBatchSampler(cursor)                # doctest: +SKIP
        >>> loader = paddle.io.DataLoader(dataset, batch_sampler=sampler)          # doctest: +SKIP
        >>> for x, y in loader:                                                    # doctest: +SKIP
        ...     train_step(x, y)
        ...     sampler.advance()  # this batch is trained: the cursor may move past it

    ``ckptcore_paddle.DataLoader(dataset, cursor)`` builds the loader and advances for you.
    """

    def __init__(self, cursor: DataCursor | CursorShard, *, rank: int | None = None,
                 world_size: int | None = None):
        if (rank is None) != (world_size is None):
            raise TypeError("pass rank and world_size together (or neither)")
        if isinstance(cursor, CursorShard):
            if rank is not None and (rank, world_size) != (cursor.rank, cursor.world_size):
                raise ValueError(f"the cursor is the shard {cursor.rank} of {cursor.world_size}, "
                                 f"but rank={rank}, world_size={world_size} were given")
            cursor, rank, world_size = cursor.cursor, cursor.rank, cursor.world_size
        elif not isinstance(cursor, DataCursor):
            raise TypeError(f"cursor must be a ckptcore.DataCursor or CursorShard, got {type(cursor).__name__}")
        self.cursor = cursor
        # Validates rank and world_size the way the core does.
        self._view = cursor.shard(rank, world_size) if world_size is not None else None
        self.rank = 0 if rank is None else self._view.rank
        self.world_size = 1 if world_size is None else self._view.world_size
        self._pass: _Pass | None = None
        self._end_epoch: int | None = None  # set by Checkpoint: epochs from here on are empty
        self._auto = False  # set by ckptcore_paddle.DataLoader, which advances as it hands batches out
        self._handed = self._advanced = 0  # since creation or load_state_dict: the staleness check
        _live.add(self)

    @property
    def batch_size(self) -> int:
        """This rank's largest batch (the global batch size split over the world)."""
        return -(-self.cursor.batch_size // self.world_size)

    @property
    def drop_last(self) -> bool:
        return self.cursor.drop_last

    def __iter__(self) -> Iterator[list[int]]:
        prev = self._pass
        if prev is not None and prev.done and prev.yielded and not prev.advanced \
                and prev.epoch == self.cursor.epoch:
            # The loop consumed a whole epoch without advance(): move on rather than repeat it.
            # Saving this cursor is refused (check_not_stale), so no wrong position is ever written.
            _log.warning("ResumableBatchSampler: a whole epoch was handed out but advance() was never "
                         "called; rolling the cursor over to epoch %d (use ckptcore_paddle.DataLoader, "
                         "or call sampler.advance() after each batch)", prev.epoch + 1)
            for _ in range(prev.yielded):
                self.cursor.next_batch()
        snap = DataCursor.from_state(self.cursor.state_dict())  # the cursor itself stays put
        view = snap.shard(self.rank, self.world_size) if self.world_size > 1 else snap
        length = 0 if self._finished() else snap.steps_remaining_in_epoch
        self._pass = p = _Pass(snap.epoch, length)
        return self._generate(view, p)

    def _generate(self, view: Any, p: _Pass) -> Iterator[list[int]]:
        for _ in range(p.length):
            batch = view.next_batch()
            p.yielded += 1
            self._handed += 1
            yield batch.tolist()
        p.done = True

    def __len__(self) -> int:
        p = self._pass
        if p is not None and p.epoch == self.cursor.epoch:
            return p.length  # the pass in progress (hapi compares its step with this)
        return 0 if self._finished() else self.cursor.steps_remaining_in_epoch

    def _finished(self) -> bool:
        return self._end_epoch is not None and self.cursor.epoch >= self._end_epoch

    def advance(self, batches: int = 1) -> None:
        """Record that ``batches`` more batches of the current ``iter()`` were trained on.

        Moves the cursor (every rank's, by whole global batches) past them; at the end of an epoch
        it rolls over to the next.

        Raises:
            ValueError: more batches advanced than this ``iter()`` has handed out (a batch cannot
                be trained before it was fetched; this catches calling ``advance()`` twice).
        """
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
            raise TypeError(f"batches must be a non-negative int, got {batches!r}")
        p = self._pass
        if p is None or p.advanced + batches > p.yielded:
            handed = 0 if p is None else p.yielded - p.advanced
            raise ValueError(f"advance({batches}) but only {handed} batch(es) were handed out and not yet "
                             "advanced; call advance() once per batch trained, after fetching it (and check "
                             "that this sampler is the training DataLoader's batch_sampler)")
        for _ in range(batches):
            self.cursor.next_batch()
        p.advanced += batches
        self._advanced += batches

    def _stale(self) -> bool:
        """Batches were handed out but the cursor never moved past any: its position is stale."""
        return not self._auto and self._handed > 0 and self._advanced == 0

    def state_dict(self) -> dict[str, Any]:
        """The cursor's state (a global position: the same on every rank).

        Raises:
            ValueError: the sampler handed out batches but was never advanced (see
                :func:`check_not_stale`).
        """
        check_not_stale(self)
        return self.cursor.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Move the cursor to a saved position; the next ``iter()`` starts there."""
        self.cursor.load_state_dict(state)
        self._pass = None
        self._handed = self._advanced = 0

    def __repr__(self) -> str:
        shard = f", rank={self.rank}, world_size={self.world_size}" if self.world_size > 1 else ""
        return f"ResumableBatchSampler({self.cursor!r}{shard})"


def samplers_of(cursor: Any) -> list[ResumableBatchSampler]:
    """The live samplers that follow ``cursor`` (a DataCursor, CursorShard or sampler)."""
    if isinstance(cursor, ResumableBatchSampler):
        return [cursor]
    base = cursor.cursor if isinstance(cursor, CursorShard) else cursor
    return [s for s in list(_live) if s.cursor is base]


def check_not_stale(cursor: Any) -> None:
    """Refuse to save the position of a cursor whose sampler hands out batches but never advances.

    Called whenever a cursor is captured for a save.  Such a cursor still holds the position it had
    before the loop started, so a run resumed from it would train those batches again.

    Raises:
        ValueError: naming the two ways to keep the cursor current.
    """
    if cursor is None:
        return
    stale = [s for s in samplers_of(cursor) if s._stale()]
    if stale:
        raise ValueError(
            f"the cursor's ResumableBatchSampler has handed out {stale[0]._handed} batch(es) but "
            "advance() was never called, so the saved data position would be stale (the batches "
            "already trained would be trained again after a resume). Build the loader with "
            "ckptcore_paddle.DataLoader(dataset, cursor, ...), which advances the cursor as it hands "
            "each batch to the loop, or call sampler.advance() after each training step")
