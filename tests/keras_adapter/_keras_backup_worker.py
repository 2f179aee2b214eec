"""``model.fit`` with ckptcore_keras.BackupAndRestore on a local root and a bucket backup, for
test_backup_kill.py: ``python _keras_backup_worker.py LOCAL BACKUP OUT`` (storage options as
JSON in CKPT_TEST_S3_OPTIONS).  It resumes from the best tier (the bucket when the local root is
gone), trains to the end saving every 2 batches, writes every model and optimizer variable to
OUT and prints DONE."""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import ckptcore  # noqa: E402
import ckptcore_keras  # noqa: E402
from _backup_kill import print_events  # noqa: E402

SAMPLES, BATCH, EPOCHS, SAVE_FREQ = 64, 8, 3, 2  # 8 batches an epoch, 24 in all


class Ready(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        print("READY", flush=True)

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.03)  # a step's worth of time, for the kills to land between and in saves


def main(local: str, backup: str, out: str) -> None:
    print_events()
    options = json.loads(os.environ.get("CKPT_TEST_S3_OPTIONS") or "{}")
    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    x = rng.randn(SAMPLES, 6).astype("float32")
    y = rng.randn(SAMPLES, 1).astype("float32")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dropout(0.3), keras.layers.Dense(1)])
    model.compile(keras.optimizers.Adam(0.01), "mse")
    cursor = ckptcore.DataCursor(SAMPLES, BATCH, seed=1)
    callback = ckptcore_keras.BackupAndRestore(local, cursor=cursor, save_freq=SAVE_FREQ, keep=2,
                                               backup=ckptcore.Backup(backup, storage_options=options))
    model.fit(ckptcore_keras.dataset(cursor, x, y), epochs=EPOCHS, verbose=0,
              callbacks=[callback, Ready()])
    np.savez(out, *[v.numpy() for v in model.variables + model.optimizer.variables])
    print("DONE", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
