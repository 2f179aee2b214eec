"""Subprocess worker for test_fit_preemption.py: ``model.fit`` on an S3 root, killed, preempted, resumed.

``python _keras_s3_worker.py <root url> <out npz> <how>`` with the storage options as JSON in
``CKPT_TEST_STORAGE_OPTIONS``.  ``how`` is:

* ``run``: train to the end (resuming from the root if it holds a checkpoint);
* ``kill:<n>``: SIGKILL this very process right after global batch ``n`` (after that batch's
  save, if one is due): its lease on the root is left behind;
* ``term:<n>``: send this process SIGTERM at global batch ``n``, as a preempted machine gets
  it: the callback saves batch ``n`` and ``fit`` returns; the process then exits normally.

A run whose ``fit`` returns writes every model and optimizer variable to ``<out npz>`` and
prints ``SAVED <the step of its last checkpoint>``.
"""

from __future__ import annotations

import json
import os
import signal
import sys

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import ckptcore  # noqa: E402
import ckptcore_keras  # noqa: E402

SAMPLES, BATCH, EPOCHS, SAVE_FREQ = 40, 8, 3, 4  # 5 batches an epoch, 15 in all


class Signal(keras.callbacks.Callback):
    """Send ``sig`` to this process when the backup callback has trained global batch ``at``."""

    def __init__(self, backup, sig, at):
        super().__init__()
        self.backup, self.sig, self.at = backup, sig, at

    def on_train_batch_end(self, batch, logs=None):
        # SIGKILL comes after the backup callback's batch end (its save, if due, is done);
        # SIGTERM before it, so the callback sees it on this very batch.
        done = self.backup._batches + (self.sig == signal.SIGTERM)
        if done == self.at:
            os.kill(os.getpid(), self.sig)


def main(root: str, out: str, how: str) -> None:
    options = json.loads(os.environ["CKPT_TEST_STORAGE_OPTIONS"])
    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    x = rng.randn(SAMPLES, 6).astype("float32")
    y = rng.randn(SAMPLES, 1).astype("float32")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dropout(0.3), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.01), "mse")
    cursor = ckptcore.DataCursor(SAMPLES, BATCH, seed=1)
    backup = ckptcore_keras.BackupAndRestore(root, cursor=cursor, save_freq=SAVE_FREQ,
                                             storage_options=options)
    callbacks = [backup]
    if how != "run":
        kind, at = how.split(":")
        sig = signal.SIGKILL if kind == "kill" else signal.SIGTERM
        spy = Signal(backup, sig, int(at))
        callbacks = [backup, spy] if sig == signal.SIGKILL else [spy, backup]
    model.fit(ckptcore_keras.dataset(cursor, x, y), epochs=EPOCHS, verbose=0, callbacks=callbacks)
    np.savez(out, *[v.numpy() for v in model.variables + model.optimizer.variables])
    print("SAVED", backup._last_step, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
