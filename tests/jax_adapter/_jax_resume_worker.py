"""One JAX training process for test_jax_resume.py: a plain loop over a DataCursor, a Flax NNX
MLP with BatchNorm and Dropout, an ``nnx.Optimizer`` over Optax's AdamW with a warmup-cosine
schedule, a CheckpointManager saving every SAVE_EVERY steps.

    python _jax_resume_worker.py ROOT OUT [KILL_AT] [--async] [--wait]

Resumes from ROOT's newest checkpoint if there is one (printing ``RESUMED <step>``); with KILL_AT
it prints ``KILL <step>`` after that step and waits to be SIGKILLed, mid-epoch; at the end it
writes every variable of the model and the optimizer to OUT (an .npz).  With ``--wait`` it first
compiles the training step, then waits for a line on stdin: a resuming process started while the
killed one still trains.
"""

from __future__ import annotations

import os
import signal
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import ckptcore  # noqa: E402
from ckptcore.cursor import DataCursor  # noqa: E402

N, FEATURES, CLASSES, BATCH, EPOCHS, SAVE_EVERY = 240, 6, 3, 16, 3, 4
TX = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 0.02, 5, 45), weight_decay=0.01)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(FEATURES, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.out = nnx.Linear(16, CLASSES, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.drop(jax.nn.relu(self.bn(self.hidden(x)))))


@jax.jit(static_argnums=0)
def _step(graphdef, state, x, y):
    model, opt = nnx.merge(graphdef, state)

    def loss(m):
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
    opt.update(model, nnx.grad(loss)(model))
    return nnx.state((model, opt))


def build():
    model = MLP(nnx.Rngs(params=0, dropout=1))
    return model, nnx.Optimizer(model, TX, wrt=nnx.Param)


def train_step(model, opt, x, y) -> None:
    graphdef, state = nnx.split((model, opt))
    nnx.update((model, opt), _step(graphdef, state, x, y))


def arrays(*objs) -> dict[str, np.ndarray]:
    out = {}
    for i, obj in enumerate(objs):
        for path, node in nnx.iter_graph(obj):
            if isinstance(node, nnx.Variable):
                v = node.get_value()
                if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
                    v = jax.random.key_data(v)
                out[f"{i}/" + "/".join(map(str, path))] = np.array(v)
    return out


def main(root: str, out: str, kill_at: int, async_save: bool) -> None:
    g = np.random.default_rng(5)
    x = jnp.asarray(g.standard_normal((N, FEATURES)).astype(np.float32))
    y = jnp.asarray(g.integers(0, CLASSES, N).astype(np.int32))
    model, opt = build()
    cursor = DataCursor(N, BATCH, seed=3)
    objects = {"model": model, "optimizer": opt, "cursor": cursor}
    mgr = ckptcore.CheckpointManager(root, keep=2, async_save=async_save, save_on_preemption=False)
    step = 0
    if mgr.latest_step() is not None:
        step = mgr.restore(**objects).step
        print(f"RESUMED {step}", flush=True)
    model.train()
    while cursor.epoch < EPOCHS:
        idx = jnp.asarray(np.asarray(cursor.next_batch(), dtype=np.int32))
        train_step(model, opt, x[idx], y[idx])
        step += 1
        if step % SAVE_EVERY == 0:
            mgr.save(step, **objects)
        if step == kill_at:
            print(f"KILL {step}", flush=True)
            signal.pause()
    mgr.close()
    np.savez(out, step=step, **arrays(model, opt))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--wait" in sys.argv:
        m, o = build()
        m.train()
        train_step(m, o, jnp.zeros((BATCH, FEATURES)), jnp.zeros(BATCH, jnp.int32))  # compile
        print("READY", flush=True)
        sys.stdin.readline()
    main(args[0], args[1], int(args[2]) if len(args) > 2 else -1, "--async" in sys.argv)
