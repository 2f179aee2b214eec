"""Keras `fit` with ckptcore_keras.BackupAndRestore on a local root and an S3 backup (moto's
server), SIGKILLed at random points again and again (often mid-replication), its local root
deleted now and then: no half replica is ever listed, no committed step is lost from both tiers,
and the resumed run ends bit for bit where an uninterrupted one does (tests/_backup_kill.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from _backup_kill import campaigns

pytest.importorskip("tensorflow")

HERE = Path(__file__).parent
KILLS = 10  # each restart imports TensorFlow (about 5 s): 10 kills keep the suite within its time


def test_killed_again_and_again_with_a_bucket_backup(tmp_path, s3_backend):
    log = campaigns(str(HERE / "_keras_backup_worker.py"), HERE, tmp_path, s3_backend, KILLS, seed=15)
    assert log.kills >= KILLS and log.mid_replication >= 5 and log.local_lost >= 1, log
