"""Preemption: SIGTERM mid-epoch makes a training loop save the step it is at and exit 0; the run
resumed from there equals an uninterrupted one bit for bit.

Real processes (a NumPy training loop through the manager), real signals, real storage (local disk
and the moto S3 server).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

import ckptcore
from ckptcore import CheckpointManager
from _support import subprocess_env

HERE = Path(__file__).parent
STEPS = 36  # 3 epochs of 12 batches

# The loop a README reader writes: restore if there is a checkpoint, train, save every 6 steps,
# and the one call for preemption after each step.  The final save repeats step 36 (a periodic
# save at the same step): the manager replaces its own step.
LOOP = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from ckptcore import CheckpointManager, DataCursor
    from ckptcore.registry import get_adapter

    root, options, async_save = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1"
    checks = sys.argv[4] == "1"
    program = get_adapter("numpy").demo(seed=3, features=4, classes=3)
    objects = dict(program.objects)
    g = np.random.default_rng(0)
    x = g.standard_normal((96, 4)).astype(np.float32)
    y = g.integers(0, 3, 96)
    cursor = DataCursor(96, 8, seed=1)
    mgr = CheckpointManager(root, keep=3, async_save=async_save, storage_options=options)
    step = 0
    if mgr.latest_step() is not None:
        step = mgr.restore(cursor=cursor, **objects).step
        print(json.dumps({"resumed": step}), flush=True)
    while cursor.epoch < 3:
        idx = cursor.next_batch()
        program.train_step(x[idx], y[idx])
        step += 1
        print(json.dumps({"step": step, "batch": idx.tolist()}), flush=True)
        if checks and mgr.save_if_preempted(step, cursor=cursor, **objects):
            print(json.dumps({"preempted": step}), flush=True)
            break
        if step % 6 == 0:
            mgr.save(step, cursor=cursor, **objects)
        time.sleep(0.03)
    else:
        mgr.save(step, cursor=cursor, **objects)
        print(json.dumps({"done": step}), flush=True)
    mgr.close()
""")


def _run(root, options, *, async_save=False, signal_at=None, sig=signal.SIGTERM, checks=True):
    """Run the loop; send ``sig`` once it reports step ``signal_at``.  (return code, records,
    stderr)."""
    proc = subprocess.Popen([sys.executable, "-c", LOOP, root, json.dumps(options or {}),
                             "1" if async_save else "0", "1" if checks else "0"],
                            env=subprocess_env(HERE), cwd=str(HERE), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    reader.start()
    records = []
    for line in proc.stdout:
        record = json.loads(line)
        records.append(record)
        if signal_at is not None and record.get("step") == signal_at:
            proc.send_signal(sig)
    code = proc.wait(120)
    reader.join(30)
    return code, records, "".join(err)


def _final(root, options):
    with CheckpointManager(root, storage_options=options, lock=False,
                           save_on_preemption=False) as mgr:
        return ckptcore.load_state(mgr.step_url(mgr.latest_step()), storage_options=options)


def _assert_bitwise_equal(a, b):
    assert a.step == b.step == STEPS
    assert sorted(a.model) == sorted(b.model)
    for k in a.model:
        assert a.model[k].tobytes() == b.model[k].tobytes(), k
    for p in a.optimizer.slots:
        for s in a.optimizer.slots[p]:
            assert a.optimizer.slots[p][s].tobytes() == b.optimizer.slots[p][s].tobytes(), (p, s)
    assert a.optimizer.step == b.optimizer.step
    assert a.data == b.data
    # The generator training draws from (the global ones are seeded afresh by each process and
    # never used here).
    aug = [json.dumps(x.rng["numpy_generators"]["aug"], sort_keys=True, default=str) for x in (a, b)]
    assert aug[0] == aug[1]


def _batches(records, upto=None):
    return [r["batch"] for r in records if "step" in r and (upto is None or r["step"] <= upto)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reference") / "run")
    code, records, err = _run(root, None)
    assert code == 0, err
    assert records[-1] == {"done": STEPS}
    return records, _final(root, None)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.slow
def test_sigterm_mid_epoch_saves_that_step_and_the_resumed_run_is_exact(tmp_path, reference,
                                                                          async_save):
    ref_records, ref_final = reference
    root = str(tmp_path / "run")
    code, records, err = _run(root, None, async_save=async_save, signal_at=15)
    assert code == 0, (err, records[-3:])  # stopped cleanly, not killed
    saved = records[-1]["preempted"]
    assert 15 <= saved < 24 and saved % 6, records[-1]  # mid epoch 1, not a periodic save
    assert "SIGTERM: saved step" in err
    with CheckpointManager(root, lock=False, save_on_preemption=False) as mgr:
        assert mgr.latest_step() == saved  # the step it was at: no step lost
    code, resumed, err = _run(root, None, async_save=async_save)
    assert code == 0, err
    assert resumed[0] == {"resumed": saved}
    assert _batches(records, saved) + _batches(resumed) == _batches(ref_records)
    _assert_bitwise_equal(_final(root, None), ref_final)


@pytest.mark.slow
def test_sigkill_then_sigterm_on_s3_resumes_at_once_and_exactly(s3_backend, reference):
    ref_records, ref_final = reference
    root, options = s3_backend.url("run"), s3_backend.storage_options
    code, killed, _ = _run(root, options, signal_at=9, sig=signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert ".ckptcore.lock" in s3_backend.listdir("run")  # the dead writer's lease stays
    code, termed, err = _run(root, options, signal_at=20)  # takes the lease over at once
    assert code == 0, err
    assert "taking over the writer lock" in err and "no longer exists" in err
    assert termed[0] == {"resumed": 6}
    saved = termed[-1]["preempted"]
    assert ".ckptcore.lock" not in s3_backend.listdir("run")  # released by close()
    code, resumed, err = _run(root, options)
    assert code == 0, err
    assert resumed[0] == {"resumed": saved}
    stitched = _batches(killed, 6) + _batches(termed, saved) + _batches(resumed)
    assert stitched == _batches(ref_records)
    _assert_bitwise_equal(_final(root, options), ref_final)


@pytest.mark.slow
def test_a_loop_that_never_checks_still_terminates_on_sigterm(tmp_path):
    # Only a loop that asks (preempted / save_if_preempted) can save and stop; for any other,
    # SIGTERM keeps its usual effect instead of being swallowed.
    code, records, _ = _run(str(tmp_path / "run"), None, signal_at=8, checks=False)
    assert code == -signal.SIGTERM
    assert "done" not in records[-1]


# ------------------------------------------------------------------------------ in process
def test_the_handler_chains_the_previous_one_and_close_restores_it(tmp_path):
    # A manager another test left open would keep the handler installed after these close.
    import gc

    from ckptcore import _preempt

    gc.collect()
    for leftover in _preempt.owners():
        leftover.close()
    calls = []

    def previous(signum, frame):
        calls.append(signum)

    saved = signal.signal(signal.SIGTERM, previous)
    try:
        mgr = CheckpointManager(str(tmp_path / "a"))
        other = CheckpointManager(str(tmp_path / "b"))
        off = CheckpointManager(str(tmp_path / "c"), save_on_preemption=False)
        assert signal.getsignal(signal.SIGTERM) is not previous
        assert not mgr.preempted and not mgr.save_if_preempted(1, ckptcore.TrainingState(
            model={"w": np.zeros(2)}))
        assert mgr.steps() == []  # nothing saved without a SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)
        assert calls == [signal.SIGTERM]  # chained
        assert mgr.preempted and other.preempted and not off.preempted
        state = ckptcore.TrainingState(model={"w": np.arange(3.0)})
        assert mgr.save_if_preempted(5, state)
        assert mgr.steps() == [5]
        assert mgr.save_if_preempted(5, state)  # already saved: not again, still True
        assert mgr.steps() == [5]
        mgr.close()  # managers may close in any order; the last one restores the handler
        assert signal.getsignal(signal.SIGTERM) is not previous
        other.close()
        off.close()
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, saved)


def test_no_handler_outside_the_main_thread(tmp_path, caplog):
    # Managers another test left open keep the process's handler installed, and a manager made
    # in a thread then simply joins them: close them first, so that this test sees no handler
    # (a manager dropped without close() gives it back when collected).
    import gc

    from ckptcore import _preempt

    gc.collect()
    for leftover in _preempt.owners():
        leftover.close()
    saved = signal.getsignal(signal.SIGTERM)
    try:
        before = signal.getsignal(signal.SIGTERM)
        assert before is not _preempt.on_sigterm
        made = []
        with caplog.at_level("INFO", logger="ckptcore"):
            t = threading.Thread(
                target=lambda: made.append(CheckpointManager(str(tmp_path / "r"))))
            t.start()
            t.join()
        assert signal.getsignal(signal.SIGTERM) is before
        assert any("outside the main thread" in r.getMessage() for r in caplog.records)
        made[0].close()
    finally:
        signal.signal(signal.SIGTERM, saved)


def test_a_manager_dropped_without_close_gives_the_handler_back(tmp_path):
    import gc

    from ckptcore import _preempt

    gc.collect()
    for leftover in _preempt.owners():
        leftover.close()
    before = signal.getsignal(signal.SIGTERM)
    mgr = CheckpointManager(str(tmp_path / "r"))
    assert signal.getsignal(signal.SIGTERM) is _preempt.on_sigterm
    kept = CheckpointManager(str(tmp_path / "q"))
    del mgr
    gc.collect()
    assert signal.getsignal(signal.SIGTERM) is _preempt.on_sigterm  # another still watches
    kept.close()
    assert signal.getsignal(signal.SIGTERM) is before
    dropped = CheckpointManager(str(tmp_path / "p"))
    assert signal.getsignal(signal.SIGTERM) is _preempt.on_sigterm
    del dropped
    gc.collect()
    assert signal.getsignal(signal.SIGTERM) is before


FORKED = textwrap.dedent("""
    import os, signal, sys, time
    from ckptcore import CheckpointManager
    mgr = CheckpointManager(sys.argv[1])
    assert not mgr.preempted  # the trainer checks: its own SIGTERM would be caught
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a data-loader worker: it trains nothing, SIGTERM must end it
        os.write(w, b"up")  # (CPython drops a signal that arrives during fork itself)
        time.sleep(30)
        os._exit(3)
    os.read(r, 2)
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    print(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, flush=True)
    mgr.close()
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.slow
def test_a_forked_worker_still_ends_on_sigterm(tmp_path):
    out = subprocess.run([sys.executable, "-c", FORKED, str(tmp_path / "run")], capture_output=True,
                         text=True, timeout=60, env=subprocess_env(HERE))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
