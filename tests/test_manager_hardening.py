"""What a careless or hostile caller gives a CheckpointManager: bad roots, bad metrics, a user's own
``metadata["metrics"]``, step folders that are links out of the root.  Each is refused before
anything is written, or handled and logged; nothing saved is lost."""

from __future__ import annotations

import logging
import math
import os

import numpy as np
import pytest

import ckptcore
from ckptcore import CheckpointManager, KeepBest, KeepLast, UnsafeCheckpointError
from _support import assert_state_of, make_state


@pytest.mark.parametrize("root, error", [("", ValueError), ("   ", ValueError), (None, TypeError),
                                         (3, TypeError), (b"/tmp/x", TypeError)])
def test_bad_roots_are_refused_before_anything_is_written(root, error, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = set(os.listdir("/"))
    with pytest.raises(error, match="root"):
        CheckpointManager(root)
    assert os.listdir(tmp_path) == []
    assert set(os.listdir("/")) == before


@pytest.mark.parametrize("metrics, error", [
    (["loss", "acc"], TypeError), ("loss", TypeError), ({"loss": "low"}, TypeError),
    ({"loss": None}, TypeError), ({1: 0.5}, TypeError), ({"loss": True}, TypeError),
    ({"loss": np.ones(2)}, TypeError), ({"loss": math.nan}, ValueError),
    ({"loss": math.inf}, ValueError), ({"loss": np.float32("-inf")}, ValueError)])
def test_bad_metrics_are_refused_before_the_commit(metrics, error, local_backend):
    with CheckpointManager(local_backend.prefix, keep=KeepBest("loss")) as mgr:
        with pytest.raises(error, match="metrics"):
            mgr.save(1, make_state(1), metrics=metrics)
        assert mgr.steps() == []
        mgr.save(1, make_state(1), metrics={"loss": np.float32(0.5), "acc": 1}).result()
        assert mgr.steps() == [1]


@pytest.mark.parametrize("user_metrics", [["loss", "acc"], "loss=0.1", {"loss": "low"},
                                          {"loss": [1, 2]}, 7])
def test_a_users_own_metadata_metrics_never_break_retention(user_metrics, backend, caplog):
    """Retention runs after the commit: a value it cannot rank must not make save() raise there
    (steps would pile up and the run die).  The step is kept or dropped by the other policies."""
    caplog.set_level(logging.WARNING, logger="ckptcore")
    prefix, options = backend
    with CheckpointManager(prefix, keep=KeepBest("loss") | KeepLast(1),
                           storage_options=options) as mgr:
        for step in (1, 2, 3):
            state = make_state(step)
            state.metadata = {"metrics": user_metrics}
            mgr.save(step, state).result()
        assert mgr.steps() == [3]
        assert_state_of(mgr.restore(), 3)
    assert "metrics" in caplog.text


def test_good_metrics_rank_steps_through_metadata_too(local_backend):
    with CheckpointManager(local_backend.prefix, keep=KeepBest("loss")) as mgr:
        for step, loss in ((1, 0.3), (2, 0.1), (3, 0.2)):
            state = make_state(step)
            state.metadata = {"metrics": {"loss": loss}}
            mgr.save(step, state).result()
        assert mgr.steps() == [2, 3]
    with CheckpointManager(local_backend.prefix, keep=KeepBest("loss")) as mgr:  # read back
        mgr.save(4, make_state(4), metrics={"loss": 0.5}).result()
        assert mgr.steps() == [2, 4]


def test_a_step_folder_linking_out_of_the_root_is_never_listed_nor_deleted_through(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ckptcore")
    outside = tmp_path / "elsewhere" / "ckpt"
    ckptcore.save_state(str(outside), make_state(99))
    root = tmp_path / "root"
    with CheckpointManager(str(root), keep=1) as mgr:
        mgr.save(1, make_state(1)).result()
        os.symlink(outside, root / "step-000000000002")  # would sort as the newest step
        assert mgr.steps() == [1]
        mgr.save(3, make_state(3)).result()  # retention runs
        mgr.save(4, make_state(4)).result()
        assert mgr.steps() == [4]
        with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
            mgr.delete(2)
        assert mgr.gc(grace=0) == []
    assert (outside / "manifest.msgpack").exists()
    assert_state_of(ckptcore.load_state(str(outside)), 99)
    assert os.path.islink(root / "step-000000000002")
    assert "symbolic link" in caplog.text and "retention: deleting checkpoint step 1" in caplog.text


def test_a_step_name_with_a_trailing_newline_is_not_a_step(tmp_path):
    root = tmp_path / "root"
    with CheckpointManager(str(root)) as mgr:
        mgr.save(1, make_state(1)).result()
        os.rename(root / "step-000000000001", root / "step-000000000001\n")
        assert mgr.steps() == []


def test_fallback_and_replacement_are_logged(local_backend, caplog):
    caplog.set_level(logging.INFO, logger="ckptcore")
    root = local_backend.prefix
    with CheckpointManager(root) as mgr:
        mgr.save(1, make_state(1)).result()
        mgr.save(2, make_state(2)).result()
    with open(os.path.join(root, "step-000000000002", "manifest.msgpack"), "wb") as f:
        f.write(b"")  # a torn write on a filesystem without atomic rename
    with CheckpointManager(root) as mgr, pytest.warns(ckptcore.CheckpointFallbackWarning):
        assert_state_of(mgr.restore(), 1)
        mgr.save(2, make_state(2)).result()
        assert_state_of(mgr.restore(), 2)
    assert "falling back" in caplog.text and "replacing damaged checkpoint step 2" in caplog.text
