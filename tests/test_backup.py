"""Backup tiers: a local root replicated to S3, GCS and Azure (real local servers), with the same
commit protocol; deduplicated chunks; restore from the best tier; retention per tier; sweeps that
never take a chunk a committed replica names; ``ckpt sync`` between any two stores."""

from __future__ import annotations

import contextlib
import logging
import shutil
import time

import numpy as np
import pytest

import ckptcore
from ckptcore import CheckpointManager, KeepLast, TrainingState, _knobs
from ckptcore._cas import sweep
from ckptcore._replica import list_blobs
from ckptcore._storage import Store
from ckptcore.cli import main as ckpt
from _proxy import CuttingProxy
from _support import finetune_state, frozen_backbone, same_finetune



def _bytes_in(store_url: str, opts: dict) -> int:
    """Everything the backup root holds, measured from the store itself."""
    return sum(e.size or 0 for e in Store(store_url, opts).find())


@pytest.fixture
def tiers(tmp_path, cloud_backend):
    return str(tmp_path / "local"), cloud_backend.url("backup"), cloud_backend.storage_options


def test_every_step_is_replicated_with_its_own_retention(tiers):
    local, backup, opts = tiers
    with CheckpointManager(local, keep=2, backup=ckptcore.Backup(backup, keep=KeepLast(3), storage_options=opts)) as mgr:
        for step in range(1, 7):
            mgr.save(step, finetune_state(step))
        mgr.wait()
        assert mgr.steps() == [5, 6]
        assert mgr.backup.steps() == [4, 5, 6]
    for step in (4, 5, 6):
        url = f"{backup}/step-{step:012d}"
        assert same_finetune(ckptcore.load_state(url, storage_options=opts), finetune_state(step))
        assert not ckptcore.verify(url, storage_options=opts)  # every chunk it refers to


def test_unchanged_tensors_are_not_uploaded_again(tiers):
    """90% of the parameter bytes frozen: each replicated step after the first adds at most 15%
    of the state's bytes to the store (measured by listing the store)."""
    local, backup, opts = tiers
    state_bytes = frozen_backbone().nbytes + finetune_state(1).model["head"].nbytes
    grown = []
    with CheckpointManager(local, backup=ckptcore.Backup(backup, storage_options=opts)) as mgr:
        for step in range(1, 5):
            before = _bytes_in(backup, opts) if step > 1 else 0
            mgr.save(step, finetune_state(step))
            mgr.wait()
            grown.append(_bytes_in(backup, opts) - before)
    assert grown[0] >= state_bytes  # the first replica uploads everything
    for g in grown[1:]:
        assert g <= 0.15 * state_bytes, (grown, state_bytes)


@pytest.mark.slow
def test_save_does_not_wait_for_the_bucket_and_wait_raises_its_errors(tmp_path, s3_backend):
    # A bucket that does not exist: every replication fails; saves go on locally.
    opts = s3_backend.storage_options
    with pytest.raises(ckptcore.CheckpointError, match="does not exist"):
        with CheckpointManager(str(tmp_path / "local"), backup=ckptcore.Backup("s3://no-such-bucket-here/run",
                               storage_options=opts)) as mgr:
            for step in (1, 2):
                mgr.save(step, finetune_state(step))
            assert mgr.steps() == [1, 2]
            mgr.wait()
    # the local steps were kept (no replica committed), and the next start retries them
    with CheckpointManager(str(tmp_path / "local"), keep=1, backup=ckptcore.Backup(s3_backend.url("b"),
                                                                 storage_options=opts)) as mgr:
        mgr.wait()
        assert mgr.backup.steps() == [1, 2]


def test_local_retention_keeps_steps_until_their_replica_is_committed(tiers, caplog):
    local, backup, opts = tiers
    mgr = CheckpointManager(local, keep=1, backup=ckptcore.Backup(backup, storage_options=opts))
    gate = __import__("threading").Event()
    original = mgr.backup._replicate
    mgr.backup._replicate = lambda step: (gate.wait(30), original(step))  # a stalled bucket
    with caplog.at_level(logging.INFO, logger="ckptcore"):
        for step in (1, 2, 3):
            mgr.save(step, finetune_state(step))
        assert mgr.steps() == [1, 2, 3]  # none replicated yet: none deleted
        assert "until its replica" in caplog.text
        gate.set()
        mgr.wait()
        mgr.save(4, finetune_state(4))
        assert mgr.steps() == [4]
    mgr.close()
    assert mgr.backup.steps() == [1, 2, 3, 4]


def test_restore_prefers_local_falls_back_to_the_replica_then_older(tiers):
    local, backup, opts = tiers
    with CheckpointManager(local, backup=ckptcore.Backup(backup, storage_options=opts)) as mgr:
        for step in (1, 2):
            mgr.save(step, finetune_state(step))
    # damage local step 2: its replica, not step 1, is restored
    shard = next((__import__("pathlib").Path(local) / "step-000000000002").glob("shard-*"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with CheckpointManager(local, backup=ckptcore.Backup(backup, storage_options=opts)) as mgr:
        with pytest.warns(ckptcore.CheckpointFallbackWarning, match="its replica"):
            state = mgr.restore()
    assert same_finetune(state, finetune_state(2))


def test_a_fresh_machine_restores_from_the_bucket_and_seeds_the_local_tier(tiers):
    local, backup, opts = tiers
    with CheckpointManager(local, keep=1, backup=ckptcore.Backup(backup, storage_options=opts)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, finetune_state(step))
    shutil.rmtree(local)
    with CheckpointManager(local, backup=ckptcore.Backup(backup, storage_options=opts)) as mgr:
        state = mgr.restore(seed=True)
        assert same_finetune(state, finetune_state(3))
        assert mgr.steps() == [3]  # seeded
        mgr.save(4, finetune_state(4))  # the run goes on from the local tier
        mgr.wait()
        assert mgr.backup.steps() == [1, 2, 3, 4]
    assert same_finetune(ckptcore.load_state(f"{local}/step-000000000003"), finetune_state(3))


def test_retention_and_sweep_never_remove_a_chunk_a_committed_replica_names(tiers):
    local, backup, opts = tiers
    with _knobs.override(gc_grace=0):
        with CheckpointManager(local, backup=ckptcore.Backup(backup, keep=KeepLast(1), storage_options=opts)) as mgr:
            for step in range(1, 5):
                mgr.save(step, finetune_state(step))
            mgr.wait()
            assert mgr.backup.steps() == [4]
        root = Store(backup, opts)
        # the frozen backbone is shared by every step: still there; old heads are gone
        state = ckptcore.load_state(f"{backup}/step-000000000004", storage_options=opts)
        assert same_finetune(state, finetune_state(4))
        referenced = {s for s in ckptcore.inspect(f"{backup}/step-000000000004",
                                                  storage_options=opts).shards}
        assert set(list_blobs(root)) == referenced
        # an unreferenced, young chunk (a replication in progress) is kept within the grace
    with _knobs.override(gc_grace=3600):
        root.write_bytes("chunks/ab/" + "ab" * 32, b"in flight")
        assert sweep(root, 3600) == []
    assert sweep(root, 0) and "cas:" + "ab" * 32 not in list_blobs(root)


def test_a_damaged_chunk_is_found_by_verify_and_the_local_copy_wins(tiers, capsys):
    local, backup, opts = tiers
    with CheckpointManager(local, backup=ckptcore.Backup(backup, storage_options=opts)) as mgr:
        mgr.save(1, finetune_state(1))
    root = Store(backup, opts)
    name = max(list_blobs(root).items(), key=lambda kv: kv[1][0])[0]  # the backbone's chunk
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
            mgr.save(step, finetune_state(step))
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
        mgr.save(4, finetune_state(4))
    assert ckpt(["sync", src, dst, "-q", "--keep-last", "2", *o]) == 0
    out = capsys.readouterr().out
    assert "copied step 4" in out and "3 already there" in out and "deleted step 1" in out
    assert [c.step for c in ckptcore.list_checkpoints(dst, storage_options=opts)] == [3, 4]
    assert same_finetune(ckptcore.load_state(f"{dst}/step-000000000004", storage_options=opts), finetune_state(4))
    # and back out to a plain local copy
    back = str(tmp_path / "back")
    assert ckpt(["sync", dst, back, "--plain", "-q", *o]) == 0
    assert same_finetune(ckptcore.load_state(f"{back}/step-000000000004"), finetune_state(4))
    assert not any((tmp_path / "back").glob("chunks"))


def test_ckpt_ls_shows_the_tiers(tiers, capsys):
    local, backup, opts = tiers
    with CheckpointManager(local, keep=1, backup=ckptcore.Backup(backup, storage_options=opts)) as mgr:
        for step in (1, 2):
            mgr.save(step, finetune_state(step))
    o = sum((["-o", f"{k}={v}"] for k, v in _flat(opts).items()), [])
    assert ckpt(["ls", local, "--backup", backup, *o]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(" backup") and lines[1].endswith(" local+backup"), lines


def test_bad_arguments_are_refused_clearly(tmp_path):
    with pytest.raises(ValueError, match="backup=URL"), pytest.warns(DeprecationWarning):
        CheckpointManager(str(tmp_path / "a"), backup_keep=3)
    with pytest.raises(TypeError, match="unexpected keyword"):
        CheckpointManager(str(tmp_path / "a"), backup_kep=3)
    with pytest.raises(TypeError, match="ckptcore.Backup"):
        CheckpointManager(str(tmp_path / "a"), backup=[{"url": "x"}])
    with pytest.raises(ValueError, match="given twice"):
        CheckpointManager(str(tmp_path / "a"), backup=[str(tmp_path / "b"), str(tmp_path / "b/")])
    with pytest.raises(TypeError, match="Backup"):
        ckptcore.Backup(str(tmp_path / "b"), dedup="yes")
    with pytest.raises(TypeError, match="keep="):
        ckptcore.Backup(str(tmp_path / "b"), keep="three")
    with pytest.raises(ValueError, match="own root"):
        CheckpointManager(str(tmp_path / "a"), backup=str(tmp_path / "a"))
    with pytest.raises(ValueError, match="backup"):
        CheckpointManager(str(tmp_path / "a"), backup="")


def test_ckpt_gc_of_a_backup_root_sweeps_unreferenced_chunks(tiers, capsys):
    local, backup, opts = tiers
    with CheckpointManager(local, backup=ckptcore.Backup(backup, storage_options=opts)) as mgr:
        mgr.save(1, finetune_state(1))
    root = Store(backup, opts)
    orphan = "chunks/cd/" + "cd" * 32  # an upload whose replica was never committed
    root.write_bytes(orphan, b"orphan")
    before = set(list_blobs(root))
    assert ckptcore.gc(backup, grace=3600, storage_options=opts) == []  # young: kept
    removed = ckptcore.gc(backup, grace=0, storage_options=opts)
    assert [u.rsplit("/", 1)[-1] for u in removed] == ["cd" * 32]
    assert set(list_blobs(root)) == before - {"cas:" + "cd" * 32}
    assert same_finetune(ckptcore.load_state(f"{backup}/step-000000000001", storage_options=opts), finetune_state(1))


@pytest.mark.slow
def test_many_small_frozen_tensors_are_not_uploaded_again(tmp_path, s3_backend):
    """A model of hundreds of small tensors (a frozen backbone's norms and biases) fills packs
    that do not change from step to step."""
    opts, backup = s3_backend.storage_options, s3_backend.url("many")
    rng = np.random.default_rng(5)
    frozen = {f"backbone/{i:03d}": rng.standard_normal(2_500).astype(np.float32)
              for i in range(400)}  # 4 MB in 10 KB tensors
    state_bytes = 4_000_000 + 400_000
    grown = []
    with CheckpointManager(str(tmp_path / "l"), backup=ckptcore.Backup(backup, storage_options=opts)) as mgr:
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


@contextlib.contextmanager
def _outage_after_step_1(tmp_path, outage, **knobs):
    """A manager (keep=1) whose step 1 is replicated, then the bucket goes down."""
    proxy, url, opts = outage
    with _knobs.override(**knobs):
        with CheckpointManager(str(tmp_path / "local"), keep=1, backup=ckptcore.Backup(url,
                               storage_options=opts)) as mgr:
            mgr.save(1, finetune_state(1))
            mgr.wait()
            proxy.down = True
            yield mgr


@pytest.mark.slow
def test_a_short_bucket_outage_is_ridden_out_by_retries(tmp_path, outage, caplog):
    proxy, url, opts = outage
    caplog.set_level(logging.INFO, logger="ckptcore")
    with _outage_after_step_1(tmp_path, outage, backup_retry_seconds=0.3, backup_retries=4) as mgr:
        mgr.save(2, finetune_state(2))
        deadline = time.monotonic() + 60
        while "trying again" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "trying again" in caplog.text  # the first try failed on the outage
        proxy.down = False
        mgr.wait()  # a later try went through: nothing to raise
        assert mgr.backup.steps() == [1, 2] and mgr.steps() == [2]
    assert proxy.refused > 0
    assert same_finetune(ckptcore.load_state(f"{url}/{ckptcore.layout.step_name(2)}",
                                     storage_options=opts), finetune_state(2))


@pytest.mark.slow
def test_steps_given_up_in_a_long_outage_go_up_once_the_bucket_answers(tmp_path, outage, caplog):
    proxy, url, opts = outage
    caplog.set_level(logging.INFO, logger="ckptcore")
    with _outage_after_step_1(tmp_path, outage, backup_retry_seconds=0.05, backup_retries=1) as mgr:
        mgr.save(2, finetune_state(2))
        mgr.save(3, finetune_state(3))
        with pytest.raises(ckptcore.StorageError):
            mgr.wait()  # every try failed: the outage is reported
        assert "giving up on step 2" in caplog.text
        assert caplog.text.count("trying again") == 1  # step 3: once, the bucket being down
        assert mgr.steps() == [2, 3]  # unreplicated local steps kept (keep=1)
        proxy.down = False
        mgr.save(4, finetune_state(4))
        mgr.wait()  # step 4 went up, then the steps given up on: no error left
        assert mgr.backup.steps() == [1, 2, 3, 4]
        assert mgr.steps() == [4]
        assert "answers again; retrying step 2" in caplog.text
    for step in (2, 3, 4):
        assert not ckptcore.verify(f"{url}/{ckptcore.layout.step_name(step)}",
                                   storage_options=opts)


def test_what_is_worth_retrying():
    """Errors as the storage layer hands them over (s3fs's translation of botocore's answers, then
    Store.translate_errors's): outages, resets and throttling are tried again; a missing bucket, missing
    or refused credentials, a damaged source and bugs are not."""
    from botocore.exceptions import ClientError, NoCredentialsError
    from s3fs.errors import translate_boto_error

    from ckptcore._retry import transient

    store = Store("s3://bucket/x", {"anon": True})

    def through_store(error: BaseException) -> BaseException:
        try:
            with store.translate_errors("put", "a", write=True):
                raise error
        except BaseException as e:  # noqa: BLE001 - what the tier sees
            return e
        raise AssertionError("not raised")

    for code in ("SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout"):
        boto = ClientError({"Error": {"Code": code, "Message": code}}, "PutObject")
        assert transient(through_store(translate_boto_error(boto))), code
    for code in ("AccessDenied", "InvalidAccessKeyId", "NoSuchBucket"):
        boto = ClientError({"Error": {"Code": code, "Message": code}}, "PutObject")
        assert not transient(through_store(translate_boto_error(boto))), code
    assert not transient(through_store(NoCredentialsError()))
    assert transient(ckptcore.StorageError("s3://b/x: put failed: EndpointConnectionError"))
    assert transient(ckptcore.LockedError("s3://b: held by another writer"))
    assert transient(ConnectionResetError()) and transient(TimeoutError())
    missing = ckptcore.StorageError("s3://b/x: the bucket 'b' does not exist (put failed)")
    missing.__cause__ = FileNotFoundError("NoSuchBucket: The specified bucket does not exist")
    assert not transient(missing)
    assert not transient(ckptcore.CorruptCheckpointError("local shard damaged"))
    assert not transient(PermissionError("denied")) and not transient(ValueError("bug"))
    assert not transient(NotADirectoryError(20, "Not a directory"))



@pytest.mark.slow
def test_a_group_replicates_once_and_every_rank_restores_from_the_best_tier(tmp_path, s3_backend,
                                                                            caplog):
    """2 ranks save a sharded state with a backup: rank 0 replicates each step once; 3 ranks
    restore it from the bucket after the local root is lost (and seed it), then fall back
    together from a damaged local copy to its replica."""
    from _support import run_ranks
    from test_dist_sharded import _rank_leaf
    from test_sharded_load import _check_rank, _state as _sharded

    caplog.set_level(logging.INFO, logger="ckptcore")
    root, url, opts = str(tmp_path / "local"), s3_backend.url("backup"), s3_backend.storage_options

    def manager(g):
        return CheckpointManager(root, keep=1, group=g, backup=ckptcore.Backup(url, storage_options=opts),
                                 save_on_preemption=False)

    def save(g):
        with manager(g) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, _sharded(_rank_leaf(2, g.rank)))
            mgr.wait()
            return mgr.backup.pending()

    out = run_ranks(ckptcore.ThreadGroup.create(2), save)
    assert out == {0: [], 1: []}, out
    assert caplog.text.count("backup: replicating step") == 3  # by rank 0 only
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [3]  # keep=1 on the local tier, once replicated
    replicas = [s for s, _ in ckptcore.layout.committed_steps(Store(url, opts))]
    assert replicas == [1, 2, 3]
    for s in replicas:
        assert not ckptcore.verify(f"{url}/{ckptcore.layout.step_name(s)}", storage_options=opts)

    def restore(g):
        with manager(g) as mgr:
            state = mgr.restore(like=_sharded(_rank_leaf(3, g.rank, template=True)), seed=True)
            _check_rank(state, 3, g.rank)
            return "ok"

    shutil.rmtree(root)  # a lost machine: only the bucket is left
    assert run_ranks(ckptcore.ThreadGroup.create(3), restore) == {0: "ok", 1: "ok", 2: "ok"}
    assert "step 3 restored from its replica" in caplog.text
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [3]  # seeded once, by rank 0
    # A damaged local copy: every rank falls back to the replica together, not to an older step.
    shard = sorted((tmp_path / "local" / ckptcore.layout.step_name(3)).glob("shard-*"))[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    caplog.clear()
    with pytest.warns(ckptcore.CheckpointFallbackWarning, match="falling back to its replica"):
        assert run_ranks(ckptcore.ThreadGroup.create(3), restore) == {0: "ok", 1: "ok", 2: "ok"}
    assert "step 3 restored from its replica" in caplog.text
    assert "replacing the damaged copy of step 3" in caplog.text  # seed=True heals the local tier
    assert not ckptcore.verify(str(tmp_path / "local" / ckptcore.layout.step_name(3)))



def test_a_bad_retry_knob_is_an_error_from_wait_and_the_tier_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTCORE_BACKUP_RETRIES", "3.0")  # a whole number written as a float
    assert _knobs.get("backup_retries") == 3
    monkeypatch.setenv("CKPTCORE_BACKUP_RETRIES", "three")
    with pytest.raises(ValueError, match="CKPTCORE_BACKUP_RETRIES='three'"):
        _knobs.get("backup_retries")
    monkeypatch.delenv("CKPTCORE_BACKUP_RETRIES")
    with CheckpointManager(str(tmp_path / "local"), backup=str(tmp_path / "bk")) as mgr:
        with _knobs.override(backup_retries=-1):
            mgr.save(1, finetune_state(1))
            with pytest.raises(ValueError, match="backup_retries=-1"):
                mgr.wait()
        mgr.save(2, finetune_state(2))  # the replicating thread survived it
        mgr.wait()
        assert mgr.backup.steps() == [2]


def test_with_a_group_every_rank_learns_what_replication_raised(tmp_path):
    from _support import run_ranks

    (tmp_path / "afile").write_bytes(b"")
    backup = str(tmp_path / "afile" / "bk")  # under a file: every replication fails

    def run(g):
        mgr = CheckpointManager(str(tmp_path / "local"), group=g, backup=backup,
                                save_on_preemption=False)
        mgr.save(1, finetune_state(1))
        try:
            mgr.wait()
        except Exception as e:  # noqa: BLE001 - compared below
            return type(e).__name__, str(e)
        finally:
            try:
                mgr.close()
            except Exception:  # noqa: BLE001 - rank 0 raises it again; seen above
                pass
        return "returned", ""

    # Knobs are the process's: overridden here, once, not in each rank's thread (two threads
    # overriding and restoring at once could leave the override behind for later tests).
    with _knobs.override(group_timeout=20):
        out = run_ranks(ckptcore.ThreadGroup.create(2), run)
    assert out[0][0] == "NotADirectoryError", out
    assert out[1][0] == "GroupError" and "NotADirectoryError" in out[1][1], out


def test_a_step_saved_again_replaces_its_stale_replica(tiers, caplog):
    local, backup, opts = tiers
    caplog.set_level(logging.INFO, logger="ckptcore")
    with CheckpointManager(local, backup=ckptcore.Backup(backup, storage_options=opts)) as mgr:
        mgr.save(1, finetune_state(1))
        mgr.save(2, finetune_state(2))
        mgr.wait()
        mgr.save(2, finetune_state(7))  # this manager's own step, saved again: replaced atomically
        mgr.wait()
    assert "replacing the replica of step 2" in caplog.text
    got = ckptcore.load_state(f"{backup}/{ckptcore.layout.step_name(2)}", storage_options=opts)
    assert same_finetune(got, finetune_state(7))


@pytest.mark.slow
def test_restore_with_the_bucket_down_uses_the_local_tier(tmp_path, outage, caplog):
    proxy, url, opts = outage
    with CheckpointManager(str(tmp_path / "local"), backup=ckptcore.Backup(url, storage_options=opts)) as mgr:
        mgr.save(1, finetune_state(1))
        mgr.wait()
    proxy.down = True
    caplog.set_level(logging.WARNING, logger="ckptcore")
    with _knobs.override(backup_retries=0):
        mgr = CheckpointManager(str(tmp_path / "local"), backup=ckptcore.Backup(url, storage_options=opts))
        try:
            assert same_finetune(mgr.restore(), finetune_state(1))
            assert "cannot be listed" in caplog.text
        finally:
            try:
                mgr.close()
            except ckptcore.StorageError:
                pass  # the listing at the start failed: raised by close(), as by wait()


@pytest.mark.slow
def test_close_with_the_bucket_down_tries_each_step_once_more_at_most(tmp_path, outage, caplog):
    proxy, url, opts = outage
    caplog.set_level(logging.INFO, logger="ckptcore")
    with _knobs.override(backup_retries=4, backup_retry_seconds=30.0):
        mgr = CheckpointManager(str(tmp_path / "local"), backup=ckptcore.Backup(url, storage_options=opts))
        mgr.save(1, finetune_state(1))
        mgr.wait()
        proxy.down = True
        mgr.save(2, finetune_state(2))
        deadline = time.monotonic() + 60
        while "trying again in 30 s (try 2 of 5)" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text[-2000:]
            time.sleep(0.05)  # the first try failed; the tier now waits 30 s before the next
        with pytest.raises(ckptcore.StorageError):
            mgr.close()  # the wait is cut short: one last try at once, then given up
    assert "try 3 of" not in caplog.text
    assert "giving up on step 2 for now (2 tries)" in caplog.text
    assert mgr.steps() == [1, 2]  # kept locally; the next start replicates it


# -- a sweep paused while another writer reuses what it is about to delete -------------------
_BIG = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: a blob of its own


def _two_unreferenced_blobs(local: str, backup: str, opts: dict, lease) -> np.ndarray:
    """Steps 1 and 2 replicated with ``keep=1``: step 1's two blobs end unreferenced (young:
    its sweep spares them).  Returns the array whose blob sorts second (deleted second)."""
    from ckptcore._replica import content_name

    a, b = _BIG, _BIG + 0.5
    with CheckpointManager(local, backup=ckptcore.Backup(backup, keep=1, storage_options=opts),
                           lease=lease, save_on_preemption=False) as mgr:
        mgr.save(1, TrainingState(model={"a": a, "b": b}, step=1))
        mgr.save(2, TrainingState(model={"a": a + 1, "b": b + 1}, step=2))
        mgr.wait()
    unreferenced = sorted(set(list_blobs(Store(backup, opts))) - set(ckptcore.inspect(
        f"{backup}/step-000000000002", storage_options=opts).shards))
    assert unreferenced == sorted(content_name(x.tobytes()) for x in (a, b))
    return a if content_name(a.tobytes()) == unreferenced[1] else b


def _pause_at_first_blob_delete(action) -> dict:
    from ckptcore import _storage

    state = {"fired": False, "inside": False}

    def hook(op: str, path: str) -> None:
        if state["inside"] or state["fired"] or op != "delete" or "/chunks/" not in path:
            return
        state["fired"] = state["inside"] = True
        try:
            action()
        finally:
            state["inside"] = False

    _storage._op_hook = hook
    return state


@pytest.mark.parametrize("where", ["memory", "s3"])
def test_a_paused_sweep_never_deletes_a_blob_a_new_holder_reuses(tmp_path, request, where,
                                                                monkeypatch):
    # gc of the backup sweeps two old unreferenced blobs, one per batch; it is stopped at its
    # first delete while its lease lapses.  A new holder replicates a step holding the second
    # blob's bytes (reused), keeps only the backup's copy, and the sweeper wakes: its fence
    # check before the next batch stops it, so the new holder's replica stays whole.
    from _faults import CLOCK, installed
    from ckptcore import _cas, _storage

    if where == "s3":
        backend = request.getfixturevalue("s3_backend")
        backup, opts = backend.url("backup"), backend.storage_options
    else:
        backup, opts = f"memory://sweep-{time.monotonic_ns()}/backup", {}
    lease = ckptcore.Lease(seconds=30, heartbeat=10)
    monkeypatch.setattr(_cas, "_BATCH", 1)
    with installed():
        reused = _two_unreferenced_blobs(str(tmp_path / "l1"), backup, opts, lease)

        def takeover() -> None:
            CLOCK.advance(10_000)  # the sweeper's lease lapses while it is stopped
            with CheckpointManager(str(tmp_path / "l2"), keep=1, lease=lease,
                                   backup=ckptcore.Backup(backup, storage_options=opts),
                                   save_on_preemption=False) as m2:
                m2.save(3, TrainingState(model={"w": reused}, step=3))
                m2.save(4, TrainingState(model={"w": reused + 2}, step=4))
                m2.wait()
                assert m2.steps() == [4] and m2.backup.replicated(3)

        try:
            paused = _pause_at_first_blob_delete(takeover)
            with pytest.raises(ckptcore.FencedError):
                ckptcore.gc(backup, grace=0, storage_options=opts)
        finally:
            _storage._op_hook = None
    assert paused["fired"]
    url = f"{backup}/step-000000000003"
    assert ckptcore.verify(url, storage_options=opts) == []
    assert np.array_equal(ckptcore.load_state(url, storage_options=opts).model["w"], reused)


def test_a_blob_no_manifest_names_is_written_again_when_reused_so_a_sweep_keeps_it(
        tmp_path, monkeypatch):
    # No fence (a sweep without a lock): the sweep decided on two old unreferenced blobs and
    # is stopped at its first delete; a writer then reuses the second.  The reuse writes the
    # blob again (no manifest names it), and the sweep, listing ages again before its next
    # batch, keeps it.
    from ckptcore import _cas, _storage
    from ckptcore._replica import copy_checkpoint

    local, backup = str(tmp_path / "l1"), str(tmp_path / "backup")
    monkeypatch.setattr(_cas, "_BATCH", 1)
    reused = _two_unreferenced_blobs(local, backup, {}, None)
    src = str(tmp_path / "l2" / "step-000000000003")
    ckptcore.save_state(src, TrainingState(model={"w": reused}, step=3))
    stats = []

    def reuse() -> None:
        time.sleep(0.05)  # (past the sweep's cutoff, at the file system's time resolution)
        stats.append(copy_checkpoint(Store(src), Store(backup).child("step-000000000003"),
                                     dedup=True)[1])

    try:
        paused = _pause_at_first_blob_delete(reuse)
        removed = sweep(Store(backup), 0)
    finally:
        _storage._op_hook = None
    assert paused["fired"] and len(removed) == 1 and removed[0].startswith(Store(backup).url)
    assert stats[0].refreshed == 1 and stats[0].reused == 0
    url = f"{backup}/step-000000000003"
    assert ckptcore.verify(url) == []
    assert np.array_equal(ckptcore.load_state(url).model["w"], reused)
