"""Exact resume with JAX after a SIGKILL, bit for bit, on CPU.

``_jax_resume_worker.py`` trains a Flax NNX MLP with BatchNorm and Dropout (AdamW with a
warmup-cosine schedule) over a shuffling ``DataCursor``, saving through a ``CheckpointManager``
(asynchronously) every 4 steps.  This process runs it uninterrupted; another is SIGKILLed in the
middle of its second epoch and a fresh process resumes it from the newest checkpoint: the final
parameters, batch statistics, Dropout RNG stream and optimizer state equal the uninterrupted
run's bit for bit.  All three processes start at once (the resuming one compiles its step, then
waits to be told the other was killed), so the imports overlap.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")

import _jax_resume_worker  # noqa: E402
from _support import subprocess_env  # noqa: E402

HERE = Path(__file__).parent
WORKER = str(HERE / "_jax_resume_worker.py")
KILL_AT = 22  # epoch 1 (15 batches an epoch), 2 steps after the checkpoint of step 20
TIMEOUT = 180


def _spawn(*args: str) -> subprocess.Popen:
    env = subprocess_env(HERE)
    env["XLA_FLAGS"] = ""  # one device is enough here: the workers start faster
    return subprocess.Popen([sys.executable, WORKER, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc: subprocess.Popen, what: str) -> str:
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, f"{what} exited with {proc.returncode}\n{err[-4000:]}"
    return out


def test_sigkilled_run_resumes_bitwise(tmp_path):
    killed = _spawn(str(tmp_path / "run"), str(tmp_path / "unused.npz"), str(KILL_AT), "--async")
    resuming = _spawn(str(tmp_path / "run"), str(tmp_path / "run.npz"), "--wait")
    try:
        # The uninterrupted reference, in this process while the others import jax.
        _jax_resume_worker.main(str(tmp_path / "ref"), str(tmp_path / "ref.npz"), -1, False)
        line = killed.stdout.readline()
        assert line.strip() == f"KILL {KILL_AT}", f"{line!r}\n{killed.stderr.read()[-4000:]}"
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(TIMEOUT)
        assert killed.returncode == -signal.SIGKILL
        assert resuming.stdout.readline().strip() == "READY", resuming.stderr.read()[-4000:]
        resuming.stdin.write("go\n")
        resuming.stdin.flush()
    except BaseException:
        for proc in (killed, resuming):
            if proc.poll() is None:
                proc.kill()
        raise
    resumed = _finish(resuming, "the resumed run")
    step = int(resumed.split("RESUMED ")[1].split()[0])
    assert 0 < step <= KILL_AT and step % 4 == 0  # the newest committed checkpoint before the kill
    assert not (tmp_path / "unused.npz").exists()
    ref, run = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "run.npz")
    assert sorted(ref.files) == sorted(run.files) and len(ref.files) > 20
    assert any("rngs" in k for k in ref.files) and any("mean" in k for k in ref.files)
    for k in ref.files:
        assert ref[k].dtype == run[k].dtype and ref[k].tobytes() == run[k].tobytes(), k
