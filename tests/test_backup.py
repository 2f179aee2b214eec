"""Backup tiers: a local root replicated to S3, GCS and Azure (real local servers), with the same
commit protocol; deduplicated chunks; restore from the best tier; retention per tier; sweeps that
never take a chunk a committed replica names; ``ckpt sync`` between any two stores."""

from __future__ import annotations

import logging
import shutil
import time

import numpy as np
import pytest

import ckptcore
from ckptcore import CheckpointManager, KeepLast, TrainingState, _knobs
from ckptcore._backup import sweep
from ckptcore._replica import list_chunks
from ckptcore._storage import Store
from ckptcore.cli import main as ckpt
from _proxy import CuttingProxy

FROZEN = np.random.default_rng(0).standard_normal(450_000).astype(np.float32)  # 1.8 MB


def _state(step: int, *, tuned: int = 50_000) -> TrainingState:
    """A fine-tuning state: 90% of the parameter bytes frozen (the backbone), the head changing
    every step, trained with plain SGD (no slots: an optimizer's slots of the trainable part
    change every step too, and are uploaded every step)."""
    head = np.random.default_rng(step).standard_normal(tuned).astype(np.float32)
    return TrainingState(model={"backbone": FROZEN, "head": head},
                         optimizer=ckptcore.OptimizerState("sgd", step=step,
                                                           hyperparams={"lr": 0.01}),
                         data={"epoch": 0, "position": step}, step=step)


def _same(a: TrainingState, b: TrainingState) -> bool:
    return (a.step == b.step and a.data == b.data and a.optimizer.step == b.optimizer.step
            and all(a.model[k].tobytes() == b.model[k].tobytes() for k in b.model))


def _bytes_in(store_url: str, opts: dict) -> int:
    """Everything the backup root holds, measured from the store itself."""
    return sum(e.size or 0 for e in Store(store_url, opts).find())


@pytest.fixture
def tiers(tmp_path, cloud_backend):
    return str(tmp_path / "local"), cloud_backend.url("backup"), cloud_backend.storage_options


def test_every_step_is_replicated_with_its_own_retention(tiers):
    local, backup, opts = tiers
    with CheckpointManager(local, keep=2, backup=backup, backup_keep=KeepLast(3),
                           backup_storage_options=opts) as mgr:
        for step in range(1, 7):
            mgr.save(step, _state(step))
        mgr.wait()
        assert mgr.steps() == [5, 6]
        assert mgr.backup.steps() == [4, 5, 6]
    for step in (4, 5, 6):
        url = f"{backup}/step-{step:012d}"
        assert _same(ckptcore.load_state(url, storage_options=opts), _state(step))
        assert not ckptcore.verify(url, storage_options=opts)  # every chunk it refers to


def test_unchanged_tensors_are_not_uploaded_again(tiers):
    """90% of the parameter bytes frozen: each replicated step after the first adds at most 15%
    of the state's bytes to the store (measured by listing the store)."""
    local, backup, opts = tiers
    state_bytes = FROZEN.nbytes + _state(1).model["head"].nbytes
    grown = []
    with CheckpointManager(local, backup=backup, backup_storage_options=opts) as mgr:
        for step in range(1, 5):
            before = _bytes_in(backup, opts) if step > 1 else 0
            mgr.save(step, _state(step))
            mgr.wait()
            grown.append(_bytes_in(backup, opts) - before)
    assert grown[0] >= state_bytes  # the first replica uploads everything
    for g in grown[1:]:
        assert g <= 0.15 * state_bytes, (grown, state_bytes)


def test_save_does_not_wait_for_the_bucket_and_wait_raises_its_errors(tmp_path, s3_backend):
    # A bucket that does not exist: every replication fails; saves go on locally.
    opts = s3_backend.storage_options
    with pytest.raises(ckptcore.CheckpointError, match="does not exist"):
        with CheckpointManager(str(tmp_path / "local"), backup="s3://no-such-bucket-here/run",
                               backup_storage_options=opts) as mgr:
            for step in (1, 2):
                mgr.save(step, _state(step))
            assert mgr.steps() == [1, 2]
            mgr.wait()
    # the local steps were kept (no replica committed), and the next start retries them
    with CheckpointManager(str(tmp_path / "local"), keep=1, backup=s3_backend.url("b"),
                           backup_storage_options=opts) as mgr:
        mgr.wait()
        assert mgr.backup.steps() == [1, 2]


def test_local_retention_keeps_steps_until_their_replica_is_committed(tiers, caplog):
    local, backup, opts = tiers
    mgr = CheckpointManager(local, keep=1, backup=backup, backup_storage_options=opts)
    gate = __import__("threading").Event()
    original = mgr.backup._replicate
    mgr.backup._replicate = lambda step: (gate.wait(30), original(step))  # a stalled bucket
    with caplog.at_level(logging.INFO, logger="ckptcore"):
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
        assert mgr.steps() == [1, 2, 3]  # none replicated yet: none deleted
        assert "until its replica" in caplog.text
        gate.set()
        mgr.wait()
        mgr.save(4, _state(4))
        assert mgr.steps() == [4]
    mgr.close()
    assert mgr.backup.steps() == [1, 2, 3, 4]


def test_restore_prefers_local_falls_back_to_the_replica_then_older(tiers):
    local, backup, opts = tiers
    with CheckpointManager(local, backup=backup, backup_storage_options=opts) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    # damage local step 2: its replica, not step 1, is restored
    shard = next((__import__("pathlib").Path(local) / "step-000000000002").glob("shard-*"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with CheckpointManager(local, backup=backup, backup_storage_options=opts) as mgr:
        with pytest.warns(ckptcore.CheckpointFallbackWarning, match="its replica"):
            state = mgr.restore()
    assert _same(state, _state(2))


def test_a_fresh_machine_restores_from_the_bucket_and_seeds_the_local_tier(tiers):
    local, backup, opts = tiers
    with CheckpointManager(local, keep=1, backup=backup, backup_storage_options=opts) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    shutil.rmtree(local)
    with CheckpointManager(local, backup=backup, backup_storage_options=opts) as mgr:
        state = mgr.restore(seed=True)
        assert _same(state, _state(3))
        assert mgr.steps() == [3]  # seeded
        mgr.save(4, _state(4))  # the run goes on from the local tier
        mgr.wait()
        assert mgr.backup.steps() == [1, 2, 3, 4]
    assert _same(ckptcore.load_state(f"{local}/step-000000000003"), _state(3))


def test_retention_and_sweep_never_remove_a_chunk_a_committed_replica_names(tiers):
    local, backup, opts = tiers
    with _knobs.override(gc_grace=0):
        with CheckpointManager(local, backup=backup, backup_keep=KeepLast(1),
                               backup_storage_options=opts) as mgr:
            for step in range(1, 5):
                mgr.save(step, _state(step))
            mgr.wait()
            assert mgr.backup.steps() == [4]
        root = Store(backup, opts)
        # the frozen backbone is shared by every step: still there; old heads are gone
        state = ckptcore.load_state(f"{backup}/step-000000000004", storage_options=opts)
        assert _same(state, _state(4))
        referenced = {s for s in ckptcore.inspect(f"{backup}/step-000000000004",
                                                  storage_options=opts).shards}
        assert set(list_chunks(root)) == referenced
        # an unreferenced, young chunk (a replication in progress) is kept within the grace
    with _knobs.override(gc_grace=3600):
        root.write_bytes("chunks/ab/" + "ab" * 32, b"in flight")
        assert sweep(root, 3600) == []
    assert sweep(root, 0) and "cas:" + "ab" * 32 not in list_chunks(root)


def test_a_damaged_chunk_is_found_by_verify_and_the_local_copy_wins(tiers, capsys):
    local, backup, opts = tiers
    with CheckpointManager(local, backup=backup, backup_storage_options=opts) as mgr:
        mgr.save(1, _state(1))
    root = Store(backup, opts)
    name = max(list_chunks(root).items(), key=lambda kv: kv[1][0])[0]  # the backbone's chunk
    rel = f"chunks/{name[4:6]}/{name[4:]}"
    data = bytearray(root.read(rel))
    data[7] ^= 1
    root.write_bytes(rel, bytes(data))
    assert ckpt(["verify", f"{backup}/step-000000000001", *sum((["-o", f"{k}={v}"] for k, v in
                                                                 _flat(opts).items()), [])]) == 1
    assert "model/backbone" in capsys.readouterr().out


def _flat(opts: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in opts.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_ckpt_sync_between_stores_is_incremental_and_resumable(tmp_path, cloud_backend, capsys):
    src = str(tmp_path / "src")
    with CheckpointManager(src) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    dst, opts = cloud_backend.url("synced"), cloud_backend.storage_options
    o = sum((["-o", f"{k}={v}"] for k, v in _flat(opts).items()), [])
    assert ckpt(["sync", src, dst, "--dry-run", *o]) == 0
    assert "would copy step 3" in capsys.readouterr().out
    assert not Store(dst, opts).exists() or not ckptcore.list_checkpoints(dst, storage_options=opts)
    # an interrupted sync: step 1 copied, then the source grows; the next run copies the rest
    from ckptcore._sync import sync
    report = sync(src, dst, storage_options=opts, keep=None)
    assert report.copied == [1, 2, 3]
    with CheckpointManager(src) as mgr:
        mgr.save(4, _state(4))
    assert ckpt(["sync", src, dst, "-q", "--keep-last", "2", *o]) == 0
    out = capsys.readouterr().out
    assert "copied step 4" in out and "3 already there" in out and "deleted step 1" in out
    assert [c.step for c in ckptcore.list_checkpoints(dst, storage_options=opts)] == [3, 4]
    assert _same(ckptcore.load_state(f"{dst}/step-000000000004", storage_options=opts), _state(4))
    # and back out to a plain local copy
    back = str(tmp_path / "back")
    assert ckpt(["sync", dst, back, "--plain", "-q", *o]) == 0
    assert _same(ckptcore.load_state(f"{back}/step-000000000004"), _state(4))
    assert not any((tmp_path / "back").glob("chunks"))


def test_ckpt_ls_shows_the_tiers(tiers, capsys):
    local, backup, opts = tiers
    with CheckpointManager(local, keep=1, backup=backup, backup_storage_options=opts) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    o = sum((["-o", f"{k}={v}"] for k, v in _flat(opts).items()), [])
    assert ckpt(["ls", local, "--backup", backup, *o]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(" backup") and lines[1].endswith(" local+backup"), lines


def test_bad_arguments_are_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="backup=URL"):
        CheckpointManager(str(tmp_path / "a"), backup_keep=3)
    with pytest.raises(ValueError, match="own root"):
        CheckpointManager(str(tmp_path / "a"), backup=str(tmp_path / "a"))
    with pytest.raises(ValueError, match="group"):
        CheckpointManager(str(tmp_path / "a"), backup="memory://x",
                          group=ckptcore.SingleProcessGroup())


def test_ckpt_gc_of_a_backup_root_sweeps_unreferenced_chunks(tiers, capsys):
    local, backup, opts = tiers
    with CheckpointManager(local, backup=backup, backup_storage_options=opts) as mgr:
        mgr.save(1, _state(1))
    root = Store(backup, opts)
    orphan = "chunks/cd/" + "cd" * 32  # an upload whose replica was never committed
    root.write_bytes(orphan, b"orphan")
    before = set(list_chunks(root))
    assert ckptcore.gc(backup, grace=3600, storage_options=opts) == []  # young: kept
    removed = ckptcore.gc(backup, grace=0, storage_options=opts)
    assert [u.rsplit("/", 1)[-1] for u in removed] == ["cd" * 32]
    assert set(list_chunks(root)) == before - {"cas:" + "cd" * 32}
    assert _same(ckptcore.load_state(f"{backup}/step-000000000001", storage_options=opts), _state(1))


def test_many_small_frozen_tensors_are_not_uploaded_again(tmp_path, s3_backend):
    """A model of hundreds of small tensors (a frozen backbone's norms and biases) fills packs
    that do not change from step to step."""
    opts, backup = s3_backend.storage_options, s3_backend.url("many")
    rng = np.random.default_rng(5)
    frozen = {f"backbone/{i:03d}": rng.standard_normal(2_500).astype(np.float32)
              for i in range(400)}  # 4 MB in 10 KB tensors
    state_bytes = 4_000_000 + 400_000
    grown = []
    with CheckpointManager(str(tmp_path / "l"), backup=backup, backup_storage_options=opts) as mgr:
        for step in (1, 2, 3):
            head = np.random.default_rng(step).standard_normal(100_000).astype(np.float32)
            before = _bytes_in(backup, opts) if step > 1 else 0
            mgr.save(step, TrainingState(model={**frozen, "zz_head": head}, step=step))
            mgr.wait()
            grown.append(_bytes_in(backup, opts) - before)
    assert all(g <= 0.15 * state_bytes for g in grown[1:]), (grown, state_bytes)
    got = ckptcore.load_state(f"{backup}/step-000000000003", storage_options=opts)
    assert all(got.model[k].tobytes() == v.tobytes() for k, v in frozen.items())


@pytest.fixture
def outage(s3_backend, s3_storage_options):
    """The S3 server behind a proxy that can be taken down (connections closed on accept) and
    brought back: storage options through the proxy, failing fast."""
    port = int(s3_storage_options["client_kwargs"]["endpoint_url"].rsplit(":", 1)[1])
    proxy = CuttingProxy(port)
    opts = {**s3_storage_options, "skip_instance_cache": True,
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{proxy.port}"},
            "config_kwargs": {"connect_timeout": 1, "read_timeout": 5,
                              "retries": {"max_attempts": 1}}}
    yield proxy, s3_backend.url("backup"), opts
    proxy.close()


def test_a_short_bucket_outage_is_ridden_out_by_retries(tmp_path, outage, caplog):
    proxy, url, opts = outage
    caplog.set_level(logging.INFO, logger="ckptcore")
    with _knobs.override(backup_retry_seconds=0.3, backup_retries=4):
        with CheckpointManager(str(tmp_path / "local"), keep=1, backup=url,
                               backup_storage_options=opts) as mgr:
            mgr.save(1, _state(1))
            mgr.wait()
            proxy.down = True
            mgr.save(2, _state(2))
            deadline = time.monotonic() + 60
            while "trying again" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "trying again" in caplog.text  # the first try failed on the outage
            proxy.down = False
            mgr.wait()  # a later try went through: nothing to raise
            assert mgr.backup.steps() == [1, 2] and mgr.steps() == [2]
    assert proxy.refused > 0
    assert _same(ckptcore.load_state(f"{url}/{ckptcore.layout.step_name(2)}",
                                     storage_options=opts), _state(2))


def test_steps_given_up_in_a_long_outage_go_up_once_the_bucket_answers(tmp_path, outage, caplog):
    proxy, url, opts = outage
    caplog.set_level(logging.INFO, logger="ckptcore")
    with _knobs.override(backup_retry_seconds=0.05, backup_retries=1):
        with CheckpointManager(str(tmp_path / "local"), keep=1, backup=url,
                               backup_storage_options=opts) as mgr:
            mgr.save(1, _state(1))
            mgr.wait()
            proxy.down = True
            mgr.save(2, _state(2))
            mgr.save(3, _state(3))
            with pytest.raises(ckptcore.StorageError):
                mgr.wait()  # every try failed: the outage is reported
            assert "giving up on step 2" in caplog.text
            assert caplog.text.count("trying again") == 1  # step 3: once, the bucket being down
            assert mgr.steps() == [2, 3]  # unreplicated local steps kept (keep=1)
            proxy.down = False
            mgr.save(4, _state(4))
            mgr.wait()  # step 4 went up, then the steps given up on: no error left
            assert mgr.backup.steps() == [1, 2, 3, 4]
            assert mgr.steps() == [4]
            assert "answers again; retrying step 2" in caplog.text
    for step in (2, 3, 4):
        assert not ckptcore.verify(f"{url}/{ckptcore.layout.step_name(step)}",
                                   storage_options=opts)


def test_what_is_worth_retrying():
    from ckptcore._backup import transient

    assert transient(ckptcore.StorageError("s3://b/x: put failed: EndpointConnectionError"))
    assert transient(ckptcore.LockedError("s3://b: held by another writer"))
    assert transient(ConnectionResetError()) and transient(TimeoutError())
    missing = ckptcore.StorageError("s3://b/x: the bucket 'b' does not exist (put failed)")
    missing.__cause__ = FileNotFoundError("NoSuchBucket: The specified bucket does not exist")
    assert not transient(missing)
    assert not transient(ckptcore.CorruptCheckpointError("local shard damaged"))
    assert not transient(PermissionError("denied")) and not transient(ValueError("bug"))
