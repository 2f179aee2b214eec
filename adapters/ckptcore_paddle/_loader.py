"""DataLoader: a ``paddle.io.DataLoader`` over a DataCursor's batches that keeps the cursor current.

The loop everyone writes is ``for x, y in loader: ... mgr.save(step, ..., cursor=cursor)``.  With a
plain ``paddle.io.DataLoader`` and a :class:`~ckptcore_paddle.ResumableBatchSampler` the cursor only
moves when the loop calls ``sampler.advance()``.  This loader does it itself, at the one moment
that is right whatever is prefetched: when a batch is *handed to the loop* (``next()`` on the
loader's iterator returns it).  The sampler's indices are drawn ahead by a buffer thread or worker
processes, but the cursor counts only what the loop has received, so a save anywhere in the loop
body after the training step records exactly the batches trained, and the next ``iter()`` starts
at the first batch the loop has not seen.  A save in the body before that batch's training step
records it as trained; save after the step (as ``DataCursor`` says: a cursor advances when it hands
a batch out).

Worker processes are forked from the training process; a fork would share the descriptor holding a
CheckpointManager's writer lock on local disk, which ckptcore closes in every forked child (see
``ckptcore/_lock.py``), so orphaned workers of a killed run never keep its root locked.

Workers end with their training process.  Paddle's workers check for a dead parent only between
reads of their index queue, and were seen blocked in such a read (a pipe whose write end they hold
themselves, so it never ends) long after a SIGKILL of the training process: they lived on
indefinitely, holding memory and shared-memory segments.  Each worker first asks Linux to SIGKILL it when its parent dies
(``prctl(PR_SET_PDEATHSIG, SIGKILL)``, in :class:`_WorkerInit`, which then calls the user's own
``worker_init_fn``), and exits at once if the parent already died before that (its parent pid is
no longer the training process's).

Kept apart from ``_data.py`` because it subclasses a Paddle class: importing it imports Paddle.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Any, Callable, Iterator, Mapping

import paddle

from ckptcore.cursor import CursorShard, DataCursor

from ._data import ResumableBatchSampler

__all__ = ["DataLoader"]

# What the cursor decides; passing them too would be ambiguous.
_CURSOR_DECIDES = ("batch_sampler", "batch_size", "shuffle", "drop_last")


class DataLoader(paddle.io.DataLoader):
    """A ``paddle.io.DataLoader`` of ``dataset`` in the order of ``cursor`` that advances it.

    Args:
        dataset: A map-style ``paddle.io.Dataset`` of ``cursor.num_samples`` samples.
        cursor: A :class:`~ckptcore.DataCursor` (or ``cursor.shard(rank, world_size)`` for data
            parallelism: each rank loads its part of every global batch).  It decides the batch
            size, the shuffling and ``drop_last``.
        **dataloader_kwargs: Passed to ``paddle.io.DataLoader`` (``num_workers``,
            ``collate_fn``, ``use_buffer_reader``, ``prefetch_factor``, ``return_list``...).

    Each ``iter(loader)`` yields the rest of the cursor's current epoch, and the cursor moves past
    each batch as the loop receives it: save with ``cursor=cursor`` (or ``cursor=loader``) after the
    training step and a resumed run continues at the next batch, bit for bit.  Loop over epochs
    with ``while cursor.epoch < epochs:`` so that a resumed run finishes the interrupted one.

    Raises:
        TypeError: ``cursor`` is not a DataCursor/CursorShard, or a keyword the cursor decides
            (``batch_size``, ``shuffle``, ``drop_last``, ``batch_sampler``) is passed.
        ValueError: the dataset's length differs from ``cursor.num_samples``.

    Example:
        >>> cursor = ckptcore.DataCursor(len(train_ds), 64, seed=0)                 # doctest: +SKIP
        >>> loader = ckptcore_paddle.DataLoader(train_ds, cursor, num_workers=2)     # doctest: +SKIP
        >>> mgr.restore(model=net, optimizer=opt, cursor=cursor)  # if there is one  # doctest: +SKIP
        >>> while cursor.epoch < 10:                                                 # doctest: +SKIP
        ...     for x, y in loader:
        ...         step += 1; train_step(x, y)
        ...         if step % 100 == 0:
        ...             mgr.save(step, model=net, optimizer=opt, cursor=cursor)
    """

    def __init__(self, dataset: Any, cursor: DataCursor | CursorShard, **dataloader_kwargs: Any):
        if not isinstance(cursor, (DataCursor, CursorShard)):
            raise TypeError(f"cursor must be a ckptcore.DataCursor or CursorShard, got {type(cursor).__name__}")
        given = [k for k in _CURSOR_DECIDES if k in dataloader_kwargs]
        if given:
            raise TypeError(f"ckptcore_paddle.DataLoader: the cursor decides {', '.join(given)}; set them on "
                            "the DataCursor (DataCursor(num_samples, batch_size, shuffle=, drop_last=, seed=))")
        base = cursor.cursor if isinstance(cursor, CursorShard) else cursor
        try:
            n = len(dataset)
        except TypeError:
            n = None  # an IterableDataset: paddle refuses a batch sampler for it below
        if n is not None and n != base.num_samples:
            raise ValueError(f"the dataset has {n} samples but the cursor walks {base.num_samples}; "
                             "build the cursor with DataCursor(len(dataset), batch_size, ...)")
        sampler = ResumableBatchSampler(cursor)
        sampler._auto = True
        init = _WorkerInit(dataloader_kwargs.pop("worker_init_fn", None))
        super().__init__(dataset, batch_sampler=sampler, worker_init_fn=init, **dataloader_kwargs)
        self.cursor = base

    def __iter__(self) -> Iterator[Any]:
        if isinstance(self.worker_init_fn, _WorkerInit):
            # Paddle forks the workers in this call (from this process, and this thread): they
            # check their parent against this pid.
            self.worker_init_fn.parent = os.getpid()
        return _Handing(super().__iter__(), self.batch_sampler)

    def __call__(self) -> Iterator[Any]:
        return self.__iter__()

    def state_dict(self) -> dict[str, Any]:
        """The cursor's state, so the loader itself can be passed as ``cursor=``."""
        return self.cursor.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Move the cursor to a saved position; the next ``iter()`` starts there."""
        self.batch_sampler.load_state_dict(state)

    def __repr__(self) -> str:
        return f"ckptcore_paddle.DataLoader({self.batch_sampler.cursor!r})"


_PR_SET_PDEATHSIG = 1
_ORPHANED_EXIT = 1  # the exit status of a worker whose parent died before it could ask to follow


class _WorkerInit:
    """The ``worker_init_fn`` of every loader: in each worker, first tie the worker's life to the
    training process's, then call ``user`` (the caller's own ``worker_init_fn``, if any) with the
    same worker id.  A module-level class with plain attributes, so it pickles if workers are
    ever spawned rather than forked.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the worker exits, not only its process:
    Paddle forks the workers from the thread that calls ``iter(loader)``, so a loader iterated from
    a thread that ends while the iterator is still used loses its workers with that thread (Paddle
    then reports them as exited unexpectedly).  Iterate from the thread that consumes the batches
    (the usual ``for x, y in loader:``), or from one that lives as long as the iterator.
    """

    def __init__(self, user: Callable[[int], Any] | None):
        if user is not None and not callable(user):
            raise TypeError(f"worker_init_fn must be callable, got {type(user).__name__}")
        self.user = user
        self.parent = os.getpid()  # set again by each iter(), just before the workers are forked

    def __call__(self, worker_id: int) -> None:
        _die_with_parent(self.parent)
        if self.user is not None:
            self.user(worker_id)


def _die_with_parent(parent: int) -> None:
    """In a worker: be SIGKILLed when the process (thread) that forked it dies (Linux), and exit now
    if it already has (the worker was reparented: its parent pid is no longer ``parent``)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        except (OSError, AttributeError):  # no prctl here: the parent check below still runs
            pass
    # After prctl: a parent that dies from here on kills this worker; one that died before has
    # left it reparented (to init or a subreaper), which this sees.
    if os.getppid() != parent:
        os._exit(_ORPHANED_EXIT)


class _Handing:
    """Paddle's loader iterator, advancing the cursor as each batch leaves it for the loop."""

    def __init__(self, it: Any, sampler: ResumableBatchSampler):
        self._it, self._sampler = it, sampler

    def __iter__(self) -> _Handing:
        return self

    def __next__(self) -> Any:
        batch = next(self._it)  # StopIteration ends the pass; the cursor has rolled over by then
        self._sampler.advance()
        return batch

    def __len__(self) -> int:
        return len(self._sampler)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)  # e.g. _reset/_shutdown of Paddle's iterators
