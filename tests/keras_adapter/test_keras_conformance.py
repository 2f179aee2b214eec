"""The adapter conformance suite (ckptcore.testing.AdapterTests) for the Keras adapter.

Runs in the Keras tests' own pytest process (TensorFlow and Paddle never share one).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

pytest.register_assert_rewrite("ckptcore.testing")  # before the import: its asserts explain themselves
from ckptcore.testing import AdapterTests  # noqa: E402

if importlib.util.find_spec("tensorflow") is None:  # not installed: skip; installed but broken: fail
    pytest.skip("tensorflow is not installed", allow_module_level=True)

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

X = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
Y = np.random.default_rng(1).integers(0, 3, 16)


class TestKerasConformance(AdapterTests):
    adapter_name = "keras"

    def make(self, seed):
        init = keras.initializers.GlorotUniform(seed=seed)
        model = keras.Sequential([
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu", kernel_initializer=init),
            keras.layers.Dropout(0.3, seed=seed),
            keras.layers.Dense(3, kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 1))])
        objects = {"model": model, "optimizer": keras.optimizers.Adam(0.01)}
        self.train(objects, 1)
        return objects

    def train(self, objects, steps):
        model, opt = objects["model"], objects["optimizer"]
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        for _ in range(steps):
            with tf.GradientTape() as tape:
                loss = loss_fn(Y, model(X, training=True))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))

    def model_arrays(self, objects):
        return {v.path: np.array(v.numpy()) for v in objects["model"].variables}

    def optimizer_arrays(self, objects):
        return {v.path: np.array(v.numpy()) for v in objects["optimizer"].variables}

    def draw_rng(self):
        return keras.random.uniform((4,)).numpy()  # keras.random's global SeedGenerator
