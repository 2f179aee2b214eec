"""The ``ckpt demo`` model: a tiny Flax NNX MLP with Dropout (its RNG stream is part of the
checkpoint), trained by Optax's Adam."""

from __future__ import annotations

import numpy as np

from ckptcore.adapter import DemoProgram

__all__ = ["demo"]


def demo(*, seed: int, features: int, classes: int) -> DemoProgram:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.hidden = nnx.Linear(features, 16, rngs=rngs)
            self.drop = nnx.Dropout(0.2, rngs=rngs)
            self.out = nnx.Linear(16, classes, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.out(self.drop(jax.nn.relu(self.hidden(x))))

    model = MLP(nnx.Rngs(params=seed, dropout=seed + 1))
    opt = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)

    @nnx.jit
    def step(model: MLP, opt: nnx.Optimizer, x: jax.Array, y: jax.Array) -> None:
        def loss(m: MLP) -> jax.Array:
            return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
        opt.update(model, nnx.grad(loss)(model))

    def train_step(x: np.ndarray, y: np.ndarray) -> None:
        step(model, opt, jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.int32))

    return DemoProgram(description="a Flax NNX MLP with Dropout and Optax Adam",
                       objects={"model": model, "optimizer": opt}, train_step=train_step)
