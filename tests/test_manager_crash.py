"""SIGKILL fault injection: a run killed anywhere in a save + retention cycle loses nothing.

A child process (``manager_support.crash_child``) resumes a run holding steps 1 and 2 and, with
``keep=KeepLast(2)``, saves step 3, whose retention deletes step 1.  It counts the storage operations of that
cycle through ``ckptcore._storage._op_hook`` and SIGKILLs itself right before operation k, for
every k of the cycle (a dry run counts them first).  ``save_until_killed`` is a resumed run that
saves until the test kills it after a random (seeded) delay.  After each kill, this process checks
what a restarted run would see:

* every step ``steps()`` lists verifies (``ckptcore.verify`` is empty) and loads the exact arrays
  of that step; ``restore()`` returns the newest without any fallback;
* the newest step committed before the interrupted save is still there;
* ``gc(grace=0)`` removes every leftover (temporary folders, step folders without a manifest,
  shards no manifest names) and no committed checkpoint;
* on local disk, the dead process's writer lock is gone: a new manager saves at once.
"""

from __future__ import annotations

import random
import signal
import time
import warnings

import pytest

from ckptcore import CheckpointManager, KeepLast
from manager_support import (check_listed_steps, crash_child, gc_and_check_clean, leftovers, mp,
                             populate, read_lines, save_until_killed, wait_for_line)
from _support import assert_state_of, make_state

KILLED = -signal.SIGKILL
# Every resume here takes over the killed writer's lock, by design (tests/test_lease.py checks
# the warning itself).
pytestmark = pytest.mark.filterwarnings("ignore::ckptcore.LockTakeoverWarning")


def _run(target, *args, timeout: float = 60.0) -> int:
    return _run_many(target, [args], timeout=timeout)[0]


def _run_many(target, arglists, *, parallel: int = 4, timeout: float = 60.0) -> list[int]:
    """Run ``target(*args)`` in a child per ``args``, ``parallel`` at a time; the exit codes.

    The children work on separate roots, so running them side by side changes nothing they
    do; it only overlaps their start-up and their waits on storage."""
    codes = []
    for start in range(0, len(arglists), parallel):
        procs = [mp().Process(target=target, args=args) for args in arglists[start:start + parallel]]
        for proc in procs:
            proc.start()
        for proc, args in zip(procs, arglists[start:start + parallel]):
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()
                raise AssertionError(f"{target.__name__}{args} hung")
            codes.append(proc.exitcode)
    return codes


def _ops(report: str) -> list[str]:
    return [line.split(" ", 2)[2] for line in read_lines(report) if line.startswith("op ")]


def _restore_newest(root: str, options: dict | None) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback: the newest listed step must verify
        with CheckpointManager(root, storage_options=options, lock=False) as mgr:
            state = mgr.restore()
    assert_state_of(state, state.step)
    return state.step


def _kill_at_every_operation(base: str, options: dict | None, async_save: bool, tmp_path,
                             *, lock: bool = True, skip_repeated_shards: bool = False) -> None:
    local = options is None
    dry = f"{base}/dry"
    report = str(tmp_path / "dry.log")
    populate(f"{base}/template", [dry], options)
    assert _run(crash_child, dry, options, 0, async_save, report, lock) == 0
    assert read_lines(report)[-1] == "committed 3"
    ops = _ops(report)
    kinds = [op.split()[0] for op in ops]
    assert kinds.count("open_write") >= 3, ops  # several shards, written by two threads
    assert ("rename" if local else "publish") in kinds
    # retention of step 1, manifest first, then its folder (local disk) or, on an object store,
    # the objects listed before the lock was asked, one by one (docs/RELIABILITY.md, "Fencing")
    first = next(i for i, op in enumerate(ops)
                 if op.startswith("delete ") and "step-000000000001/" in op)
    assert ops[first].endswith("step-000000000001/manifest.msgpack"), ops
    assert (kinds[first:] == ["delete", "delete_tree"] if local else
            len(kinds) - first > 1 and set(kinds[first:]) == {"delete"}), ops
    assert check_listed_steps(dry, options) == [2, 3]
    assert leftovers(dry, options) == []

    seen = set()
    ks = [k for k in range(1, len(ops) + 1)
          # (optionally) one shard opening stands for the others, which run in the same pool
          if not (skip_repeated_shards and kinds[k - 1] == "open_write" and k > 1
                  and kinds[k - 2] == "open_write")]
    populate(f"{base}/template2", [f"{base}/k{k}" for k in ks], options)
    codes = _run_many(crash_child, [(f"{base}/k{k}", options, k, async_save,
                                     str(tmp_path / f"k{k}.log"), lock) for k in ks])
    for k, code in zip(ks, codes):
        root = f"{base}/k{k}"
        report = str(tmp_path / f"k{k}.log")
        assert code == KILLED, (k, code, read_lines(report))
        numbers = [int(line.split()[1]) for line in read_lines(report) if line.startswith("op ")]
        assert k in numbers, read_lines(report)  # killed right before operation k
        assert max(numbers) <= k + 1, read_lines(report)  # (+1: the other shard-writing thread)
        steps = check_listed_steps(root, options)
        assert 2 in steps, (k, steps)  # the newest committed before the save survives
        if 3 in steps:  # committed; retention may or may not have removed step 1 yet
            assert steps in ([1, 2, 3], [2, 3]), (k, steps)
        else:  # not committed: retention never ran
            assert steps == [1, 2], (k, steps)
        assert _restore_newest(root, options) == steps[-1]
        junk = leftovers(root, options)
        seen.add((3 in steps, 1 in steps, bool(junk)))
        gc_and_check_clean(root, options)
        if local:  # the kernel released the dead writer's lock: a restarted run saves at once
            with CheckpointManager(root, keep=KeepLast(2)) as mgr:
                mgr.save(4, make_state(4))
                assert mgr.steps()[-1] == 4 and len(mgr.steps()) == 2
            assert check_listed_steps(root, options)[-1] == 4
    # The loop went through every phase: before the commit (with leftovers), after it with
    # step 1 still listed, and in the middle of removing step 1.
    assert (False, True, True) in seen, seen
    assert (True, True, False) in seen, seen
    assert any(committed and not one for committed, one, _ in seen), seen


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.slow
def test_kill_at_every_operation_local(tmp_path, async_save):
    _kill_at_every_operation(str(tmp_path / "store"), None, async_save, tmp_path)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.slow
def test_kill_at_every_operation_s3(s3_backend, tmp_path, async_save):
    # The lease object of a killed writer stays (see test_manager.py); each k has its own root.
    # Async saves make the same storage calls from another thread: to save time their loop
    # kills at one shard opening of the several.
    _kill_at_every_operation(s3_backend.prefix, s3_backend.storage_options, async_save, tmp_path,
                             skip_repeated_shards=async_save)


def _kill_at_random(root: str, options: dict | None, async_save: bool, tmp_path, *, kills: int,
                    seed: int, max_delay: float, lock: bool = True, min_progress: int | None = None,
                    min_interrupted: int = 3, after_commit: bool = False) -> None:
    """``kills`` runs of ``save_until_killed``, each SIGKILLed after a random delay (counted from
    its first committed step with ``after_commit``: a state the test can observe, so that a
    loaded machine's slow start-up cannot make every kill land before any save)."""
    rng = random.Random(seed)
    # the newest committed step when the run was started
    with CheckpointManager(root, storage_options=options, lock=False) as reader:
        newest = reader.latest_step() or 0
    interrupted = 0
    for i in range(kills):
        report = str(tmp_path / f"run-{seed}-{i}.log")
        proc = mp().Process(target=save_until_killed, args=(root, options, async_save, report, lock))
        proc.start()
        if after_commit:
            wait_for_line(report, "committed", proc=proc)
        time.sleep(rng.uniform(0.0, max_delay))
        proc.kill()
        proc.join(30)
        assert proc.exitcode == KILLED, (i, proc.exitcode, read_lines(report))
        lines = read_lines(report)
        if lines:  # the run resumed right after the newest checkpoint
            assert lines[0] == f"started {newest + 1}", (newest, lines)
        # Reported once committed and pruned; at most one more save was in flight.
        committed = [int(line.split()[1]) for line in lines if line.startswith("committed")]
        steps = check_listed_steps(root, options)
        survivor = committed[-1] if committed else newest
        if survivor:
            assert survivor in steps, (i, survivor, steps)
            assert steps[-1] in (survivor, survivor + 1), (i, survivor, steps)
            if committed:  # its retention ran: KeepLast(2), plus one committed but not pruned
                assert len(steps) <= 3, (steps, lines)
            assert _restore_newest(root, options) == steps[-1]
        newest = steps[-1] if steps else 0
        interrupted += bool(leftovers(root, options))
        gc_and_check_clean(root, options)
    min_progress = kills // 10 if min_progress is None else min_progress
    assert newest >= min_progress, f"the runs made too little progress ({newest} steps)"
    assert interrupted >= min_interrupted, f"only {interrupted} kills landed in a save"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.slow
def test_kill_at_random_delays_local(tmp_path, async_save):
    _kill_at_random(str(tmp_path / "store"), None, async_save, tmp_path, kills=50,
                    seed=1234 + async_save, max_delay=0.12)


@pytest.mark.slow
def test_kill_at_random_delays_s3(s3_backend, tmp_path):
    # lock=False: these kills test the commit protocol alone (a killed writer's lease is taken
    # over at once on its machine: tests/test_lease.py).  Fewer kills than on local disk (each
    # costs a second of requests); sync and async runs alternate on the same root.  Each kill
    # comes after the run's first commit (a random delay from there): on a loaded machine a
    # fixed window from the start could end before any save reached the server.
    root, options = s3_backend.url("run"), s3_backend.storage_options
    rng = random.Random(7)
    for i in range(6):
        _kill_at_random(root, options, bool(i % 2), tmp_path, kills=1, seed=rng.randrange(1 << 30),
                        max_delay=0.6, lock=False, min_progress=1, min_interrupted=0,
                        after_commit=True)
    with CheckpointManager(root, storage_options=options, lock=False) as reader:
        assert len(reader.steps()) >= 1
