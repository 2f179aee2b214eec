"""ckptcore_keras on Keras 3's JAX and PyTorch backends (issue 26.4), in subprocesses of
``_keras_backend_worker.py`` (``KERAS_BACKEND`` must be set before Keras is imported):

* capture/restore of a BatchNorm + Dropout + Adam model is bitwise (every variable, slot, the
  iteration counter, the seed generators: one more step on each copy is equal), and the
  TensorFlow-only parts raise ``UnsupportedBackendError`` naming the backend;
* a ``fit`` with ``BackupAndRestore`` SIGKILLed mid-epoch resumes and ends bit for bit where an
  uninterrupted run does;
* a checkpoint saved on one backend restores on another (jax -> torch, torch -> tensorflow,
  tensorflow -> jax) with equal weights, statistics and slots;
* on JAX, a custom loop holding its state as arrays (``stateless_call``/``stateless_apply``
  under ``jax.jit``), written back into the variables before each save, resumes bit for bit.
"""

from __future__ import annotations

import signal

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("torch")

WORKER = "_keras_backend_worker.py"
BACKENDS = ("jax", "torch")


@pytest.fixture(scope="module")
def saved(tmp_path_factory, run_python_module):
    """One roundtrip per backend (TensorFlow's too), each leaving a checkpoint for the others."""
    out = {}
    for backend in ("tensorflow", "jax", "torch"):
        folder = tmp_path_factory.mktemp(f"saved_{backend}")
        out[backend] = (folder, run_python_module(WORKER, backend, "roundtrip", folder))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_capture_restore_is_bitwise_and_tf_only_parts_refuse(saved, backend):
    assert saved[backend][1].strip().endswith("OK")


@pytest.mark.parametrize("source,target", [("jax", "torch"), ("torch", "tensorflow"),
                                           ("tensorflow", "jax")])
def test_a_checkpoint_restores_on_another_backend(saved, run_python, source, target):
    assert run_python(WORKER, target, "load", saved[source][0]).strip().endswith("OK")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fit_killed_mid_epoch_resumes_bit_for_bit(tmp_path, spawn_python, backend):
    ref = spawn_python(WORKER, backend, "fit", tmp_path / "ref", tmp_path / "ref.npz", 0)
    killed = spawn_python(WORKER, backend, "fit", tmp_path / "run", tmp_path / "run.npz", 11)
    for p in (ref, killed):
        p.wait(timeout=300)
    assert ref.returncode == 0, ref.stderr.read()[-4000:]
    assert killed.returncode == -signal.SIGKILL, killed.stderr.read()[-4000:]
    assert not (tmp_path / "run.npz").exists()
    resumed = spawn_python(WORKER, backend, "fit", tmp_path / "run", tmp_path / "run.npz", 0)
    resumed.wait(timeout=300)
    assert resumed.returncode == 0, resumed.stderr.read()[-4000:]
    a, b = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "run.npz")
    assert len(a.files) == len(b.files) > 10
    for k in a.files:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def test_a_stateless_jax_loop_resumes_bit_for_bit(tmp_path, run_python):
    assert run_python(WORKER, "jax", "loop", tmp_path).strip().endswith("OK")
