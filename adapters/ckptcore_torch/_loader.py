"""DataLoader: a ``torch.utils.data.DataLoader`` over a DataCursor's batches that keeps it current.

The loop everyone writes is ``for x, y in loader: ... mgr.save(step, ..., cursor=cursor)``.  This
loader moves the cursor at the one moment that is right whatever is prefetched: when a batch is
*handed to the loop* (``next()`` on the loader's iterator returns it).  Torch draws the indices
ahead (``num_workers * prefetch_factor`` batches in flight) from a :class:`CursorBatches` that
leaves the cursor alone; batches come back in sampler order (``in_order=True``, which this loader
insists on), and the cursor counts only those the loop received.  So a save anywhere in the loop
body after the training step records exactly the batches trained, and the next ``iter()`` (or a
new process given the saved cursor) starts at the first batch the loop has not seen.  A save in
the body *before* the batch's training step records it as trained: save after the step.

Workers end with their training process
---------------------------------------
Torch's workers watch their parent themselves, but only between reads of their index queue
(``ManagerWatchdog``, polled every ``MP_STATUS_CHECK_INTERVAL`` = 5 s): a worker busy in a slow
``__getitem__`` or ``collate_fn`` lives on until that returns, and even an idle one outlives a
SIGKILLed training process by up to 5 s (measured: 4.5 s, 3 runs, torch 2.13 on Linux), holding
the dataset's memory and its shared-memory batches.  Each worker therefore first asks Linux to
SIGKILL it when its parent dies (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, in :class:`_WorkerInit`,
which then calls the user's own ``worker_init_fn``); measured: gone within 0.03 s.  A worker whose
parent is not the training process (``multiprocessing_context="forkserver"``), or whose parent
died before it could ask, watches the training process through a pidfd instead (a daemon thread
that ends the worker when the process exits) or exits at once.

``PR_SET_PDEATHSIG`` fires when the *thread* that forked the worker exits: torch forks the workers
in ``iter(loader)``, so iterate from the thread that consumes the batches (the usual ``for``), or
from one that lives as long as the iterator.

Worker processes forked while a CheckpointManager holds its writer lock on local disk share the
lock's descriptor; ckptcore closes it in every forked child (``ckptcore/_lock.py``), so orphaned
workers never keep a root locked.

Kept apart from ``_data.py`` because it subclasses a torch class: importing it imports torch.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
from typing import Any, Callable, Iterator, Mapping

import torch.utils.data

from ckptcore.cursor import CursorShard, DataCursor

from ._data import CursorBatches

__all__ = ["DataLoader"]


def _check_kwargs(cursor: DataCursor, kwargs: dict[str, Any]) -> None:
    """Refuse the keywords by which torch would choose the samples or their order itself, and
    drop those that merely agree with the cursor (``batch_size``, ``drop_last``, ``shuffle=False``)."""
    given = [k for k in ("sampler", "batch_sampler") if kwargs.get(k) is not None]
    if kwargs.get("shuffle"):
        given.append("shuffle=True")
    if given:
        raise TypeError(f"ckptcore_torch.DataLoader: the cursor decides the samples and their order; "
                        f"do not pass {', '.join(given)} (build the cursor with DataCursor(num_samples, "
                        "batch_size, shuffle=..., drop_last=..., seed=...))")
    kwargs.pop("sampler", None), kwargs.pop("batch_sampler", None), kwargs.pop("shuffle", None)
    if "batch_size" in kwargs:
        size = kwargs.pop("batch_size")
        if size != cursor.batch_size:
            raise ValueError(f"ckptcore_torch.DataLoader: batch_size={size!r} but the cursor's (global) "
                             f"batch size is {cursor.batch_size}; leave batch_size out, the cursor decides it")
    if "drop_last" in kwargs:
        drop = kwargs.pop("drop_last")
        if bool(drop) != cursor.drop_last:
            raise ValueError(f"ckptcore_torch.DataLoader: drop_last={drop!r} but the cursor has "
                             f"drop_last={cursor.drop_last}; leave drop_last out, the cursor decides it")
    if kwargs.get("in_order", True) is not True:
        raise ValueError("ckptcore_torch.DataLoader: in_order=False hands batches to the loop out of the "
                         "cursor's order, so no saved position could say which were trained; leave it out")


class DataLoader(torch.utils.data.DataLoader):
    """A ``torch.utils.data.DataLoader`` of ``dataset`` in the order of ``cursor`` that advances it.

    Args:
        dataset: A map-style dataset of ``cursor.num_samples`` samples.
        cursor: A :class:`~ckptcore.DataCursor` (or ``cursor.shard(rank, world_size)`` for data
            parallelism: each rank loads its part of every global batch).  It decides the batch
            size, the shuffling and ``drop_last``.
        **dataloader_kwargs: Passed to ``torch.utils.data.DataLoader`` (``num_workers``,
            ``prefetch_factor``, ``collate_fn``, ``pin_memory``, ``persistent_workers``,
            ``worker_init_fn``...).  ``batch_size`` and ``drop_last`` are accepted when they equal
            the cursor's, ``shuffle`` when False.

    Each ``iter(loader)`` yields the rest of the cursor's current epoch, and the cursor moves past
    each batch as the loop receives it: save with ``cursor=cursor`` (or ``cursor=loader``) after
    the training step and a resumed run continues at the next batch.  Loop over epochs with
    ``while cursor.epoch < epochs:`` so that a resumed run finishes the interrupted epoch.

    Raises:
        TypeError: ``cursor`` is not a DataCursor/CursorShard, the dataset is iterable-style, or
            ``sampler``, ``batch_sampler`` or ``shuffle=True`` is passed.
        ValueError: ``batch_size``/``drop_last`` differ from the cursor's, ``in_order=False``, or
            the dataset's length differs from ``cursor.num_samples``.

    Example:
        >>> cursor = ckptcore.DataCursor(len(train_ds), 64, seed=0)                 # doctest: +SKIP
        >>> loader = ckptcore_torch.DataLoader(train_ds, cursor, num_workers=2)      # doctest: +SKIP
        >>> mgr.restore(model=net, optimizer=opt, cursor=cursor)  # if there is one  # doctest: +SKIP
        >>> while cursor.epoch < 10:                                                 # doctest: +SKIP
        ...     for x, y in loader:
        ...         step += 1; train_step(x, y)
        ...         if step % 100 == 0:
        ...             mgr.save(step, model=net, optimizer=opt, cursor=cursor)
    """

    def __init__(self, dataset: Any, cursor: DataCursor | CursorShard, **dataloader_kwargs: Any):
        sampler = CursorBatches(cursor)  # the TypeError for a cursor of another kind
        base = sampler.cursor
        if isinstance(dataset, torch.utils.data.IterableDataset):
            raise TypeError("ckptcore_torch.DataLoader needs a map-style dataset (__getitem__ and "
                            "__len__): an IterableDataset chooses its own samples, which no cursor can place")
        _check_kwargs(base, dataloader_kwargs)
        n = len(dataset)
        if n != base.num_samples:
            raise ValueError(f"the dataset has {n} samples but the cursor walks {base.num_samples}; "
                             "build the cursor with DataCursor(len(dataset), batch_size, ...)")
        init = _WorkerInit(dataloader_kwargs.pop("worker_init_fn", None))
        # torch draws each iter()'s worker base seed from ``generator``, or else from the
        # global generator: one draw the uninterrupted run did at the start of the epoch and a
        # resumed one does mid-epoch, so the global stream (Dropout, init) would differ after a
        # resume.  Without a generator of the caller's, the loader keeps its own, seeded at each
        # iter() from the cursor's seed and position (worker seeds reproducible too).
        self._own_generator = dataloader_kwargs.get("generator") is None
        if self._own_generator:
            dataloader_kwargs["generator"] = torch.Generator()
        super().__init__(dataset, batch_sampler=sampler, worker_init_fn=init, **dataloader_kwargs)
        self.cursor = base

    def __iter__(self) -> Iterator[Any]:
        if isinstance(self.worker_init_fn, _WorkerInit):
            # torch starts the workers in this call (from this process and thread): they watch
            # this pid.  (Persistent workers started by an earlier iter() keep theirs.)
            self.worker_init_fn.parent = os.getpid()
        if self._own_generator:
            c = self.cursor
            self.generator.manual_seed(hash((c.seed, c.epoch, c.position)) & 0x7FFF_FFFF_FFFF_FFFF)
        it = super().__iter__()  # draws iter(batch_sampler): the pass this iterator serves
        return _Handing(it, self.batch_sampler, self.batch_sampler._pass)

    def state_dict(self) -> dict[str, Any]:
        """The cursor's state, so the loader itself can be passed as ``cursor=``."""
        return self.cursor.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Move the cursor to a saved position; the next ``iter()`` starts there."""
        self.batch_sampler.load_state_dict(state)

    def __repr__(self) -> str:
        return f"ckptcore_torch.DataLoader({self.batch_sampler!r})"


class _Handing:
    """torch's loader iterator, advancing the cursor as each batch leaves it for the loop."""

    def __init__(self, it: Any, sampler: CursorBatches, p: Any):
        self._it, self._sampler, self._pass = it, sampler, p

    def __iter__(self) -> _Handing:
        return self

    def __next__(self) -> Any:
        batch = next(self._it)  # StopIteration ends the pass; the cursor has rolled over by then
        self._sampler.advance(self._pass)
        return batch

    def __len__(self) -> int:
        return self._pass.length  # this pass: the rest of the epoch it started in

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)  # e.g. _shutdown_workers of torch's iterators


_PR_SET_PDEATHSIG = 1
_ORPHANED_EXIT = 1  # the exit status of a worker whose training process is already gone


class _WorkerInit:
    """The ``worker_init_fn`` of every loader: in each worker, first tie the worker's life to the
    training process's, then call ``user`` (the caller's own ``worker_init_fn``) with the same
    worker id.  A module-level class with plain attributes, so it pickles for spawned workers."""

    def __init__(self, user: Callable[[int], Any] | None):
        if user is not None and not callable(user):
            raise TypeError(f"worker_init_fn must be callable, got {type(user).__name__}")
        self.user = user
        self.parent = os.getpid()  # set again by each iter(), just before the workers start

    def __call__(self, worker_id: int) -> None:
        _die_with(self.parent)
        if self.user is not None:
            self.user(worker_id)


def _die_with(parent: int) -> None:
    """In a worker: end when the training process ``parent`` dies (see the module docstring)."""
    if os.getppid() == parent and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        except (OSError, AttributeError):  # no prctl: the pidfd below still watches
            pass
        else:
            if os.getppid() == parent:  # still ours after prctl: its death now kills this worker
                return
            os._exit(_ORPHANED_EXIT)  # died between the two checks
    # Not our direct parent (forkserver), no prctl, or already gone: watch the pid itself.
    try:
        fd = os.pidfd_open(parent)
    except ProcessLookupError:
        os._exit(_ORPHANED_EXIT)
    except (OSError, AttributeError):  # no pidfd (old kernel, not Linux): torch's watchdog remains
        return

    def watch() -> None:
        select.select([fd], [], [])  # readable once the process has exited
        os._exit(_ORPHANED_EXIT)

    threading.Thread(target=watch, name="ckptcore-torch-parent-watch", daemon=True).start()
