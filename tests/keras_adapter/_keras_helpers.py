"""Models, data and comparisons shared by the Keras tests and their subprocess workers."""

from __future__ import annotations

import random

import keras
import numpy as np
import tensorflow as tf

from ckptcore.state import ParamInfo, TrainingState


# --- models -------------------------------------------------------------------------------

def seq_bn_dropout() -> keras.Model:
    m = keras.Sequential([
        keras.Input((6, 6, 2)), keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.BatchNormalization(), keras.layers.Dropout(0.3), keras.layers.Flatten(),
        keras.layers.Dense(3)])
    m.compile(keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.01, 3, 0.5)),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def functional_sgd() -> keras.Model:
    x = inp = keras.Input((5,))
    x = keras.layers.Dense(8, activation="relu")(x)
    x = keras.layers.Dropout(0.5)(x)
    x = keras.layers.Dense(8)(x)
    x = keras.layers.LayerNormalization()(x)
    m = keras.Model(inp, keras.layers.Dense(1)(x))
    m.compile(keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True), "mse")
    return m


class Subclassed(keras.Model):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.emb = keras.layers.Embedding(10, 4)
        self.gru = keras.layers.GRU(3)
        self.drop = keras.layers.Dropout(0.2)
        self.out = keras.layers.Dense(2)

    def call(self, x, training=False):
        return self.out(self.drop(self.gru(self.emb(x)), training=training))


def subclassed_rmsprop() -> keras.Model:
    m = Subclassed()
    m(np.zeros((1, 5), "int32"))
    m.compile(keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True), "mse")
    return m


def accum4() -> keras.Model:
    m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                          keras.layers.Dense(1)])
    m.compile(keras.optimizers.Adam(0.01, gradient_accumulation_steps=4), "mse")
    return m


def loss_scale() -> keras.Model:
    x = inp = keras.Input((5,))
    x = keras.layers.Dense(6)(x)
    x = keras.layers.BatchNormalization()(x)
    m = keras.Model(inp, keras.layers.Dense(1)(x))
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01), initial_scale=2.0 ** 8,
                                              dynamic_growth_steps=2)
    m.compile(opt, "mse")
    return m


class CustomTrainStep(keras.Model):
    """Gradient accumulation in a custom ``train_step``: a step counter and one accumulator per
    weight, raw ``tf.Variable`` attributes that Keras does not track."""

    def __init__(self, n_gradients, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.n_gradients = tf.constant(n_gradients, dtype=tf.int32)
        self.n_acum_step = tf.Variable(0, dtype=tf.int32, trainable=False)
        self.gradient_accumulation = [tf.Variable(tf.zeros_like(v, dtype=tf.float32), trainable=False)
                                      for v in self.trainable_variables]

    def train_step(self, data):
        self.n_acum_step.assign_add(1)
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x, y, y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        for i in range(len(self.gradient_accumulation)):
            self.gradient_accumulation[i].assign_add(gradients[i])
        tf.cond(tf.equal(self.n_acum_step, self.n_gradients), self.apply_accu_gradients, lambda: None)
        return {"loss": loss}

    def apply_accu_gradients(self):
        self.optimizer.apply_gradients(zip(self.gradient_accumulation, self.trainable_variables))
        self.n_acum_step.assign(0)
        for i in range(len(self.gradient_accumulation)):
            self.gradient_accumulation[i].assign(tf.zeros_like(self.trainable_variables[i], dtype=tf.float32))

    def raw_state(self):
        return [self.n_acum_step, *self.gradient_accumulation]


def accumulating_train_step() -> keras.Model:
    inp = keras.Input(shape=(4, 4))
    x = keras.layers.Flatten()(inp)
    x = keras.layers.Dense(8, activation="relu")(x)
    out = keras.layers.Dense(3, activation="softmax", name="primary")(x)
    m = CustomTrainStep(n_gradients=4, inputs=[inp], outputs=[out])
    m.compile(loss=keras.losses.CategoricalCrossentropy(), optimizer=keras.optimizers.Adam(1e-2))
    return m


# name -> (builder, data kind, steps before the interruption, steps after)
SCENARIOS = {
    "seq_adam_decay_bn_dropout": (seq_bn_dropout, "image3", 5, 4),
    "functional_sgd_nesterov": (functional_sgd, "reg5", 4, 4),
    "subclassed_rmsprop_gru": (subclassed_rmsprop, "tokens", 4, 3),
    "keras_accumulation_4": (accum4, "reg5", 6, 6),
    "loss_scale_optimizer": (loss_scale, "reg5", 5, 4),
    "train_step_accumulation": (accumulating_train_step, "onehot16", 6, 6),
}


def batches(kind: str, n: int, seed: int = 123) -> list[tuple[np.ndarray, np.ndarray]]:
    rs = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        if kind == "image3":
            out.append((rs.rand(8, 6, 6, 2).astype("float32"), rs.randint(0, 3, 8).astype("int32")))
        elif kind == "reg5":
            out.append((rs.rand(8, 5).astype("float32"), rs.rand(8, 1).astype("float32")))
        elif kind == "tokens":
            out.append((rs.randint(0, 10, (8, 5)).astype("int32"), rs.rand(8, 2).astype("float32")))
        elif kind == "onehot16":
            out.append((rs.rand(8, 4, 4).astype("float32"),
                        np.eye(3, dtype="float32")[rs.randint(0, 3, 8)]))
    return out


# --- RNG ----------------------------------------------------------------------------------

def seed_everything(seed: int) -> None:
    keras.utils.set_random_seed(seed)
    tf.random.set_global_generator(tf.random.Generator.from_seed(seed + 1000))


def draw_all() -> list[np.ndarray]:
    """One draw from each global generator a state carries."""
    return [np.array([random.random()]), np.random.rand(3),
            keras.random.uniform((3,)).numpy(),
            tf.random.get_global_generator().normal((3,)).numpy()]


# --- comparisons --------------------------------------------------------------------------

def snapshot(model: keras.Model, optimizer=None) -> list[np.ndarray]:
    """Every value the run depends on, by position: model variables, raw ones, optimizer's."""
    opt = optimizer if optimizer is not None else model.optimizer
    values = [v.numpy() for v in model.variables]
    values += [v.numpy() for v in getattr(model, "raw_state", lambda: [])()]
    values += [v.numpy() for v in (opt.variables if opt is not None else [])]
    return [np.array(v) for v in values]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and \
        np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))


def assert_same_bits(xs: list[np.ndarray], ys: list[np.ndarray], what: str = "") -> None:
    assert len(xs) == len(ys), f"{what}: {len(xs)} vs {len(ys)} values"
    bad = [i for i, (a, b) in enumerate(zip(xs, ys)) if not same_bits(a, b)]
    assert not bad, f"{what}: values {bad} differ, e.g. {xs[bad[0]].ravel()[:4]} vs {ys[bad[0]].ravel()[:4]}"


_PLAIN = (type(None), bool, int, float, str, bytes)


def assert_plain(value, where: str = "state") -> None:
    """Only msgpack-able values and numpy arrays (the TrainingState schema)."""
    if isinstance(value, TrainingState):
        for section in TrainingState.SECTIONS:
            assert_plain(getattr(value, section), f"{where}.{section}")
    elif isinstance(value, ParamInfo):
        assert_plain(value.to_dict(), where)
    elif hasattr(value, "__dataclass_fields__"):
        for f in value.__dataclass_fields__:
            assert_plain(getattr(value, f), f"{where}.{f}")
    elif isinstance(value, dict):
        for k, v in value.items():
            assert isinstance(k, (str, int)), f"{where}: key {k!r}"
            assert_plain(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            assert_plain(v, f"{where}[{i}]")
    else:
        assert isinstance(value, (_PLAIN, np.ndarray)), f"{where}: {type(value).__name__} {value!r}"
