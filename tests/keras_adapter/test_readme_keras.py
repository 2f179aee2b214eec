"""The README's MirroredStrategy recipe (section "Keras") runs as written, on two logical CPUs.

The code block is taken from README.md itself; a prelude defines what the README leaves to the
reader (``strategy``, ``x_train``, ``y_train``, ``make_model``) and the bucket URL is replaced
by a local folder.  The run is interrupted by an exception mid-epoch and the same script run
again in a new process, which must end bit for bit where an uninterrupted run ends.
"""

from __future__ import annotations

import re
import textwrap

import numpy as np
import pytest

pytest.importorskip("tensorflow")

from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

URL = "s3://bucket/loop1"

PRELUDE = textwrap.dedent('''
    import os, sys
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    keras.utils.set_random_seed(0)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert strategy.num_replicas_in_sync == 2
    rng = np.random.RandomState(0)
    x_train = rng.randn(300, 8).astype("float32")
    y_train = (x_train[:, 0] > 0).astype("int64") + (x_train[:, 1] > 0)
    def make_model():
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(3)])
    STOP_AT = int(sys.argv[2]) if len(sys.argv) > 2 else None  # raise after this global step
''')

EPILOGUE = textwrap.dedent('''
    np.savez(sys.argv[1], *[v.numpy() for v in model.variables + optimizer.variables])
    print("EPOCH", cursor.epoch, "STEP", int(optimizer.iterations.numpy()))
''')


def _recipe() -> str:
    text = (REPO / "README.md").read_text()
    keras_section = text[text.index("\n## Keras"):text.index("\n## Paddle")]
    blocks = re.findall(r"```python\n(.*?)```", keras_section, re.S)
    recipe = [b for b in blocks if "experimental_distribute_dataset" in b]
    assert len(recipe) == 1, "the README's Keras section lost its MirroredStrategy recipe"
    return recipe[0]


def _npz(path):
    with np.load(path) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


def test_readme_mirrored_recipe_runs_and_resumes(tmp_path, run_python, spawn_python):
    from _keras_helpers import assert_same_bits

    code = _recipe()
    assert code.count(URL) == 1 and "int(optimizer.iterations.numpy())" in code
    # Fewer epochs and saves every 2 steps, so the test is short and a save falls mid-epoch.
    code = code.replace("GLOBAL_BATCH, EPOCHS = 64, 10", "GLOBAL_BATCH, EPOCHS = 64, 3")
    code = code.replace("step % 100 == 0", "step % 2 == 0")
    assert "EPOCHS = 64, 3" in code and "step % 2 == 0" in code
    def script(root):
        body = code.replace(URL, str(root))
        # The interruption: the process stops right after training step STOP_AT (before its
        # save, if one is due), as a crash would.
        body = body.replace(
            "        with strategy.scope():\n",
            "        if step == STOP_AT:\n            mgr.close(); raise SystemExit(3)\n"
            "        with strategy.scope():\n", 1)
        body = body.replace("batches = strategy", 'print("START", int(optimizer.iterations.numpy()))\n'
                            "batches = strategy", 1)
        return PRELUDE + body + EPILOGUE

    ref = tmp_path / "ref.py"
    ref.write_text(script(tmp_path / "ref"))
    out = run_python(ref, tmp_path / "ref.npz")
    assert "START 0" in out and "EPOCH 3 STEP 15" in out  # 300 samples in 5 global batches of 64 (the last of 44)

    run = tmp_path / "run.py"
    run.write_text(script(tmp_path / "run"))
    proc = spawn_python(run, tmp_path / "first.npz", "9")  # trains step 9, saved at 8, stops
    proc.communicate(timeout=300)
    assert proc.returncode == 3
    out = run_python(run, tmp_path / "run.npz")  # the same script again: resumes after step 8
    assert "START 8" in out and "EPOCH 3 STEP 15" in out
    assert_same_bits(_npz(tmp_path / "ref.npz"), _npz(tmp_path / "run.npz"), "final state")
