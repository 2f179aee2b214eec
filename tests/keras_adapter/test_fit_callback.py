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
    cb = ckptcore_keras.BackupAndRestore(root, save_freq=save_freq, cursor=cur if cursor else None,
                                         **fit_kw.pop("cb_kw", {}))
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
