"""Tiers (``ckptcore/_tier.py``): the local root and every backup obey one set of rules, and a
third tier is configuration (a list of ``ckptcore.Backup``), not code."""

from __future__ import annotations

import contextlib
import logging
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


# -- a backup that is down or damaged when a run resumes --------------------------------------
def _dead_backup() -> Backup:
    pytest.importorskip("s3fs")
    from _support import dead_s3_options
    return Backup("s3://bucket/run", storage_options=dead_s3_options())


def test_save_goes_on_locally_when_the_backup_cannot_be_listed(tmp_path, caplog):
    # A resumed run whose backup is down from the start: the local retention asks whether each
    # step it would delete is replicated; a listing that fails means "not replicated" (logged
    # once), never an exception out of save() after the local commit.
    local = str(tmp_path / "run")
    with CheckpointManager(local, save_on_preemption=False) as mgr:
        for s in (1, 2):
            mgr.save(s, _state(s))
    with ckptcore._knobs.override(backup_retries=0), \
            caplog.at_level(logging.WARNING, logger="ckptcore"):
        mgr = CheckpointManager(local, keep=1, backup=_dead_backup(), save_on_preemption=False)
        try:
            assert mgr.restore().step == 2
            mgr.save(3, _state(3))
            mgr.save(4, _state(4))
            assert mgr.steps() == [1, 2, 3, 4]  # none replicated: every one kept
        finally:
            with pytest.raises(ckptcore.StorageError):
                mgr.close()  # what failed is reported by wait()/close(), as documented
    said = [r.getMessage() for r in caplog.records if "count as not replicated" in r.getMessage()]
    assert len(said) == 1 and "s3://bucket/run" in said[0], said


def _two_replicated_steps(tmp_path) -> tuple[str, str]:
    local, backup = str(tmp_path / "run"), str(tmp_path / "backup")
    with CheckpointManager(local, backup=Backup(backup), save_on_preemption=False) as mgr:
        for s in (1, 2):
            mgr.save(s, _state(s))
        mgr.wait()
    return local, backup


def test_save_goes_on_when_a_local_backups_replica_manifest_cannot_be_read(tmp_path, caplog,
                                                                           monkeypatch):
    # A local-disk backup (an NFS mount) whose listed replica's manifest cannot be read (EIO,
    # an OSError that is not a CheckpointError; injected below the storage layer, at the one
    # function that reads a local file) when a resumed run's retention first asks about that
    # step: not replicated (logged), the local step kept, and save() returns, never a bare
    # OSError out of it.
    import errno

    from ckptcore import _localfs

    local, backup = _two_replicated_steps(tmp_path)
    manifest = os.path.join(backup, step_name(1), "manifest.msgpack")
    real = _localfs.read_file

    def eio(path, *a, **kw):
        if path == manifest:
            raise OSError(errno.EIO, "Input/output error", path)
        return real(path, *a, **kw)

    monkeypatch.setattr(_localfs, "read_file", eio)
    with caplog.at_level(logging.WARNING, logger="ckptcore"):
        mgr = CheckpointManager(local, keep=1, backup=Backup(backup), save_on_preemption=False)
        try:
            assert mgr.restore().step == 2
            mgr.save(3, _state(3))
            assert 1 in mgr.steps() and 3 in mgr.steps()  # step 1 kept: its replica is unknown
        finally:
            with contextlib.suppress(ckptcore.errors.CheckpointError):
                mgr.close()  # (replicating step 1 again may meet the same EIO: typed if so)
    assert any("count as not replicated" in r.getMessage() and "Input/output" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_folder_in_place_of_a_replicas_manifest_is_a_typed_error(tmp_path, caplog):
    # A hostile replica: a folder named like its manifest.  Retention counts it as broken (not
    # replicated, the local step kept); replicating the step again cannot delete the folder:
    # a typed UnsafeCheckpointError from wait()/close(), never a bare IsADirectoryError.
    local, backup = _two_replicated_steps(tmp_path)
    manifest = os.path.join(backup, step_name(1), "manifest.msgpack")
    os.replace(manifest, manifest + ".moved")
    os.mkdir(manifest)
    with caplog.at_level(logging.WARNING, logger="ckptcore"):
        mgr = CheckpointManager(local, keep=1, backup=Backup(backup), save_on_preemption=False)
        try:
            assert mgr.restore().step == 2
            mgr.save(3, _state(3))
            assert 1 in mgr.steps() and 3 in mgr.steps()
        finally:
            with pytest.raises(ckptcore.errors.UnsafeCheckpointError, match="is a folder"):
                mgr.close()
    assert any("replica of step 1" in r.getMessage() and "is broken" in r.getMessage()
               for r in caplog.records)


def test_restore_of_a_step_whole_locally_ignores_a_backup_that_is_down(tmp_path, caplog):
    local = str(tmp_path / "run")
    with CheckpointManager(local, save_on_preemption=False) as mgr:
        for s in (1, 2):
            mgr.save(s, _state(s))
    with ckptcore._knobs.override(backup_retries=0):
        mgr = CheckpointManager(local, backup=_dead_backup(), save_on_preemption=False)
        try:
            with caplog.at_level(logging.WARNING, logger="ckptcore"):
                state = mgr.restore(step=1)
            assert state.step == 1 and np.array_equal(state.model["w"], _state(1).model["w"])
            assert any("cannot be asked for step 1" in r.getMessage() for r in caplog.records)
        finally:
            with pytest.raises(ckptcore.StorageError):
                mgr.close()


def _damage_replica(backup: str, step: int, how: str) -> None:
    from ckptcore._read import read_manifest
    from ckptcore._replica import blob_rel

    b = Store(backup)
    folder = b.child(step_name(step))
    if how == "blob":  # a blob only this step's replica names is lost (bit rot, a careless hand)
        others = set().union(*({s.path for s in read_manifest(b.child(step_name(o))).shards}
                               for o in Tier(b).steps() if o != step))
        victim = next(s.path for s in read_manifest(folder).shards if s.path not in others)
        os.remove(b.join(blob_rel(victim)))
    else:  # one byte of its manifest flipped
        path = os.path.join(folder.path, "manifest.msgpack")
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("how", ["blob", "manifest"])
def test_a_resumed_run_counts_a_listed_replica_only_once_it_passes_the_structural_check(
        tmp_path, caplog, how):
    local, backup = str(tmp_path / "local"), str(tmp_path / "backup")
    with CheckpointManager(local, backup=Backup(backup), save_on_preemption=False) as mgr:
        for s in (1, 2):
            mgr.save(s, _state(s))
        mgr.wait()
    _damage_replica(backup, 2, how)
    with caplog.at_level(logging.WARNING, logger="ckptcore"):
        with CheckpointManager(local, keep=1, backup=Backup(backup),
                               save_on_preemption=False) as mgr:
            assert mgr.backup.replicated(1)  # whole: counted
            assert not mgr.backup.replicated(2)  # broken: not counted, queued again (logged)
            mgr.save(3, _state(3))
            mgr.wait()
            assert mgr.backup.replicated(2) and mgr.backup.steps() == [1, 2, 3]
    assert any("replica of step 2" in r.getMessage() and "replicating it again" in r.getMessage()
               for r in caplog.records)
    assert ckptcore.verify(Store(backup).child(step_name(2)).url) == []  # whole again
    state = ckptcore.load_state(Store(backup).child(step_name(2)).url)
    assert np.array_equal(state.model["w"], _state(2).model["w"])
