"""Integrity of deduplicated replicas: a chunk is reused only once verified (by the store's MD5
where it gives one, else read back), a damaged or missing one is uploaded again from the local
copy; a replica counts as replicated only once it verifies; ``ckpt sync`` heals or reports
broken steps; ``ckptcore.scrub`` / ``ckpt verify --deep`` check a whole backup root and repair it
from other tiers.  On local disk, ``memory://`` and the real S3 server (moto), some on GCS and
Azure too."""

from __future__ import annotations

import logging

import pytest

import ckptcore
from ckptcore import CheckpointManager
from ckptcore._replica import content_name, copy_checkpoint, list_blob_objects
from ckptcore._storage import Store
from ckptcore._sync import sync
from ckptcore.api import read_manifest
from ckptcore.cli import main as ckpt
from _support import finetune_state, frozen_backbone, same_finetune, store_params



def _flat(opts: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in opts.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _o(opts: dict) -> list[str]:
    return sum((["-o", f"{k}={v}"] for k, v in _flat(opts).items()), [])


@pytest.fixture(params=store_params("local", "memory", "s3"))
def store(request):
    """Local disk, memory:// and the real S3 server (moto)."""
    return request.getfixturevalue(f"{request.param}_backend")


def _rel(name: str) -> tuple[str, str, str]:
    return "chunks", name[4:6], name[4:]


def _backbone(root: Store) -> str:
    return max(list_blob_objects(root).items(), key=lambda kv: kv[1].size)[0]


def _damage(b, root_part: str, name: str, how: str) -> None:
    parts = (root_part, *_rel(name))
    if how == "flip":
        data = bytearray(b.read(*parts))
        data[12345] ^= 0x40
        b.write(bytes(data), *parts)
    elif how == "delete":
        b.delete(*parts)
    else:  # "swap": another object's bytes under this name
        b.write(b"\0" * 4096, *parts)


def _intact(url: str, opts: dict) -> bool:
    return not ckptcore.verify(url, storage_options=opts)


# -- 1. verified reuse ---------------------------------------------------------------------------
@pytest.mark.parametrize("how", ("flip", "delete", "swap"))
def test_a_damaged_chunk_is_not_reused_but_uploaded_again(tmp_path, store, how, caplog):
    backup, opts = store.url("backup"), store.storage_options
    with CheckpointManager(str(tmp_path / "local"), keep=1, backup=ckptcore.Backup(backup,
                           storage_options=opts)) as mgr:
        mgr.save(1, finetune_state(1))
        mgr.wait()
        name = _backbone(Store(backup, opts))
        _damage(store, "backup", name, how)
        with caplog.at_level(logging.WARNING, logger="ckptcore"):
            mgr.save(2, finetune_state(2))
            mgr.wait()
        assert name in caplog.text and "uploading it again" in caplog.text
        assert mgr.backup.last.healed == [name]
    for step in (1, 2):  # the re-upload healed step 1's replica as well
        url = f"{backup}/step-{step:012d}"
        assert _intact(url, opts)
        assert same_finetune(ckptcore.load_state(url, storage_options=opts), finetune_state(step))


def test_the_first_reuse_in_a_process_is_verified_and_what_it_costs(tmp_path, store, caplog):
    """A new process trusts nothing it did not upload: the first reuse of each chunk is checked,
    by the store's MD5 where there is one (S3: no byte read back), else read back; later reuses
    of an unchanged chunk cost nothing more."""
    backup, opts = store.url("backup"), store.storage_options
    with CheckpointManager(str(tmp_path / "local"), backup=ckptcore.Backup(backup,
                           storage_options=opts)) as mgr:
        mgr.save(1, finetune_state(1))
    name = _backbone(Store(backup, opts))
    _damage(store, "backup", name, "flip")
    with CheckpointManager(str(tmp_path / "local"), backup=ckptcore.Backup(backup,
                           storage_options=opts)) as mgr:
        with caplog.at_level(logging.WARNING, logger="ckptcore"):
            mgr.save(2, finetune_state(2))
            mgr.wait()
        assert mgr.backup.last.healed == [name] and name in caplog.text
        mgr.save(3, finetune_state(3))
        mgr.wait()
        third = mgr.backup.last
        assert third.healed == [] and third.reused >= 1
        # the backbone was verified by the heal's post-commit check: no new verification now
        assert third.read_back == (0 if store.name == "s3" else third.read_back)
        assert third.lists == 2  # one listing at the start of the copy, one to verify it
    assert all(_intact(f"{backup}/step-{s:012d}", opts) for s in (1, 2, 3))
    # a fresh writer verifies what it reuses: by ETag on S3, by reading back elsewhere
    src = Store(str(tmp_path / "local")).child("step-000000000003")
    dst = Store(backup, opts).child("step-000000000003")
    dst.delete("manifest.msgpack")
    _, stats = copy_checkpoint(src, dst, dedup=True, known={})
    # the backbone, which steps 1 and 2 name, is reused; the head, which no manifest names
    # once step 3's is gone (a sweep may be about to remove it), is verified and written again
    assert stats.reused == 1 and stats.refreshed == 1 and stats.healed == []
    assert stats.written + stats.reused_bytes == stats.read
    if store.name == "s3":
        assert stats.read_back == 0 and stats.checked >= 2
    else:
        assert stats.read_back >= frozen_backbone().nbytes and stats.checked == 0


@pytest.mark.parametrize("cloud", ("gcs", "azure"))
def test_gcs_and_azure_verify_reuse_by_their_md5(tmp_path, cloud, request):
    b = request.getfixturevalue(f"{cloud}_backend")
    backup, opts = b.url("backup"), b.storage_options
    src = str(tmp_path / "local")
    with CheckpointManager(src) as mgr:
        mgr.save(1, finetune_state(1))
    sync(src, backup, dst_storage_options=opts)
    name = _backbone(Store(backup, opts))
    _damage(b, "backup", name, "flip")
    _, stats = copy_checkpoint(Store(src).child("step-000000000001"),
                               Store(backup, opts).child("step-000000000001"), dedup=True,
                               known={}, overwrite=True)
    assert stats.healed == [name] and stats.read_back == 0 and stats.checked >= 1
    assert _intact(f"{backup}/step-000000000001", opts)


# -- 2. replicated only once verified ------------------------------------------------------------
def test_a_replica_that_does_not_verify_is_not_replicated_and_the_local_copy_stays(
        tmp_path, store, monkeypatch, caplog):
    from ckptcore import _replica

    backup, opts = store.url("backup"), store.storage_options
    real = _replica.write_objects

    def bad_store(root, objects):  # a store that corrupts what it is sent
        real(root, {n: (bytes(d[:-1]) + b"?" if len(d) > 1 << 20 else d)
                    for n, d in objects.items()})

    monkeypatch.setattr(_replica, "write_objects", bad_store)
    mgr = CheckpointManager(str(tmp_path / "local"), keep=1, backup=ckptcore.Backup(backup,
                            storage_options=opts))
    with caplog.at_level(logging.WARNING, logger="ckptcore"):
        mgr.save(1, finetune_state(1))
        with pytest.raises((ckptcore.CorruptCheckpointError,
                            ckptcore.IncompleteCheckpointError)) as e:
            mgr.wait()
    assert "cas:" in str(e.value) and "uncommitting" in caplog.text
    assert not mgr.backup.replicated(1) and mgr.backup.steps() == []
    monkeypatch.setattr(_replica, "write_objects", real)
    mgr.save(2, finetune_state(2))
    mgr.wait()
    assert mgr.backup.last.healed  # the damaged chunk left behind is found and replaced
    assert 1 in mgr.steps() and 2 in mgr.steps()  # step 1 has no replica: kept locally
    mgr.close()
    assert _intact(f"{backup}/step-000000000002", opts)


# -- 3. ckpt sync ----------------------------------------------------------------------------------
def test_ckpt_sync_heals_the_destination_or_exits_non_zero(tmp_path, store, capsys):
    src = str(tmp_path / "src")
    dst, opts = store.url("dst"), store.storage_options
    with CheckpointManager(src) as mgr:
        mgr.save(1, finetune_state(1))
    assert ckpt(["sync", src, dst, "-q", *_o(opts)]) == 0
    name = _backbone(Store(dst, opts))
    _damage(store, "dst", name, "flip")
    with CheckpointManager(src) as mgr:
        for step in (2, 3):
            mgr.save(step, finetune_state(step))
    capsys.readouterr()
    assert ckpt(["sync", src, dst, "-q", *_o(opts)]) == 0
    assert "2 step(s) copied" in capsys.readouterr().out
    assert all(_intact(f"{dst}/step-{s:012d}", opts) for s in (1, 2, 3))
    # a step already there with a chunk missing: copied again over itself
    only1 = ({s.path for s in read_manifest(Store(dst, opts).child("step-000000000001")).shards}
             - {s.path for s in read_manifest(Store(dst, opts).child("step-000000000002")).shards})
    (pack,) = only1
    _damage(store, "dst", pack, "delete")
    report = sync(src, dst, storage_options={}, dst_storage_options=opts)
    assert report.healed == [1] and report.broken == [] and report.copied == []
    assert _intact(f"{dst}/step-000000000001", opts)
    # ... and when the source cannot heal it either, the sync says so and exits 1
    _damage(store, "dst", pack, "delete")
    shard = next((tmp_path / "src" / "step-000000000001").glob("shard-*"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert ckpt(["sync", src, dst, "-q", *_o(opts)]) == 1
    out = capsys.readouterr().out
    assert "BROKEN step 1" in out and "1 broken" in out


# -- 4. scrub / ckpt verify --deep --------------------------------------------------------------
def _backup_with_three_steps(tmp_path, b):
    local, backup, opts = str(tmp_path / "local"), b.url("backup"), b.storage_options
    with CheckpointManager(local, backup=ckptcore.Backup(backup, storage_options=opts)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, finetune_state(step))
    root = Store(backup, opts)
    packs = {s: ({x.path for x in read_manifest(root.child(f"step-{s:012d}")).shards}
                 - {_backbone(root)}).pop() for s in (1, 2, 3)}
    return local, backup, opts, _backbone(root), packs


def test_scrub_finds_damage_and_repairs_it_from_the_local_root(tmp_path, store, capsys, caplog):
    local, backup, opts, backbone, packs = _backup_with_three_steps(tmp_path, store)
    clean = ckptcore.scrub(backup, storage_options=opts)
    assert clean.ok and clean.deduplicated and clean.steps == (1, 2, 3) and clean.blobs == 4
    assert clean.bytes_read >= frozen_backbone().nbytes and not clean.damaged
    _damage(store, "backup", backbone, "flip")      # named by every step
    _damage(store, "backup", packs[2], "delete")    # a pack: several tensors, zero padding
    _damage(store, "backup", packs[3], "swap")
    orphan = content_name(b"an upload whose replica was never committed")
    store.fs.makedirs(store.path("backup", *_rel(orphan)[:2]), exist_ok=True)
    store.write(b"not those bytes", "backup", *_rel(orphan))
    report = ckptcore.scrub(backup, storage_options=opts)
    assert not report.ok
    assert set(report.broken) == {backbone, packs[2], packs[3]}
    assert set(report.damaged) == {backbone, packs[2], packs[3], orphan}  # the orphan: not broken
    assert isinstance(report, ckptcore.ScrubReport) and report.repaired == ()
    assert ckpt(["verify", "--deep", backup, *_o(opts)]) == 1
    out = capsys.readouterr().out
    assert f"BROKEN   {backbone}" in out and "3 still broken" in out
    with caplog.at_level(logging.WARNING, logger="ckptcore"):
        assert ckpt(["verify", "--deep", backup, "--repair-from", local, *_o(opts)]) == 0
    out = capsys.readouterr().out
    assert all(f"REPAIRED {n}" in out for n in (backbone, packs[2], packs[3]))
    assert "repaired blob" in caplog.text and "0 still broken" in out
    for step in (1, 2, 3):
        url = f"{backup}/step-{step:012d}"
        assert _intact(url, opts)
        assert same_finetune(ckptcore.load_state(url, storage_options=opts), finetune_state(step))
    assert ckptcore.scrub(backup, storage_options=opts).damaged == (orphan,)


def test_scrub_repairs_from_another_backup_root_and_never_from_another_checkpoint(
        tmp_path, store):
    local, backup, opts, backbone, packs = _backup_with_three_steps(tmp_path, store)
    mirror = str(tmp_path / "mirror")
    sync(backup, mirror, storage_options=opts, dst_storage_options={})
    other = str(tmp_path / "other")  # another run's step 2: the same step, another checkpoint
    with CheckpointManager(other) as mgr:
        mgr.save(2, finetune_state(2))
    _damage(store, "backup", packs[2], "flip")
    report = ckptcore.scrub(backup, storage_options=opts, repair_from=[other],
                            repair_storage_options={})
    assert report.broken == (packs[2],)  # another writer's step is not used
    report = ckptcore.scrub(backup, storage_options=opts, repair_from=[other, mirror],
                            repair_storage_options={})
    assert report.ok and report.repaired == (packs[2],)
    assert _intact(f"{backup}/step-000000000002", opts)


def test_verify_deep_of_a_plain_root_verifies_every_step(tmp_path, capsys):
    root = str(tmp_path / "run")
    with CheckpointManager(root) as mgr:
        for step in (1, 2):
            mgr.save(step, finetune_state(step))
    assert ckpt(["verify", "--deep", root]) == 0
    assert "2 step(s) verified" in capsys.readouterr().out
    shard = next((tmp_path / "run" / "step-000000000001").glob("shard-*"))
    data = bytearray(shard.read_bytes())
    data[64] ^= 1
    shard.write_bytes(bytes(data))
    report = ckptcore.scrub(root)
    assert not report.deduplicated and report.broken == ("step 1",)
    assert ckpt(["verify", "--deep", root]) == 1
    assert ckpt(["verify", f"{root}/step-000000000002"]) == 0  # without --deep: as before
    with pytest.raises(ValueError):
        ckptcore.scrub(f"{root}/step-000000000002")
