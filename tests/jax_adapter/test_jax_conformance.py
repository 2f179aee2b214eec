"""The adapter conformance suite (ckptcore.testing.AdapterTests) for the JAX adapter: a Flax
NNX model (Linear, BatchNorm, Dropout) with an ``nnx.Optimizer`` over Optax's Adam, and a bare
parameter pytree with an Optax state held in ``ckptcore_jax.Ref``s.

Imports jax into pytest's own process: run the folder in a pytest process of its own.
"""

from __future__ import annotations

import importlib.util

import pytest

pytest.register_assert_rewrite("ckptcore.testing")  # before the import: its asserts explain themselves
from ckptcore.testing import AdapterTests  # noqa: E402

if importlib.util.find_spec("jax") is None or importlib.util.find_spec("flax") is None:
    pytest.skip("jax or flax is not installed", allow_module_level=True)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from _jax_models import X, Y, make_step, model_arrays, nnx_arrays, nnx_objects, params, train_nnx, tree_arrays  # noqa: E402

import ckptcore_jax  # noqa: E402


class TestJaxNnxConformance(AdapterTests):
    adapter_name = "jax"

    def make(self, seed):
        objects = nnx_objects(seed)
        self.train(objects, 1)
        return objects

    def train(self, objects, steps):
        train_nnx(objects, steps)

    def model_arrays(self, objects):
        return model_arrays(objects["model"])

    def optimizer_arrays(self, objects):
        return nnx_arrays(objects["optimizer"])

    def draw_rng(self):
        # JAX has no global generator; the global ones a JAX run has are Python's and NumPy's.
        return np.random.random(4)


_TX = optax.adam(0.01)
_STEP = make_step(_TX)


class TestJaxPytreeConformance(AdapterTests):
    """Parameters and an Optax state as bare pytrees, restored into ``Ref``s."""

    adapter_name = "jax"

    def make(self, seed):
        p = params(seed)
        objects = {"model": ckptcore_jax.Ref(p), "optimizer": ckptcore_jax.Ref(_TX.init(p), tx=_TX)}
        self.train(objects, 1)
        return objects

    def train(self, objects, steps):
        model, opt = objects["model"], objects["optimizer"]
        for _ in range(steps):
            model.value, opt.value = _STEP(model.value, opt.value, X, Y)

    def model_arrays(self, objects):
        return tree_arrays(objects["model"].value)

    def optimizer_arrays(self, objects):
        return tree_arrays(objects["optimizer"].value)

    def draw_rng(self):
        return np.random.random(4)
