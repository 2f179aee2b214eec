"""Cross-framework tests: Keras, Paddle, PyTorch and JAX each run in their own worker process.

TensorFlow and Paddle never share a process (importing both crashes), and pytest's own process
imports neither.  The workers run once per session, in a chain (Keras source -> Paddle -> Keras
target), and leave JSON results that the tests assert on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
HAVE = {m: importlib.util.find_spec(m) is not None for m in ("paddle", "tensorflow", "keras", "torch")}
HAVE_JAX = all(importlib.util.find_spec(m) is not None for m in ("jax", "flax", "optax"))


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(HERE), str(REPO), str(REPO / "adapters"), env.get("PYTHONPATH", "")]
    env.update(PYTHONPATH=os.pathsep.join(p for p in paths if p), GLOG_minloglevel="3",
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", FLAGS_call_stack_level="0",
               TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow")
    return env


def run_worker(*args: str, timeout: float = 600) -> None:
    proc = subprocess.run([sys.executable, *args], env=worker_env(), capture_output=True, text=True,
                          timeout=timeout, cwd=str(HERE))
    _check(args, proc.returncode, proc.stdout, proc.stderr)


def _check(args: tuple, rc: int, stdout: str, stderr: str) -> None:
    if rc != 0:
        pytest.fail(f"{args} exited with {rc}\n--- stdout\n{stdout[-4000:]}\n"
                    f"--- stderr\n{stderr[-8000:]}", pytrace=False)


@pytest.fixture(scope="session")
def migration_results(tmp_path_factory, s3_storage_options):
    """Run the three workers once; ``{"keras_source": ..., "paddle": ..., "keras_target": ...}``."""
    if not (HAVE["paddle"] and HAVE["tensorflow"] and HAVE["keras"]):
        pytest.skip("needs both paddlepaddle and tensorflow/keras")
    d = tmp_path_factory.mktemp("migration")
    opts = json.dumps({"e2e_url": f"s3://ckptcore-test/migration-{uuid.uuid4().hex}/step-11",
                       "storage_options": s3_storage_options})
    run_worker("_kworker.py", "source", str(d), opts)
    run_worker("_pworker.py", str(d), opts)
    run_worker("_kworker.py", "target", str(d), opts)
    return {name: json.loads((d / f"{name}.json").read_text())
            for name in ("keras_source", "paddle", "keras_target")}


@pytest.fixture(scope="session")
def torch_migration_results(tmp_path_factory):
    """The PyTorch pairs: torch source -> Keras (both ways) -> Paddle (both ways) -> torch target.
    ``{"torch_source": ..., "keras_torch": ..., "paddle_torch": ..., "torch_target": ...}``."""
    if not all(HAVE.values()):
        pytest.skip("needs torch, paddlepaddle and tensorflow/keras")
    d = tmp_path_factory.mktemp("torch_migration")
    run_worker("_tworker.py", "source", str(d))
    run_worker("_kworker.py", "torch", str(d), "{}")
    run_worker("_pworker.py", str(d), "{}", "torch")
    run_worker("_tworker.py", "target", str(d))
    return {name: json.loads((d / f"{name}.json").read_text())
            for name in ("torch_source", "keras_torch", "paddle_torch", "torch_target")}


@pytest.fixture(scope="session")
def jax_migration_results(tmp_path_factory):
    """The JAX pairs: JAX source -> PyTorch, Keras, Paddle (each continuing the JAX runs and training
    its own) -> JAX target.  ``{"jax_source": ..., "torch_jax": ..., "keras_jax": ..., "paddle_jax": ...,
    "jax_target": ...}``."""
    if not (HAVE_JAX and all(HAVE.values())):
        pytest.skip("needs jax/flax/optax, torch, paddlepaddle and tensorflow/keras")
    d = tmp_path_factory.mktemp("jax_migration")
    # One JAX process for both JAX phases: it waits for the partners between them and reuses its
    # compiled training steps.  As tests/jax_adapter/conftest.py but one device, one thread, and
    # XLA's quick compile (its optimisation passes take seconds per step; a step takes milliseconds).
    env = worker_env() | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false "
                          "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"}
    args = ("_jworker.py", "both", str(d))
    with open(d / "jax.out", "w+") as out, open(d / "jax.err", "w+") as err:
        jax = subprocess.Popen([sys.executable, *args], env=env, stdout=out, stderr=err, cwd=str(HERE))
        try:
            while not (d / "jax_source.json").exists() and jax.poll() is None:
                time.sleep(0.2)
            if not (d / "jax_source.json").exists():
                out.seek(0), err.seek(0)
                _check(args, jax.wait(), out.read(), err.read())
            run_worker("_tworker.py", "jax", str(d))
            run_worker("_kworker.py", "jax", str(d), "{}")
            run_worker("_pworker.py", str(d), "{}", "jax")
        except BaseException:
            jax.kill()
            jax.wait()
            raise
        finally:
            (d / "partners.done").touch()
        rc = jax.wait(timeout=600)
        out.seek(0), err.seek(0)
        _check(args, rc, out.read(), err.read())
    return {name: json.loads((d / f"{name}.json").read_text())
            for name in ("jax_source", "torch_jax", "keras_jax", "paddle_jax", "jax_target")} | {"dir": str(d)}
