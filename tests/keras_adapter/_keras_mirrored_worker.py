"""Subprocess worker for test_mirrored.py (a MirroredStrategy custom loop).

``strategy <dir>``: two logical CPUs, train a small CNN with ``strategy.run`` on
``ckptcore_keras.dataset(cursor, ...)`` distributed by the strategy, saving every 3
steps with a ``ckptcore.CheckpointManager`` inside the scope.  Then: capture inside
the scope, check one copy per variable, restore into a model without a strategy
(same process) and a strategy model from a non-strategy state; resume a fresh
strategy model from the mid-epoch checkpoint and train to the end (must equal the
uninterrupted run); save weights and test accuracy.
``plain <dir>``: one CPU, no strategy: restore the manager's newest checkpoint into
a fresh model and save its weights and test accuracy.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

PHASE, OUT = sys.argv[1], sys.argv[2]
if PHASE == "strategy":  # before anything initializes the runtime
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import ckptcore  # noqa: E402
import ckptcore_keras  # noqa: E402

GLOBAL_BATCH_SIZE = 16
EPOCHS, SAVE_EVERY = 3, 3


def data():
    rs = np.random.RandomState(0)
    images = rs.rand(112, 12, 12, 1).astype("float32")
    labels = np.argmax(images.reshape(112, -1) @ rs.randn(144, 10), axis=1)  # learnable
    return (images[:64], labels[:64]), (images[64:], labels[64:])


def create_model():
    return keras.Sequential([
        keras.Input((12, 12, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.MaxPooling2D(), keras.layers.Flatten(),
        keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10, activation="softmax")])


def accuracy(model, test, save: bool = False) -> float:
    predictions = model(test[0], training=False).numpy()
    if save:
        np.save(os.path.join(OUT, f"predictions.{PHASE}.npy"), predictions)
    return float(np.mean(np.argmax(predictions, axis=1) == test[1]))


def weights(model, optimizer) -> list[np.ndarray]:
    return [v.numpy() for v in model.variables] + [v.numpy() for v in optimizer.variables]


def make_model(strategy):
    with strategy.scope():
        model = create_model()
        optimizer = keras.optimizers.Adam(0.01)
        # Keras 3 cannot build the optimizer lazily inside strategy.run in a tf.function
        # ("You must feed a value for placeholder tensor 'cond/else/...'"): build it here.
        optimizer.build(model.trainable_variables)
    return model, optimizer


def make_step(strategy, model, optimizer):
    with strategy.scope():
        loss_object = keras.losses.SparseCategoricalCrossentropy(reduction="none")

    def train_step(inputs):
        images, labels = inputs
        with tf.GradientTape() as tape:
            per_example = loss_object(labels, model(images, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH_SIZE)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(inputs):
        losses = strategy.run(train_step, args=(inputs,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    return distributed_train_step


def train(strategy, model, optimizer, cursor, x, y, mgr=None) -> None:
    """The strategy loop over the cursor's batches, saving every SAVE_EVERY steps."""
    step_fn = make_step(strategy, model, optimizer)
    while cursor.epoch < EPOCHS:
        for batch in strategy.experimental_distribute_dataset(ckptcore_keras.dataset(cursor, x, y)):
            step_fn(batch)
            cursor.next_batch()  # this batch has been trained
            step = int(optimizer.iterations.numpy())
            if mgr is not None and step % SAVE_EVERY == 0:
                with strategy.scope():
                    mgr.save(step, model=model, optimizer=optimizer, cursor=cursor)


def strategy_phase() -> None:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    (x, y), test = data()
    keras.utils.set_random_seed(0)
    model, optimizer = make_model(strategy)
    mgr = ckptcore.CheckpointManager(os.path.join(OUT, "ckpt"), keep=2)
    train(strategy, model, optimizer, ckptcore.DataCursor(len(x), GLOBAL_BATCH_SIZE, seed=3),
          x, y, mgr)
    mgr.close()
    assert mgr.steps() == [9, 12]

    # A fresh strategy model resumes from the mid-epoch checkpoint (epoch 2, batch 1 of 4).
    keras.utils.set_random_seed(9)
    resumed, resumed_opt = make_model(strategy)
    cursor = ckptcore.DataCursor(len(x), GLOBAL_BATCH_SIZE, seed=3)
    with strategy.scope():
        ckptcore.CheckpointManager(os.path.join(OUT, "ckpt")).restore(
            9, model=resumed, optimizer=resumed_opt, cursor=cursor)
    assert (cursor.epoch, cursor.position) == (2, GLOBAL_BATCH_SIZE)
    train(strategy, resumed, resumed_opt, cursor, x, y)
    resumed_same = all(np.array_equal(a, b) for a, b in
                       zip(weights(model, optimizer), weights(resumed, resumed_opt)))

    with strategy.scope():
        state = ckptcore_keras.capture(model, optimizer)
    assert type(model.variables[0].value).__name__ == "MirroredVariable"
    assert list(state.model) == [v.path for v in model.variables]
    for v in model.variables:
        assert state.model[v.path].shape == tuple(v.shape), v.path  # one copy, not one per replica
    assert state.optimizer.step == 12

    # Into a model without a strategy, in this process (auto-names differ: sequential_1...).
    plain_model, plain_opt = create_model(), keras.optimizers.Adam(0.01)
    assert ckptcore_keras.restore(state, plain_model, plain_opt).ok
    same = all(np.array_equal(a, b) for a, b in zip(weights(model, optimizer), weights(plain_model, plain_opt)))

    # A non-strategy state into a strategy model: every replica gets the values.
    with strategy.scope():
        mirrored, mirrored_opt = create_model(), keras.optimizers.Adam(0.01)
    ckptcore_keras.restore(ckptcore_keras.capture(plain_model, plain_opt), mirrored, mirrored_opt)
    replicas_ok = all(np.array_equal(component.numpy(), v.numpy())
                      for v in list(mirrored.variables) + list(mirrored_opt.variables)
                      for component in v.value.values)
    replicas_ok &= all(len(v.value.values) == 2 for v in mirrored.variables)
    same_after = all(np.array_equal(a, b) for a, b in zip(weights(model, optimizer), weights(mirrored, mirrored_opt)))

    np.savez(os.path.join(OUT, "strategy.npz"), *weights(model, optimizer))
    with open(os.path.join(OUT, "strategy.json"), "w") as f:
        json.dump({"accuracy": accuracy(model, test, save=True), "plain_accuracy": accuracy(plain_model, test),
                   "mirrored_accuracy": accuracy(mirrored, test), "same_weights": same,
                   "replicas_ok": bool(replicas_ok), "same_after_round_trip": same_after,
                   "resumed_same": resumed_same}, f)


def plain_phase() -> None:
    assert len(tf.config.list_logical_devices("CPU")) == 1
    _, test = data()
    keras.utils.set_random_seed(5)
    model, optimizer = create_model(), keras.optimizers.Adam(0.01)
    state = ckptcore.CheckpointManager(os.path.join(OUT, "ckpt")).restore(model=model, optimizer=optimizer)
    assert state.step == 12 and state.data["epoch"] == EPOCHS
    np.savez(os.path.join(OUT, "plain.npz"), *weights(model, optimizer))
    with open(os.path.join(OUT, "plain.json"), "w") as f:
        json.dump({"accuracy": accuracy(model, test, save=True)}, f)


if __name__ == "__main__":
    strategy_phase() if PHASE == "strategy" else plain_phase()
