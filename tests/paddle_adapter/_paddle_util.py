"""Helpers for the Paddle tests.

Paddle runs only in worker subprocesses (``_worker.py``), never in pytest's own process, so these
tests can share a pytest run with the TensorFlow ones (the two frameworks crash in one process).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
HAVE_PADDLE = importlib.util.find_spec("paddle") is not None


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(HERE), str(REPO), str(REPO / "adapters"), env.get("PYTHONPATH", "")]
    env.update(PYTHONPATH=os.pathsep.join(p for p in paths if p), GLOG_minloglevel="3",
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", FLAGS_call_stack_level="0")
    return env


def run_python(args: list[str], *, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python args...`` with the repo on the path; fail the test with its output if it fails."""
    proc = subprocess.run([sys.executable, *args], env=worker_env(), capture_output=True, text=True,
                          timeout=timeout, cwd=str(HERE))
    if proc.returncode != 0:
        pytest.fail(f"{args} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                    f"--- stderr\n{proc.stderr[-8000:]}", pytrace=False)
    return proc


def run_worker(command: str, directory: Path) -> None:
    if not HAVE_PADDLE:
        pytest.skip("paddlepaddle is not installed")
    run_python([str(HERE / "_worker.py"), command, str(directory)])
