"""Checkpoint: a ``paddle.Model.fit`` (hapi) callback that saves through CheckpointManager and
resumes exactly at the next unseen batch.

How resuming works in hapi (Paddle 3.x)
---------------------------------------
``fit`` has no ``initial_epoch``: its loop is ``for epoch in range(epochs)`` over the DataLoader it
was given, calling ``on_train_begin`` once first.  The callback therefore

* restores the newest checkpoint in ``on_train_begin``: model, optimizer, its LR scheduler, the
  cursor and the RNGs (and the AMP GradScaler, if ``prepare`` enabled AMP).  The loader's
  :class:`~ckptcore_paddle.ResumableBatchSampler` then starts its next ``iter()`` at the cursor,
  so hapi's first loop pass is the rest of the interrupted epoch, and ``len(loader)`` is that
  pass's length (hapi's ``accumulate_grad_batches`` update rule compares the step with it);
* counts epochs with the cursor, not with hapi's loop index: ``fit(..., epochs=E)`` means E epochs
  in total, and once the cursor has finished epoch E-1 the callback sets ``model.stop_training``
  so the loop ends early (hapi's own index and the callbacks that print it restart at 0, which is
  cosmetic).  A run that had already finished gets empty passes and trains nothing;
* advances the cursor in ``on_train_batch_end``, once per batch trained (never as batches are
  fetched: the loader prefetches), and writes a due checkpoint at the next ``on_train_batch_begin``
  / ``on_epoch_begin`` / ``on_train_end``.  Deferring the write to the start of the next batch means
  every other callback has finished with the batch, in particular hapi's own
  ``paddle.callbacks.LRScheduler``, which ``fit`` appends after user callbacks and which steps the
  scheduler in ``on_train_batch_end``: a checkpoint written earlier would hold the scheduler one
  step behind.  A checkpoint is thus exactly the state before the next batch.

With ``accumulate_grad_batches=N`` a due checkpoint waits for the end of the accumulation window
(gradients are then clear), since hapi counts windows from the start of each loop pass.
Checkpoint ``step`` numbers (and ``state.step``) count batches trained; ``state.optimizer.step``
counts optimizer updates.  The callback's own progress (batches trained, epochs completed) is
persisted under ``state.extra["paddle"]["fit"]``.  Only rank 0 writes; every rank restores.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import paddle

from ckptcore._storage import check_url
from ckptcore.adapter import CALLBACK_KEEP
from ckptcore.cursor import CursorShard, DataCursor
from ckptcore.manager import CheckpointManager
from ckptcore.state import TrainingState

from ._capture import capture
from ._data import ResumableBatchSampler, samplers_of

__all__ = ["Checkpoint"]


class Checkpoint(paddle.callbacks.Callback):
    """Save a ``paddle.Model.fit`` run under ``root`` and resume it exactly.

    Args:
        root: A folder or any fsspec URL; checkpoints go to ``<root>/step-<batches trained>``.  A
            non-empty str or path-like, else ``ValueError`` / ``TypeError`` before anything is created.
        save_freq: ``"epoch"`` (at the end of every epoch) or an int N (every N batches, and at
            the end of every epoch).  A checkpoint is also written when ``fit`` ends.
        cursor: The :class:`~ckptcore_paddle.ResumableBatchSampler` of the training DataLoader
            (or the ``DataCursor``/``CursorShard`` it follows).  Without one only ``"epoch"`` is
            exact (a ``shuffle=True`` DataLoader draws each epoch's order from numpy's global RNG
            as the epoch starts, and the checkpoint holds that RNG), an int ``save_freq`` is
            refused, and resuming a run that already completed ``epochs`` raises ValueError
            (with a cursor it trains nothing).
        keep: Retention, as for :class:`~ckptcore.CheckpointManager` (default:
            ``ckptcore.adapter.CALLBACK_KEEP``, the newest 3, as in every adapter's callback).
        async_save: Write in a background thread.
        storage_options: Passed to fsspec.

    After ``on_train_begin``, ``restored`` is the state that was restored (None on a fresh start)
    and ``initial_epoch`` the number of epochs it had completed.

    Example:
        >>> cursor = ckptcore.DataCursor(len(train_ds), 64, seed=0)                       # doctest: +SKIP
        >>> sampler = ckptcore_paddle.ResumableBatchSampler(cursor)                       # doctest: +SKIP
        >>> loader = paddle.io.DataLoader(train_ds, batch_sampler=sampler)                # doctest: +SKIP
        >>> model.fit(loader, epochs=10,                                                  # doctest: +SKIP
        ...           callbacks=[ckptcore_paddle.Checkpoint("ckpts", save_freq=100, cursor=sampler)])
    """

    def __init__(self, root: str | os.PathLike, *, save_freq: str | int = "epoch", cursor: Any = None,
                 keep: Any = CALLBACK_KEEP, async_save: bool = False, storage_options: Mapping[str, Any] | None = None):
        # Checked before anything else: "" would put checkpoints in "/" and None in a folder "None".
        root = check_url(root, "root")
        super().__init__()
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int)
                                     or save_freq < 1):
            raise ValueError(f"save_freq must be 'epoch' or a positive int, got {save_freq!r}")
        if cursor is not None and not isinstance(cursor, (ResumableBatchSampler, DataCursor, CursorShard)):
            raise TypeError("cursor must be a ckptcore_paddle.ResumableBatchSampler, DataCursor or CursorShard, "
                            f"got {type(cursor).__name__}")
        if cursor is None and save_freq != "epoch":
            raise ValueError("saving every N batches needs the data position to resume exactly: pass "
                             "cursor=<the ResumableBatchSampler of the training DataLoader>")
        self.root = root
        self.save_freq = save_freq
        self.cursor = cursor
        self.keep, self.async_save, self.storage_options = keep, async_save, dict(storage_options or {})
        self.restored: TrainingState | None = None
        self.initial_epoch = 0
        self._manager: CheckpointManager | None = None
        self._batches = self._epoch = self._pass_batches = 0
        self._saved_at: int | None = None
        self._due = self._stopped = False

    # -- hapi hooks ---------------------------------------------------------------------------
    def on_train_begin(self, logs: Any = None) -> None:
        if self._manager is not None:  # a previous fit raised before on_train_end: let its lock go
            self._manager.close()
        self._manager = CheckpointManager(self.root, keep=self.keep, async_save=self.async_save,
                                          storage_options=self.storage_options)
        self._batches = self._epoch = self._pass_batches = 0
        self._saved_at, self._due, self._stopped, self.restored = None, False, False, None
        epochs = self._epochs()
        for s in self._samplers():
            s._end_epoch = epochs
        if self._manager.latest_step() is not None:
            self._restore()
        if epochs is not None and self._epoch >= epochs and self.cursor is None:
            raise ValueError(f"the checkpoint in {self.root} has already completed {self._epoch} epochs "
                             f"(fit was asked for {epochs}); pass a larger epochs= or a new root")

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._flush(aligned=True)
        self._pass_batches = 0

    def on_train_batch_begin(self, step: int, logs: Any = None) -> None:
        self._flush(aligned=self._pass_batches % self._accumulate() == 0)

    def on_train_batch_end(self, step: int, logs: Any = None) -> None:
        self._advance()
        self._batches += 1
        self._pass_batches += 1
        if self.save_freq != "epoch" and self._batches % self.save_freq == 0:
            self._due = True

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._epoch = self._cursor().epoch if self.cursor is not None else self._epoch + 1
        self._due = True
        epochs = self._epochs()
        if epochs is not None and self._epoch >= epochs and epoch + 1 < epochs:
            self.model.stop_training = self._stopped = True  # hapi's loop would run past the total

    def on_train_end(self, logs: Any = None) -> None:
        try:
            if self._saved_at != self._batches:
                self._due = True
            self._flush(aligned=True)
        finally:
            if self._stopped:
                self.model.stop_training = False  # hapi never resets it; a later fit would stop early
            if self._manager is not None:
                self._manager.close()
                self._manager = None

    # -- helpers ------------------------------------------------------------------------------
    def _epochs(self) -> int | None:
        epochs = (self.params or {}).get("epochs")
        return None if epochs is None else int(epochs)

    def _accumulate(self) -> int:
        return max(1, int(getattr(self.model, "_accumulate", 1) or 1))

    def _cursor(self) -> DataCursor:
        c = self.cursor
        return c.cursor if isinstance(c, (ResumableBatchSampler, CursorShard)) else c

    def _samplers(self) -> list[ResumableBatchSampler]:
        return [] if self.cursor is None else samplers_of(self.cursor)

    def _advance(self) -> None:
        if self.cursor is None:
            return
        if isinstance(self.cursor, ResumableBatchSampler):
            self.cursor.advance()
            return
        active = [s for s in self._samplers() if s._pass is not None and s._pass.yielded > s._pass.advanced]
        if len(active) != 1:
            raise ValueError(f"{len(active)} ResumableBatchSamplers over this cursor have a batch in flight; "
                               "pass the training DataLoader's sampler itself as Checkpoint(cursor=...)")
        active[0].advance()

    def _scaler(self) -> Any:
        adapter = getattr(self.model, "_adapter", None)
        if getattr(adapter, "_amp_level", "O0") == "O0":
            return None
        if self.model._scaler is None:  # hapi makes it at the first batch; make it now to restore it
            self.model._scaler = paddle.amp.GradScaler(**getattr(adapter, "_amp_configs", {}))
        return self.model._scaler

    def _objects(self) -> dict[str, Any]:
        objects: dict[str, Any] = {"model": self.model}
        if self.cursor is not None:
            objects["cursor"] = self._cursor()
        scaler = self._scaler()
        if scaler is not None:
            objects["scaler"] = scaler
        return objects

    def _restore(self) -> None:
        state = self._manager.restore(**self._objects())
        fit = ((state.extra or {}).get("paddle") or {}).get("fit") or {}
        self._batches = int(fit.get("batches", state.step))
        self._epoch = int(fit.get("epoch", state.epoch))
        self._saved_at = self._batches
        self.restored, self.initial_epoch = state, self._epoch

    def _flush(self, *, aligned: bool) -> None:
        if not self._due or not aligned:
            return
        self._due = False
        if self._saved_at == self._batches or paddle.distributed.get_rank() != 0:
            return
        epoch = self._cursor().epoch if self.cursor is not None else self._epoch
        objects = self._objects()
        # Views, not copies: a synchronous save writes them before training goes on, and an
        # asynchronous manager copies a given state into its reused staging buffers first.
        state = capture(objects.pop("model"), cursor=objects.get("cursor"), scaler=objects.get("scaler"),
                        copy=False)
        state.step, state.epoch = self._batches, epoch
        state.extra.setdefault("paddle", {})["fit"] = {"batches": self._batches, "epoch": epoch}
        self._manager.save(self._batches, state)
        self._saved_at = self._batches
