"""Keras 3 on one backend, for test_backends.py: ``python _keras_backend_worker.py BACKEND CMD ...``
(``KERAS_BACKEND`` is set from BACKEND before Keras is imported).

* ``roundtrip DIR``: train a BatchNorm + Dropout + Adam model a few steps, capture it, restore
  into a fresh copy: every variable, slot, counter and seed state equal in value and dtype, and
  one more step on each gives equal results (the seed generators go on alike); save the state to
  ``DIR/ckpt`` and every value to ``DIR/expect.npz``; on JAX and PyTorch the TensorFlow-only
  parts raise ``UnsupportedBackendError`` naming the backend.
* ``load DIR``: restore ``DIR/ckpt`` (saved on another backend) into a fresh model: every
  weight, statistic and slot equal to ``DIR/expect.npz``, the counters and seed words too; then
  train a step.
* ``loop ROOT`` (JAX): a custom loop as JAX users write it, the state held as arrays outside
  the model (``stateless_call`` and ``stateless_apply`` under ``jax.jit``), written back into the
  variables before each save through a CheckpointManager; a run stopped after step 11 is resumed
  by fresh objects from its newest checkpoint (step 9) and ends with every model and optimizer
  variable equal, bit for bit, to an uninterrupted run's.
* ``fit ROOT OUT KILL_AT``: ``model.fit`` on ``ckptcore_keras.dataset`` with ``BackupAndRestore``
  (saving every 3 batches); with KILL_AT > 0 the process SIGKILLs itself after that many batches
  of this process; at the end every model and optimizer variable is written to OUT.
"""

from __future__ import annotations

import os
import signal
import sys

os.environ["KERAS_BACKEND"] = sys.argv[1]
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import ckptcore  # noqa: E402
import ckptcore_keras  # noqa: E402

SAMPLES, BATCH, EPOCHS, SAVE_FREQ = 32, 4, 3, 3  # 8 batches an epoch, 24 in all


def make_model() -> keras.Model:
    m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.BatchNormalization(), keras.layers.Dropout(0.3),
                          keras.layers.Dense(1)])
    m.compile(keras.optimizers.Adam(0.01), "mse")
    return m


def data() -> tuple[np.ndarray, np.ndarray]:
    rs = np.random.RandomState(0)
    x = rs.randn(SAMPLES, 6).astype("float32")
    return x, (x[:, :1] * 2 - x[:, 1:2]).astype("float32")


def values(model: keras.Model) -> dict[str, np.ndarray]:
    """Every model and optimizer variable by path, as numpy."""
    out = {v.path: keras.ops.convert_to_numpy(v.value) for v in model.variables}
    out.update({v.path: keras.ops.convert_to_numpy(v.value) for v in model.optimizer.variables})
    return out


def words(a: np.ndarray) -> np.ndarray:
    """Seed states as uint32 words and counters as int64, whatever the backend's dtype."""
    a = np.asarray(a)
    if a.dtype == np.int32 and a.ndim:  # PyTorch's seed words
        return a.view(np.uint32).astype(np.int64)
    return a.astype(np.int64) if a.dtype.kind in "iu" else a


def roundtrip(folder: str) -> None:
    keras.utils.set_random_seed(0)
    x, y = data()
    model = make_model()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    state = ckptcore_keras.capture(model)
    assert state.metadata["backend"] == keras.backend.backend(), state.metadata
    other = make_model()
    ckptcore_keras.restore(state, other)
    a, b = values(model), values(other)
    assert len(a) == len(b) == len(model.variables) + len(model.optimizer.variables)
    for (ka, va), (kb, vb) in zip(a.items(), b.items()):
        assert va.dtype == vb.dtype and np.array_equal(va, vb), (ka, kb, va, vb)
    assert int(keras.ops.convert_to_numpy(other.optimizer.iterations)) == SAMPLES // BATCH
    # One more step on each (dropout draws from the restored seed generators): equal again.
    # Their losses are not compared: train_on_batch reports the loss tracker, a metric that
    # fit left accumulated in one and that capture does not hold (BackupAndRestore saves it).
    # On PyTorch an unseeded Dropout draws from torch's global RNG, shared by both models here:
    # restoring again puts it (and the other's weights, equal anyway) back before the second step.
    model.train_on_batch(x[:8], y[:8])
    ckptcore_keras.restore(state, other)
    other.train_on_batch(x[:8], y[:8])
    for (ka, va), vb in zip(values(model).items(), values(other).values()):
        assert np.array_equal(va, vb), ka
    ckptcore.save_state(os.path.join(folder, "ckpt"), model=model)
    np.savez(os.path.join(folder, "expect.npz"), **{k.replace("/", "|"): v
                                                    for k, v in values(model).items()})
    if keras.backend.backend() != "tensorflow":
        tf_only()
    print("OK", flush=True)


def tf_only() -> None:
    """The TensorFlow-only parts refuse with an error that names the backend."""
    backend = keras.backend.backend()
    model = make_model()
    for call in (lambda: ckptcore_keras.import_tf_checkpoint("/nonexistent/ckpt"),
                 lambda: ckptcore_keras.export_tf_checkpoint(None, "/nonexistent/ckpt", model)):
        try:
            call()
        except ckptcore_keras.UnsupportedBackendError as e:
            assert backend in str(e) and "TensorFlow" in str(e), e
            assert isinstance(e, (ckptcore.CheckpointError, NotImplementedError))
        else:
            raise AssertionError("no UnsupportedBackendError")
    try:
        ckptcore_keras.process_group(object())
    except ckptcore_keras.UnsupportedBackendError as e:
        assert backend in str(e), e
    else:
        raise AssertionError("no UnsupportedBackendError")
    assert ckptcore_keras.process_group().size == 1


def load(folder: str) -> None:
    keras.utils.set_random_seed(1)
    model = make_model()
    ckptcore.load_state(os.path.join(folder, "ckpt"), model=model)  # strict: every name taken
    expect = {k.replace("|", "/"): v for k, v in np.load(os.path.join(folder, "expect.npz")).items()}
    got = values(model)
    assert sorted(got) == sorted(expect), (sorted(got), sorted(expect))
    for k, v in expect.items():
        assert np.array_equal(words(got[k]), words(v)), (k, got[k], v)
        if v.dtype.kind == "f":
            assert got[k].dtype == v.dtype, k
    x, y = data()
    assert np.isfinite(model.train_on_batch(x[:8], y[:8]))
    print("OK", flush=True)


class Kill(keras.callbacks.Callback):
    def __init__(self, at: int):
        super().__init__()
        self.at, self.seen = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.at and self.seen == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def fit(root: str, out: str, kill_at: str) -> None:
    keras.utils.set_random_seed(0)
    x, y = data()
    model = make_model()
    cursor = ckptcore.DataCursor(SAMPLES, BATCH, seed=1)
    backup = ckptcore_keras.BackupAndRestore(root, cursor=cursor, save_freq=SAVE_FREQ)
    model.fit(ckptcore_keras.dataset(cursor, x, y), epochs=EPOCHS, verbose=0, shuffle=False,
              callbacks=[backup, Kill(int(kill_at))])
    np.savez(out, *values(model).values())
    print("DONE", flush=True)


def loop(root: str) -> None:
    x, y = data()
    reference = _jax_loop(os.path.join(root, "ref"), x, y)
    assert _jax_loop(os.path.join(root, "run"), x, y, stop_after=11) is None
    resumed = _jax_loop(os.path.join(root, "run"), x, y)
    assert len(reference) == len(resumed) > 10
    for i, (a, b) in enumerate(zip(reference, resumed)):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (i, a, b)
    print("OK", flush=True)


def _jax_loop(root: str, x: np.ndarray, y: np.ndarray, stop_after: int = 0) -> list | None:
    """Train EPOCHS epochs (or stop after ``stop_after`` steps), resuming from ``root``; every
    model and optimizer variable at the end, in order (their paths differ between models made
    in one process)."""
    import jax

    keras.utils.set_random_seed(0)
    model = make_model()
    optimizer, loss_fn = model.optimizer, keras.losses.MeanSquaredError()
    optimizer.build(model.trainable_variables)
    cursor = ckptcore.DataCursor(SAMPLES, BATCH, seed=1)
    mgr = ckptcore.CheckpointManager(root, keep=2, save_on_preemption=False)
    if mgr.latest_step() is not None:
        mgr.restore(model=model, optimizer=optimizer, cursor=cursor)
    groups = (model.trainable_variables, model.non_trainable_variables, optimizer.variables)

    def loss_and_updates(trainable, non_trainable, xb, yb):
        pred, non_trainable = model.stateless_call(trainable, non_trainable, xb, training=True)
        return loss_fn(yb, pred), non_trainable

    @jax.jit
    def train_step(state, xb, yb):
        trainable, non_trainable, opt_vars = state
        (loss, non_trainable), grads = jax.value_and_grad(loss_and_updates, has_aux=True)(
            trainable, non_trainable, xb, yb)
        trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
        return loss, (trainable, non_trainable, opt_vars)

    def write_back(state) -> None:  # what a save needs first: the variables hold the state
        for variables, values in zip(groups, state):
            for v, value in zip(variables, values):
                v.assign(value)

    state = tuple([v.value for v in vs] for vs in groups)  # after the restore: its values
    step = int(keras.ops.convert_to_numpy(optimizer.iterations))
    while cursor.epoch < EPOCHS:
        idx = cursor.next_batch()
        _, state = train_step(state, x[idx], y[idx])
        step += 1
        if step % SAVE_FREQ == 0:
            write_back(state)
            mgr.save(step, model=model, optimizer=optimizer, cursor=cursor)
        if step == stop_after:
            mgr.close()
            return None
    write_back(state)
    mgr.close()
    return [np.asarray(keras.ops.convert_to_numpy(v.value)) for vs in groups for v in vs]


if __name__ == "__main__":
    {"roundtrip": roundtrip, "load": load, "fit": fit, "loop": loop}[sys.argv[2]](*sys.argv[3:])
