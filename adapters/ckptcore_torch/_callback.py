"""Checkpoint: a Lightning callback that saves ``trainer.fit`` through CheckpointManager and resumes
it at the next unseen batch.

Use it with a :class:`ckptcore_torch.DataLoader` (``Checkpoint(root, cursor=loader)``): the loader
moves its cursor as each batch is handed to the loop, and Lightning draws a sized loader's batches
one at a time (no look-ahead), so at ``on_train_batch_end`` the cursor is exactly past the batches
trained; the callback checks this after every batch.  Without a cursor only epoch ends are exact
resume points (``every_n_steps`` is refused and a SIGTERM mid-epoch stops without a save).

What a checkpoint holds
-----------------------
The LightningModule, ``trainer.optimizers[0]``, the scheduler of ``trainer.lr_scheduler_configs``,
the precision plugin's GradScaler (if any), the RNGs, the cursor, and under
``state.extra["torch"]["lightning"]`` the trainer's progress: ``trainer.fit_loop.state_dict()``
(Lightning's own loop counters: epoch, batch, optimizer and scheduler progress), batches trained
and the best ``monitor`` value.  Checkpoint ``step`` numbers count batches trained (with
``accumulate_grad_batches`` several batches share one ``trainer.global_step``).

When (how Lightning's loop is followed)
---------------------------------------
A resume point is *recorded* at ``on_train_batch_end`` (mid-epoch) and at ``on_train_epoch_end``
(the epoch's last batch: Lightning has then run the epoch-end work, which a resume must not
skip), and *written* once Lightning is done with that batch or epoch: at the next
``on_train_batch_start`` / ``on_train_epoch_start`` or at ``on_train_end``.  What runs in between
(the LightningModule's own ``on_train_batch_end``, validation, ``ReduceLROnPlateau`` steps, the
epoch-end hooks) is thus in the saved state, and a checkpoint is exactly the state before the
next batch, as in the Paddle callback.  ``every_n_steps=N`` writes every N batches, plus every
epoch end; ``fit`` ending writes a last one.

How resuming works in Lightning 2.x
-----------------------------------
``on_fit_start`` (after the strategy made the optimizers, before the sanity check and before the
fit loop builds its data fetcher) restores the newest checkpoint and hands the recorded counters
to ``trainer.fit_loop.load_state_dict``, which is what ``trainer.fit(ckpt_path=...)`` does.  So
``trainer.global_step`` (``epoch_loop.automatic_optimization.optim_progress``), the epoch
(``fit_loop.epoch_progress``) and the batch (``epoch_loop.batch_progress``) continue, and
``max_steps``/``max_epochs`` are totals across kills.  Lightning's own restart logic then does
the rest: a point recorded at ``on_train_batch_end`` restarts mid-epoch (no
``on_train_epoch_start``; ``batch_idx`` continues; the data fetcher counts the batches already
done, so ``len(loader)`` must be the full epoch while the first ``iter()`` yields its rest, as
for any resumable loader; the validation due after that batch is skipped, it ran before the
write); a point recorded at ``on_train_epoch_end`` resumes on that epoch's end.

Every ``iter()`` of a ``torch.utils.data.DataLoader`` draws its base seed from torch's global
generator.  An uninterrupted fit drew it at the start of the epoch, before a mid-epoch save: the
RNGs of a mid-epoch checkpoint are therefore put back in ``on_train_start``, after the resumed
fit's own ``iter()``; those of an epoch-end checkpoint in ``on_fit_start``, before it.

Preemption
----------
The manager catches SIGTERM (Lightning's own handler is chained in front of it).  After the
batch in progress the callback saves it through ``save_if_preempted``, sets
``trainer.should_stop`` and clears Lightning's ``received_sigterm``, so ``fit`` returns normally
(instead of raising ``SIGTERMException``) and ``preempted`` is True: end the script then.  That
save is taken at ``on_train_batch_end`` (at ``on_train_epoch_end`` for an epoch's last batch):
anything that would run after it for that batch is not in it.  Only global rank 0 writes.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Mapping

import lightning.pytorch as pl
from lightning.pytorch.loops import _Loop

from ckptcore.adapter import CALLBACK_KEEP, check_url, tiers, unapplied_parts
from ckptcore.cursor import CursorShard, DataCursor
from ckptcore.errors import RestoreError
from ckptcore.manager import CheckpointManager
from ckptcore.rng import restore_rng
from ckptcore.state import TrainingState

from ._capture import capture, restore
from ._rng import restore_framework_rng

__all__ = ["Checkpoint"]

_log = logging.getLogger("ckptcore")
_SECTION, _PROGRESS = "torch", "lightning"  # state.extra["torch"]["lightning"]


class Checkpoint(pl.callbacks.Callback):
    """Save a Lightning ``trainer.fit`` under ``root`` and resume it exactly.

    Args:
        root: A folder or any fsspec URL; checkpoints go to ``<root>/step-<batches trained>``.
        cursor: The training :class:`ckptcore_torch.DataLoader` (or its ``DataCursor`` /
            ``CursorShard``, when the loader advances it as it hands each batch out).
        every_n_steps: Also write every this many batches (needs ``cursor``); None: at epoch
            ends only.  ``fit`` ending always writes.
        keep: Retention, as for :class:`~ckptcore.CheckpointManager` (default
            ``ckptcore.adapter.CALLBACK_KEEP``, the newest 3, as in every adapter's callback).
        async_save: Write in a background thread (captured in the training thread).
        storage_options: Passed to fsspec.
        backup: A bucket tier behind ``root`` (``CheckpointManager(backup=...)``).
        lease: A ``ckptcore.Lease`` for the writer locks on object stores.
        lock: Take the root's writer lock (the manager's ``lock=``).
        save_on_preemption: Catch SIGTERM: save the batch in progress and stop ``fit``.
        monitor: The ``trainer.callback_metrics`` name ``save_best_only`` watches.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (``"max"`` when ``monitor`` contains ``"acc"``).
        save_best_only: Write a due checkpoint only when ``monitor`` improved (the best persists
            across resumes); preemption saves and the final save are always written.

    Every checkpoint carries ``metrics=``: the finite scalars of ``trainer.callback_metrics``.
    With ``log_figures`` (the default), each save's figures are logged through
    ``pl_module.log_dict`` at the next batch's end, as any metric goes to the trainer's loggers
    (``ckpt_save_seconds``, ``ckpt_blocked_seconds``, ``ckpt_bytes``, ``ckpt_bytes_written``,
    ``ckpt_requests``, with a backup ``ckpt_backup_lag_steps``/``ckpt_backup_lag_seconds``:
    ``ckptcore.SaveEvent.metrics``; rank 0, where saves are written); they are never recorded
    as a checkpoint's metrics.
    After ``on_fit_start``, ``restored`` is the restored state (None on a fresh start); after
    ``fit``, ``preempted`` says whether SIGTERM stopped it.

    Example:
        >>> cursor = ckptcore.DataCursor(len(train_ds), 64, seed=0)                      # doctest: +SKIP
        >>> loader = ckptcore_torch.DataLoader(train_ds, cursor)                         # doctest: +SKIP
        >>> ckpt = ckptcore_torch.Checkpoint("ckpts", cursor=loader, every_n_steps=100)  # doctest: +SKIP
        >>> L.Trainer(max_epochs=10, callbacks=[ckpt]).fit(model, loader)                # doctest: +SKIP
        >>> if ckpt.preempted: sys.exit(0)                                               # doctest: +SKIP
    """

    def __init__(self, root: str | os.PathLike, *, cursor: Any = None, every_n_steps: int | None = None,
                 keep: Any = CALLBACK_KEEP, async_save: bool = False,
                 storage_options: Mapping[str, Any] | None = None, backup: Any = None, lease: Any = None,
                 lock: bool = True, save_on_preemption: bool = True, monitor: str = "train_loss",
                 mode: str = "auto", save_best_only: bool = False, log_figures: bool = True):
        root = check_url(root, "root")  # before anything else: "" would be "/", None a folder "None"
        super().__init__()
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
                                          or every_n_steps < 1):
            raise ValueError(f"every_n_steps must be None or a positive int, got {every_n_steps!r}")
        if cursor is not None and not isinstance(_base(cursor), DataCursor):
            raise TypeError("cursor must be a ckptcore_torch.DataLoader, DataCursor or CursorShard, "
                            f"got {type(cursor).__name__}")
        if cursor is None and every_n_steps is not None:
            raise ValueError("saving every N batches needs the data position to resume exactly: pass "
                             "cursor=<the training ckptcore_torch.DataLoader>")
        if not isinstance(monitor, str) or not monitor:
            raise TypeError(f"monitor must be a non-empty str, got {monitor!r}")
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
        self.root, self.cursor, self.every_n_steps = root, cursor, every_n_steps
        self.keep, self.async_save, self.storage_options = keep, async_save, dict(storage_options or {})
        self.lock, self.save_on_preemption = bool(lock), bool(save_on_preemption)
        self.log_figures = bool(log_figures)
        self._logged: Any = None  # the save event whose figures were logged last
        self._backup = tiers(backup, lease)
        self.monitor, self.save_best_only = monitor, bool(save_best_only)
        self.mode = mode if mode != "auto" else ("max" if "acc" in monitor else "min")
        self._manager: CheckpointManager | None = None
        self.restored: TrainingState | None = None
        self.preempted = False
        self._reset()

    def _reset(self) -> None:
        self.best: float | None = None
        self._batches = 0
        self._point: dict[str, Any] | None = None  # the resume point recorded last (see the docstring)
        self._due = False                          # write it once Lightning is done with it
        self._saved_at: int | None = None
        self._rng: dict[str, Any] | None = None    # RNGs to put back in on_train_start
        self._expect: DataCursor | None = None     # where the cursor must be after the next batch
        self._metrics: dict[str, float] = {}

    # -- Lightning hooks ----------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._abandon()  # a previous fit that raised: let its lock and handler go
        self._reset()
        self.restored, self.preempted = None, False
        _objects(trainer)  # one optimizer and scheduler, checked before anything is opened
        self._manager = CheckpointManager(self.root, keep=self.keep, async_save=self.async_save,
                                          storage_options=self.storage_options, lock=self.lock,
                                          save_on_preemption=self.save_on_preemption, **self._backup)
        # Asked once now: SIGTERM is then this loop's to handle (not the default end of the
        # process), also before the first batch ends.
        _ = self._manager.preempted
        try:
            if self._manager.latest_step() is not None:
                self._restore(trainer, pl_module)
        except BaseException:
            self._abandon()  # fit ends here; on_exception may not see it (setup errors)
            raise

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._rng is not None:  # after the fit loop's first iter() (see the docstring)
            _put_rng(self._rng)
            self._rng = None
        c = self._cursor()
        if c is not None:
            n = trainer.num_training_batches
            if trainer.limit_train_batches != 1.0 or (n != c.batches_per_epoch and n != float("inf")):
                raise ValueError(
                    f"Checkpoint(cursor=...): Lightning counts {n} batches an epoch but the cursor's epoch "
                    f"has {c.batches_per_epoch}; leave limit_train_batches at 1.0 and train on a loader "
                    "whose len() is the whole epoch while iter() yields the rest of it (what Lightning "
                    "expects of a resumable loader: it counts the batches already done itself)")
            self._expect = DataCursor.from_state(c.state_dict())

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._flush(trainer, pl_module)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer, pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self._batches += 1
        self._check_cursor()
        self._log_figures(pl_module)
        self._note(trainer)
        if _last_batch(trainer):
            return  # recorded at on_train_epoch_end, after the epoch-end work
        if self.cursor is None:  # only an epoch end is a position without one
            if self._preempt_now(trainer):
                _log.warning("Checkpoint: SIGTERM in the middle of an epoch without a cursor: stopping "
                             "without a save (the last epoch-end checkpoint resumes exactly; pass cursor= "
                             "to save mid-epoch)")
                self._stop(trainer)
            return
        self._point = self._record(trainer, epoch_end=False)
        if self._preempt_now(trainer):
            self._save_preempted(trainer, pl_module)
        elif self.every_n_steps and self._batches % self.every_n_steps == 0:
            self._due = True

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.preempted or not _last_batch(trainer):
            return  # fit stopping mid-epoch (should_stop, max_steps): the batch-end point stays
        self._note(trainer)
        self._point = self._record(trainer, epoch_end=True)
        if self._preempt_now(trainer):
            self._save_preempted(trainer, pl_module)
        else:
            self._due = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.preempted and self._point is not None and self._saved_at != self._point["batches"]:
            self._due = True
            self._flush(trainer, pl_module, final=True)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After Lightning's teardown put its SIGTERM handler back: ours goes back now too.
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._abandon()

    # -- restore ------------------------------------------------------------------------------
    def _restore(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = self._manager.restore(seed=True)  # (from the bucket: kept locally too)
        progress = ((state.extra or {}).get(_SECTION) or {}).get(_PROGRESS)
        if not isinstance(progress, Mapping) or not isinstance(progress.get("loops"), Mapping):
            raise RestoreError(f"{self.root}: the newest checkpoint was not written by "
                               "ckptcore_torch.Checkpoint (it has no Lightning progress); use another root, "
                               "or restore it with ckptcore.load_state")
        optimizer, scheduler, scaler = _objects(trainer)
        cursor = self._cursor()
        with unapplied_parts() as unapplied:
            restore(state, pl_module, optimizer, cursor=cursor, rng=False, scheduler=scheduler,
                    scaler=scaler, warn_data=cursor is None)
        # The run's lineage records what went where (ckpt log: an exact resume, or flagged);
        # the RNG states are put back below (rng=False above only defers them).
        self._manager.restored_into(state, unapplied=unapplied, model=pl_module,
                                    optimizer=optimizer, cursor=cursor)
        trainer.fit_loop.load_state_dict(_plain(progress["loops"]))
        if progress.get("epoch_end"):
            # The epoch has ended: nothing of it is to be restarted.  FitLoop decides so itself
            # for max_epochs, but with max_steps it marks every loaded loop as restarting, and
            # the next epoch would then continue the old one's batch_idx and skip its
            # on_train_epoch_start.
            _Loop.restarting.fset(trainer.fit_loop, False)
            _put_rng(state.rng)  # before the resumed fit's first iter(), as the killed fit had it
        else:
            self._rng = dict(state.rng)
        self._batches = self._saved_at = int(progress["batches"])
        best = progress.get("best")
        self.best = None if best is None else float(best)
        self.restored = state
        _log.info("Checkpoint: resumed %s at step %d (epoch %d, global_step %d)", self.root, state.step,
                  trainer.current_epoch, trainer.global_step)

    # -- record and write ---------------------------------------------------------------------
    def _record(self, trainer: pl.Trainer, *, epoch_end: bool) -> dict[str, Any]:
        c = self._cursor()
        return {"loops": _plain(trainer.fit_loop.state_dict()), "batches": self._batches,
                "epoch_end": epoch_end, "data": None if c is None else c.state_dict(),
                "epoch": trainer.current_epoch + int(epoch_end) if c is None else c.epoch}

    def _state(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> TrainingState:
        point = self._point
        optimizer, scheduler, scaler = _objects(trainer)
        # Views, not copies: a synchronous save writes them before training goes on, and an
        # asynchronous manager copies a given state into its staging buffers first.
        state = capture(pl_module, optimizer, scheduler=scheduler, scaler=scaler, copy=False,
                        step=trainer.global_step, accumulate_every=trainer.accumulate_grad_batches)
        if point["data"] is not None:
            state.data = dict(point["data"])  # the cursor as it was after the point's batch
        state.step, state.epoch = point["batches"], point["epoch"]
        progress = {k: point[k] for k in ("loops", "batches", "epoch_end")}
        if self.best is not None:
            progress["best"] = self.best
        state.extra.setdefault(_SECTION, {})[_PROGRESS] = progress
        return state

    def _flush(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *, final: bool = False) -> None:
        if not self._due or self._point is None:
            return
        self._due = False
        step = self._point["batches"]
        if self._saved_at == step or not trainer.is_global_zero:
            return
        if self.save_best_only and not final and not self._improved(step):
            return
        try:
            self._manager.save(step, self._state(trainer, pl_module), metrics=self._metrics or None)
        except BaseException:
            self._abandon()
            raise
        self._saved_at = step

    def _preempt_now(self, trainer: pl.Trainer) -> bool:
        return self._manager is not None and self._manager.preempted and not self.preempted

    def _stop(self, trainer: pl.Trainer) -> None:
        self.preempted, self._due = True, False
        trainer.should_stop = True
        # Lightning raises SIGTERMException after this batch when it saw SIGTERM; the stop is
        # handled here, so fit returns normally.
        trainer._signal_connector.received_sigterm = False

    def _save_preempted(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop(trainer)
        if trainer.is_global_zero and self._saved_at != self._batches:
            state = self._state(trainer, pl_module)
            if self._manager.save_if_preempted(self._batches, state, metrics=self._metrics or None):
                self._saved_at = self._batches

    # -- helpers ------------------------------------------------------------------------------
    def _cursor(self) -> DataCursor | None:
        return None if self.cursor is None else _base(self.cursor)

    def _check_cursor(self) -> None:
        """The cursor must have moved past exactly the batch just trained (no look-ahead)."""
        c, expect = self._cursor(), self._expect
        if c is None or expect is None:
            return
        expect.next_batch()
        if (c.epoch, c.position) != (expect.epoch, expect.position):
            raise RuntimeError(
                f"Checkpoint: after {self._batches} batches the cursor is at epoch {c.epoch}, position "
                f"{c.position}, but the batches trained put it at epoch {expect.epoch}, position "
                f"{expect.position}: the training loader must advance the cursor as it hands each batch "
                "to Lightning, and nothing else may move it (use ckptcore_torch.DataLoader)")

    def _log_figures(self, pl_module: pl.LightningModule) -> None:
        """Log the figures of a save committed since the last time, through Lightning."""
        last = None if self._manager is None else self._manager.last_save
        if self.log_figures and last is not None and last is not self._logged:
            self._logged = last
            pl_module.log_dict(last.metrics(), on_step=True, on_epoch=False, rank_zero_only=True)

    def _note(self, trainer: pl.Trainer) -> None:
        for k, v in trainer.callback_metrics.items():
            if str(k).startswith("ckpt_"):
                continue  # a save's figures (_log_figures), not the model's
            try:
                f = float(v)
            except (TypeError, ValueError, RuntimeError):
                continue
            if math.isfinite(f):
                self._metrics[str(k)] = f

    def _improved(self, step: int) -> bool:
        value = self._metrics.get(self.monitor)
        if value is None:
            _log.warning("Checkpoint(save_best_only=True): no %r in trainer.callback_metrics (it has %s); "
                         "checkpoint %d skipped", self.monitor, sorted(self._metrics) or "nothing yet", step)
            return False
        if self.best is not None and not (value < self.best if self.mode == "min" else value > self.best):
            return False
        self.best = value
        return True

    def _abandon(self) -> None:
        """Release the writer lock and the SIGTERM handler of a fit that ended in an error."""
        manager, self._manager = self._manager, None
        if manager is None:
            return
        try:
            manager.close()
        except Exception as e:  # noqa: BLE001 - the error in flight is the one to report
            _log.warning("Checkpoint: closing the manager after an error failed too: %s", e)


def _base(cursor: Any) -> Any:
    if isinstance(cursor, CursorShard):
        return cursor.cursor
    inner = getattr(cursor, "cursor", None)  # a ckptcore_torch.DataLoader
    return inner if isinstance(inner, DataCursor) else cursor


def _objects(trainer: pl.Trainer) -> tuple[Any, Any, Any]:
    """The optimizer, LR scheduler and GradScaler a checkpoint holds (one of each at most)."""
    optimizers, configs = list(trainer.optimizers), list(trainer.lr_scheduler_configs)
    if len(optimizers) > 1 or len(configs) > 1:
        raise ValueError(f"ckptcore_torch.Checkpoint saves one optimizer and one LR scheduler; "
                         f"configure_optimizers returned {len(optimizers)} and {len(configs)}")
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return (optimizers[0] if optimizers else None, configs[0].scheduler if configs else None, scaler)


def _last_batch(trainer: pl.Trainer) -> bool:
    """Whether the batch just trained ended the epoch (Lightning's own test of it)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return bool(progress.is_last_batch) or progress.current.ready == trainer.num_training_batches


def _plain(tree: Any) -> Any:
    """Lightning's loop state as plain dicts of ints and bools, without a loader's own state
    (``combined_loader``: the cursor is restored by ckptcore)."""
    if isinstance(tree, Mapping):
        return {str(k): _plain(v) for k, v in tree.items() if k != "combined_loader"}
    if isinstance(tree, (list, tuple)):
        return [_plain(v) for v in tree]
    return tree


def _put_rng(rng: Mapping[str, Any]) -> None:
    if rng:
        restore_framework_rng(rng)  # checks its entries before it sets anything
        restore_rng({k: v for k, v in rng.items() if k in ("python", "numpy")})
