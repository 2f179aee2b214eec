"""Shared helpers of the JAX suite: a tiny Flax NNX model with every kind of state (Params,
BatchNorm statistics, a Dropout RNG stream), fixed data, jitted training steps for an
``nnx.Optimizer`` and for a bare pytree with an Optax state, and bitwise snapshots of live
objects read from JAX itself (never through the adapter).

Importing this imports jax: JAX tests only.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

FEATURES, HIDDEN, CLASSES = 6, 8, 3
X = jnp.asarray(np.random.default_rng(0).standard_normal((8, FEATURES)).astype(np.float32))
Y = jnp.asarray(np.random.default_rng(1).integers(0, CLASSES, 8).astype(np.int32))


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(FEATURES, HIDDEN, rngs=rngs)
        self.bn = nnx.BatchNorm(HIDDEN, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, CLASSES, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.drop(jax.nn.relu(self.bn(self.lin(x)))))


def net(seed: int) -> Net:
    return Net(nnx.Rngs(params=seed, dropout=seed + 100))


# One transformation for every optimizer: the tx is static in the graph, and a new closure would
# compile the training step again.
ADAM = optax.adam(0.01)


def nnx_objects(seed: int, tx: Any = None) -> dict[str, Any]:
    model = net(seed)
    return {"model": model, "optimizer": nnx.Optimizer(model, tx or ADAM, wrt=nnx.Param)}


def _loss_nnx(model: Net, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@jax.jit(static_argnums=0)
def _pure_step(graphdef: Any, state: Any, x: jax.Array, y: jax.Array) -> Any:
    model, opt = nnx.merge(graphdef, state)
    opt.update(model, nnx.grad(_loss_nnx)(model, x, y))
    return nnx.state((model, opt))


def train_nnx(objects: dict[str, Any], steps: int, x: jax.Array = X, y: jax.Array = Y) -> None:
    """Steps of one jitted function over the split state (compiled once per graph structure,
    where ``nnx.jit`` compiles again for every new model instance)."""
    pair = (objects["model"], objects["optimizer"])
    objects["model"].train()
    for _ in range(steps):
        graphdef, state = nnx.split(pair)
        nnx.update(pair, _pure_step(graphdef, state, x, y))


def nnx_arrays(obj: Any) -> dict[str, np.ndarray]:
    """Every variable of an NNX object, by graph path, keys as their key data (a variable that
    holds no array, as Optax's ``MaskedNode`` in a masked optimizer state, left out)."""
    out = {}
    for path, node in nnx.iter_graph(obj):
        if isinstance(node, nnx.Variable):
            v = node.get_value()
            if not jax.tree_util.tree_leaves(v):
                continue
            if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
                v = jax.random.key_data(v)
            out["/".join(map(str, path))] = np.array(v)
    return out


def model_arrays(model: Any) -> dict[str, np.ndarray]:
    return {k: v for k, v in nnx_arrays(model).items() if "/rngs/" not in f"/{k}/"}


# --- a bare pytree and an Optax state -----------------------------------------------------------


def params(seed: int) -> dict[str, Any]:
    g = np.random.default_rng(seed)
    return {"dense": {"kernel": jnp.asarray(g.standard_normal((FEATURES, HIDDEN)), jnp.float32),
                      "bias": jnp.zeros(HIDDEN, jnp.float32)},
            "head": {"kernel": jnp.asarray(g.standard_normal((HIDDEN, CLASSES)), jnp.float32),
                     "bias": jnp.zeros(CLASSES, jnp.bfloat16)}}


def _loss(p: dict[str, Any], x: jax.Array, y: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ p["dense"]["kernel"] + p["dense"]["bias"])
    logits = h @ p["head"]["kernel"] + p["head"]["bias"].astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_step(tx: optax.GradientTransformation) -> Any:
    @jax.jit
    def step(p: Any, s: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any]:
        g = jax.grad(_loss)(p, x, y)
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s
    return step


def tree_arrays(tree: Any) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): np.array(v) for p, v in flat}


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str = "") -> None:
    assert list(a) == list(b), (what, list(a), list(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (what, k, a[k].dtype, b[k].dtype)
        assert a[k].tobytes() == b[k].tobytes(), f"{what}: {k} differs"
