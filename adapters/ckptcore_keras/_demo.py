"""The ``ckpt demo`` model: a tiny Keras MLP with Dropout, trained by Adam, seeded."""

from __future__ import annotations

import os

import numpy as np

from ckptcore.adapter import DemoProgram

__all__ = ["demo"]


def demo(*, seed: int, features: int, classes: int) -> DemoProgram:
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")  # oneDNN kernels are not bitwise repeatable
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dropout(0.2), keras.layers.Dense(classes)])
    opt = keras.optimizers.Adam(0.01)
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train_step(x: np.ndarray, y: np.ndarray) -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))

    return DemoProgram(description="a Keras MLP with Dropout and Adam",
                       objects={"model": model, "optimizer": opt}, train_step=train_step)
