"""Custom training loops with ``ckptcore.CheckpointManager`` (a loop that would otherwise
use tf.train.Checkpoint).

The loop saves with ``mgr.save(step, model=..., optimizer=..., cursor=...)``, "crashes"
after a step that was not saved, and a fresh model with an unbuilt optimizer resumes
with ``mgr.restore(model=..., optimizer=..., cursor=...)``: the continued run equals an
uninterrupted one bit for bit, batch for batch.  The batches come either straight from
the cursor or from ``ckptcore_keras.dataset`` (prefetching ahead while the loop marks
each trained batch with ``cursor.next_batch()``).
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import ckptcore  # noqa: E402
import ckptcore_keras  # noqa: E402
from _keras_helpers import assert_same_bits, draw_all, seed_everything  # noqa: E402

STEPS, CRASH, EVERY = 10, 8, 3  # 10 steps in all; the crash loses steps 7 and 8
rs = np.random.RandomState(0)
X, Y = rs.rand(40, 8, 8).astype("float32"), rs.randint(0, 10, 40).astype("int64")


def create_model():  # a small CNN classifier
    return keras.models.Sequential([keras.Input((8, 8)), keras.layers.Flatten(),
                                    keras.layers.Dense(16, activation="relu"),
                                    keras.layers.Dropout(0.2), keras.layers.Dense(10)])


def batches(cursor, source):
    """Endless (x, y) batches in the cursor's order; ``source="dataset"`` goes through tf.data."""
    while True:
        if source == "cursor":
            for idx in cursor:  # advances the cursor as it hands out a batch: fetch == train
                yield X[idx], Y[idx]
        else:
            yield from ckptcore_keras.dataset(cursor, X, Y)  # prefetches; never advances


def train(model, optimizer, cursor, until, source, mgr=None, seen=None):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))

    it = batches(cursor, source)
    while int(optimizer.iterations) < until:
        x, y = next(it)
        step(x, y)
        if source == "dataset":
            cursor.next_batch()  # mark the batch as trained, before any save
        if seen is not None:
            seen.append(np.asarray(y).tolist())
        done = int(optimizer.iterations)
        if mgr is not None and done % EVERY == 0:
            mgr.save(done, model=model, optimizer=optimizer, cursor=cursor)


@pytest.mark.parametrize("source", ["cursor", "dataset"])
def test_custom_loop_resumes_bitwise(tmp_path, source):
    seed_everything(0)
    ref_model, ref_opt = create_model(), keras.optimizers.SGD(0.05, momentum=0.9)
    ref_cursor, ref_seen = ckptcore.DataCursor(40, 8, seed=1), []
    train(ref_model, ref_opt, ref_cursor, STEPS, source, seen=ref_seen)
    ref = [v.numpy() for v in ref_model.variables + ref_opt.variables] + draw_all()

    seed_everything(0)
    model, opt = create_model(), keras.optimizers.SGD(0.05, momentum=0.9)
    cursor, seen = ckptcore.DataCursor(40, 8, seed=1), []
    mgr = ckptcore.CheckpointManager(tmp_path / "ckpt", keep=2, async_save=True)
    train(model, opt, cursor, CRASH, source, mgr=mgr, seen=seen)
    mgr.close()  # the process ends (a SIGKILL would leave the same committed checkpoints)
    assert mgr.steps() == [3, 6]

    seed_everything(5)  # another process: different initial weights and RNG states
    model, opt = create_model(), keras.optimizers.SGD(0.05, momentum=0.9)
    cursor = ckptcore.DataCursor(40, 8, seed=1)
    mgr = ckptcore.CheckpointManager(tmp_path / "ckpt", keep=2, async_save=True)
    state = mgr.restore(model=model, optimizer=opt, cursor=cursor)
    assert state.step == 6 and int(opt.iterations) == 6 and (cursor.epoch, cursor.position) == (1, 8)
    seen = seen[:6]
    train(model, opt, cursor, STEPS, source, mgr=mgr, seen=seen)
    mgr.close()
    assert seen == ref_seen
    assert_same_bits(ref, [v.numpy() for v in model.variables + opt.variables] + draw_all(), source)
