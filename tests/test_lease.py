"""Writer leases that survive preemption: a holder that is provably gone is taken over at once,
with a warning and a log line naming it; a live holder (heartbeating) never is.

Real processes and real storage: local disk (flock) and the moto S3 server (lease objects).
"""
from __future__ import annotations

import gc
import json
import logging
import os
import socket
import time

import pytest

import ckptcore
from ckptcore import CheckpointManager, LockedError
from ckptcore._lock import _machine, _start_time
from ckptcore import LockTakeoverWarning
from manager_support import hold_lock, mp, open_manager, wait_for_line
from _support import make_state


def _start_holder(root, options, tmp_path, name="holder", **kw):
    report = str(tmp_path / f"{name}.log")
    release = mp().Event()
    proc = mp().Process(target=hold_lock, args=(root, options, report, release, kw))
    proc.start()
    line = wait_for_line(report, "holding", proc=proc)
    return proc, release, int(line.split()[1])


def _stop(proc):
    if proc.is_alive():
        proc.kill()
    proc.join(30)


def _lease(backend, name="run"):
    return json.loads(backend.read(name, ".ckptcore.lock"))


def _plant(backend, lease, name="run"):
    backend.fs.makedirs(backend.path(name), exist_ok=True)
    backend.write(json.dumps(lease).encode(), name, ".ckptcore.lock")


def _foreign_lease(**fields):
    """A lease as a writer on another machine would have written it."""
    now = time.time()
    lease = {"holder": "elsewhere:4242:deadbeef", "host": "elsewhere", "pid": 4242,
             "token": "deadbeef", "machine": "other-boot/1", "start": "1", "heartbeat": now,
             "expires": now + 30.0, "lease_seconds": 30.0}
    lease.update(fields)
    return lease


# ------------------------------------------------------------------------------ after SIGKILL
@pytest.mark.slow
def test_a_sigkilled_writer_on_s3_is_taken_over_at_once(s3_backend, tmp_path, caplog):
    root, options = s3_backend.url("run"), s3_backend.storage_options
    proc, _, pid = _start_holder(root, options, tmp_path)
    proc.kill()  # preempted: the lease object stays behind
    proc.join(30)
    assert f":{pid}:" in _lease(s3_backend)["holder"]
    mgr = CheckpointManager(root, storage_options=options)
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="ckptcore"), \
            pytest.warns(LockTakeoverWarning, match=rf":{pid}:.*process {pid} on this machine"):
        mgr.save(2, make_state(2))
    assert time.monotonic() - started < 10  # not the lease's 30 s, let alone an hour
    assert any(r.levelno == logging.WARNING and f":{pid}:" in r.getMessage()
               and "taking over" in r.getMessage() for r in caplog.records)
    assert f":{os.getpid()}:" in _lease(s3_backend)["holder"]
    assert mgr.steps() == [1, 2]
    mgr.close()
    assert ".ckptcore.lock" not in s3_backend.listdir("run")


def test_a_sigkilled_writer_on_local_disk_is_named_when_taken_over(tmp_path, caplog):
    root = str(tmp_path / "run")
    proc, _, pid = _start_holder(root, None, tmp_path)
    proc.kill()
    proc.join(30)
    with caplog.at_level(logging.WARNING, logger="ckptcore"), \
            pytest.warns(LockTakeoverWarning, match=rf":{pid}:.*flock"):
        with CheckpointManager(root) as mgr:
            mgr.save(2, make_state(2))
    assert any(f":{pid}:" in r.getMessage() for r in caplog.records)
    # A writer that closed cleanly leaves nothing to warn about.
    with CheckpointManager(root) as mgr:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mgr.save(3, make_state(3))


# ------------------------------------------------------------------------------ live writers
@pytest.mark.slow
def test_a_live_writer_is_never_taken_over_while_it_heartbeats(s3_backend, tmp_path):
    root, options = s3_backend.url("run"), s3_backend.storage_options
    proc, release, pid = _start_holder(root, options, tmp_path,
                                       lease=ckptcore.Lease(seconds=2.0, heartbeat=0.4))
    try:
        first = _lease(s3_backend)
        assert first["lease_seconds"] == 2.0 and first["pid"] == pid
        time.sleep(3.0)  # longer than the lease: only the heartbeat keeps it
        renewed = _lease(s3_backend)
        assert renewed["heartbeat"] > first["heartbeat"] and renewed["expires"] > time.time()
        mgr = CheckpointManager(root, storage_options=options, lease=ckptcore.Lease(seconds=2.0,
                                heartbeat=0.4))
        with pytest.raises(LockedError, match=rf":{pid}:.*last renewed"):
            mgr.save(2, make_state(2))
        assert mgr.steps() == [1]
        release.set()
        proc.join(30)
        assert proc.exitcode == 0
        mgr.save(2, make_state(2))  # released cleanly: no takeover, no warning needed
        mgr.close()
    finally:
        _stop(proc)


@pytest.mark.slow
def test_a_live_writer_of_another_machine_waits_for_its_lease_to_expire(s3_backend):
    root, options = s3_backend.url("run"), s3_backend.storage_options
    _plant(s3_backend, _foreign_lease(expires=time.time() + 1.5))
    mgr = CheckpointManager(root, storage_options=options)
    with pytest.raises(LockedError, match="elsewhere:4242:deadbeef"):
        mgr.save(1, make_state(1))
    time.sleep(1.6)  # its holder stopped renewing it
    with pytest.warns(LockTakeoverWarning, match="elsewhere:4242:deadbeef.*expired"):
        mgr.save(1, make_state(1))
    mgr.close()


def test_the_same_host_name_in_another_container_is_not_taken_over_by_pid(s3_backend):
    # Two containers can share a host name; their pid namespaces differ, so a pid that does not
    # exist here says nothing about the holder there.
    root, options = s3_backend.url("run"), s3_backend.storage_options
    _plant(s3_backend, _foreign_lease(host=socket.gethostname(), pid=2 ** 22 - 3))
    with CheckpointManager(root, storage_options=options) as mgr:
        with pytest.raises(LockedError, match="deadbeef"):
            mgr.save(1, make_state(1))


@pytest.mark.slow
def test_a_reused_pid_does_not_keep_a_dead_holders_lease(s3_backend):
    # The holder's pid now names another (live) process: its start time differs.
    root, options = s3_backend.url("run"), s3_backend.storage_options
    parent = os.getppid()
    mine = dict(host=socket.gethostname(), machine=_machine(), pid=parent)
    _plant(s3_backend, _foreign_lease(**mine, start=_start_time(parent)))
    with CheckpointManager(root, storage_options=options) as mgr:
        with pytest.raises(LockedError):  # that very process is alive: never taken over
            mgr.save(1, make_state(1))
    _plant(s3_backend, _foreign_lease(**mine, start="12345"))
    with CheckpointManager(root, storage_options=options) as mgr:
        with pytest.warns(LockTakeoverWarning, match=f"process {parent} on this machine"):
            mgr.save(1, make_state(1))


@pytest.mark.slow
def test_a_manager_dropped_without_close_is_taken_over_in_the_same_process(s3_backend):
    first = open_manager(s3_backend)
    first.save(1, make_state(1))
    with pytest.raises(LockedError, match=f":{os.getpid()}:"):  # alive: refused
        open_manager(s3_backend).save(2, make_state(2))
    holder = first._lock.holder
    del first
    gc.collect()
    with open_manager(s3_backend) as again:
        with pytest.warns(LockTakeoverWarning, match=f"{holder}.*closed or dropped"):
            again.save(2, make_state(2))


@pytest.mark.slow
def test_an_unreadable_lease_is_taken_over(s3_backend):
    s3_backend.fs.makedirs(s3_backend.path("run"), exist_ok=True)
    s3_backend.write(b"\x00garbage", "run", ".ckptcore.lock")
    with open_manager(s3_backend) as mgr:
        with pytest.warns(LockTakeoverWarning, match="unreadable"):
            mgr.save(1, make_state(1))


def test_the_heartbeat_finds_its_lease_taken_over_and_the_next_save_stops(s3_backend, caplog):
    first = open_manager(s3_backend, lease=ckptcore.Lease(seconds=1.0, heartbeat=0.2))
    first.save(1, make_state(1))
    _plant(s3_backend, _foreign_lease())  # another writer took it (its clock said it expired)
    with caplog.at_level(logging.WARNING, logger="ckptcore"):
        deadline = time.monotonic() + 10
        while not first._lock._lost and time.monotonic() < deadline:
            time.sleep(0.05)
    assert first._lock._lost == "elsewhere:4242:deadbeef"
    assert any("took it over" in r.getMessage() for r in caplog.records)
    with pytest.raises(LockedError, match="took it over"):
        first.save(2, make_state(2))
    first.close()
    assert _lease(s3_backend)["holder"] == "elsewhere:4242:deadbeef"  # never removed another's
    with open_manager(s3_backend, lock=False) as reader:
        assert reader.steps() == [1]


@pytest.mark.parametrize("lease, beat", [(10, 10), (10, 20), (0, 0), (-1, 0.5), (float("nan"), 1)])
def test_lease_and_heartbeat_periods_are_checked(tmp_path, lease, beat):
    with pytest.raises(ValueError, match="heartbeat|seconds > 0"):
        CheckpointManager(str(tmp_path / "run"), lease=ckptcore.Lease(seconds=lease, heartbeat=beat))
    # the old spelling: still checked, and warned about
    with pytest.raises(ValueError, match="heartbeat|seconds > 0"), pytest.warns(DeprecationWarning):
        CheckpointManager(str(tmp_path / "run"), lease_seconds=lease, heartbeat_seconds=beat)


def test_a_lease_given_alone_gets_a_heartbeat_that_fits(tmp_path):
    with CheckpointManager(str(tmp_path / "run"), lease=ckptcore.Lease(seconds=6)) as mgr:
        assert (mgr._lock.lease_seconds, mgr._lock.heartbeat_seconds) == (6.0, 2.0)
    with CheckpointManager(str(tmp_path / "run"), lease=ckptcore.Lease(seconds=600)) as mgr:
        assert mgr._lock.heartbeat_seconds == 10.0
    with pytest.warns(DeprecationWarning, match=r"lease=Lease\(seconds=...\)"):
        mgr = CheckpointManager(str(tmp_path / "run"), lease_seconds=6)
    with mgr:
        assert (mgr._lock.lease_seconds, mgr._lock.heartbeat_seconds) == (6.0, 2.0)
