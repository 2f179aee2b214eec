"""What a writer commits and deletes is what readers accept:

* a manifest a reader would refuse (over ``max_manifest_bytes``) is never committed, and the
  good step before it survives ``keep=1``;
* retention deletes older steps only once the newest, which supersedes them, passes the reader's
  structural checks (a shard of it lost between its commit and retention keeps the older ones);
* a backup whose lease lapses mid-replication, taken over by ``ckpt gc --grace 0`` which sweeps
  the chunks just uploaded, never ends up listing a replica that names a missing chunk, and the
  step is not lost from both tiers.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings

import numpy as np
import pytest

import ckptcore
from ckptcore import CheckpointManager, FencedError, SchemaError, TrainingState, _knobs, _storage
from ckptcore import LockTakeoverWarning
from _support import store_params


def _state(step: int, meta: str = "") -> TrainingState:
    return TrainingState(model={"w": np.full(4096, step, np.float32),
                                "b": np.arange(300, dtype=np.float64) * step},
                         metadata={"note": meta} if meta else {}, step=step)


@pytest.fixture(params=store_params("local", "memory", "s3"))
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run"), {}
    if request.param == "memory":
        return f"memory://guards-{time.monotonic_ns()}/run", {}
    backend = request.getfixturevalue("s3_backend")
    return backend.url("run"), backend.storage_options


def test_a_manifest_readers_would_refuse_is_never_committed(root):
    url, opts = root
    with _knobs.override(max_manifest_bytes=64 << 10):
        with CheckpointManager(url, storage_options=opts, keep=1, save_on_preemption=False) as mgr:
            mgr.save(1, _state(1))
            with pytest.raises(SchemaError, match="max_manifest_bytes"):
                mgr.save(2, _state(2, meta="x" * (80 << 10)))  # a 80 KiB metadata value
            assert mgr.steps() == [1]
        with CheckpointManager(url, storage_options=opts, lock=False) as reader:
            assert reader.restore().step == 1
        with pytest.raises(SchemaError, match="nothing committed"):
            ckptcore.save_state(f"{url}/plain", _state(3, meta="y" * (80 << 10)),
                                storage_options=opts)
        assert not ckptcore.list_checkpoints(url, storage_options=opts)[1:]


def test_retention_keeps_older_steps_while_the_newest_fails_structural_checks(root, caplog):
    url, opts = root
    lost = []

    def hook(op: str, path: str) -> None:  # a shard of step 2 vanishes right as it commits
        if op in ("publish", "rename") and "step-000000000002" in path and not lost:
            store = _storage.Store(url, opts).child("step-000000000002")
            if op == "rename":  # local: the step is still in its temporary folder
                tmp = [e.name for e in _storage.Store(url, opts).listdir() if ".tmp-" in e.name]
                store = _storage.Store(url, opts).child(tmp[0])
            shard = sorted(e.name for e in store.listdir() if e.name.startswith("shard-"))[0]
            store.delete(shard)
            lost.append(shard)

    with CheckpointManager(url, storage_options=opts, keep=1, save_on_preemption=False) as mgr:
        mgr.save(1, _state(1))
        _storage._op_hook = hook
        try:
            with caplog.at_level(logging.WARNING, logger="ckptcore"):
                mgr.save(2, _state(2))
        finally:
            _storage._op_hook = None
        assert lost and mgr.steps() == [1, 2]  # step 1 kept: step 2 does not restore
        assert any("does not pass the reader's checks" in r.getMessage() for r in caplog.records)
        with pytest.warns(ckptcore.CheckpointFallbackWarning):
            assert mgr.restore().step == 1
        mgr.save(3, _state(3))  # a good newest step: now step 1 goes (the damaged step 2, which
        assert mgr.steps() == [2, 3]  # restore() fell back over, is never judged: kept, as before


@pytest.mark.parametrize("where", ["memory", "s3"])
@pytest.mark.slow
def test_gc_taking_a_lapsed_backup_over_mid_replication_loses_nothing(tmp_path, request, where):
    if where == "s3":
        backend = request.getfixturevalue("s3_backend")
        backup, opts = backend.url("backup"), backend.storage_options
    else:
        backup, opts = f"memory://guards-{time.monotonic_ns()}/backup", {}
    local = str(tmp_path / "local")
    swept: list[str] = []
    paused = threading.Event()

    def hook(op: str, path: str) -> None:
        # The replication of step 2 pauses once its chunks are uploaded, right before its
        # manifest: its lease lapses (heartbeat stopped, as a stopped process's would), gc takes
        # the bucket over and sweeps those chunks (no committed replica names them yet), then
        # the replication goes on and publishes.
        if op == "publish" and "backup/step-000000000002" in path and not paused.is_set():
            paused.set()
            lock = mgr.backup._lock
            lock._stop.set()
            time.sleep(lock.lease_seconds + 0.5)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", LockTakeoverWarning)
                swept.extend(ckptcore.gc(backup, grace=0, storage_options=opts))

    mgr = CheckpointManager(local, keep=1, backup=ckptcore.Backup(backup, storage_options=opts),
                            lease=ckptcore.Lease(seconds=1.5, heartbeat=0.5),
                            save_on_preemption=False)
    try:
        mgr.save(1, _state(1))
        mgr.wait()
        _storage._op_hook = hook
        mgr.save(2, _state(2))
        with pytest.raises(FencedError):
            mgr.wait()
    finally:
        _storage._op_hook = None
        try:
            mgr.close()
        except ckptcore.CheckpointError:
            pass
    assert paused.is_set() and swept  # the new chunks of step 2 were swept
    with CheckpointManager(backup, storage_options=opts, lock=False) as reader:
        for step in reader.steps():  # no listed replica names a missing chunk
            assert not ckptcore.verify(reader.step_url(step), storage_options=opts), step
        assert 2 not in reader.steps() or not ckptcore.verify(reader.step_url(2),
                                                              storage_options=opts)
    # step 2 is not lost: the local tier kept it (its replica never verified as committed)
    with CheckpointManager(local, lock=False) as reader:
        assert reader.steps()[-1] == 2
        assert reader.restore().step == 2
