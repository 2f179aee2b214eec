"""Subprocess worker for test_fit_resume.py: ``model.fit`` with BackupAndRestore, killed and resumed.

``python _keras_fit_worker.py <out> <task> [<task> ...]`` runs the tasks in order in
this process.  A task is ``<scenario>:<kill>``:

* ``ref``: the uninterrupted run, in ``<out>/<scenario>/ref``;
* ``<n>``: train (resuming from ``<out>/<scenario>/ckpt`` if it holds a checkpoint) and
  SIGKILL this very process right after global batch ``n`` (after that batch's save,
  if one is due);
* ``x<n>``: the same, but raise an exception out of ``fit`` instead, and go on with the
  next task (so one process can interrupt two runs);
* ``-1``: resume and train to the end.

Every trained batch appends ``{"pid", "g", "labels"}`` to ``<scenario>/<ref|ckpt>.jsonl``
(``g``: batches trained in the run so far, over all processes).  A run that finishes
writes ``<ref|ckpt>.npz`` (every model, custom and optimizer variable) and
``<ref|ckpt>.json`` (its History).
"""

from __future__ import annotations

import json
import os
import signal
import sys

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import warnings  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import ckptcore  # noqa: E402
import ckptcore_keras  # noqa: E402
from _keras_helpers import CustomTrainStep, snapshot  # noqa: E402

warnings.filterwarnings("ignore", message=".*shuffle=True.*")
SEEN: list[list[float]] = []  # labels of the batches trained since the last on_train_batch_end


def record_labels(y_true):
    # Logging y_true from inside the loss shows which samples each step really trains.
    tf.py_function(lambda t: SEEN.append(t.numpy().reshape(-1).tolist()), [y_true], [])


def my_mse(y_true, y_pred):  # a per-sample sum of squares that logs its labels
    record_labels(y_true)
    return keras.ops.sum(keras.ops.square(y_pred - y_true), axis=1)


def dense_mse():
    x = np.random.RandomState(0).randn(15, 10).astype("float32")
    y = np.arange(15).astype("float32").reshape(15, 1)
    inputs = keras.Input(shape=(10,))
    model = keras.Model(inputs, keras.layers.Dense(1, activation="linear")(inputs))
    model.compile(optimizer="rmsprop", loss=my_mse)
    return model, (x, y), 4, 2


def bn_dropout_decay():
    rs = np.random.RandomState(1)
    x, y = rs.randn(40, 6).astype("float32"), rs.randint(0, 3, 40).astype("int32")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.BatchNormalization(), keras.layers.Dropout(0.3),
                              keras.layers.Dense(3)])
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=4, decay_rate=0.5)
    model.compile(keras.optimizers.Adam(schedule),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model, (x, y), 8, 3


def _onehot_data():
    rs = np.random.RandomState(2)
    return rs.rand(20, 4, 4).astype("float32"), np.eye(3, dtype="float32")[rs.randint(0, 3, 20)]


def train_step_accumulation():  # accumulate 4 batches in train_step, then apply
    inp = keras.Input(shape=(4, 4))
    x = keras.layers.Dense(8, activation="relu")(keras.layers.Flatten()(inp))
    out = keras.layers.Dense(3, activation="softmax", name="primary")(x)
    model = CustomTrainStep(n_gradients=4, inputs=[inp], outputs=[out])
    model.compile(loss=keras.losses.CategoricalCrossentropy(), optimizer=keras.optimizers.Adam(1e-2))
    return model, _onehot_data(), 4, 3


def keras_accumulation():  # Keras 3's own gradient_accumulation_steps=4
    model = keras.Sequential([keras.Input((4, 4)), keras.layers.Flatten(),
                              keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
    model.compile(keras.optimizers.Adam(1e-2, gradient_accumulation_steps=4),
                  keras.losses.CategoricalCrossentropy(), metrics=["accuracy"])
    return model, _onehot_data(), 4, 3


SCENARIOS = {"dense_mse": dense_mse, "bn_dropout_decay": bn_dropout_decay,
             "train_step_accumulation": train_step_accumulation,
             "keras_accumulation": keras_accumulation}
EPOCHS = 3


class Interrupted(Exception):
    pass


class Recorder(keras.callbacks.Callback):
    """Logs each trained batch, then kills the process after batch ``kill`` (runs after the save)."""

    def __init__(self, path: str, cursor: ckptcore.DataCursor, kill: str):
        super().__init__()
        self.path, self.cursor = path, cursor
        self.kill, self.by_exception = int(kill.lstrip("x")), kill.startswith("x")

    def on_train_batch_end(self, batch, logs=None):
        c = self.cursor
        g = c.epoch * c.batches_per_epoch + c.position // c.batch_size  # advanced by BackupAndRestore
        labels = [int(round(v)) for v in SEEN.pop()] if SEEN else None
        with open(self.path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "g": g, "labels": labels}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if g == self.kill:
            if self.by_exception:
                raise Interrupted
            os.kill(os.getpid(), signal.SIGKILL)


def run(out: str, scenario: str, kill: str) -> None:
    keras.utils.set_random_seed(0)
    model, arrays, batch_size, save_freq = SCENARIOS[scenario]()
    SEEN.clear()
    which = "ref" if kill == "ref" else "ckpt"
    folder = os.path.join(out, scenario)
    os.makedirs(folder, exist_ok=True)
    cursor = ckptcore.DataCursor(len(arrays[0]), batch_size, seed=7)
    backup = ckptcore_keras.BackupAndRestore(os.path.join(folder, which), save_freq=save_freq,
                                             cursor=cursor, keep=None)  # the test inspects them
    recorder = Recorder(os.path.join(folder, f"{which}.jsonl"), cursor,
                        "-1" if kill == "ref" else kill)
    try:
        history = model.fit(ckptcore_keras.dataset(cursor, *arrays), epochs=EPOCHS, verbose=0,
                            callbacks=[backup, recorder])
    except Interrupted:
        return
    np.savez(os.path.join(folder, f"{which}.npz"), *snapshot(model))
    with open(os.path.join(folder, f"{which}.json"), "w") as f:
        json.dump({"history": history.history, "epochs": history.epoch,
                   "cursor": cursor.state_dict()}, f)


if __name__ == "__main__":
    for task in sys.argv[2:]:
        name, _, kill = task.partition(":")
        run(sys.argv[1], name, kill)
        print(task, "done", flush=True)
