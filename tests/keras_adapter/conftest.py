"""Keras adapter tests: deterministic TensorFlow settings before anything imports it.

TensorFlow and Paddle never share a process (importing both segfaults), so the
Keras tests live here and run in their own pytest process or subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (REPO / "adapters", REPO):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO), str(REPO / "adapters"), str(HERE)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _runner():
    def run(*args: str, timeout: float = 240) -> str:
        proc = subprocess.run([sys.executable, *args], env=subprocess_env(), capture_output=True,
                              text=True, timeout=timeout, cwd=str(HERE))
        if proc.returncode != 0:
            raise AssertionError(f"subprocess {args} failed ({proc.returncode}):\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        return proc.stdout
    return run


@pytest.fixture
def run_python():
    """Run ``python <args>`` in a fresh process with the repo importable; return stdout."""
    return _runner()


@pytest.fixture(scope="module")
def run_python_module():
    """:func:`run_python` for module-scoped fixtures."""
    return _runner()


@pytest.fixture(scope="module")
def spawn_python():
    """Start ``python <args>`` in a fresh process with the repo importable; return its ``Popen``.

    For workers that are expected to die (SIGKILL): the caller checks the return code.
    """
    def spawn(*args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, *args], env=subprocess_env(), cwd=str(HERE),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return spawn
