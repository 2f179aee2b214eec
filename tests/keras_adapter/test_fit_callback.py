"""``ckptcore_keras.dataset`` and ``BackupAndRestore`` in one process: order, epochs, edge cases.

Kills in fresh processes are in test_fit_resume.py; here an interruption is an
exception raised from a callback, and "the new process" a new model and callback.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import ckptcore  # noqa: E402
import ckptcore_keras  # noqa: E402
from _keras_helpers import assert_same_bits  # noqa: E402

X = np.random.RandomState(0).randn(15, 10).astype("float32")
Y = np.arange(15, dtype="float32").reshape(15, 1)

pytestmark = pytest.mark.filterwarnings("ignore:.*shuffle=True.*")


# --- dataset ---------------------------------------------------------------------------------

def _epoch(ds) -> list[list[int]]:
    return [np.asarray(b[1] if isinstance(b, tuple) else b).reshape(-1).astype(int).tolist()
            for b in ds]


def test_dataset_yields_rest_of_epoch_and_never_advances():
    cursor = ckptcore.DataCursor(15, 4, seed=3)
    ds = ckptcore_keras.dataset(cursor, X, Y)
    full = _epoch(ds)
    assert full == _epoch(ds)  # nothing advanced the cursor: the same epoch again
    assert (cursor.epoch, cursor.position) == (0, 0)
    want = [cursor.indices(0, s, min(s + 4, 15)).tolist() for s in range(0, 15, 4)]
    assert full == want and sorted(sum(full, [])) == list(range(15))
    cursor.next_batch()
    cursor.next_batch()
    assert _epoch(ds) == full[2:]  # an iterator started mid-epoch: the rest only
    cursor.next_batch()
    cursor.next_batch()
    assert _epoch(ds) == [cursor.indices(1, s, min(s + 4, 15)).tolist() for s in range(0, 15, 4)]


def test_dataset_map_fn_over_indices_nested_arrays_and_shards():
    cursor = ckptcore.DataCursor(15, 4, seed=3)
    table = tf.constant(Y[:, 0] * 10)
    ds = ckptcore_keras.dataset(cursor, map_fn=lambda idx: (tf.gather(table, idx), idx))
    got = [(a.numpy().tolist(), b.numpy().tolist()) for a, b in ds]
    assert [b for _, b in got] == [cursor.indices(0, s, min(s + 4, 15)).tolist() for s in range(0, 15, 4)]
    assert all(a == [10.0 * i for i in b] for a, b in got)

    nested = ckptcore_keras.dataset(cursor, {"a": X, "b": X[:, :2]}, Y,
                                    map_fn=lambda x, y: (x, y * 2))
    (x0, y0) = next(iter(nested))
    assert set(x0) == {"a", "b"} and x0["b"].shape == (4, 2)
    assert y0.numpy().ravel().tolist() == (2 * Y[cursor.indices(0, 0, 4), 0]).tolist()

    parts = [_epoch(ckptcore_keras.dataset(cursor.shard(r, 2), X, Y)) for r in range(2)]
    assert [a + b for a, b in zip(*parts)] == _epoch(ckptcore_keras.dataset(cursor, X, Y))


def test_dataset_checks_its_inputs():
    cursor = ckptcore.DataCursor(15, 4)
    with pytest.raises(ValueError, match="14 rows"):
        ckptcore_keras.dataset(cursor, X[:14])
    with pytest.raises(TypeError, match="map_fn"):
        ckptcore_keras.dataset(cursor, [1, 2, 3])
    with pytest.raises(TypeError, match="DataCursor"):
        ckptcore_keras.dataset(object(), X)


# --- BackupAndRestore ------------------------------------------------------------------------

class Interrupt(Exception):
    pass


class StopAfter(keras.callbacks.Callback):
    """Raise after ``n`` batches of this fit (a crash that on_train_end never sees)."""

    def __init__(self, n):
        super().__init__()
        self.n, self.seen = n, []

    def on_train_batch_end(self, batch, logs=None):
        self.n -= 1
        if self.n == 0:
            raise Interrupt


def _model(**compile_kw):
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((10,)), keras.layers.Dense(3), keras.layers.Dropout(0.2),
                          keras.layers.Dense(1)])
    m.compile(keras.optimizers.Adam(0.01), "mse", **compile_kw)
    return m


def _fit(root, *, crash=None, epochs=3, save_freq=2, cursor=True, extra=(), **fit_kw):
    model = _model(**fit_kw.pop("compile_kw", {}))
    cur = ckptcore.DataCursor(15, 4, seed=5)
    where = {fit_kw.pop("root_as", "root"): root}
    cb = ckptcore_keras.BackupAndRestore(**where, save_freq=save_freq,
                                         cursor=cur if cursor else None, **fit_kw.pop("cb_kw", {}))
    data = ckptcore_keras.dataset(cur, X, Y)
    callbacks = [cb, *extra] + ([StopAfter(crash)] if crash else [])
    try:
        history = model.fit(data, epochs=epochs, verbose=0, callbacks=callbacks, **fit_kw)
    except Interrupt:
        return model, cur, cb, None
    return model, cur, cb, history


def _values(model):
    return [v.numpy() for v in model.variables + model.optimizer.variables]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    model, cursor, _, history = _fit(tmp_path_factory.mktemp("ref") / "ckpt")
    return _values(model), history.history


def test_epoch_mode_async_resume_in_place(tmp_path, reference):
    root = tmp_path / "ckpt"
    _fit(root, crash=6, save_freq="epoch", cb_kw={"async_save": True})  # dies in epoch 1
    assert ckptcore.CheckpointManager(root).steps() == [4]
    model, cursor, cb, history = _fit(root, save_freq="epoch", cb_kw={"async_save": True})
    assert history.epoch == [1, 2] and cursor.epoch == 3
    assert_same_bits(reference[0], _values(model))
    assert history.history["loss"] == reference[1]["loss"][1:]
    assert model._initial_epoch is None  # reset, so a later fit of this model starts normally
    state = ckptcore.load_state(str(root / "step-000000000012"))
    progress = state.extra["keras"]["fit"]
    assert progress == {**progress, "epoch": 2, "batch": 4, "epoch_done": True, "batches": 12}
    assert "keras_fit" not in state.extra
    assert state.epoch == 3 and state.data["epoch"] == 3


def test_progress_under_the_old_key_is_still_read(tmp_path, reference, caplog):
    """Checkpoints written before the progress moved to extra["keras"]["fit"] resume the same."""
    root = tmp_path / "ckpt"
    _fit(root, crash=6)  # dies in epoch 1, after a mid-epoch save
    newest = str(sorted(root.glob("step-*"))[-1])
    state = ckptcore.load_state(newest)
    state.extra["keras_fit"] = state.extra["keras"].pop("fit")
    ckptcore.save_state(newest, state, overwrite=True)
    with caplog.at_level("INFO", logger="ckptcore"):
        model, cursor, cb, history = _fit(root)
    assert "keras_fit" in caplog.text
    assert history.epoch == [1, 2] and cursor.epoch == 3
    assert_same_bits(reference[0], _values(model))
    assert history.history["loss"] == reference[1]["loss"][1:]


def test_default_retention_is_the_shared_one(tmp_path):
    from ckptcore.adapter import CALLBACK_KEEP

    assert ckptcore_keras.BackupAndRestore(tmp_path).keep == CALLBACK_KEEP


def test_steps_per_execution_and_a_second_fit(tmp_path, reference):
    root = tmp_path / "ckpt"
    model, cursor, cb, history = _fit(root, epochs=2, compile_kw={"steps_per_execution": 3})
    # 4 batches an epoch in executions of 3 + 1: epochs still end where the cursor's do.
    assert (cursor.epoch, cursor.position) == (2, 0) and cb.manager.steps()[-1] == 8
    history = model.fit(ckptcore_keras.dataset(cursor, X, Y), epochs=3, verbose=0, callbacks=[cb])
    assert history.epoch == [0, 1, 2]  # no checkpoint newer than its own: nothing restored
    assert cursor.epoch == 5


@pytest.mark.filterwarnings("ignore:Your input ran out of data")  # epochs end by exhaustion
def test_lock_taken_over_after_an_interrupted_fit_and_no_cursor_warns(tmp_path, reference):
    root = tmp_path / "ckpt"
    _fit(root, crash=3, cursor=False)  # its manager still holds the root's lock
    with pytest.warns(UserWarning, match="without a cursor"):
        model, _, _, history = _fit(root, cursor=False)
    assert history.epoch == [0, 1, 2]  # redone from the epoch's first batch, as Keras does


def test_stop_training_from_other_callbacks_is_kept(tmp_path):
    class Stop(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                self.model.stop_training = True

    _, cursor, _, history = _fit(tmp_path / "a", extra=[Stop()])
    assert history.epoch == [0, 1] and cursor.epoch == 2
    _, cursor, _, history = _fit(tmp_path / "b", extra=[keras.callbacks.TerminateOnNaN()])
    assert history.epoch == [0, 1, 2]


def test_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="save_freq"):
        ckptcore_keras.BackupAndRestore(tmp_path, save_freq=0)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        _fit(tmp_path / "s", steps_per_epoch=4)
    ckptcore.save_state(str(tmp_path / "foreign" / "step-000000000001"),
                        ckptcore.TrainingState(model={"w": np.zeros(2)}))
    with pytest.raises(ckptcore.errors.RestoreError, match="fit progress"):
        _fit(tmp_path / "foreign")


# --- issue 12: reuse, epoch ends, metrics, best only, Keras spellings, warnings, SIGTERM -----

def test_the_same_callback_resumes_a_second_fit_after_an_interruption(tmp_path, reference):
    """The notebook flow: fit raises mid-epoch; fit again with the same objects resumes."""
    root = tmp_path / "ckpt"
    model, cursor, cb, history = _fit(root, crash=7)  # batches 7 trained, 6 saved
    assert history is None and cb.manager.steps()[-1] == 6
    assert (cursor.epoch, cursor.position) == (1, 12)  # samples: 3 batches into epoch 1
    history = model.fit(ckptcore_keras.dataset(cursor, X, Y), epochs=3, verbose=0, callbacks=[cb])
    assert history.epoch == [1, 2] and cursor.epoch == 3  # batch 7 trained again, from step 6
    assert_same_bits(reference[0], _values(model))
    assert history.history["loss"] == reference[1]["loss"][1:]


def _fit_arrays(root, epochs, **cb_kw):
    """fit on arrays (no cursor, Keras knows its 4 steps an epoch)."""
    model = _model()
    cb = ckptcore_keras.BackupAndRestore(root, **cb_kw)
    history = model.fit(X, Y, batch_size=4, epochs=epochs, shuffle=False, verbose=0, callbacks=[cb])
    return model, cb, history


def test_integer_save_freq_at_an_epochs_last_batch_counts_the_epoch_done(tmp_path):
    root = tmp_path / "ckpt"
    model, cb, history = _fit_arrays(root, 2, save_freq=4)  # saves land on batches 4 and 8
    assert history.epoch == [0, 1]
    steps = ckptcore.CheckpointManager(root).steps()
    assert steps == [4, 8]
    for step, epoch in zip(steps, (0, 1)):
        progress = ckptcore.load_state(str(root / f"step-{step:012d}")).extra["keras"]["fit"]
        assert (progress["epoch"], progress["epoch_done"]) == (epoch, True)
    # Running the finished script again restores the final state and trains nothing.
    again, _, history = _fit_arrays(root, 2, save_freq=4)
    assert history.epoch == []
    assert_same_bits(_values(model), _values(again))


def test_metrics_are_recorded_so_keep_best_works(tmp_path):
    root = tmp_path / "ckpt"
    model, cursor, cb, history = _fit(root, save_freq="epoch",
                                      cb_kw={"keep": ckptcore.KeepBest("loss", n=1)})
    losses = history.history["loss"]
    best = 4 * (1 + int(np.argmin(losses)))
    assert set(ckptcore.CheckpointManager(root).steps()) == {best, 12}  # the best and the newest
    metrics = ckptcore.load_state(str(root / "step-000000000012")).metadata["metrics"]
    assert metrics == {"loss": losses[-1]}
    only = tmp_path / "only"
    _fit(only, save_freq=2, cb_kw={"metrics": ["loss"], "monitor": "loss"})
    assert set(ckptcore.load_state(str(only / "step-000000000010")).metadata["metrics"]) == {"loss"}


def test_each_epochs_logs_carry_the_last_saves_figures(tmp_path):
    root = tmp_path / "ckpt"
    seen = []
    with ckptcore.on_event(seen.append):
        _, _, _, history = _fit(root, epochs=2, save_freq="epoch",
                                cb_kw={"backup": str(tmp_path / "bucket")})
    saves = [e for e in seen if e.kind == "save"]
    assert [e.step for e in saves] == [4, 8]
    logged = history.history
    assert logged["ckpt_bytes"] == [float(e.bytes) for e in saves]
    assert logged["ckpt_save_seconds"] == [e.seconds_total for e in saves]
    assert logged["ckpt_blocked_seconds"] == [e.seconds_blocked for e in saves]
    assert all(n >= 1 for n in logged["ckpt_backup_lag_steps"])  # handed over, not yet copied
    assert logged["ckpt_bytes"][0] == ckptcore.inspect(str(root / "step-000000000004")).nbytes
    # Figures are not the model's metrics: never recorded in a checkpoint.
    assert set(ckptcore.load_state(str(root / "step-000000000008")).metadata["metrics"]) == {"loss"}


@pytest.mark.parametrize("mode", ["min", "max"])
def test_save_best_only(tmp_path, mode):
    root = tmp_path / "ckpt"
    _, _, _, history = _fit(root, save_freq="epoch", cb_kw={"save_best_only": True,
                                                            "monitor": "loss", "mode": mode})
    best, want = None, []
    for epoch, loss in enumerate(history.history["loss"]):
        if best is None or (loss < best if mode == "min" else loss > best):
            best = loss
            want.append(4 * (epoch + 1))
    assert ckptcore.CheckpointManager(root).steps() == want
    assert want != [4, 8, 12]  # some epoch did not improve: a save was skipped
    progress = ckptcore.load_state(str(root / f"step-{want[-1]:012d}")).extra["keras"]["fit"]
    assert progress["best"] == best


def test_save_best_only_warns_when_the_monitor_is_not_logged(tmp_path):
    with pytest.warns(UserWarning, match="'val_loss' is not among the logs"):
        _fit(tmp_path / "ckpt", save_freq="epoch", cb_kw={"save_best_only": True})
    assert ckptcore.CheckpointManager(tmp_path / "ckpt").steps() == []


def test_backup_dir_and_delete_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    _fit(root, crash=6, cb_kw={"delete_checkpoint": True}, root_as="backup_dir")
    assert ckptcore.CheckpointManager(root).steps() == [2, 4, 6]  # interrupted: the backup stays
    _, cursor, _, history = _fit(root, cb_kw={"delete_checkpoint": True}, root_as="backup_dir")
    assert history.epoch == [1, 2] and cursor.epoch == 3
    assert ckptcore.CheckpointManager(root).steps() == []  # finished: deleted, as Keras does
    with pytest.raises(TypeError, match="not both"):
        ckptcore_keras.BackupAndRestore(root, backup_dir=root)
    with pytest.raises(TypeError, match="backup_dir"):
        ckptcore_keras.BackupAndRestore()
    with pytest.raises(ValueError, match="mode"):
        ckptcore_keras.BackupAndRestore(root, mode="best")


def test_lock_and_storage_options_reach_the_manager(tmp_path):
    cb = ckptcore_keras.BackupAndRestore(tmp_path, lock=False, storage_options={"auto_mkdir": True})
    assert cb.manager._lock is None and cb.manager.local.options == {"auto_mkdir": True}
    cb.manager.close()


def test_resume_through_the_callback_does_not_warn_and_a_bare_restore_does(tmp_path):
    import warnings

    from ckptcore.errors import UnappliedStateWarning

    root = tmp_path / "ckpt"
    _fit(root, crash=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnappliedStateWarning)
        _, cursor, _, history = _fit(root)  # positions its own cursor
    state = ckptcore.load_state(str(root / "step-000000000012"))
    with pytest.warns(UnappliedStateWarning, match=r"data \(pass cursor="):
        ckptcore_keras.restore(state, _model())
    # The callback tells its manager what the state went into: ckpt log judges the resume.
    session = ckptcore.run_log(str(root))["runs"][0]["sessions"][-1]
    assert session["verdict"] == "exact", session


@pytest.mark.parametrize("async_save", [False, True])
def test_sigterm_saves_the_batch_just_trained_and_stops_fit(tmp_path, reference, async_save):
    import os
    import signal

    class Term(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if cb._batches == 6:  # cb runs first: batch 7 is trained when it sees the signal
                os.kill(os.getpid(), signal.SIGTERM)

    root = tmp_path / "ckpt"
    model = _model()
    cursor = ckptcore.DataCursor(15, 4, seed=5)
    cb = ckptcore_keras.BackupAndRestore(root, save_freq=2, cursor=cursor, async_save=async_save)
    before = signal.getsignal(signal.SIGTERM)
    history = model.fit(ckptcore_keras.dataset(cursor, X, Y), epochs=3, verbose=0,
                        callbacks=[cb, Term()])
    assert signal.getsignal(signal.SIGTERM) == before  # the manager put the old handler back
    assert history.epoch == [0, 1] and ckptcore.CheckpointManager(root).steps() == [4, 6, 7]
    progress = ckptcore.load_state(str(root / "step-000000000007")).extra["keras"]["fit"]
    assert progress == {**progress, "epoch": 1, "batch": 3, "epoch_done": False, "batches": 7}
    model, cursor, _, history = _fit(root)
    assert history.epoch == [1, 2] and cursor.epoch == 3
    assert_same_bits(reference[0], _values(model))
