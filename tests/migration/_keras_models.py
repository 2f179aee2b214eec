"""Keras models, optimizers and training steps of the migration tests (imports TensorFlow)."""

from __future__ import annotations

import os

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from _common import IMG  # noqa: E402

L = keras.layers
_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def cnn(seed: int = 0) -> keras.Model:
    """Seed 004's MNIST CNN, channels-last."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((IMG, IMG, 1)),
        L.Conv2D(20, 5, padding="same", activation="relu"), L.MaxPooling2D(2, 2),
        L.Conv2D(20, 5, padding="same", activation="relu"), L.MaxPooling2D(2, 2),
        L.Flatten(), L.Dense(10)])


def optimizer(name: str, kwargs: dict, schedule=None):
    kw = dict(kwargs)
    if schedule is not None:
        kw["learning_rate"] = schedule
    return getattr(keras.optimizers, name)(**kw)


def schedule(name: str, kwargs: dict):
    return getattr(keras.optimizers.schedules, name)(**kwargs)


def train_step(model, opt, x: np.ndarray, y: np.ndarray) -> float:
    with tf.GradientTape() as tape:
        loss = _LOSS(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return float(loss)


def tiny() -> keras.Model:
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((4,)), L.Dense(2)])


def tiny_step(model, opt, x: np.ndarray) -> None:
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x)))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))


def zoo(seed: int = 3) -> keras.Model:
    """Embedding, Conv1D, LSTM, GRU, LayerNorm on a sequence; DepthwiseConv2D, Conv2DTranspose,
    BatchNorm, Flatten, Dense on an image (layer order mirrored by the Paddle Zoo)."""
    keras.utils.set_random_seed(seed)
    seq = keras.Input((5,), dtype="int32")
    img = keras.Input((6, 6, 3))
    x = L.Embedding(10, 4)(seq)
    x = L.Conv1D(6, 3)(x)
    x = L.LSTM(5, return_sequences=True)(x)
    x = L.GRU(3)(x)
    x = L.LayerNormalization()(x)
    y = L.DepthwiseConv2D(3, depth_multiplier=2)(img)
    y = L.Conv2DTranspose(2, 3)(y)
    y = L.BatchNormalization()(y)
    y = L.Dense(3)(L.Flatten()(y))
    model = keras.Model([seq, img], [x, y])
    rs = np.random.RandomState(seed)
    for v in model.weights:   # every weight random, moving variances positive
        val = rs.randn(*v.shape).astype("float32") * 0.5
        if "moving_variance" in v.path:
            val = np.abs(val) + 0.5
        v.assign(val)
    return model


def zoo_inputs() -> tuple[np.ndarray, np.ndarray]:
    rs = np.random.RandomState(11)
    return rs.randint(0, 10, size=(16, 5)).astype("int32"), rs.randn(16, 6, 6, 3).astype("float32")


def zoo_outputs(model) -> list[np.ndarray]:
    seq, img = zoo_inputs()
    return [np.asarray(o) for o in model([seq, img], training=False)]


def cli_cnn_adam():
    """``ckpt convert --model _keras_models:cli_cnn_adam``: the target of the Keras leg."""
    return cnn(5), keras.optimizers.Adam(1e-3)
