"""A writer paused past its lease (a stopped process) deletes nothing of the writer that took the
root over, whatever it was doing when it stopped:

* ``gc`` judging a step folder without a manifest a leftover, stopped before deleting it, while
  the new holder commits that step in the same folder (an object store has no atomic rename: a
  commit goes into the existing prefix): the step stays, bit for bit;
* ``rewind`` stopped between a step's manifest and its shards, while the new holder saves that
  step again: the same;
* a plain copy (``ckpt sync --plain``, ``Backup(dedup=False)``) stopped before its shards, while
  another sync copies the step: the fenced copier's cleanup removes only its own shards (named
  by its attempt's token), never the winner's;
* ``ckpt sync`` meeting a step in DST that a fenced writer committed there (no reader accepts
  it): removed (logged) and copied over, and the steps after it copied too.

The pause is a storage-operation hook (``ckptcore._storage._op_hook``) and the lease clock is the
fault checker's (tests/_faults.py), on ``memory://`` and a real S3 server (moto).
"""

from __future__ import annotations

import logging
import time
import warnings

import pytest

import ckptcore
from ckptcore import CheckpointManager, FencedError, Lease, _lock, _storage
from ckptcore._storage import Store
from ckptcore._sync import sync
from ckptcore.api import read_manifest
from _faults import CLOCK
from _support import assert_state_of, make_state, store_params

LEASE = Lease(seconds=30, heartbeat=10)


@pytest.fixture(params=store_params("memory", "s3"))
def remote(request):
    """A root URL on an object store (where leases, not flocks, guard writers) and its options."""
    if request.param == "memory":
        return f"memory://paused-{time.monotonic_ns()}", {}
    backend = request.getfixturevalue("s3_backend")
    return backend.url(""), backend.storage_options


@pytest.fixture
def clock(monkeypatch):
    monkeypatch.setattr(_lock, "time", CLOCK)
    saved = CLOCK.offset
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckptcore.LockTakeoverWarning)
        yield CLOCK
    CLOCK.offset = saved
    _storage._op_hook = None


def _pause_once(match, action) -> dict:
    """Run ``action()`` before the first mutating storage operation ``match(op, path)`` picks,
    as if the writer were stopped there (nested operations pass through)."""
    state = {"fired": False, "inside": False}

    def hook(op: str, path: str) -> None:
        if state["inside"] or state["fired"] or not match(op, path):
            return
        state["fired"] = state["inside"] = True
        try:
            action()
        finally:
            state["inside"] = False

    _storage._op_hook = hook
    return state


def _lapse(clock) -> None:
    """Every live writer's lease lapses: heartbeats stopped (a stopped process's would be), the
    clock past the lease."""
    for lock in list(_lock._LIVE.values()):
        if lock._stop is not None:
            lock._stop.set()
    clock.offset += LEASE.seconds + 5


def _restores(url: str, opts: dict, step: int) -> None:
    with CheckpointManager(url, storage_options=opts, lock=False,
                           save_on_preemption=False) as reader:
        assert step in reader.steps()
        assert_state_of(reader.restore(step=step), step)
        assert not ckptcore.verify(reader.step_url(step), storage_options=opts)


def test_a_paused_gc_never_deletes_a_step_the_new_holder_committed(remote, clock, caplog):
    base, opts = remote
    root = base + "/run"
    with CheckpointManager(root, lease=LEASE, storage_options=opts,
                           save_on_preemption=False) as m:
        m.save(1, make_state(1))
        m.save(2, make_state(2))
    # An interrupted save of step 3 (a shard, no manifest): gc's to remove.
    Store(root, opts).child("step-000000000003").write_bytes("shard-00000-deadbeefdeadbeef.bin",
                                                             b"x" * 100)
    acked = []

    def take_over() -> None:  # gc stopped right before deleting the leftover
        _lapse(clock)
        with CheckpointManager(root, lease=LEASE, storage_options=opts,
                               save_on_preemption=False) as new:
            new.restore()
            new.save(3, make_state(3))
            acked.append(3)

    state = _pause_once(lambda op, p: op in ("delete", "delete_tree")
                        and "step-000000000003" in p, take_over)
    with caplog.at_level(logging.INFO, logger="ckptcore"):
        try:
            removed = ckptcore.gc(root, grace=0, storage_options=opts)
        except FencedError:
            removed = []
    _storage._op_hook = None
    assert state["fired"] and acked == [3]
    assert not any(u.rstrip("/").endswith("step-000000000003") for u in removed), removed
    _restores(root, opts, 3)  # the acknowledged step stands, bit for bit
    # every deletion gc decided is in the log, naming what it deleted
    assert any("shard-00000-deadbeefdeadbeef.bin" in r.getMessage() for r in caplog.records)


def test_a_paused_rewind_never_deletes_the_step_the_new_holder_saved_again(remote, clock):
    base, opts = remote
    root = base + "/run"
    m = CheckpointManager(root, lease=LEASE, keep=None, storage_options=opts,
                          save_on_preemption=False)
    try:
        for s in (1, 2, 3):
            m.save(s, make_state(s))

        def take_over() -> None:  # step 3's manifest is gone, its shards not yet
            _lapse(clock)
            with CheckpointManager(root, lease=LEASE, storage_options=opts,
                                   save_on_preemption=False) as new:
                assert new.restore().step == 2
                new.save(3, make_state(3))

        state = _pause_once(lambda op, p: op in ("delete", "delete_tree")
                            and "step-000000000003" in p
                            and not p.endswith("manifest.msgpack"), take_over)
        try:
            m.rewind(3)
        except FencedError:
            pass
        _storage._op_hook = None
        assert state["fired"]
    finally:
        _storage._op_hook = None
        try:
            m.close()
        except ckptcore.CheckpointError:
            pass
    _restores(root, opts, 3)


def test_a_fenced_plain_copy_never_deletes_the_winners_shards(remote, clock, tmp_path):
    base, opts = remote
    dst = base + "/mirror"
    src = str(tmp_path / "run")
    with CheckpointManager(src, save_on_preemption=False) as m:
        m.save(1, make_state(1))
    second = []

    def take_over() -> None:  # the first copier stopped before its first shard
        _lapse(clock)
        second.append(sync(src, dst, dedup=False, dst_storage_options=opts))

    state = _pause_once(lambda op, p: op in ("write_bytes", "open_write")
                        and "mirror/step-000000000001/shard-" in p, take_over)
    with pytest.raises(FencedError):
        sync(src, dst, dedup=False, dst_storage_options=opts)
    _storage._op_hook = None
    assert state["fired"] and second[0].copied == [1] and not second[0].broken
    _restores(dst, opts, 1)  # the winner's shards are all there


def test_a_plain_copy_names_its_shards_by_its_own_attempt(tmp_path):
    """docs/FORMAT.md: every shard name is unique to one attempt; a plain copy's too (so two
    copies of a step never share a file).  Readers read whatever the manifest names."""
    src, dst = str(tmp_path / "run"), str(tmp_path / "mirror")
    with CheckpointManager(src, save_on_preemption=False) as m:
        m.save(1, make_state(1))
    sync(src, dst, dedup=False)
    names = {s.path for s in read_manifest(Store(dst).child("step-000000000001")).shards}
    source = {s.path for s in read_manifest(Store(src).child("step-000000000001")).shards}
    assert names and not names & source
    tokens = {n.rsplit("-", 1)[1] for n in names}
    assert len(tokens) == 1 and all(n.startswith("shard-") and n.endswith(".bin") for n in names)
    _restores(dst, {}, 1)


@pytest.mark.parametrize("dedup", [True, False])
def test_sync_copies_over_a_step_a_fenced_writer_committed_in_dst(remote, clock, tmp_path, caplog,
                                                                  dedup):
    base, opts = remote
    dst = base + "/mirror"
    a = CheckpointManager(dst, lease=LEASE, storage_options=opts, save_on_preemption=False)
    try:
        a.save(1, make_state(1))

        def take_over() -> None:  # A stopped right before publishing step 3
            _lapse(clock)
            with CheckpointManager(dst, lease=LEASE, storage_options=opts,
                                   save_on_preemption=False) as t:
                t.restore()
                t._lock.acquire()

        _pause_once(lambda op, p: op == "publish" and "step-000000000003" in p, take_over)
        with pytest.raises(FencedError):
            a.save(3, make_state(3, scale=2))  # (not what SRC holds as step 3)
        _storage._op_hook = None
    finally:
        _storage._op_hook = None
        try:
            a.close()
        except ckptcore.CheckpointError:
            pass
    assert Store(dst, opts).child("step-000000000003").exists("manifest.msgpack")  # fenced
    src = str(tmp_path / "run")
    with CheckpointManager(src, save_on_preemption=False) as m:
        for s in range(1, 6):
            m.save(s, make_state(s))
    with caplog.at_level(logging.WARNING, logger="ckptcore"):
        report = sync(src, dst, dedup=dedup, dst_storage_options=opts)
    assert report.copied == [2, 3, 4, 5] and not report.broken
    assert any("sync(3): removing" in r.getMessage() for r in caplog.records)
    for s in range(1, 6):
        _restores(dst, opts, s)
