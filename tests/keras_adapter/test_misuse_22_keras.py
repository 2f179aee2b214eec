"""Misuse a new user hit with the Keras adapter.

* A custom loop over ``ckptcore_keras.dataset`` that never calls ``cursor.next_batch()`` had its
  checkpoints record position 0 without a word; the save is now refused with a ``ValueError``
  naming the fix, as the Paddle adapter's ``ResumableBatchSampler`` refuses it.
* ``model.fit`` warns "``shuffle=True`` ... will be ignored" for any ``tf.data.Dataset`` unless
  ``shuffle=False`` is passed: the documented ``fit`` example passes it and trains without it.
"""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import ckptcore  # noqa: E402
import ckptcore_keras  # noqa: E402
from ckptcore_keras import _data  # noqa: E402

rs = np.random.RandomState(0)
X, Y = rs.rand(24, 4).astype("float32"), rs.randint(0, 3, 24).astype("int64")


def _model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _loop(model, cursor, steps, *, advance):
    """A custom loop over ckptcore_keras.dataset: ``steps`` trained batches."""
    ds = ckptcore_keras.dataset(cursor, X, Y)
    for i, (x, y) in enumerate(ds):
        model.train_on_batch(x, y)
        if advance:
            cursor.next_batch()
        if i + 1 == steps:
            break


def test_custom_loop_without_next_batch_cannot_save_a_stale_position(tmp_path):
    model, cursor = _model(), ckptcore.DataCursor(24, 4, seed=1)
    _loop(model, cursor, 3, advance=False)
    assert (cursor.epoch, cursor.position) == (0, 0)  # the mistake: the cursor never moved
    mgr = ckptcore.CheckpointManager(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"cursor\.next_batch\(\).*BackupAndRestore"):
        mgr.save(3, model=model, cursor=cursor)
    with pytest.raises(ValueError, match="never moved"):
        ckptcore_keras.capture(model, cursor=cursor.shard(0, 2))  # a shard view alike
    mgr.close()
    assert mgr.steps() == []  # nothing was written


def test_custom_loop_with_next_batch_saves_the_position(tmp_path):
    model, cursor = _model(), ckptcore.DataCursor(24, 4, seed=1)
    _loop(model, cursor, 3, advance=True)
    with ckptcore.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(3, model=model, cursor=cursor)
        assert mgr.restore().data["position"] == 12
    # The check does not change what a cursor is: copies and pickles save as before.
    assert pickle.loads(pickle.dumps(cursor)).state_dict() == cursor.state_dict()
    restored = ckptcore.DataCursor(24, 4, seed=1)
    restored.load_state_dict(cursor.state_dict())
    assert (restored.epoch, restored.position) == (0, 12)


def test_a_cursor_no_dataset_read_is_not_checked():
    cursor = ckptcore.DataCursor(24, 4, seed=1)
    ckptcore_keras.dataset(cursor, X, Y)  # built but never iterated: nothing drawn
    assert cursor.state_dict()["position"] == 0
    assert "state_dict" not in vars(cursor)


def test_fit_with_the_callback_advances_and_saves(tmp_path):
    model, cursor = _model(), ckptcore.DataCursor(24, 4, seed=1)
    cb = ckptcore_keras.BackupAndRestore(tmp_path / "run", cursor=cursor, save_freq=2)
    model.fit(ckptcore_keras.dataset(cursor, X, Y), epochs=2, callbacks=[cb], verbose=0,
              shuffle=False)
    assert (cursor.epoch, cursor.position) == (2, 0)
    mgr = ckptcore.CheckpointManager(tmp_path / "run")
    assert mgr.restore().data["epoch"] == 2
    mgr.close()


def _shuffle_warnings(caught):
    return [w for w in caught if "shuffle=True" in str(w.message)]


def test_documented_fit_example_emits_no_shuffle_warning(tmp_path):
    lines = _data.dataset.__doc__.splitlines()
    start = [i for i, line in enumerate(lines) if ">>> model.fit(ckptcore_keras.dataset" in line]
    assert start, "ckptcore_keras.dataset's docstring lost its fit example"
    parts = [lines[start[0]].split(">>>", 1)[1]]
    for line in lines[start[0] + 1:]:
        if not line.strip().startswith("..."):
            break
        parts.append(line.split("...", 1)[1])
    call = " ".join(part.split("#", 1)[0].strip() for part in parts)
    assert "shuffle=False" in call, call
    namespace = {"model": _model(), "ckptcore_keras": ckptcore_keras,
                 "cursor": ckptcore.DataCursor(24, 4, seed=1), "x": X, "y": Y}
    namespace["cb"] = ckptcore_keras.BackupAndRestore(tmp_path / "run", cursor=namespace["cursor"],
                                                      save_freq=100)
    call = call.replace("epochs=5", "epochs=1").replace("callbacks=[cb],", "callbacks=[cb], verbose=0,")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eval(call, namespace)  # noqa: S307 - the docstring's own line
    assert not _shuffle_warnings(caught), [str(w.message) for w in caught]
    # Where the warning comes from: fit's default shuffle=True with any tf.data.Dataset.
    cursor = ckptcore.DataCursor(24, 4, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _model().fit(ckptcore_keras.dataset(cursor, X, Y), epochs=1, verbose=0,
                     callbacks=[ckptcore_keras.BackupAndRestore(tmp_path / "run2", cursor=cursor)])
    assert _shuffle_warnings(caught)
