"""`ckpt demo`: the README's first command kills a real training process and resumes it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

CKPT = [sys.executable, "-m", "ckptcore.cli", "demo"]


def run_demo(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CKPT, "--root", str(tmp_path / "demo"), *extra], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_numpy_demo_resumes_bit_exactly(tmp_path):
    out = run_demo(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SIGKILLed at step 23" in out.stdout
    assert "RESULT: the resumed run equals the uninterrupted run" in out.stdout
    assert (tmp_path / "demo" / "run").is_dir()


def test_demo_refuses_memory_root():
    out = subprocess.run([*CKPT, "--root", "memory://x"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "memory://" in out.stderr


@pytest.mark.parametrize("framework", ["paddle", "keras"])
def test_framework_demo_resumes_bit_exactly(tmp_path, framework):
    # find_spec, not importorskip: this process must not import a framework (they clash).
    if importlib.util.find_spec("paddle" if framework == "paddle" else "tensorflow") is None:
        pytest.skip(f"{framework} is not installed")
    out = run_demo(tmp_path, "--framework", framework)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "RESULT: the resumed run equals the uninterrupted run" in out.stdout
