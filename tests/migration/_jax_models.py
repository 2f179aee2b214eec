"""Flax NNX models, Optax optimizers and training steps of the migration tests (imports JAX).

The twins of ``_keras_models``/``_torch_models`` in Flax NNX: channels-last, ``padding="SAME"``
(TensorFlow's: the extra row/column bottom/right), BatchNorms with Keras' statistics (momentum
0.99, epsilon 1e-3), LayerNorms with epsilon 1e-5, Glorot-uniform kernels and zero biases as
Keras initialises them, transposed convolutions in Flax's default layout (``transpose_kernel=
False``: a spatially flipped kernel).  Attributes are defined in another order than they run,
and NNX lists them alphabetically, so pairing relies on the traced structure.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from _common import SEQ_EMBED, SEQ_FEAT, SEQ_HEADS, TWIN_CLASSES  # noqa: E402

_R: nnx.Rngs   # the layers' Rngs while a twin is built (abstractly: twin() sets every value)


def _conv(cin, cout, k, stride=1, groups=1, bias=False):
    return nnx.Conv(cin, cout, (k, k), strides=(stride, stride), padding="SAME", feature_group_count=groups,
                    use_bias=bias, rngs=_R)


def _bn(c):
    return nnx.BatchNorm(c, momentum=0.99, epsilon=1e-3, use_fast_variance=False, rngs=_R)


def _pool(x):
    return nnx.max_pool(x, (2, 2), strides=(2, 2))


class ResNetTwin(nnx.Module):
    def __init__(self):
        self.short_conv, self.short_bn = _conv(8, 16, 1, 2), _bn(16)
        self.b2_conv2, self.b2_bn2 = _conv(16, 16, 3), _bn(16)
        self.b2_conv1, self.b2_bn1 = _conv(8, 16, 3, 2), _bn(16)
        self.stem, self.stem_bn = _conv(3, 8, 3), _bn(8)
        self.b1_conv1, self.b1_bn1 = _conv(8, 8, 3), _bn(8)
        self.b1_conv2, self.b1_bn2 = _conv(8, 8, 3), _bn(8)
        self.fc = nnx.Linear(16, TWIN_CLASSES, rngs=_R)

    def __call__(self, x):
        x = jax.nn.relu(self.stem_bn(self.stem(x)))
        y = self.b1_bn2(self.b1_conv2(jax.nn.relu(self.b1_bn1(self.b1_conv1(x)))))
        x = jax.nn.relu(x + y)
        s = self.short_bn(self.short_conv(x))
        y = self.b2_bn2(self.b2_conv2(jax.nn.relu(self.b2_bn1(self.b2_conv1(x)))))
        return self.fc(jax.nn.relu(y + s).mean(axis=(1, 2)))


class UNetTwin(nnx.Module):
    def __init__(self):
        up = dict(strides=(2, 2), padding="SAME", rngs=_R)
        self.up1, self.dec1, self.dec1_bn = nnx.ConvTranspose(16, 8, (2, 2), **up), _conv(16, 8, 3), _bn(8)
        self.up2, self.dec2, self.dec2_bn = nnx.ConvTranspose(16, 16, (2, 2), **up), _conv(32, 16, 3), _bn(16)
        self.enc1, self.enc1_bn = _conv(3, 8, 3), _bn(8)
        self.enc2, self.enc2_bn = _conv(8, 16, 3), _bn(16)
        self.mid, self.mid_bn = _conv(16, 16, 3), _bn(16)
        self.head = _conv(8, TWIN_CLASSES, 1, bias=True)

    def __call__(self, x):
        e1 = jax.nn.relu(self.enc1_bn(self.enc1(x)))
        e2 = jax.nn.relu(self.enc2_bn(self.enc2(_pool(e1))))
        b = jax.nn.relu(self.mid_bn(self.mid(_pool(e2))))
        d2 = jax.nn.relu(self.dec2_bn(self.dec2(jnp.concatenate([self.up2(b), e2], axis=-1))))
        d1 = jax.nn.relu(self.dec1_bn(self.dec1(jnp.concatenate([self.up1(d2), e1], axis=-1))))
        return self.head(d1).mean(axis=(1, 2))


class Inverted(nnx.Module):
    def __init__(self, cin, cout, expand, stride):
        mid = cin * expand
        self.residual = stride == 1 and cin == cout
        self.project, self.project_bn = _conv(mid, cout, 1), _bn(cout)
        self.dw, self.dw_bn = _conv(mid, mid, 3, stride, groups=mid), _bn(mid)
        self.has_expand = expand != 1
        if self.has_expand:
            self.expand_conv, self.expand_bn = _conv(cin, mid, 1), _bn(mid)

    def __call__(self, x):
        y = x
        if self.has_expand:
            y = jax.nn.relu6(self.expand_bn(self.expand_conv(y)))
        y = jax.nn.relu6(self.dw_bn(self.dw(y)))
        y = self.project_bn(self.project(y))
        return x + y if self.residual else y


class MobileNetTwin(nnx.Module):
    def __init__(self):
        self.head, self.head_bn = _conv(12, 32, 1), _bn(32)
        self.fc = nnx.Linear(32, TWIN_CLASSES, rngs=_R)
        self.stem, self.stem_bn = _conv(3, 8, 3, 2), _bn(8)
        self.blocks = nnx.List([Inverted(8, 8, 1, 1), Inverted(8, 12, 3, 2), Inverted(12, 12, 3, 1),
                                Inverted(12, 12, 3, 1)])

    def __call__(self, x):
        x = jax.nn.relu6(self.stem_bn(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        return self.fc(jax.nn.relu6(self.head_bn(self.head(x))).mean(axis=(1, 2)))


class TransformerTwin(nnx.Module):
    """A post-norm Transformer encoder block on [batch, seq, feature]: Linear embedding,
    self-attention, Add & LayerNorm, feed-forward, Add & LayerNorm, mean over the sequence, head."""

    def __init__(self):
        e = SEQ_EMBED
        self.head = nnx.Linear(e, TWIN_CLASSES, rngs=_R)
        self.ln2 = nnx.LayerNorm(e, epsilon=1e-5, use_fast_variance=False, rngs=_R)
        self.ln1 = nnx.LayerNorm(e, epsilon=1e-5, use_fast_variance=False, rngs=_R)
        self.ff2, self.ff1 = nnx.Linear(2 * e, e, rngs=_R), nnx.Linear(e, 2 * e, rngs=_R)
        self.attn = nnx.MultiHeadAttention(SEQ_HEADS, e, decode=False, deterministic=True, rngs=_R)
        self.embed = nnx.Linear(SEQ_FEAT, e, rngs=_R)

    def __call__(self, x):
        x = self.embed(x)
        x = self.ln1(x + self.attn(x))
        x = self.ln2(x + self.ff2(jax.nn.relu(self.ff1(x))))
        return self.head(x.mean(axis=1))


class BranchesTwin(nnx.Module):
    def __init__(self):
        self.stem = _conv(3, 8, 3, bias=True)
        self.a = _conv(8, 8, 3, bias=True)
        self.b = _conv(8, 8, 3, bias=True)
        self.fc = nnx.Linear(8, TWIN_CLASSES, rngs=_R)

    def __call__(self, x):
        x = self.stem(x)
        return self.fc((self.a(x) + self.b(x)).mean(axis=(1, 2)))


_TWINS = {"resnet": ResNetTwin, "unet": UNetTwin, "mobilenet": MobileNetTwin, "transformer": TransformerTwin,
          "branches": BranchesTwin}


_ABSTRACT: dict[str, nnx.Module] = {}


def _abstract(name: str) -> nnx.Module:
    global _R
    _R = nnx.Rngs(0)
    return _TWINS[name]()


def twin(name: str, seed: int = 0) -> nnx.Module:
    """The twin with Glorot-uniform kernels and zero biases (Keras' initialisation).  Built
    abstractly (``nnx.eval_shape``), then every value set from NumPy: Flax's own initialisers would
    compile an XLA program per shape, seconds per twin."""
    if name not in _ABSTRACT:
        _ABSTRACT[name] = nnx.eval_shape(lambda: _abstract(name))
    net = nnx.clone(_ABSTRACT[name])
    rs = np.random.RandomState(seed)
    for path, var in nnx.iter_graph(net):
        if not isinstance(var, nnx.Variable):
            continue
        shape = tuple(var.get_value().shape)
        if path[-1] != "kernel":   # biases and means zero, norm scales and variances one
            fill = np.ones if path[-1] in ("scale", "var") else np.zeros
            var.set_value(jnp.asarray(fill(shape, np.float32)))
            continue
        if len(shape) == 3 and path[-2] in ("query", "key", "value"):   # [in, heads, head_dim]
            fan_in, fan_out = shape[0], shape[1] * shape[2]
        elif len(shape) == 3 and path[-2] == "out":                     # [heads, head_dim, out]
            fan_in, fan_out = shape[0] * shape[1], shape[2]
        else:
            k = int(np.prod(shape[:-2]))
            fan_in, fan_out = shape[-2] * k, shape[-1] * k
        lim = np.sqrt(6.0 / (fan_in + fan_out))
        var.set_value(jnp.asarray(rs.uniform(-lim, lim, size=shape).astype("float32")))
    return net


_TX: dict[tuple, optax.GradientTransformation] = {}


def optimizer(name: str, kwargs: dict, net) -> nnx.Optimizer:
    """``nnx.Optimizer`` over ``optax.<name>(**kwargs)``; one transformation per spec, so the
    jitted step (the transformation is static in it) compiles once per spec."""
    key = (name, tuple(sorted(kwargs.items())))
    if key not in _TX:
        _TX[key] = getattr(optax, name)(**kwargs)
    return nnx.Optimizer(net, _TX[key], wrt=nnx.Param)


@nnx.jit
def _train(net, opt, x, y):
    def loss_fn(m):
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(net)
    opt.update(net, grads)
    return loss


def train_step(net, opt, x: np.ndarray, y: np.ndarray) -> float:
    net.train()
    return float(_train(net, opt, jnp.asarray(x), jnp.asarray(y)))


@nnx.jit
def _forward(net, x):
    return net(x)


def logits(net, x: np.ndarray, *, training: bool = False) -> np.ndarray:
    """Eval-mode logits, or training-mode ones (batch statistics, on a copy: the model's moving
    statistics stay as they are)."""
    m = nnx.clone(net) if training else net
    m.train() if training else m.eval()
    out = np.asarray(_forward(m, jnp.asarray(x)))
    net.train()
    return out
