"""Acceptance: a Keras ``fit`` on an S3 root (a real local S3 server), SIGKILLed, then SIGTERMed.

The SIGKILLed process leaves its lease on the root behind; the next process takes it over at
once (its holder is provably gone: a dead process on this machine) instead of waiting for it to
expire.  The SIGTERMed process saves the batch it just trained (``save_if_preempted``) and
returns from ``fit`` normally.  A third process finishes the run, which must equal an
uninterrupted run bit for bit.  The worker is ``_keras_s3_worker.py``.
"""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest

pytest.importorskip("tensorflow")

import ckptcore  # noqa: E402
from _keras_helpers import assert_same_bits  # noqa: E402

WORKER = "_keras_s3_worker.py"


def _npz(path):
    with np.load(path) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


def test_fit_on_s3_killed_then_preempted_resumes_bitwise(s3_backend, tmp_path, monkeypatch,
                                                          run_python, spawn_python):
    prefix, options = s3_backend
    monkeypatch.setenv("CKPT_TEST_STORAGE_OPTIONS", json.dumps(options))
    root = f"{prefix}/run"
    run_python(WORKER, f"{prefix}/ref", tmp_path / "ref.npz", "run")

    proc = spawn_python(WORKER, root, tmp_path / "killed.npz", "kill:6")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, stderr[-4000:]
    mgr = ckptcore.CheckpointManager(root, storage_options=options, lock=False)
    assert mgr.steps() == [4]  # batches 5 and 6 were lost with the process

    # Starts at once on the root the dead process still holds a lease on, then is preempted.
    out = run_python(WORKER, root, tmp_path / "preempted.npz", "term:9")
    assert "SAVED 9" in out
    assert mgr.steps() == [4, 8, 9]  # the periodic save at 8, the preemption save at 9
    progress = ckptcore.load_state(mgr.step_url(9), storage_options=options).extra["keras"]["fit"]
    assert progress == {**progress, "epoch": 1, "batch": 4, "epoch_done": False, "batches": 9}

    out = run_python(WORKER, root, tmp_path / "resumed.npz", "run")
    assert "SAVED 15" in out
    assert_same_bits(_npz(tmp_path / "ref.npz"), _npz(tmp_path / "resumed.npz"), "final state")
