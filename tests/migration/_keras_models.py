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


# ----------------------------------------------------------------------------- structure twins
# Functional models whose layer lists do not follow the Paddle twins' definition order; every conv
# before a BatchNorm has no bias, BatchNorms keep Keras' defaults (the Paddle twins set the same).


def _conv_bn(x, filters, k, stride=1, act=True, relu6=False):
    x = L.Conv2D(filters, k, strides=stride, padding="same", use_bias=False)(x)
    x = L.BatchNormalization()(x)
    if act:
        x = L.ReLU(6.0)(x) if relu6 else L.ReLU()(x)
    return x


def resnet_twin(seed: int = 0) -> keras.Model:
    """Stem, an identity block, then a stride-2 block with a 1x1 projection shortcut (its BatchNorm
    has the main branch's last BatchNorm's size)."""
    from _common import TWIN_CLASSES, TWIN_IMG
    keras.utils.set_random_seed(seed)
    inp = keras.Input((TWIN_IMG, TWIN_IMG, 3))
    x = _conv_bn(inp, 8, 3)
    y = _conv_bn(_conv_bn(x, 8, 3), 8, 3, act=False)
    x = L.ReLU()(L.Add()([x, y]))
    y = _conv_bn(_conv_bn(x, 16, 3, stride=2), 16, 3, act=False)
    s = _conv_bn(x, 16, 1, stride=2, act=False)
    x = L.ReLU()(L.Add()([y, s]))
    return keras.Model(inp, L.Dense(TWIN_CLASSES)(L.GlobalAveragePooling2D()(x)))


def unet_twin(seed: int = 0) -> keras.Model:
    """Two down steps, two up steps (2x2 transposed convolutions) with skip concatenations."""
    from _common import TWIN_CLASSES, TWIN_IMG
    keras.utils.set_random_seed(seed)
    inp = keras.Input((TWIN_IMG, TWIN_IMG, 3))
    e1 = _conv_bn(inp, 8, 3)
    e2 = _conv_bn(L.MaxPooling2D(2)(e1), 16, 3)
    b = _conv_bn(L.MaxPooling2D(2)(e2), 16, 3)
    u2 = L.Conv2DTranspose(16, 2, strides=2)(b)
    d2 = _conv_bn(L.Concatenate()([u2, e2]), 16, 3)
    u1 = L.Conv2DTranspose(8, 2, strides=2)(d2)
    d1 = _conv_bn(L.Concatenate()([u1, e1]), 8, 3)
    out = L.Conv2D(TWIN_CLASSES, 1)(d1)
    return keras.Model(inp, L.GlobalAveragePooling2D()(out))


def _inverted(x, cin, cout, expand, stride):
    y = x
    if expand != 1:
        y = _conv_bn(y, cin * expand, 1, relu6=True)
    y = L.DepthwiseConv2D(3, strides=stride, padding="same", use_bias=False)(y)
    y = L.ReLU(6.0)(L.BatchNormalization()(y))
    y = _conv_bn(y, cout, 1, act=False)
    return L.Add()([x, y]) if stride == 1 and cin == cout else y


def mobilenet_twin(seed: int = 0) -> keras.Model:
    """MobileNetV2 in small: inverted residuals with depthwise convolutions, linear bottlenecks."""
    from _common import TWIN_CLASSES, TWIN_IMG
    keras.utils.set_random_seed(seed)
    inp = keras.Input((TWIN_IMG, TWIN_IMG, 3))
    x = _conv_bn(inp, 8, 3, stride=2, relu6=True)
    x = _inverted(x, 8, 8, 1, 1)
    x = _inverted(x, 8, 12, 3, 2)
    x = _inverted(x, 12, 12, 3, 1)
    x = _inverted(x, 12, 12, 3, 1)
    x = _conv_bn(x, 32, 1, relu6=True)
    return keras.Model(inp, L.Dense(TWIN_CLASSES)(L.GlobalAveragePooling2D()(x)))


def branches_twin(seed: int = 0) -> keras.Model:
    """Two identical branches from one stem, summed: nothing tells them apart."""
    from _common import TWIN_CLASSES, TWIN_IMG
    keras.utils.set_random_seed(seed)
    inp = keras.Input((TWIN_IMG, TWIN_IMG, 3))
    x = L.Conv2D(8, 3, padding="same", name="stem")(inp)
    a = L.Conv2D(8, 3, padding="same", name="left")(x)
    b = L.Conv2D(8, 3, padding="same", name="right")(x)
    return keras.Model(inp, L.Dense(TWIN_CLASSES)(L.GlobalAveragePooling2D()(L.Add()([a, b]))))


def twin(name: str, seed: int = 0) -> keras.Model:
    return globals()[f"{name}_twin"](seed)


# ----------------------------------------------------------------------------- PyTorch pairs


def transformer_twin(seed: int = 0) -> keras.Model:
    """A post-norm Transformer encoder block (the torch twin's): Dense embedding, MultiHeadAttention,
    Add & LayerNormalization, feed-forward, Add & LayerNormalization, mean over the sequence, head."""
    from _common import SEQ_EMBED, SEQ_FEAT, SEQ_HEADS, SEQ_LEN, TWIN_CLASSES
    keras.utils.set_random_seed(seed)
    inp = keras.Input((SEQ_LEN, SEQ_FEAT))
    x = L.Dense(SEQ_EMBED)(inp)
    a = L.MultiHeadAttention(SEQ_HEADS, SEQ_EMBED // SEQ_HEADS)(x, x)
    x = L.LayerNormalization(epsilon=1e-5)(L.Add()([x, a]))
    f = L.Dense(SEQ_EMBED)(L.Dense(2 * SEQ_EMBED, activation="relu")(x))
    x = L.LayerNormalization(epsilon=1e-5)(L.Add()([x, f]))
    return keras.Model(inp, L.Dense(TWIN_CLASSES)(L.GlobalAveragePooling1D()(x)))


def logits(model, x: np.ndarray, *, training: bool = False) -> np.ndarray:
    """Inference logits, or training-mode ones (batch statistics; moving statistics put back)."""
    if not training:
        return np.asarray(model(x, training=False))
    saved = [v.numpy() for v in model.weights]
    out = np.asarray(model(x, training=True))
    for v, s in zip(model.weights, saved):
        v.assign(s)
    return out
