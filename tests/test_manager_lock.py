"""CheckpointManager: the writer lock (flock locally, a lease object on S3), gc, stale listings.

Split from test_manager.py (same conventions: real storage, no mocks of the storage layer).
"""
from __future__ import annotations

import gc
import json
import os
import socket
import time

import fsspec
import pytest

import ckptcore
from ckptcore import CheckpointManager, CheckpointNotFoundError, LockedError, _storage
from ckptcore import LockTakeoverWarning
from manager_support import (hold_lock, leftovers, mp, open_manager, read_lines, root_of,
                             wait_for_line)
from _support import assert_state_of, make_state


# ------------------------------------------------------------------------------------ lock
def test_second_manager_on_the_same_root_is_locked_out(backend):
    first = open_manager(backend)
    first.save(1, make_state(1))
    second = open_manager(backend)
    with pytest.raises(LockedError) as err:
        second.save(2, make_state(2))
    message = str(err.value)
    assert f"{socket.gethostname()}:{os.getpid()}:" in message  # names the holder
    assert isinstance(err.value, BlockingIOError)
    # Readers need no lock: listing and restoring work while the writer holds it.
    assert second.steps() == [1]
    assert_state_of(second.restore(), 1)
    assert_state_of(second.restore(step=1), 1)
    # Writes other than save() are the lock holder's too.
    with pytest.raises(LockedError):
        second.delete(1)
    with pytest.raises(LockedError):
        second.gc(grace=0)
    assert second.steps() == [1]
    first.save(2, make_state(2))  # the holder goes on saving
    first.close()  # releases the lock
    second.save(3, make_state(3))
    assert second.steps() == [1, 2, 3]
    with pytest.raises(LockedError):
        open_manager(backend).save(4, make_state(4))
    second.close()


@pytest.mark.slow
def test_a_manager_dropped_without_close_releases_its_local_lock(local_backend):
    # A notebook cell creating the manager, run twice: the first manager is unreachable but
    # was never closed.  While it lives, the error says the holder is in this process.
    first = open_manager(local_backend)
    first.save(1, make_state(1))
    with pytest.raises(LockedError, match="another CheckpointManager of this process"):
        open_manager(local_backend).save(2, make_state(2))
    del first
    gc.collect()
    with open_manager(local_backend) as again:
        again.save(2, make_state(2))
        assert again.steps() == [1, 2]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_keep_the_lock(local_backend):
    # A child forked while the lock is held closes its copy of the descriptor at fork: once the
    # parent closes its manager, the root is free although the child still runs.
    first = open_manager(local_backend)
    first.save(1, make_state(1))
    r, w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: runs (its fork handlers done) until told to go
        os.close(w)
        os.write(ready_w, b"x")
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    os.read(ready_r, 1)  # the child closes its copy in its fork handler, before it runs any code
    try:
        first.close()
        with open_manager(local_backend) as mgr:
            mgr.save(2, make_state(2))
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)


def _start_holder(root, options, tmp_path, name="holder"):
    report = str(tmp_path / f"{name}.log")
    release = mp().Event()
    proc = mp().Process(target=hold_lock, args=(root, options, report, release))
    proc.start()
    line = wait_for_line(report, "holding", proc=proc)
    return proc, release, report, int(line.split()[1])


@pytest.mark.parametrize("ending", ["close", "sigkill"])
def test_lock_held_by_another_process_local(tmp_path, ending):
    root = str(tmp_path / "run")
    proc, release, report, pid = _start_holder(root, None, tmp_path)
    try:
        mgr = CheckpointManager(root)
        with pytest.raises(LockedError, match=f":{pid}:") as err:
            mgr.save(2, make_state(2))
        assert "this process" not in str(err.value) and "forked" not in str(err.value)
        assert mgr.steps() == [1] and mgr.latest_step() == 1  # readers need no lock
        if ending == "close":
            release.set()
            proc.join(30)
            assert proc.exitcode == 0 and "released" in read_lines(report)
        else:
            proc.kill()  # SIGKILL: the kernel drops the flock with the process
            proc.join(30)
            assert proc.exitcode == -9
        if ending == "close":
            mgr.save(2, make_state(2))
        else:  # the dead holder is named when its lock is taken over
            with pytest.warns(LockTakeoverWarning, match=f":{pid}:"):
                mgr.save(2, make_state(2))
        assert mgr.steps() == [1, 2]
        mgr.close()
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


@pytest.mark.slow
def test_lock_on_s3_is_a_lease_object(s3_backend, tmp_path):
    root, options = s3_backend.url("run"), s3_backend.storage_options
    proc, release, report, pid = _start_holder(root, options, tmp_path)
    try:
        lease = json.loads(s3_backend.read("run", ".ckptcore.lock"))
        assert f":{pid}:" in lease["holder"] and lease["expires"] > time.time()
        mgr = CheckpointManager(root, storage_options=options)
        with pytest.raises(LockedError, match=f":{pid}:"):
            mgr.save(2, make_state(2))
        assert mgr.steps() == [1]
        release.set()
        proc.join(30)
        assert proc.exitcode == 0
        assert ".ckptcore.lock" not in s3_backend.listdir("run")  # close() removed the lease
        mgr.save(2, make_state(2))
        mgr.close()
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    # A holder killed outright leaves its lease.  Seen from another machine (its host name is
    # not ours), the next writer is told who holds it...
    proc, release, report, pid = _start_holder(s3_backend.url("run2"), options, tmp_path, "killed")
    proc.kill()
    proc.join(30)
    lease = json.loads(s3_backend.read("run2", ".ckptcore.lock"))
    lease["host"] = "another-host"
    s3_backend.write(json.dumps(lease).encode(), "run2", ".ckptcore.lock")
    mgr = CheckpointManager(s3_backend.url("run2"), storage_options=options)
    with pytest.raises(LockedError, match=f":{pid}:.*delete that object"):
        mgr.save(2, make_state(2))
    # ...and once the lease has expired (its holder stopped renewing it), it is taken over.
    s3_backend.write(json.dumps(dict(lease, expires=time.time() - 1)).encode(),
                     "run2", ".ckptcore.lock")
    with pytest.warns(LockTakeoverWarning, match=f":{pid}:.*expired"):
        mgr.save(2, make_state(2))
    assert f":{os.getpid()}:" in json.loads(s3_backend.read("run2", ".ckptcore.lock"))["holder"]
    mgr.close()


# ------------------------------------------------------------------------------------ gc
def _age(backend, *parts, seconds=3600.0):
    """Make a local leftover look old (object stores date objects themselves)."""
    path = backend.path(*parts)
    old = time.time() - seconds
    for dirpath, dirnames, filenames in os.walk(path):
        for n in filenames + dirnames:
            os.utime(os.path.join(dirpath, n), (old, old))
    os.utime(path, (old, old))


def _put(backend, data: bytes, *parts: str) -> None:
    backend.fs.makedirs(backend.path(*parts[:-1]), exist_ok=True)
    backend.write(data, *parts)


def _plant_leftovers(backend) -> None:
    """What interrupted saves leave: a temporary folder (local), a step folder with shards and
    no manifest, and a losing writer's shard next to a committed manifest."""
    _put(backend, b"x" * 100, "run", ".step-000000000009.tmp-0123456789abcdef",
         "shard-00000-0123456789abcdef.bin")
    _put(backend, b"x" * 100, "run", "step-000000000008", "shard-00000-feedfeedfeedfeed.bin")
    _put(backend, b"x" * 100, "run", "step-000000000002", "shard-00000-deaddeaddeaddead.bin")


def test_gc_removes_leftovers_and_never_committed_checkpoints(backend):
    with open_manager(backend) as mgr:
        for s in (1, 2):
            mgr.save(s, make_state(s))
        _plant_leftovers(backend)
        planted = set(leftovers(*root_of(backend)))
        assert len(planted) == 3, planted
        # Fresh leftovers may belong to a save in progress: the grace period protects them.
        assert mgr.gc(grace=3600) == []
        assert set(leftovers(*root_of(backend))) == planted
        removed = mgr.gc(grace=0)
        assert len(removed) == 3, removed
        assert leftovers(*root_of(backend)) == []
        assert mgr.steps() == [1, 2]
        for s in (1, 2):
            assert ckptcore.verify(mgr.step_url(s), storage_options=backend.storage_options) == []
        assert mgr.gc(grace=0) == []


def test_gc_grace_is_measured_from_the_newest_file(local_backend):
    backend = local_backend
    with open_manager(backend) as mgr:
        mgr.save(1, make_state(1))
        _plant_leftovers(backend)
        for name in (".step-000000000009.tmp-0123456789abcdef", "step-000000000008"):
            _age(backend, "run", name)
        # A shard still being written to keeps its folder alive, however old the folder is.
        backend.write(b"fresh", "run", "step-000000000008", "shard-00001-feedfeedfeedfeed.bin")
        removed = mgr.gc(grace=600)
        assert [os.path.basename(r) for r in removed] == [".step-000000000009.tmp-0123456789abcdef"]
        assert "step-000000000008" in backend.listdir("run")
        assert "shard-00000-deaddeaddeaddead.bin" in backend.listdir("run", "step-000000000002")
        mgr.gc(grace=0)
        assert leftovers(*root_of(backend)) == []
        assert mgr.steps() == [1]


def test_gc_leaves_a_half_deleted_step_nothing_to_read(local_backend):
    # Retention interrupted between removing the manifest and the data leaves a manifest-less
    # folder the writer record no longer names (it stops naming a step before its manifest
    # goes): not listed, not restorable, and gc() finishes the job.
    backend = local_backend
    with open_manager(backend) as mgr:
        for s in (1, 2):
            mgr.save(s, make_state(s))
        mgr._lock.forget(1)  # retention's first act
    backend.delete("run", "step-000000000001", "manifest.msgpack")  # its second; then a crash
    mgr = open_manager(backend)
    assert mgr.steps() == [2]
    with pytest.raises(CheckpointNotFoundError, match="interrupted"):
        mgr.restore(step=1)
    assert mgr.gc(grace=0) == [mgr.step_url(1)]
    assert backend.listdir("run") == [".ckptcore.gen", ".ckptcore.lock", "step-000000000002"]
    mgr.close()


# ------------------------------------------------------------------------------------ staleness
def _other_process_options(options: dict) -> dict:
    """Options for a second s3fs instance: its own caches, as in another process."""
    return dict(options, skip_instance_cache=True)


@pytest.mark.slow
def test_long_lived_manager_sees_other_processes_commits_on_s3(s3_backend):
    # A reader's gc() lists step folders; s3fs caches those listings.  A commit by another
    # process afterwards must still count: steps() must list it, and gc() must not take the
    # step for a manifest-less leftover (it would delete a committed checkpoint).
    root, options = s3_backend.url("run"), s3_backend.storage_options
    other = _other_process_options(options)
    writer = CheckpointManager(root, storage_options=other, lock=False)
    writer.save(1, make_state(1))
    reader = CheckpointManager(root, storage_options=options, lock=False)
    other_fs = fsspec.filesystem("s3", **other)
    partial = s3_backend.path("run", "step-000000000002", "shard-00000-aaaaaaaaaaaaaaaa.bin")
    other_fs.pipe_file(partial, b"partial")
    assert reader.gc(grace=3600) == []  # sees step 2 in progress, leaves it (grace)
    other_fs.rm_file(partial)
    writer.save(2, make_state(2))
    assert reader.steps() == [1, 2]
    assert_state_of(reader.restore(), 2)
    assert reader.gc(grace=0) == []
    assert writer.steps() == [1, 2]
    writer.delete(2)  # and deletions by the other process show too
    assert reader.steps() == [1]
    writer.close()
    reader.close()


def test_store_exists_is_not_answered_from_a_stale_listing(s3_backend):
    options = s3_backend.storage_options
    store = _storage.Store(s3_backend.url("ckpt"), options)
    store.write_bytes("shard-00000-aaaaaaaaaaaaaaaa.bin", b"x")
    assert [e.name for e in store.listdir()] == ["shard-00000-aaaaaaaaaaaaaaaa.bin"]
    other = _storage.Store(s3_backend.url("ckpt"), _other_process_options(options))
    other.write_bytes("manifest.msgpack", b"m", create_only=True)  # another process commits
    assert store.exists("manifest.msgpack")


@pytest.mark.slow
def test_a_lapsed_lease_taken_over_stops_the_old_writer_on_s3(s3_backend):
    # A writer that saves less often than the lease lasts can find its lease taken over by a
    # second writer (who saw it expired).  The first must then stop, not write next to it.
    root, options = s3_backend.url("run"), s3_backend.storage_options
    first = CheckpointManager(root, storage_options=options)
    first.save(1, make_state(1))
    lease = json.loads(s3_backend.read("run", ".ckptcore.lock"))
    s3_backend.write(json.dumps(dict(lease, expires=time.time() - 1)).encode(),
                     "run", ".ckptcore.lock")  # time passes: the lease lapses
    second = CheckpointManager(root, storage_options=_other_process_options(options))
    with pytest.warns(LockTakeoverWarning, match="expired"):
        second.save(2, make_state(2))  # takes the expired lease over
    taken = json.loads(s3_backend.read("run", ".ckptcore.lock"))["holder"]
    assert taken != lease["holder"]
    with pytest.raises(LockedError, match="took it over"):
        first.save(3, make_state(3))
    assert first.steps() == [1, 2]  # the old writer wrote nothing more
    first.close()  # and does not remove the new holder's lease
    assert json.loads(s3_backend.read("run", ".ckptcore.lock"))["holder"] == taken
    second.save(3, make_state(3))
    second.close()
    assert ".ckptcore.lock" not in s3_backend.listdir("run")


@pytest.mark.slow
def test_a_lease_removed_by_hand_is_taken_again_on_s3(s3_backend):
    root, options = s3_backend.url("run"), s3_backend.storage_options
    with CheckpointManager(root, storage_options=options, lease=ckptcore.Lease(seconds=3,
                           heartbeat=0.5)) as mgr:
        mgr.save(1, make_state(1))
        s3_backend.delete("run", ".ckptcore.lock")
        time.sleep(0.3)  # a save renews a lease not renewed for half a heartbeat
        mgr.save(2, make_state(2))
        assert f":{os.getpid()}:" in json.loads(s3_backend.read("run", ".ckptcore.lock"))["holder"]
    assert ".ckptcore.lock" not in s3_backend.listdir("run")


_ORPHAN = r'''
import os, signal, sys, time, warnings
import numpy as np
import ckptcore
root = sys.argv[1]
r, w = os.pipe()
pid = os.fork()
if pid == 0:  # the training process: holds the lock, forks a long-lived worker, then is killed
    mgr = ckptcore.CheckpointManager(root, save_on_preemption=False)
    mgr.save(1, ckptcore.TrainingState(model={"w": np.zeros(3)}))
    if os.fork() == 0:  # a data-loader worker that outlives its parent
        os.write(w, b"x")  # running: its fork handler has closed its copy of the lock
        time.sleep(6)
        os._exit(0)
    time.sleep(60)
    os._exit(0)
os.read(r, 1)
os.kill(pid, signal.SIGKILL)
os.waitpid(pid, 0)
warnings.simplefilter("ignore")
with ckptcore.CheckpointManager(root) as mgr:
    mgr.save(2, ckptcore.TrainingState(model={"w": np.zeros(3)}))
    print(mgr.steps())
'''


@pytest.mark.slow
def test_orphaned_forked_children_do_not_keep_a_killed_writers_lock(tmp_path):
    """A forked child (a loader worker) closes its copy of the flock descriptor, so after the
    writer is SIGKILLed a new manager takes the root over at once, while the orphan still runs."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _ORPHAN, str(tmp_path / "root")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[1, 2]"
