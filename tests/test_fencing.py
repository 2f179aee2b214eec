"""Fencing (docs/RELIABILITY.md, "Fencing"): a writer whose lease was taken over can never commit
a step readers accept, never takes the lease back, never deletes anything.

Real processes on the moto S3 server: writer A (tests/_fence_worker.py) is paused with SIGSTOP in
the middle of a save, or between saves, or starved of the GIL by a long C call, while writer B
(this process) takes the root over and saves.
"""

from __future__ import annotations

import json
import os
import signal
import time
import warnings

import pytest

import ckptcore
from ckptcore import CheckpointManager, LockedError
from ckptcore import LockTakeoverWarning

from _support import tiny_state

LEASE = dict(lease=ckptcore.Lease(seconds=3.0, heartbeat=1.0), save_on_preemption=False)


def _line(proc, prefix: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line.strip()
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no {prefix!r} from writer A: {proc.stderr.read()[-3000:]}")


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] == "T"


def _take_over(root, options, steps=(21, 22)) -> CheckpointManager:
    """Writer B: restore, then save ``steps`` as soon as A's lease has lapsed."""
    b = CheckpointManager(root, storage_options=options, **LEASE)
    assert b.restore().step == 20
    deadline = time.monotonic() + 30
    while True:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", LockTakeoverWarning)
                b.save(steps[0], tiny_state(steps[0]))
            break
        except LockedError:
            assert time.monotonic() < deadline, "A's lease never lapsed"
            time.sleep(0.3)
    for s in steps[1:]:
        b.save(s, tiny_state(s))
    return b


def _reader(root, options) -> CheckpointManager:
    return CheckpointManager(root, storage_options=options, lock=False, save_on_preemption=False)


def _results(proc) -> dict[int, str]:
    out = {}
    for s in (30, 40):
        words = _line(proc, f"RESULT {s}").split()
        out[s] = words[2]
    return out


@pytest.mark.parametrize("mode", ["pause-in-save", "pause-in-save-async"])
@pytest.mark.slow
def test_a_writer_paused_before_its_manifest_commits_nothing_readers_accept(
        s3_backend, spawn_python, mode):
    root, options = s3_backend.url("run"), s3_backend.storage_options
    a = spawn_python("_fence_worker.py", root, json.dumps(options), mode)
    _line(a, "PAUSING")
    deadline = time.monotonic() + 20
    while not _stopped(a.pid):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    b = _take_over(root, options)  # B restores 20 and saves 21 and 22 while A is stopped
    os.kill(a.pid, signal.SIGCONT)
    results = _results(a)
    assert results == {30: "FencedError", 40: "FencedError"}, results
    assert a.wait(60) == 0
    # A committed its manifest of step 30 after the takeover: no reader accepts it, and A
    # deleted nothing (its keep=1 would have removed 20, 21 and 22).
    reader = _reader(root, options)
    assert reader.steps() == [20, 21, 22]
    assert reader.latest_step() == 22 and reader.restore().step == 22
    assert [c.step for c in ckptcore.list_checkpoints(root, storage_options=options)] == [20, 21, 22]
    b.save(24, tiny_state(24))  # B goes on: nothing of A's is in its way
    b.save(30, tiny_state(30))
    assert ckptcore.load_state(b.step_url(30), storage_options=options).model["w"][0] == 30
    b.close()
    assert _reader(root, options).steps() == [20, 21, 22, 24, 30]


@pytest.mark.slow
def test_a_writer_paused_between_saves_never_takes_the_root_back(s3_backend, spawn_python,
                                                                  tmp_path):
    root, options = s3_backend.url("run"), s3_backend.storage_options
    go = tmp_path / "go"
    a = spawn_python("_fence_worker.py", root, json.dumps(options), "pause-between", str(go))
    _line(a, "READY")
    os.kill(a.pid, signal.SIGSTOP)
    b = _take_over(root, options)
    b.close()  # B is done and released the lease: A finds no lease object when it wakes
    os.kill(a.pid, signal.SIGCONT)
    go.touch()
    assert _results(a) == {30: "FencedError", 40: "FencedError"}
    assert a.wait(60) == 0
    reader = _reader(root, options)
    assert reader.steps() == [20, 21, 22] and reader.restore().step == 22
    assert ".ckptcore.lock" not in s3_backend.listdir("run")  # A never re-created the lease


@pytest.mark.slow
def test_a_writer_starved_of_the_gil_is_fenced(s3_backend, spawn_python, tmp_path):
    root, options = s3_backend.url("run"), s3_backend.storage_options
    go = tmp_path / "go"
    a = spawn_python("_fence_worker.py", root, json.dumps(options), "gil", "9", str(go))
    _line(a, "STARVING")
    b = _take_over(root, options)  # while A is alive, its heartbeat thread starved
    starved = _line(a, "STARVED", timeout=120)
    go.touch()
    assert _results(a) == {30: "FencedError", 40: "FencedError"}, starved
    assert a.wait(60) == 0
    b.save(23, tiny_state(23))
    b.close()
    assert _reader(root, options).steps() == [20, 21, 22, 23]


@pytest.mark.slow
def test_an_explicit_restore_of_a_fenced_step_is_refused(s3_backend, spawn_python):
    root, options = s3_backend.url("run"), s3_backend.storage_options
    a = spawn_python("_fence_worker.py", root, json.dumps(options), "pause-in-save")
    _line(a, "PAUSING")
    while not _stopped(a.pid):
        time.sleep(0.05)
    b = _take_over(root, options)
    os.kill(a.pid, signal.SIGCONT)
    _results(a)
    a.wait(60)
    assert s3_backend.fs.exists(s3_backend.path("run", "step-000000000030", "manifest.msgpack"))
    reader = _reader(root, options)
    with pytest.raises(ckptcore.CheckpointNotFoundError):
        reader.restore(step=30)  # committed after the takeover: not a checkpoint to any reader
    b.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LockTakeoverWarning)
        removed = ckptcore.gc(root, grace=3600, storage_options=options)
    assert removed == [b.step_url(30)]  # gc removes it, whatever the grace
    s3_backend.fs.invalidate_cache()
    assert not s3_backend.fs.exists(s3_backend.path("run", "step-000000000030", "manifest.msgpack"))
    assert _reader(root, options).steps() == [20, 21, 22]


def test_a_taker_restores_and_its_first_commit_hides_nothing():
    """A new holder keeps the accepted steps its claim wrote, from its claim on: a holder that
    took its takeover as "no step accepted" restored nothing although steps were committed,
    then wrote the empty list into its record with its first commit, hiding every earlier step
    from every reader (a restarted writer "found no checkpoint" in the fencing loop).  (The
    claim no longer reads its record back, so a failed read-back cannot cause this; a failed
    read of the record it supersedes raises, see test_fencing_races.py.)"""
    import uuid

    root = f"memory://fencing-readback-{uuid.uuid4().hex}/run"
    with CheckpointManager(root, keep=2, **LEASE) as a:
        for s in range(4):
            a.save(s, tiny_state(s))
    with CheckpointManager(root, keep=2, **LEASE) as b:
        b.gc(grace=3600)  # takes the lease: claims generation 2
        assert b.restore().step == 3
        b.save(4, tiny_state(4))
    with _reader(root, {}) as r:
        assert r.steps() == [3, 4]


def test_a_restore_whose_listed_steps_all_vanish_lists_again(monkeypatch):
    """Listing a root is not atomic (its step folders, then each one's manifest): a restorer
    paused in between (SIGSTOP, a loaded machine) can find every step it listed deleted by the
    holder's retention meanwhile, and none of the holder's newer steps.  restore() lists again
    instead of reporting "no committed checkpoints" (a restarted writer of the fencing loop
    found no checkpoint although steps were acknowledged)."""
    import uuid

    from ckptcore._storage import RemoteStore

    root = f"memory://fencing-relist-{uuid.uuid4().hex}/run"
    a = CheckpointManager(root, keep=2, **LEASE)
    for s in range(4):
        a.save(s, tiny_state(s))
    real = RemoteStore.listdir
    armed = [True]

    def listdir(self, rel="", **kw):
        out = real(self, rel, **kw)
        if armed[0] and rel == "" and self.url.rstrip("/") == root:
            armed[0] = False  # the holder saves two steps; its retention deletes 2 and 3
            a.save(4, tiny_state(4))
            a.save(5, tiny_state(5))
        return out

    monkeypatch.setattr(RemoteStore, "listdir", listdir)
    try:
        with _reader(root, {}) as r:
            assert r.restore().step == 5
    finally:
        a.close()
    assert not armed[0]
