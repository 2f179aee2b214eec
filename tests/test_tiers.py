"""Tiers (``ckptcore/_tier.py``): the local root and every backup obey one set of rules, and a
third tier is configuration (a list of ``ckptcore.Backup``), not code."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

import ckptcore
from ckptcore import Backup, CheckpointManager, KeepLast
from ckptcore._steps import step_name
from ckptcore._storage import Store
from ckptcore._tier import Tier
from ckptcore.policies import KeepAll


def _state(step: int) -> ckptcore.TrainingState:
    return ckptcore.TrainingState(model={"w": np.full(64, float(step), np.float32)}, step=step)


def _corrupt(root, step: int) -> None:
    folder = os.path.join(root, step_name(step))
    shard = sorted(n for n in os.listdir(folder) if n.startswith("shard-"))[0]
    with open(os.path.join(folder, shard), "r+b") as f:
        f.seek(0)
        f.write(b"\xff" * 8)


def test_two_backups_each_get_every_step_with_their_own_retention(tmp_path):
    local, b1, b2 = (str(tmp_path / n) for n in ("local", "b1", "b2"))
    with CheckpointManager(local, keep=1, save_on_preemption=False,
                           backup=[Backup(b1, keep=KeepLast(2)), Backup(b2, dedup=False)]) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, _state(s))
        mgr.wait()
        assert [b.steps() for b in mgr.backups] == [[2, 3], [1, 2, 3]]
        assert mgr.steps() == [3]
        assert [t.url for t in mgr.tiers] == [mgr.root.url] + [b.root.url for b in mgr.backups]
    assert os.path.isdir(os.path.join(b1, "chunks"))  # deduplicated
    assert not os.path.exists(os.path.join(b2, "chunks"))  # plain copies


def test_restore_goes_through_the_tiers_in_order(tmp_path):
    local, b1, b2 = (str(tmp_path / n) for n in ("local", "b1", "b2"))
    with CheckpointManager(local, save_on_preemption=False,
                           backup=[Backup(b1, dedup=False), Backup(b2, dedup=False)]) as mgr:
        for s in (1, 2):
            mgr.save(s, _state(s))
        mgr.wait()
    _corrupt(local, 2)
    _corrupt(b1, 2)
    with CheckpointManager(local, save_on_preemption=False,
                           backup=[Backup(b1, dedup=False), Backup(b2, dedup=False)]) as mgr:
        with pytest.warns(ckptcore.CheckpointFallbackWarning) as caught:
            state = mgr.restore(seed=True)
        assert state.step == 2 and np.array_equal(state.model["w"], _state(2).model["w"])
        assert sum("falling back to its replica" in str(w.message) for w in caught) == 2
        assert mgr.local.verify(2) == []  # healed from the second backup
    # and a local root that is gone restores from the first backup that has the step
    import shutil

    shutil.rmtree(local)
    with CheckpointManager(local, save_on_preemption=False,
                           backup=[Backup(b1, dedup=False), Backup(b2, dedup=False)]) as mgr:
        assert mgr.latest_step() == 2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ckptcore.CheckpointFallbackWarning)
            assert mgr.restore().step == 2


def test_local_retention_waits_for_every_backup_that_asks(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    broken = str(tmp_path / "file" / "backup")  # every replication there fails for good
    for waits, left in ((True, [1, 2, 3]), (False, [3])):
        local = str(tmp_path / f"local-{waits}")
        mgr = CheckpointManager(local, keep=1, save_on_preemption=False,
                                backup=[Backup(str(tmp_path / f"ok-{waits}")),
                                        Backup(broken, keep_unreplicated=waits)])
        for s in (1, 2, 3):
            mgr.save(s, _state(s))
        with pytest.raises(OSError):
            mgr.wait()
        assert mgr.steps() == left
        assert mgr.backups[0].steps() == [1, 2, 3]
        mgr.close()


def test_one_retention_for_every_tier(tmp_path):
    root = Store(str(tmp_path / "r"))
    with CheckpointManager(root.url, save_on_preemption=False) as mgr:
        for s in (1, 2, 3, 4):
            mgr.save(s, _state(s), metrics={"loss": float(5 - s)})
    tier = Tier(root)
    assert tier.retain(KeepLast(1), dry_run=True) == [1, 2, 3]
    assert tier.steps() == [1, 2, 3, 4]  # a dry run deletes nothing
    # skipped steps are neither judged nor the newest; held ones stay
    assert tier.retain(KeepLast(1), skip={4}, hold=lambda doomed: {1}) == [2]
    assert tier.steps() == [1, 3, 4]
    # the newest step failing the reader's checks stops every deletion
    os.remove(os.path.join(root.path, step_name(4), sorted(
        n for n in os.listdir(os.path.join(root.path, step_name(4))) if n.startswith("shard-"))[0]))
    assert tier.retain(KeepLast(1)) == []
    assert tier.steps() == [1, 3, 4]
    assert tier.retain(KeepAll()) == []


def test_a_tier_never_deletes_through_a_symlink(tmp_path):
    root = tmp_path / "r"
    with CheckpointManager(str(root), save_on_preemption=False) as mgr:
        mgr.save(1, _state(1))
    elsewhere = tmp_path / "elsewhere"
    os.rename(root / step_name(1), elsewhere)
    os.symlink(elsewhere, root / step_name(1))
    with pytest.raises(ckptcore.UnsafeCheckpointError, match="symbolic link"):
        Tier(Store(str(root))).delete(1)
    assert (elsewhere / "manifest.msgpack").exists() or os.listdir(elsewhere)


def test_options_are_checked_where_they_are_written():
    with pytest.raises(ValueError, match="heartbeat"):
        ckptcore.Lease(seconds=10, heartbeat=10)
    with pytest.raises(TypeError, match="seconds"):
        ckptcore.Lease(seconds="30")
    with pytest.raises(ValueError, match="> 0"):
        ckptcore.Lease(heartbeat=float("nan"))
    with pytest.raises(TypeError, match="Backup"):
        ckptcore.Backup(None)  # type: ignore[arg-type]
    assert ckptcore.Backup("s3://b/r") == ckptcore.Backup("s3://b/r")
    assert hash(ckptcore.Backup("s3://b/r", storage_options={"anon": True}))
