"""Keras `fit` with ckptcore_keras.BackupAndRestore, with a local root and an S3 backup (moto's server), SIGKILLed at random points
again and again (often mid-replication), its local root deleted now and then: no half replica is
ever listed, no committed step is lost from both tiers, and the resumed run ends bit for bit
where an uninterrupted one does (tests/_backup_kill.py)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from _backup_kill import KillLog, run_until_done
from _support import subprocess_env

pytest.importorskip("tensorflow")

HERE = Path(__file__).parent
KILLS = 25


def _final(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def test_killed_again_and_again_with_a_bucket_backup(tmp_path, s3_backend):
    opts = s3_backend.storage_options
    env = {**subprocess_env(HERE), "CKPT_TEST_S3_OPTIONS": json.dumps(opts)}
    worker = str(HERE / "_keras_backup_worker.py")
    ref = tmp_path / "reference.npz"
    log = KillLog()
    run_until_done([sys.executable, worker, str(tmp_path / "ref-local"), s3_backend.url("ref"),
                    str(ref)], env, str(HERE), str(tmp_path / "ref-local"), s3_backend.url("ref"),
                   opts, log, random.Random(0), max_kills=0, window=0)
    expected = _final(ref)
    rng = random.Random(15)
    campaign = 0
    while log.kills < KILLS:
        campaign += 1
        local, backup = str(tmp_path / f"local{campaign}"), s3_backend.url(f"backup{campaign}")
        out = tmp_path / f"run{campaign}.npz"
        run_until_done([sys.executable, worker, local, backup, str(out)], env, str(HERE), local,
                       backup, opts, log, rng, max_kills=KILLS - log.kills, window=1.5)
        got = _final(out)
        assert got.keys() == expected.keys()
        for k in expected:
            assert got[k].tobytes() == expected[k].tobytes(), k
    assert log.kills >= KILLS and log.mid_replication >= 5 and log.local_lost >= 1, log
    print(log)
