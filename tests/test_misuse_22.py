"""What a new user hit, each made clear and early: a dict passed as the state, a malformed
TrainingState, a restore that leaves the data position unapplied, load_state of a run's root,
messages shown twice or with counts that disagree or hints that do not apply, and errors that
came late (an unreachable backup, a root another live writer holds)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import ckptcore
from ckptcore import (CheckpointManager, CheckpointNotFoundError, DataCursor, LockedError,
                      OptimizerState, ScheduleState, StorageError, TrainingState,
                      UnappliedStateWarning)
from ckptcore import _knobs
from ckptcore._backup import BackupTier
from ckptcore._storage import Store
from ckptcore.errors import MigrationError
from _support import dead_s3_options, subprocess_env, tiny_state

HERE = Path(__file__).parent


def _run_script(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with Python's default warning and logging setup
    (no handler on any logger): what a user's script shows on its console."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          env=subprocess_env(HERE), capture_output=True, text=True, timeout=120,
                          cwd=str(HERE))


# ------------------------------------------------------------------------- 1. what save() takes
def test_manager_save_of_a_dict_is_a_type_error_naming_what_to_pass(tmp_path):
    with CheckpointManager(tmp_path / "run", save_on_preemption=False) as mgr:
        with pytest.raises(TypeError) as err:
            mgr.save(1, {"w": np.zeros(3)})
        message = str(err.value)
        assert "TrainingState" in message and "model=" in message and "dict" in message
        assert mgr.steps() == []
        mgr.save(1, tiny_state(1, n=3))  # nothing was taken or left behind by the refused call
        assert mgr.steps() == [1]
    with pytest.raises(TypeError, match="TrainingState.*model="):
        ckptcore.save_state(tmp_path / "one", {"w": np.zeros(3)})


@pytest.mark.parametrize("section, value", [
    ("model", "x"), ("model", [np.zeros(3)]), ("optimizer", {"kind": "sgd"}),
    ("schedule", "cosine"), ("accumulation", 4), ("rng", None), ("data", 3),
    ("metadata", "run 1"), ("extra", []), ("params", "p"), ("step", 1.5), ("epoch", "2"),
    ("framework", 3)])
def test_a_training_state_checks_its_sections_at_construction(section, value):
    with pytest.raises(TypeError, match=rf"TrainingState\.{section} must be"):
        TrainingState(**{"model": {"w": np.zeros(3)}, section: value})


def test_a_well_formed_training_state_is_accepted():
    s = TrainingState(model={"w": np.zeros(3)}, optimizer=OptimizerState("sgd"),
                      schedule=ScheduleState("constant"), step=np.int64(3), epoch=1,
                      framework="numpy", data={"epoch": 0})
    assert s.step == 3
    assert TrainingState().model == {}


# ------------------------------------------------------------------- 2. the data position, once
_RESTORE_WITHOUT_CURSOR = """
    import sys, numpy as np, ckptcore
    from ckptcore_numpy import Model
    root = sys.argv[1]
    cursor = ckptcore.DataCursor(12, 4, seed=3)
    cursor.next_batch()
    mgr = ckptcore.CheckpointManager(root)
    mgr.save(1, model=Model({"w": np.ones(3, np.float32)}), cursor=cursor)
    print("restore", flush=True)
    mgr.restore(model=Model({"w": np.zeros(3, np.float32)}))
    sys.stderr.flush()
    print("load_state", flush=True)
    ckptcore.load_state(mgr.step_url(1), model=Model({"w": np.zeros(3, np.float32)}))
    sys.stderr.flush()
    print("plain", flush=True)
    assert ckptcore.load_state(mgr.step_url(1)).data == cursor.state_dict()
    assert mgr.restore().data == cursor.state_dict()
    mgr.close()
"""


@pytest.mark.slow
def test_a_restore_without_cursor_shows_the_warning_once_on_a_plain_console(tmp_path):
    proc = _run_script(_RESTORE_WITHOUT_CURSOR, str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    # Each restore into objects warns once: the warning, not also the log line beside it.
    assert proc.stderr.count("leaves unapplied: data (pass cursor=") == 2, proc.stderr
    assert proc.stderr.count("UnappliedStateWarning") == 2, proc.stderr


def test_restores_into_objects_warn_once_and_plain_loads_never(tmp_path, caplog):
    import ckptcore_numpy as cn
    cursor = DataCursor(12, 4, seed=3)
    cursor.next_batch()
    with CheckpointManager(tmp_path / "run", save_on_preemption=False) as mgr:
        mgr.save(1, model=cn.Model({"w": np.ones(3, np.float32)}), cursor=cursor)
        for restore in (lambda: mgr.restore(model=cn.Model({"w": np.zeros(3, np.float32)})),
                        lambda: mgr.restore(1, model=cn.Model({"w": np.zeros(3, np.float32)})),
                        lambda: ckptcore.load_state(mgr.step_url(1),
                                                    model=cn.Model({"w": np.zeros(3, np.float32)}))):
            with warnings.catch_warnings(record=True) as caught, \
                    caplog.at_level(logging.WARNING, logger="ckptcore"):
                warnings.simplefilter("always")
                caplog.clear()
                restore()
            hits = [w for w in caught if issubclass(w.category, UnappliedStateWarning)]
            assert len(hits) == 1 and hits[0].filename == __file__, [str(w.message) for w in caught]
            # with logging set up (here pytest's), the trail has it too, once
            assert len([r for r in caplog.records if "data (pass cursor=" in r.getMessage()]) == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert ckptcore.load_state(mgr.step_url(1)).data == cursor.state_dict()
            assert mgr.restore().data == cursor.state_dict()


# ---------------------------------------------------------------------------- 3. a run's root
def test_load_state_of_a_run_root_says_it_is_a_root_and_what_to_call(tmp_path):
    root = tmp_path / "run"
    with CheckpointManager(root, save_on_preemption=False) as mgr:
        mgr.save(7, tiny_state(7, n=3))
    for call in (ckptcore.load_state, ckptcore.inspect, ckptcore.verify):
        with pytest.raises(CheckpointNotFoundError) as err:
            call(root)
        message = str(err.value)
        assert "run's root" in message and "CheckpointManager(" in message, message
        assert ".restore(" in message and "step-000000000007" in message, message
        assert "interrupted save" not in message
    leftover = tmp_path / "half" / "step-000000000001"  # a step folder without its manifest
    leftover.mkdir(parents=True)
    (leftover / "shard-0").write_bytes(b"x")
    with pytest.raises(CheckpointNotFoundError, match="interrupted save"):
        ckptcore.load_state(leftover)


# ------------------------------------------------------------------------------------ 4. noise
_TAKEOVER = """
    import os, sys, numpy as np, ckptcore
    root, mode = sys.argv[1], sys.argv[2]
    st = ckptcore.TrainingState(model={"w": np.zeros(3, np.float32)})
    mgr = ckptcore.CheckpointManager(root)
    mgr.save(len(mgr.steps()) + 1, st)
    if mode == "crash":
        os._exit(0)  # dies holding the lock: no close()
    mgr.close()
"""


@pytest.mark.slow
def test_a_lock_takeover_shows_once_on_a_plain_console(tmp_path):
    root = str(tmp_path / "run")
    assert _run_script(_TAKEOVER, root, "crash").returncode == 0
    proc = _run_script(_TAKEOVER, root, "close")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("taking over the writer lock") == 1, proc.stderr
    assert "LockTakeoverWarning" in proc.stderr


def test_a_lock_takeover_is_still_logged_where_logging_is_set_up(tmp_path, caplog):
    root = str(tmp_path / "run")
    assert _run_script(_TAKEOVER, root, "crash").returncode == 0
    with caplog.at_level(logging.WARNING, logger="ckptcore"), \
            pytest.warns(ckptcore.LockTakeoverWarning):
        with CheckpointManager(root, save_on_preemption=False) as mgr:
            mgr.save(2, tiny_state(2, n=3))
    assert [r for r in caplog.records
            if r.levelno == logging.WARNING and "taking over the writer lock" in r.getMessage()]


def _cosine_pair():
    """A keras state whose cosine schedule cannot continue as the paddle target's constant
    rate: a schedule problem only (the layers pair by themselves)."""
    from ckptcore import ParamInfo
    k = TrainingState(framework="keras",
                      model={"d/kernel": np.ones((4, 2), np.float32), "d/bias": np.ones(2, np.float32)},
                      params={"d/kernel": ParamInfo(0, "d", "dense", "kernel", "io"),
                              "d/bias": ParamInfo(0, "d", "dense", "bias", "o")},
                      extra={"keras": {"variables": ["d/kernel", "d/bias"]}})
    k.optimizer = OptimizerState("sgd", 20, {"learning_rate": 0.05, "momentum": 0.0}, {})
    k.schedule = ScheduleState("CosineDecay", {"initial_learning_rate": 0.1, "decay_steps": 16,
                                               "alpha": 0.0}, step=20)
    p = TrainingState(framework="paddle",
                      model={"fc.weight": np.zeros((4, 2), np.float32),
                             "fc.bias": np.zeros(2, np.float32)},
                      params={"fc.weight": ParamInfo(0, "fc", "dense", "kernel", "io"),
                              "fc.bias": ParamInfo(0, "fc", "dense", "bias", "o")},
                      extra={"paddle": {"param_names": {"fc.weight": "p_0", "fc.bias": "p_1"}}})
    p.optimizer = OptimizerState("sgd", 0, {"learning_rate": 0.1})
    return k, p


def test_a_schedule_migration_error_gives_no_name_map_hint():
    from ckptcore.migrate import convert_state
    from ckptcore_keras._dialect import DIALECT as KERAS
    from ckptcore_paddle._dialect import DIALECT as PADDLE
    dialects = {"keras": KERAS, "paddle": PADDLE}
    k, p = _cosine_pair()
    with pytest.raises(MigrationError) as err:
        convert_state(k, p, dialects=dialects)
    assert "schedule:" in str(err.value) and "name_map" not in str(err.value), str(err.value)
    # a layer that has no counterpart still gets the hint
    p.model["extra.weight"] = np.zeros((3, 3), np.float32)
    p.params["extra.weight"] = ckptcore.ParamInfo(1, "extra", "dense", "kernel", "io")
    with pytest.raises(MigrationError, match="Pass name_map="):
        convert_state(k, p, dialects=dialects)


def test_backup_retry_counts_agree_when_close_cuts_the_schedule(tmp_path, caplog):
    local = Store(str(tmp_path / "local"))
    (tmp_path / "backup").mkdir()
    tier = BackupTier(local, ckptcore.Backup(str(tmp_path / "backup"), dedup=False), lock=False)

    def down(step):
        raise StorageError(f"{tier.root.url}: connection refused")

    tier._replicate = down  # the bucket is down for this step's every try
    caplog.set_level(logging.INFO, logger="ckptcore")
    with _knobs.override(backup_retries=4, backup_retry_seconds=30.0):
        box = {}
        worker = threading.Thread(target=lambda: box.setdefault("e", tier._attempts(2)))
        worker.start()
        deadline = time.monotonic() + 30
        while "(try 2 of 5)" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text[-2000:]
            time.sleep(0.02)
        tier.closing()  # close() starts during the 30 s wait: one last try, at once
        worker.join(10)
        assert not worker.is_alive()
    assert isinstance(box["e"], StorageError)
    lines = [r.getMessage() for r in caplog.records if "step 2" in r.getMessage()]
    announced = [line for line in lines if " of " in line and "(try " in line]
    assert announced[-1].endswith("(try 2 of 2)"), lines  # the count given last...
    gave_up = [line for line in lines if "giving up" in line]
    assert len(gave_up) == 1 and "(2 tries)" in gave_up[0], lines  # ...is the one kept
    assert "not the 5 of the full schedule: close() started" in gave_up[0], lines
    assert "try 3 of" not in caplog.text


# -------------------------------------------------------------------- 5. errors that came late
def _dead_endpoint() -> dict:
    """Storage options of an S3 endpoint nobody listens on, failing fast."""
    return dead_s3_options(read_timeout=2, key="k", secret="s")


@pytest.mark.slow
def test_a_backup_that_cannot_be_reached_is_an_error_at_construction(tmp_path):
    pytest.importorskip("s3fs")
    started = time.monotonic()
    with pytest.raises(StorageError) as err:
        CheckpointManager(tmp_path / "local", backup=ckptcore.Backup("s3://nobucket/run1",
                          storage_options=_dead_endpoint()), save_on_preemption=False)
    assert time.monotonic() - started < 30  # not the 85-96 s of wait()'s retries
    assert "s3://nobucket/run1" in str(err.value) and "cannot be reached" in str(err.value)
    assert not (tmp_path / "local" / ".ckptcore.lock").exists()  # nothing taken or written
    # A resumed run (local steps) whose bucket is down for now goes on locally, as before.
    with CheckpointManager(tmp_path / "local", save_on_preemption=False) as mgr:
        mgr.save(1, tiny_state(1, n=3))
    mgr = CheckpointManager(tmp_path / "local", backup=ckptcore.Backup("s3://nobucket/run1",
                            storage_options=_dead_endpoint()), save_on_preemption=False)
    try:
        assert mgr.restore().step == 1
        mgr.save(2, tiny_state(2, n=3))
        assert mgr.steps() == [1, 2]
    finally:
        with pytest.raises(StorageError):
            mgr.close()  # what failed is reported by close(), as before


def test_a_reachable_backup_passes_the_check(tmp_path):
    with CheckpointManager(tmp_path / "local", backup=str(tmp_path / "bk" / "new"),
                           save_on_preemption=False) as mgr:
        mgr.save(1, tiny_state(1, n=3))
        mgr.wait()
        assert mgr.backup.steps() == [1]


_HOLDER = """
    import sys, numpy as np, ckptcore
    mgr = ckptcore.CheckpointManager(sys.argv[1], save_on_preemption=False)
    mgr.save(1, ckptcore.TrainingState(model={"w": np.zeros(3, np.float32)}))
    print("holding", flush=True)
    sys.stdin.read()  # until the test closes our stdin
    mgr.close()
"""


@pytest.mark.parametrize("where", ["local", "memory"])
def test_lock_true_refuses_a_root_a_live_writer_of_this_process_holds(tmp_path, where):
    root = str(tmp_path / "run") if where == "local" else f"memory://misuse22-{time.time_ns()}/run"
    first = CheckpointManager(root, save_on_preemption=False)
    first.save(1, tiny_state(1, n=3))
    with pytest.raises(LockedError, match=f":{os.getpid()}:"):
        CheckpointManager(root, lock=True, save_on_preemption=False)
    # lazy (the default): constructed, refused at the first write; readers need no lock
    lazy = CheckpointManager(root, lock="lazy", save_on_preemption=False)
    with pytest.raises(LockedError):
        lazy.save(2, tiny_state(2, n=3))
    with CheckpointManager(root, lock=False, save_on_preemption=False) as reader:
        assert reader.steps() == [1]
    first.save(2, tiny_state(2, n=3))  # the holder was not disturbed by the checks
    first.close()
    lazy.close()
    with CheckpointManager(root, lock=True, save_on_preemption=False) as again:  # closed: free
        again.save(3, tiny_state(3, n=3))
        assert again.steps() == [1, 2, 3]
    with pytest.raises(ValueError, match="lock must be"):
        CheckpointManager(root, lock="eager", save_on_preemption=False)


def test_lock_true_with_a_group_refuses_on_every_rank_at_construction(tmp_path):
    # Only rank 0 holds a group's lock: its verdict reaches the other ranks at once, where they
    # used to wait out the group timeout in the first save.
    from _support import run_ranks
    root = str(tmp_path / "run")
    with CheckpointManager(root, save_on_preemption=False) as first:
        first.save(1, tiny_state(1, n=3))
        with _knobs.override(group_timeout=30):
            out = run_ranks(ckptcore.ThreadGroup.create(3), lambda g: CheckpointManager(
                root, lock=True, group=g, save_on_preemption=False), timeout=60)
        # every rank refused at construction (not constructed, nor a GroupTimeoutError later)
        assert all(type(out[r]) is LockedError for r in range(3)), out
    with _knobs.override(group_timeout=30):  # free now: every rank constructs and saves
        def body(g):
            with CheckpointManager(root, lock=True, group=g, save_on_preemption=False) as m:
                m.save(2, tiny_state(2, n=3))
                return m.steps()
        out = run_ranks(ckptcore.ThreadGroup.create(3), body, timeout=60)
    assert out == {0: [1, 2], 1: [1, 2], 2: [1, 2]}, out


@pytest.mark.slow
def test_lock_true_refuses_a_live_writer_of_another_process_and_takes_a_dead_ones(tmp_path):
    root = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_HOLDER), root],
                              env=subprocess_env(HERE), cwd=str(HERE), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding", holder.stderr.read()
        with pytest.raises(LockedError, match=f":{holder.pid}:"):
            CheckpointManager(root, lock=True, save_on_preemption=False)
        holder.kill()  # dies holding it: the kernel drops its flock, its name stays in the file
        holder.wait(30)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    mgr = CheckpointManager(root, lock=True, save_on_preemption=False)  # a dead holder: free
    with pytest.warns(ckptcore.LockTakeoverWarning, match=f":{holder.pid}:"):
        mgr.save(2, tiny_state(2, n=3))
    mgr.close()
