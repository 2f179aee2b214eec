"""``BackupAndRestore``: ``model.fit`` that survives being killed and resumes at the next unseen batch.

The contract
------------
``model.fit(ckptcore_keras.dataset(cursor, x, y), epochs=E, callbacks=[cb], shuffle=False)``
with ``cb = BackupAndRestore(root, cursor=cursor, save_freq=...)`` (the cursor shuffles:
``fit``'s default ``shuffle=True`` does nothing on a ``tf.data.Dataset`` but warn so):

* **Saving.** After every ``save_freq`` trained batches (or at each epoch's end
  for ``"epoch"``), and once more when ``fit`` returns, the callback captures the
  whole state in the training thread (model and optimizer variables, schedule,
  RNGs, the cursor, ``model.metrics_variables``, and its own progress: Keras
  epoch, batches trained in it, batches trained in all) and saves it through a
  :class:`ckptcore.CheckpointManager` as step ``<batches trained in all>``.
* **Advancing.** The callback advances the cursor in ``on_train_batch_end``, by
  the number of batches the step trained (``steps_per_execution`` included), so
  the saved position counts batches trained, never batches the input pipeline
  fetched ahead.  Nothing else may advance the cursor during ``fit``.
* **Epochs.** When the cursor rolls over, the callback ends the Keras epoch right
  there (it sets ``model.stop_training`` to a marker and clears it in
  ``on_epoch_end``), so Keras epochs are cursor epochs, including a shorter
  first epoch after a resume.  Keras itself cannot do this: a dataset of unknown
  length that ends early makes Keras 3.15 remember that length, and later epochs
  would be cut to it.  Hence ``steps_per_epoch`` is rejected with a cursor.
* **Resuming.** ``on_train_begin`` restores the newest checkpoint that verifies
  (into the model, the optimizer, which it builds if needed, the RNGs and the
  cursor) and sets ``model._initial_epoch`` as Keras' own callback does: to the
  interrupted epoch, or the next one if it had ended.  The first iterator then
  starts at the cursor's next unseen batch; the interrupted epoch's metrics
  continue from their saved values, so its logs equal an uninterrupted run's.
* **What is redone.** Batches trained after the last checkpoint are trained
  again (the same batches, with the same RNG states).  ``on_epoch_end`` work
  (validation, other callbacks) of an epoch whose last batch was saved but whose
  ``on_epoch_end`` did not run is skipped.
* **Without a cursor** the data cannot be positioned: like Keras' own callback, a
  mid-epoch checkpoint redoes the interrupted epoch from its first batch (warned).
* **Backends.** The same on Keras' TensorFlow, JAX and PyTorch backends.  On JAX, ``fit`` keeps
  the state outside the variables during an epoch; a save reads ``self.model``, which puts it
  back first (Keras' ``jax_state_sync``), and nothing else does.
* **Threads.** The callback overrides ``on_train_batch_end`` and is not
  ``async_safe``, so Keras calls batch hooks synchronously in the training
  thread, where Keras keeps its global seed generator; ``async_save=True`` only
  moves the writing to a background thread.
* **Several fits.**  A ``fit`` interrupted by an exception (Ctrl-C in a notebook) never
  reaches ``on_train_end``: the next ``fit`` with the same callback object restores the
  newest checkpoint and resumes at its epoch and batch, as Keras' own callback does.
  After a ``fit`` that ended normally, the next one starts normally (``model._initial_epoch``
  is reset) and does not restore the checkpoint this callback just wrote (the model
  holds it).  The checkpoints are kept (retention ``keep``; ``delete_checkpoint=True``
  deletes them when ``fit`` ends normally, as Keras does): running the finished script
  again restores the final state and trains nothing.  One process writes a root at a time
  (the manager's lock, a lease that a dead writer's successor takes over).
* **Epoch ends.**  An epoch counts as done once its last batch is trained: when the cursor
  rolls over, or, without a cursor, at batch ``steps`` of a ``fit`` that knows its
  steps per epoch.  So an integer ``save_freq`` that lands on an epoch's last batch
  records a finished epoch, and a re-run does not train it again.
* **Metrics and best only.**  Each save records the run's finite scalar logs (all of them,
  or those named in ``metrics=`` plus ``monitor``) as the checkpoint's metrics, so retention
  such as ``ckptcore.KeepBest("loss")`` works.  ``save_best_only=True`` saves only when
  ``monitor`` improves (``mode`` ``"min"``/``"max"``/``"auto"``, Keras' spellings); the
  best value so far travels in the checkpoint, so a resumed run keeps comparing to it.
* **Save figures in the logs.**  At each epoch's end the callback adds the figures of its last
  committed save to the epoch's logs (``ckpt_save_seconds``, ``ckpt_blocked_seconds``: what
  training waited, ``ckpt_bytes``, ``ckpt_bytes_written``, ``ckpt_requests``, and with a
  backup ``ckpt_backup_lag_steps``/``ckpt_backup_lag_seconds``: ``ckptcore.SaveEvent.metrics``),
  so they land in ``History`` and the progress bar beside the loss; ``log_figures=False`` leaves
  the logs alone.  They are never recorded as a checkpoint's metrics.
* **Preemption.**  The manager catches SIGTERM (``save_on_preemption=False`` to opt out);
  after each batch the callback asks ``manager.preempted``, saves the batch just
  trained through ``manager.save_if_preempted`` (synchronously) and stops ``fit``.

The callback may sit anywhere in the list: a stop another callback requests
(EarlyStopping...) is never cleared, because the end-of-epoch marker is a
distinct object.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Mapping, Sequence

import keras
import numpy as np

from ckptcore.adapter import check_url, tiers, unapplied_parts
from ckptcore.adapter import CALLBACK_KEEP
from ckptcore.errors import RestoreError
from ckptcore.manager import CheckpointManager

from ._capture import capture, restore
from ._data import advance

__all__ = ["BackupAndRestore"]

log = logging.getLogger("ckptcore")

_SECTION, _PROGRESS = "keras", "fit"   # state.extra["keras"]["fit"]
_OLD_PROGRESS = "keras_fit"             # where checkpoints written before it moved keep it
# root URL -> the manager a BackupAndRestore of this process opened on it.  fit does not call
# on_train_end when it raises, so an interrupted fit (Ctrl-C in a notebook) leaves its
# manager holding the root's writer lock; the next callback on that root closes it.
_OPEN: dict[str, CheckpointManager] = {}


class _EndOfEpoch:
    """The ``model.stop_training`` value that ends one Keras epoch, not the run."""

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "<ckptcore_keras: end of epoch>"


_END_OF_EPOCH = _EndOfEpoch()


class BackupAndRestore(keras.callbacks.Callback):
    """Back up the whole training state to ``root`` and resume ``fit`` exactly where it stopped.

    Args:
        root: Any fsspec URL (a local folder, ``s3://bucket/run``...): a non-empty str or
            path-like, else ``ValueError`` / ``TypeError`` before anything is created.
        backup_dir: Keras' spelling of ``root`` (give one of them).
        save_freq: ``"epoch"``, or save every this many trained batches.
        cursor: The :class:`ckptcore.DataCursor` that ``ckptcore_keras.dataset``
            reads; the callback advances it and resumes it mid-epoch.
        keep: Retention, as for :class:`ckptcore.CheckpointManager` (an int keeps the
            last n; the older ones are the fallback if the newest is damaged;
            ``ckptcore.KeepBest("val_loss")`` ranks by the recorded metrics).  The
            default, ``ckptcore.adapter.CALLBACK_KEEP``, is every adapter's callback's.
        async_save: Write checkpoints in a background thread (the state is still
            captured in the training thread, between steps).
        metrics: The names of the logs to record with each checkpoint (default: every
            finite scalar Keras logs at that point: ``loss``, compiled metrics, and at an
            epoch's end ``val_*``).
        monitor: The log that ``save_best_only`` compares (recorded as well).
        mode: ``"auto"``, ``"min"`` or ``"max"`` (``"auto"``: max for names with ``acc``,
            ``auc`` or ``fmeasure``, else min), as in ``keras.callbacks.ModelCheckpoint``.
        save_best_only: Save only when ``monitor`` (default ``"val_loss"``) improved on the
            best value saved so far; no final save at the end of ``fit``.  A preemption
            save still happens (its state would be lost otherwise).
        delete_checkpoint: Delete every checkpoint of ``root`` when ``fit`` ends normally
            (not when it was preempted), as Keras' ``BackupAndRestore`` does by default.
            Off by default here: kept checkpoints make a finished script's re-run train
            nothing.
        lock: Hold the root's writer lease while training (``CheckpointManager(lock=)``).
        save_on_preemption: Catch SIGTERM, save the batch just trained and stop ``fit``.
        storage_options: Passed to fsspec.
        backup: A bucket tier behind ``root`` (a ``ckptcore.Backup``, a URL, or a list of them),
            as ``CheckpointManager(backup=...)`` takes it: each committed checkpoint replicated
            in the background, restored from when ``root`` has none.  (``backup_keep`` and
            ``backup_storage_options``, the older spellings, still work with a
            ``DeprecationWarning``.)
        lease: A ``ckptcore.Lease`` for the writer locks on object stores.
        log_figures: Add the last save's figures to each epoch's logs (``ckpt_save_seconds``...).

    Example:
        >>> cursor = ckptcore.DataCursor(len(x), 64, seed=0)                  # doctest: +SKIP
        >>> cb = ckptcore_keras.BackupAndRestore("gs://b/run1", save_freq=500,
        ...                                      cursor=cursor)                # doctest: +SKIP
        >>> ds = ckptcore_keras.dataset(cursor, x, y)                          # doctest: +SKIP
        >>> model.fit(ds, epochs=10, callbacks=[cb], shuffle=False)            # doctest: +SKIP
    """

    def __init__(self, root: Any = None, *, backup_dir: Any = None,
                 save_freq: str | int = "epoch", cursor: Any = None,
                 keep: Any = CALLBACK_KEEP, async_save: bool = False,
                 metrics: str | Sequence[str] | None = None, monitor: str | None = None,
                 mode: str = "auto", save_best_only: bool = False,
                 delete_checkpoint: bool = False, lock: bool = True,
                 save_on_preemption: bool = True,
                 storage_options: Mapping[str, Any] | None = None, backup: Any = None,
                 lease: Any = None, backup_keep: Any = None,
                 backup_storage_options: Mapping[str, Any] | None = None,
                 log_figures: bool = True):
        if root is None and backup_dir is None:
            raise TypeError("BackupAndRestore needs root (or backup_dir, Keras' spelling of it)")
        if root is not None and backup_dir is not None:
            raise TypeError("BackupAndRestore: give root or backup_dir (the same thing), not both")
        # Checked before anything else: str("") is "/" to the manager and str(None) a folder "None".
        root = check_url(root if root is not None else backup_dir, "root")
        super().__init__()
        if save_freq != "epoch" and (not isinstance(save_freq, int) or isinstance(save_freq, bool)
                                     or save_freq < 1):
            raise ValueError(f"save_freq must be 'epoch' or a positive int, got {save_freq!r}")
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
        if monitor is None and save_best_only:
            monitor = "val_loss"  # keras.callbacks.ModelCheckpoint's default
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise TypeError(f"monitor must be the name of a log (e.g. 'loss'), got {monitor!r}")
        if isinstance(metrics, str):
            metrics = (metrics,)
        if metrics is not None:
            metrics = tuple(metrics)
            if not all(isinstance(m, str) and m for m in metrics):
                raise TypeError(f"metrics must be names of logs (str), got {metrics!r}")
        self.root, self.backup_dir, self.save_freq, self.cursor = root, root, save_freq, cursor
        self.keep, self.async_save = keep, async_save
        self.metrics = None if metrics is None else tuple(dict.fromkeys(
            metrics + ((monitor,) if monitor else ())))
        self.monitor, self.save_best_only = monitor, bool(save_best_only)
        self.mode = mode if mode != "auto" or monitor is None else (
            "max" if any(k in monitor for k in ("acc", "auc", "fmeasure")) else "min")
        self.delete_checkpoint, self.lock = bool(delete_checkpoint), lock
        self.save_on_preemption = bool(save_on_preemption)
        self.log_figures = bool(log_figures)
        self.storage_options = dict(storage_options or {})
        # A bucket tier behind the fast root (CheckpointManager(backup=...)): every committed
        # step replicated in the background; on_train_end waits for it.
        self._backup = tiers(backup, lease, backup_keep, backup_storage_options)
        self._manager: CheckpointManager | None = None
        self._batches = 0          # batches trained in the whole run, over all processes
        self._epoch = 0            # the Keras epoch in progress
        self._in_epoch = 0         # batches trained in it
        self._epoch_done = False
        self._since_save = 0
        self._last_step: int | None = None  # the checkpoint this callback wrote or restored last
        self._resume: tuple[int, int, dict] | None = None  # (epoch, batches done, metrics)
        self._late_metrics: tuple[dict[str, list[np.ndarray]], set[int]] | None = None
        self._begin = 0
        self._best: float | None = None     # the best monitored value saved so far
        self._running = False      # between on_train_begin and on_train_end
        self._preempted = False
        self._warned_monitor = False

    @property
    def manager(self) -> CheckpointManager:
        """The :class:`ckptcore.CheckpointManager` of ``root`` (opened on first use)."""
        if self._manager is None:
            # The previous fit's manager on this root is closed first: it holds the root's lock,
            # which the new manager checks for at construction (lock=True).
            stale = _OPEN.pop(self.root, None)
            if stale is not None:
                try:
                    stale.close()
                except Exception as e:  # noqa: BLE001 - its run is over; report and move on
                    warnings.warn(f"{self.root}: the previous fit's last save failed: {e!r}",
                                  stacklevel=3)
            mgr = CheckpointManager(self.root, keep=self.keep, async_save=self.async_save,
                                    storage_options=self.storage_options, lock=self.lock,
                                    save_on_preemption=self.save_on_preemption, **self._backup)
            self._manager = _OPEN[self.root] = mgr
        return self._manager

    # -- resume ---------------------------------------------------------------------------------
    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.cursor is not None and self.params.get("steps") is not None:
            raise ValueError("BackupAndRestore(cursor=...) ends each epoch where the cursor does: "
                             "train on ckptcore_keras.dataset(cursor, ...) and do not pass "
                             "steps_per_epoch (a resumed epoch is shorter than the others)")
        interrupted, self._running, self._preempted = self._running, True, False
        latest = self.manager.latest_step()
        if latest is None:
            return  # nothing saved yet
        if latest == self._last_step and not interrupted:
            return  # this callback's own last save, at the end of a fit: the model holds it
        if interrupted:
            # The interrupted fit trained past its last checkpoint (model, optimizer, cursor):
            # go back to that checkpoint, as a new process would.
            log.info("%s: the previous fit with this callback was interrupted; resuming from "
                     "step %d", self.root, latest)
        self._restore(self.manager.restore(seed=True))  # (from the bucket: kept locally too)

    def _restore(self, state: Any) -> None:
        progress = _progress(state)
        if progress is None:
            raise RestoreError(f"{self.root}: the newest checkpoint was not written by "
                               "ckptcore_keras.BackupAndRestore (it has no fit progress); "
                               "use another root, or restore it with ckptcore.load_state")
        with unapplied_parts() as unapplied:
            restore(state, self.model, cursor=self.cursor)
        # The run's lineage records what went where (ckpt log: an exact resume, or flagged).
        self.manager.restored_into(state, unapplied=unapplied, model=self.model,
                                   cursor=self.cursor)
        epoch, done = int(progress["epoch"]), bool(progress["epoch_done"])
        in_epoch = 0 if done else int(progress["batch"])
        self._batches = self._last_step = int(progress["batches"])
        self._since_save = 0
        best = progress.get("best")
        self._best = float(best) if isinstance(best, (int, float)) else None
        start = epoch + 1 if done else epoch
        if in_epoch and self.cursor is None:
            warnings.warn(f"resuming in the middle of epoch {epoch} without a cursor: the epoch "
                          "is trained again from its first batch; pass cursor= and train on "
                          "ckptcore_keras.dataset(cursor, ...) to continue at the next batch",
                          stacklevel=2)
            in_epoch = 0
        self._resume = (start, in_epoch, progress.get("metrics") or {}) if in_epoch else None
        self.model._initial_epoch = start  # what keras.callbacks.BackupAndRestore sets, too

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch, self._in_epoch, self._epoch_done = epoch, 0, False
        resume, self._resume = self._resume, None
        if resume is not None and resume[0] == epoch:
            self._in_epoch = resume[1]
            # fit has just reset the metrics; continue the interrupted epoch's instead.
            existing = {id(v) for v in self.model.metrics_variables}
            self._late_metrics = (_assign_metrics(self.model, resume[2]), existing)

    # -- progress -------------------------------------------------------------------------------
    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self._begin = batch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        trained = max(1, batch - self._begin + 1)  # steps_per_execution
        rolled = False
        if self.cursor is not None:
            trained, rolled = advance(self.cursor, trained)
        self._batches += trained
        self._in_epoch += trained
        self._since_save += trained
        if self._late_metrics is not None:
            _add_metrics(self.model, *self._late_metrics)
            self._late_metrics = None
        steps = self.params.get("steps") if self.cursor is None else None
        if rolled or (steps is not None and batch + 1 >= steps):
            # The epoch's last batch: a save from here on records the epoch as done.
            self._epoch_done = True
        # self._model, not self.model: on JAX, self.model copies the trainer's state back into
        # the variables (jax_state_sync), which only a save needs.
        if rolled and not self._fit_model().stop_training:
            self._fit_model().stop_training = _END_OF_EPOCH
        if self.manager.preempted:
            self._save_preempted(logs)
        elif self.save_freq != "epoch" and self._since_save >= self.save_freq:
            self._save(logs)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self._fit_model().stop_training is _END_OF_EPOCH:
            self._fit_model().stop_training = False
        if self._preempted:
            return  # stopped mid-epoch by SIGTERM: the epoch is not done
        self._epoch_done = True
        if self.save_freq == "epoch":
            self._save(logs)
        last = self._manager.last_save if self._manager is not None else None
        if self.log_figures and logs is not None and last is not None:
            logs.update(last.metrics())  # History and the progress bar come after this callback

    def on_train_end(self, logs: dict | None = None) -> None:
        try:
            opt = getattr(self.model, "optimizer", None)
            # After fit, Keras swaps EMA averages into the weights: not a state to continue from.
            final = not (self.save_best_only or self._preempted or self.delete_checkpoint
                         or getattr(opt, "use_ema", False))
            if final and self._batches != self._last_step:
                self._save(logs)
            if self._manager is not None:
                if self.delete_checkpoint and not self._preempted:
                    self._delete_all()
                _OPEN.pop(self.root, None)
                self._manager.close()
        finally:
            self._manager = None
            self._running = False
            self.model._initial_epoch = None

    def _fit_model(self) -> Any:
        """The model whose ``stop_training`` fit reads, without ``self.model``'s JAX state sync
        (a ``DistributedDataParallel`` wrapper's Keras model on PyTorch)."""
        model = self._model
        return model if hasattr(model, "stop_training") else model.module

    # -- saving ---------------------------------------------------------------------------------
    def _state(self, logs: Mapping[str, Any] | None) -> tuple[Any, dict[str, float]]:
        recorded = _recorded(logs, self.metrics)
        state = capture(self.model, cursor=self.cursor)
        state.epoch = self._epoch + int(self._epoch_done)
        state.extra.setdefault(_SECTION, {})[_PROGRESS] = {
            "epoch": self._epoch, "batch": self._in_epoch, "epoch_done": self._epoch_done,
            "batches": self._batches, "metrics": _metric_values(self.model), "best": self._best}
        return state, recorded

    def _save(self, logs: Mapping[str, Any] | None = None) -> None:
        if self._batches == self._last_step:
            return
        if self.save_best_only and not self._improved(logs):
            self._since_save = 0
            return
        state, recorded = self._state(logs)
        self.manager.save(self._batches, state, metrics=recorded or None)
        self._last_step, self._since_save = self._batches, 0

    def _improved(self, logs: Mapping[str, Any] | None) -> bool:
        """Whether ``monitor`` in ``logs`` beats the best saved value (and if so, it becomes it)."""
        value = _recorded(logs, (self.monitor,)).get(self.monitor)
        if value is None:
            if not self._warned_monitor:
                self._warned_monitor = True
                warnings.warn(f"save_best_only: {self.monitor!r} is not among the logs at this "
                              f"save ({sorted(logs or {})}); not saving. Monitor a log that exists "
                              "when saving (val_* only at an epoch's end, with save_freq='epoch')",
                              stacklevel=3)
            log.info("save_best_only: no %r in the logs at step %d; not saved",
                     self.monitor, self._batches)
            return False
        better = self._best is None or (value < self._best if self.mode == "min"
                                        else value > self._best)
        if not better:
            log.info("save_best_only: %s=%s at step %d does not improve on %s; not saved",
                     self.monitor, value, self._batches, self._best)
            return False
        self._best = value
        return True

    def _save_preempted(self, logs: Mapping[str, Any] | None) -> None:
        """SIGTERM arrived: save the batch just trained (synchronously) and stop ``fit``."""
        if self._batches == self._last_step:
            self.manager.save_if_preempted(self._batches)
        else:
            state, recorded = self._state(logs)
            self.manager.save_if_preempted(self._batches, state, metrics=recorded or None)
        self._last_step, self._since_save, self._preempted = self._batches, 0, True
        self.model.stop_training = True

    def _delete_all(self) -> None:
        mgr = self.manager
        mgr.wait()
        for step in mgr.steps():
            log.info("%s: delete_checkpoint=True, fit ended: deleting step %d", self.root, step)
            mgr.delete(step)


def _recorded(logs: Mapping[str, Any] | None, names: Sequence[str] | None) -> dict[str, float]:
    """The finite scalar logs (of ``names``, or all) as plain floats, for ``save(metrics=)``."""
    out: dict[str, float] = {}
    for k, v in (logs or {}).items():
        if (names is not None and k not in names) or str(k).startswith("ckpt_"):
            continue  # (ckpt_*: the figures of the previous save, not the model's)
        try:
            a = np.asarray(v)
        except Exception:  # noqa: BLE001 - a log that is not a number is not a metric
            continue
        if a.size == 1 and a.dtype.kind in "fiu" and np.isfinite(a).all():
            out[str(k)] = float(a.reshape(()))
    return out


def _progress(state: Any) -> dict | None:
    """The fit progress a checkpoint holds, or None if ``BackupAndRestore`` did not write it."""
    extra = state.extra or {}
    progress = (extra.get(_SECTION) or {}).get(_PROGRESS)
    if progress is None and isinstance(extra.get(_OLD_PROGRESS), dict):
        log.info("fit progress read from extra[%r], where checkpoints written by older versions "
                 "keep it (now extra[%r][%r])", _OLD_PROGRESS, _SECTION, _PROGRESS)
        progress = extra[_OLD_PROGRESS]
    return progress if isinstance(progress, dict) else None


# -- metrics --------------------------------------------------------------------------------------

def _metric_values(model: Any) -> dict[str, list[np.ndarray]]:
    out: dict[str, list[np.ndarray]] = {}
    for v in model.metrics_variables:
        out.setdefault(v.path, []).append(np.array(v.numpy()))
    return out


def _assign_metrics(model: Any, saved: Mapping[str, Any]) -> dict[str, list[np.ndarray]]:
    """Assign saved metric values to the metric variables that exist; return the rest.

    Compile metrics are built when the train function is first traced, after
    ``on_epoch_begin`` in a fresh process; the rest is added after the first step.
    """
    pending = {k: [np.asarray(a) for a in v] for k, v in saved.items()}
    for v in model.metrics_variables:
        values = pending.get(v.path)
        if values and values[0].shape == tuple(v.shape):
            v.assign(values.pop(0).astype(v.dtype, copy=False))
    return {k: v for k, v in pending.items() if v}


def _add_metrics(model: Any, pending: Mapping[str, list[np.ndarray]], existing: set[int]) -> None:
    """Add saved values to metrics built during the first step (their state is sums and counts)."""
    pending = {k: list(v) for k, v in pending.items()}
    for v in model.metrics_variables:
        values = pending.get(v.path) if id(v) not in existing else None
        if values and values[0].shape == tuple(v.shape):
            v.assign_add(values.pop(0).astype(v.dtype, copy=False))
