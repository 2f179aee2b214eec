"""Checkpoint: a ``paddle.Model.fit`` (hapi) callback that saves through CheckpointManager and
resumes exactly at the next unseen batch.

Use it with a :class:`ckptcore_paddle.DataLoader` (``Checkpoint(root, cursor=loader)``), which hands hapi
the cursor's batches; a ``paddle.io.DataLoader`` over a :class:`~ckptcore_paddle.ResumableBatchSampler`
also works (the callback then advances the sampler).  On SIGTERM (``save_on_preemption=True``, the
default) the callback lets the batch in progress finish, ends hapi's loop after it, saves that batch
through ``CheckpointManager.save_if_preempted`` once hapi's own callbacks are done with it, and
stops ``fit``.  Every save carries ``metrics=`` from hapi's logs; ``save_best_only`` writes only
improvements of ``monitor``.

How resuming works in hapi (Paddle 3.x)
---------------------------------------
``fit`` has no ``initial_epoch``: its loop is ``for epoch in range(epochs)`` over the DataLoader it
was given, calling ``on_train_begin`` once first.  The callback therefore

* restores the newest checkpoint in ``on_train_begin``: model, optimizer, its LR scheduler, the
  cursor and the RNGs (and the AMP GradScaler, if ``prepare`` enabled AMP).  The loader then
  starts its next ``iter()`` at the cursor,
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

import logging
import math
import os
import warnings
from typing import Any, Mapping

import paddle

from ckptcore.adapter import check_url, tiers
from ckptcore.adapter import CALLBACK_KEEP
from ckptcore.cursor import CursorShard, DataCursor
from ckptcore.manager import CheckpointManager
from ckptcore.state import TrainingState

from . import _shield_logging
from ._capture import capture
from ._data import ResumableBatchSampler, samplers_of
from ._loader import DataLoader

__all__ = ["Checkpoint"]

_log = logging.getLogger("ckptcore")
_shield_logging()  # paddle is imported: its root handler leaves ckptcore's records alone
_NOT_METRICS = frozenset({"step", "batch_size"})


class Checkpoint(paddle.callbacks.Callback):
    """Save a ``paddle.Model.fit`` run under ``root`` and resume it exactly.

    Args:
        root: A folder or any fsspec URL; checkpoints go to ``<root>/step-<batches trained>``.  A
            non-empty str or path-like, else ``ValueError`` / ``TypeError`` before anything is created.
        save_freq: ``"epoch"`` (at the end of every epoch) or an int N (every N batches, and at
            the end of every epoch).  A checkpoint is also written when ``fit`` ends.
        cursor: The training :class:`ckptcore_paddle.DataLoader` (or its ``DataCursor``), or the
            :class:`~ckptcore_paddle.ResumableBatchSampler` of a ``paddle.io.DataLoader``.  Without one only ``"epoch"`` is
            exact (a ``shuffle=True`` DataLoader draws each epoch's order from numpy's global RNG
            as the epoch starts, and the checkpoint holds that RNG), an int ``save_freq`` is
            refused, and resuming a run that already completed ``epochs`` raises ValueError
            (with a cursor it trains nothing).
        keep: Retention, as for :class:`~ckptcore.CheckpointManager` (default:
            ``ckptcore.adapter.CALLBACK_KEEP``, the newest 3, as in every adapter's callback).
        async_save: Write in a background thread.
        storage_options: Passed to fsspec (through the manager).
        backup: A bucket tier behind ``root`` (a ``ckptcore.Backup``, a URL, or a list of them),
            as ``CheckpointManager(backup=...)`` takes it: each committed checkpoint replicated
            in the background, restored from when ``root`` has none.  (``backup_keep`` and
            ``backup_storage_options``, the older spellings, still work with a
            ``DeprecationWarning``.)
        lease: A ``ckptcore.Lease`` for the writer locks on object stores.
        lock: Take the root's writer lock (the manager's ``lock=``).
        save_on_preemption: Catch SIGTERM (the manager's ``save_on_preemption=``): after the batch
            in progress, save it and stop ``fit`` cleanly (``model.stop_training``).  With a
            cursor the save is exact mid-epoch; without one, a SIGTERM mid-epoch stops without
            saving (the last epoch checkpoint stays the one to resume from, and that is logged).
        monitor: The metric ``save_best_only`` watches, by the name in hapi's logs (``"loss"``,
            ``"acc"``...; evaluation results as ``"eval_<name>"``).
        mode: ``"min"``, ``"max"`` or ``"auto"`` (``"max"`` when ``monitor`` contains ``"acc"``).
        save_best_only: Write a due checkpoint only when ``monitor`` improved on the best so far
            (the best persists across resumes).  Preemption saves are always written.

    Every checkpoint carries ``metrics=``: the numbers of the latest training logs and evaluation
    logs (prefixed ``eval_``), so ``keep=ckptcore.KeepBest("eval_loss")`` works.

    With ``log_figures`` (the default), ``on_epoch_end`` adds the figures of the last committed
    save to the epoch's logs (``ckpt_save_seconds``, ``ckpt_blocked_seconds``, ``ckpt_bytes``,
    ``ckpt_bytes_written``, ``ckpt_requests``, with a backup ``ckpt_backup_lag_steps`` and
    ``ckpt_backup_lag_seconds``: ``ckptcore.SaveEvent.metrics``), for the callbacks after this
    one (VisualDL, your own); a save is written at the start of the next batch or epoch, so an
    epoch's logs carry the save before it.  They are never recorded as a checkpoint's metrics.

    After ``on_train_begin``, ``restored`` is the state that was restored (None on a fresh start)
    and ``initial_epoch`` the number of epochs it had completed.

    Example:
        >>> cursor = ckptcore.DataCursor(len(train_ds), 64, seed=0)                       # doctest: +SKIP
        >>> loader = ckptcore_paddle.DataLoader(train_ds, cursor, num_workers=2)          # doctest: +SKIP
        >>> model.fit(loader, epochs=10,                                                  # doctest: +SKIP
        ...           callbacks=[ckptcore_paddle.Checkpoint("ckpts", save_freq=100, cursor=loader)])
    """

    def __init__(self, root: str | os.PathLike, *, save_freq: str | int = "epoch", cursor: Any = None,
                 keep: Any = CALLBACK_KEEP, async_save: bool = False, storage_options: Mapping[str, Any] | None = None,
                 lock: bool = True, save_on_preemption: bool = True, monitor: str = "loss", mode: str = "auto",
                 save_best_only: bool = False, backup: Any = None, lease: Any = None,
                 backup_keep: Any = None, backup_storage_options: Mapping[str, Any] | None = None,
                 log_figures: bool = True):
        # Checked before anything else: "" would put checkpoints in "/" and None in a folder "None".
        root = check_url(root, "root")
        super().__init__()
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int)
                                     or save_freq < 1):
            raise ValueError(f"save_freq must be 'epoch' or a positive int, got {save_freq!r}")
        if cursor is not None and not isinstance(cursor, (DataLoader, ResumableBatchSampler, DataCursor,
                                                           CursorShard)):
            raise TypeError("cursor must be a ckptcore_paddle.DataLoader, ResumableBatchSampler, DataCursor or "
                            f"CursorShard, got {type(cursor).__name__}")
        if not isinstance(monitor, str) or not monitor:
            raise TypeError(f"monitor must be a non-empty str, got {monitor!r}")
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
        if cursor is None and save_freq != "epoch":
            raise ValueError("saving every N batches needs the data position to resume exactly: pass "
                             "cursor=<the training ckptcore_paddle.DataLoader>")
        self.root = root
        self.save_freq = save_freq
        self.cursor = cursor
        self.keep, self.async_save, self.storage_options = keep, async_save, dict(storage_options or {})
        self.lock, self.save_on_preemption = bool(lock), bool(save_on_preemption)
        self.log_figures = bool(log_figures)
        # A bucket tier behind the fast root (CheckpointManager(backup=...)): every committed
        # step replicated in the background; on_train_end waits for it.
        self._backup = tiers(backup, lease, backup_keep, backup_storage_options)
        self.monitor, self.save_best_only = monitor, bool(save_best_only)
        self.mode = mode if mode != "auto" else ("max" if "acc" in monitor else "min")
        self.best: float | None = None
        self._metrics: dict[str, float] = {}
        self._position: dict[str, Any] | None = None
        self._preempted = False
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
                                          storage_options=self.storage_options, lock=self.lock,
                                          save_on_preemption=self.save_on_preemption,
                                          **self._backup)
        self._batches = self._epoch = self._pass_batches = 0
        self._saved_at, self._due, self._stopped, self.restored = None, False, False, None
        self._metrics, self.best, self._preempted = {}, None, False
        self._position = None if self.cursor is None else self._cursor().state_dict()
        epochs = self._epochs()
        for s in self._samplers():
            s._end_epoch = epochs
        try:
            if self._manager.latest_step() is not None:
                self._restore()
            if epochs is not None and self._epoch >= epochs and self.cursor is None:
                raise ValueError(f"the checkpoint in {self.root} has already completed {self._epoch} epochs "
                                 f"(fit was asked for {epochs}); pass a larger epochs= or a new root")
        except BaseException:
            self._abandon()  # fit ends here without on_train_end
            raise

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._flush(aligned=True)
        self._pass_batches = 0

    def on_train_batch_begin(self, step: int, logs: Any = None) -> None:
        self._flush(aligned=self._pass_batches % self._accumulate() == 0)

    def on_train_batch_end(self, step: int, logs: Any = None) -> None:
        self._advance()
        if self.cursor is not None:  # what has been trained: the loader may hand out the next batch first
            self._position = self._cursor().state_dict()
        self._batches += 1
        self._pass_batches += 1
        self._note(logs)
        if self.save_freq != "epoch" and self._batches % self.save_freq == 0:
            self._due = True
        if self._manager is not None and getattr(self._manager, "preempted", False) and not self._preempted:
            # Stop after this batch; the save waits for on_epoch_end, after hapi's LRScheduler
            # callback has stepped for this batch.  hapi reads num_iters after each batch and
            # breaks its loop when it runs out (stop_training alone ends only the epoch loop).
            self._preempted = True
            self.model.num_iters = 1
            self.model.stop_training = self._stopped = True

    def on_eval_end(self, logs: Any = None) -> None:
        self._note(logs, prefix="eval_")

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        # Without a cursor only a whole epoch is a position; a preempted pass may have ended early.
        complete = not self._preempted or self._pass_batches >= self._steps()
        if self.cursor is not None:
            self._epoch = self._cursor().epoch
        elif complete:
            self._epoch += 1
        if self._preempted:
            if self.cursor is not None or complete:
                self._save_preempted()
            else:
                _log.warning("Checkpoint: SIGTERM in the middle of an epoch without a cursor: stopping "
                             "without a save (the last epoch checkpoint resumes exactly; pass cursor= to "
                             "save mid-epoch)")
            return
        self._due = True
        last = None if self._manager is None else self._manager.last_save
        if self.log_figures and isinstance(logs, dict) and last is not None:
            logs.update(last.metrics())  # for the callbacks after this one
        epochs = self._epochs()
        if epochs is not None and self._epoch >= epochs and epoch + 1 < epochs:
            self.model.stop_training = self._stopped = True  # hapi's loop would run past the total

    def on_train_end(self, logs: Any = None) -> None:
        try:
            if self._preempted:
                self._due = False  # on_epoch_end saved what can be resumed exactly
            elif self._saved_at != self._batches:
                self._due = True
            self._flush(aligned=True)
        finally:
            if self._stopped:
                self.model.stop_training = False  # hapi never resets it; a later fit would stop early
            for s in self._samplers():
                s._end_epoch = None  # the loader is the caller's again: a loop after fit is not empty
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
        return c.cursor if isinstance(c, (DataLoader, ResumableBatchSampler, CursorShard)) else c

    def _samplers(self) -> list[ResumableBatchSampler]:
        if isinstance(self.cursor, DataLoader):
            return [self.cursor.batch_sampler]
        return [] if self.cursor is None else samplers_of(self.cursor)

    def _advance(self) -> None:
        if self.cursor is None:
            return
        if any(s._auto for s in self._samplers()):
            return  # a ckptcore_paddle.DataLoader advanced it as it handed the batch out
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
        scaler = self._scaler()
        if scaler is not None:
            objects["scaler"] = scaler
        return objects

    def _restore(self) -> None:
        objects = self._objects()
        if self.cursor is not None:
            objects["cursor"] = self._cursor()
        state = self._manager.restore(seed=True, **objects)  # (from the bucket: kept locally too)
        fit = ((state.extra or {}).get("paddle") or {}).get("fit") or {}
        self._batches = int(fit.get("batches", state.step))
        self._epoch = int(fit.get("epoch", state.epoch))
        self._saved_at = self._batches
        self.restored, self.initial_epoch = state, self._epoch
        best = fit.get("best")
        self.best = None if best is None else float(best)
        if self.cursor is not None:
            self._position = self._cursor().state_dict()

    def _note(self, logs: Any, prefix: str = "") -> None:
        """Keep the numbers of hapi's latest logs (a loss comes as a one-element list)."""
        for k, v in (logs or {}).items():
            if k in _NOT_METRICS or not isinstance(k, str) or k.startswith("ckpt_"):
                continue  # (ckpt_*: a save's figures, not the model's)
            if isinstance(v, (list, tuple)) and len(v) == 1:
                v = v[0]
            try:
                f = float(v)
            except (TypeError, ValueError):
                continue
            if math.isfinite(f):
                self._metrics[prefix + k] = f

    def _improved(self) -> bool:
        value = self._metrics.get(self.monitor)
        if value is None:
            msg = (f"Checkpoint(save_best_only=True): no {self.monitor!r} in hapi's logs "
                   f"(it has {sorted(self._metrics) or 'nothing yet'}); checkpoint {self._batches} skipped")
            _log.warning("%s", msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            return False
        if self.best is not None and not (value < self.best if self.mode == "min" else value > self.best):
            _log.info("Checkpoint: %s=%g does not improve on %g; checkpoint %d skipped",
                      self.monitor, value, self.best, self._batches)
            return False
        self.best = value
        return True

    def _save_preempted(self) -> None:
        if self._saved_at == self._batches or paddle.distributed.get_rank() != 0:
            return
        if self._manager.save_if_preempted(self._batches, self._state(), metrics=self._metrics or None):
            self._saved_at = self._batches

    def _steps(self) -> int:
        return int((self.params or {}).get("steps") or 0)

    def _state(self) -> TrainingState:
        objects = self._objects()
        # Views, not copies: a synchronous save writes them before training goes on, and an
        # asynchronous manager copies a given state into its reused staging buffers first.
        state = capture(objects.pop("model"), scaler=objects.get("scaler"), copy=False)
        epoch = self._position["epoch"] if self._position is not None else self._epoch
        if self._position is not None:
            state.data = dict(self._position)
        state.step, state.epoch = self._batches, epoch
        fit = {"batches": self._batches, "epoch": epoch}
        if self.best is not None:
            fit["best"] = self.best
        state.extra.setdefault("paddle", {})["fit"] = fit
        return state

    def _flush(self, *, aligned: bool) -> None:
        if not self._due or not aligned:
            return
        self._due = False
        if self._saved_at == self._batches or paddle.distributed.get_rank() != 0:
            return
        if self.save_best_only and not self._improved():
            return
        try:
            self._manager.save(self._batches, self._state(), metrics=self._metrics or None)
        except BaseException:
            self._abandon()  # hapi has no hook for a failed fit
            raise
        self._saved_at = self._batches

    def _abandon(self) -> None:
        """Release the writer lock and the SIGTERM handler of a fit that is ending in an error."""
        manager, self._manager = self._manager, None
        try:
            manager.close()
        except Exception as e:  # noqa: BLE001 - the error in flight is the one to report
            _log.warning("Checkpoint: closing the manager after an error failed too: %s", e)
