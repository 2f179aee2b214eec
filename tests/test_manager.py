"""CheckpointManager: saving, listing, retention, async saves, fallback, the writer lock, gc.

Every test runs against real storage (a tmp_path folder, ``memory://``, or the moto S3 server
from conftest.py); nothing of ckptcore's storage layer is mocked.  ``_storage._op_hook``, the
library's own test hook, is used to observe the order of storage operations and to hold a
background save at a chosen point.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import pytest

import ckptcore
from ckptcore import (CheckpointExistsError, CheckpointFallbackWarning, CheckpointManager,
                      CheckpointNotFoundError, CorruptCheckpointError, DataCursor,
                      IncompleteCheckpointError, KeepBest, KeepEvery, KeepEveryDuration, KeepLast,
                      SchemaError, TrainingState, UnsafeCheckpointError, api)
from ckptcore import _storage
from ckptcore.policies import RetentionPolicy
from manager_support import Gate, leftovers, open_manager, root_of
from _support import assert_state_of, make_state


@pytest.fixture(params=["local", "memory"])
def fast_backend(request):
    """Local disk and ``memory://``: for the long parametrized tables (S3 runs a few rows)."""
    return request.getfixturevalue(f"{request.param}_backend")


@pytest.fixture
def hook():
    """Install an ``_op_hook`` for one test and always remove it."""
    def install(fn):
        _storage._op_hook = fn
        return fn
    yield install
    _storage._op_hook = None


# ------------------------------------------------------------------------------------ basics
def test_save_restore_list_roundtrip(backend):
    with open_manager(backend) as mgr:
        assert mgr.steps() == [] and mgr.latest_step() is None
        handles = [mgr.save(s, make_state(s)) for s in (1, 2, 5)]
        for h, s in zip(handles, (1, 2, 5)):
            info = h.result()
            assert h.done() and h.step == s and info.step == s
            assert h.url == mgr.step_url(s) == info.url
        assert mgr.steps() == [1, 2, 5]
        assert mgr.latest_step() == 5
        assert_state_of(mgr.restore(), 5)
        assert_state_of(mgr.restore(step=2), 2)
        mgr.wait()  # nothing in flight: returns at once
    # The context manager closed it: no more writes, but a new manager reads what was written.
    with pytest.raises(ValueError, match="closed"):
        mgr.save(6, make_state(6))
    mgr.close()  # closing twice is harmless
    with open_manager(backend) as again:
        assert again.steps() == [1, 2, 5]
        assert_state_of(again.restore(), 5)


def test_empty_root_has_nothing_to_restore(backend):
    with open_manager(backend, lock=False) as mgr:
        assert mgr.steps() == [] and mgr.latest_step() is None
        with pytest.raises(CheckpointNotFoundError):
            mgr.restore()
        with pytest.raises(CheckpointNotFoundError):
            mgr.restore(step=3)


def test_step_folder_names_sort_in_step_order(backend):
    steps = [0, 7, 9, 10, 99, 100, 12345, 10 ** 9, 10 ** 12 + 3]
    with open_manager(backend) as mgr:
        for s in reversed(steps):  # written out of order (a manager refuses that) at its URLs
            ckptcore.save_state(mgr.step_url(s), make_state(0),
                                storage_options=backend.storage_options)
        folders = [n for n in backend.listdir("run") if n.startswith("step-")]
        assert sorted(folders) == [f"step-{s:012d}" for s in steps]
        assert mgr.steps() == steps
        assert mgr.latest_step() == 10 ** 12 + 3
        for bad in (-1, True, 1.5, "3"):
            with pytest.raises(ValueError):
                mgr.save(bad, make_state(0))


def test_saved_step_and_metrics_round_trip(backend):
    with open_manager(backend) as mgr:
        state = TrainingState(model={"w": np.arange(4.0)})  # no step of its own
        mgr.save(40, state, metrics={"loss": np.float32(0.25), "acc": 1})
        info = ckptcore.inspect(mgr.step_url(40), storage_options=backend.storage_options)
        assert info.metadata["metrics"] == {"loss": 0.25, "acc": 1.0}
        restored = mgr.restore()
        assert restored.step == 40
        assert restored.metadata["metrics"] == {"loss": 0.25, "acc": 1.0}
        assert state.metadata == {}  # the caller's state was not modified


def test_a_step_of_another_run_is_never_replaced(backend):
    with open_manager(backend) as mgr:
        mgr.save(3, make_state(3))
    with open_manager(backend) as mgr:  # a new run that did not restore
        with pytest.raises(CheckpointExistsError, match=r"mgr.rewind\(3\)") as err:
            mgr.save(3, make_state(4))
        assert "another run or manager" in str(err.value) and "mgr.restore()" in str(err.value)
        assert_state_of(mgr.restore(step=3), 3)
        assert leftovers(*root_of(backend)) == []


def test_data_cursor_travels_in_state_data(backend):
    cursor = DataCursor(100, 8, seed=3)
    for _ in range(5):
        cursor.next_batch()
    saved = cursor.state_dict()
    with open_manager(backend) as mgr:
        mgr.save(5, make_state(5), cursor=cursor)
        expected = [cursor.next_batch() for _ in range(20)]  # crosses into the next epoch
        info = ckptcore.inspect(mgr.step_url(5), storage_options=backend.storage_options)
        assert info.data == saved and (saved["epoch"], saved["position"]) == (0, 40)
        fresh = DataCursor(100, 8, seed=3)
        state = mgr.restore(cursor=fresh)
        assert_state_of(state, 5)
        assert state.data == saved
        assert all(np.array_equal(fresh.next_batch(), e) for e in expected)
        again = DataCursor(100, 8, seed=3)
        mgr.restore(step=5, cursor=again)
        assert np.array_equal(again.next_batch(), expected[0])


# ------------------------------------------------------------------------------------ retention
class _FakeClock:
    """Stands in for the ``time`` module inside ckptcore.api, to date checkpoints."""

    def __init__(self):
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now


@pytest.mark.parametrize("keep, saves, expected", [
    (KeepLast(2), range(6), [4, 5]),
    (3, range(6), [3, 4, 5]),
    (KeepEvery(3), range(8), [0, 3, 6, 7]),
    (KeepLast(1) | KeepEvery(2), range(6), [0, 2, 4, 5]),
    ([KeepLast(1), KeepEvery(4)], range(1, 10), [4, 8, 9]),
    (None, range(5), [0, 1, 2, 3, 4]),
    # losses 0.5 .3 .9 .1 .8: the two lowest, and the newest (always kept)
    (KeepBest("loss", n=2), range(5), [1, 3, 4]),
    (KeepBest("acc", mode="max") | KeepLast(1), range(5), [2, 4]),
], ids=["last2", "int3", "every3", "last1|every2", "list", "none", "best-min", "best-max|last1"])
def test_retention_policies_remove_the_right_steps(fast_backend, keep, saves, expected):
    _check_retention(fast_backend, keep, saves, expected)


@pytest.mark.slow
def test_retention_policies_on_s3(s3_backend):
    _check_retention(s3_backend, KeepLast(1) | KeepEvery(2), range(6), [0, 2, 4, 5])
    _check_retention(s3_backend, KeepBest("loss", n=2), range(5), [1, 3, 4], name="best")


def _check_retention(backend, keep, saves, expected, name="run"):
    losses = [0.5, 0.3, 0.9, 0.1, 0.8]
    accs = [0.1, 0.4, 0.9, 0.2, 0.3]
    with open_manager(backend, name, keep=keep) as mgr:
        for s in saves:
            mgr.save(s, make_state(s), metrics={"loss": losses[s % 5], "acc": accs[s % 5]})
            assert mgr.latest_step() == s  # the newest is never removed
        assert mgr.steps() == expected
        assert leftovers(*root_of(backend, name)) == []
        for s in expected:
            assert_state_of(mgr.restore(step=s), s)


def test_retention_keep_every_duration(backend, monkeypatch):
    clock = _FakeClock()
    monkeypatch.setattr(api, "time", clock)
    with open_manager(backend, keep=KeepEveryDuration(hours=1) | KeepLast(1)) as mgr:
        for s in range(7):  # one checkpoint every 25 minutes
            clock.now = 1_000_000.0 + s * 1500.0
            mgr.save(s, make_state(s))
        # kept: 0 (first), 3 (75 min after 0), 6 (150 min: 75 min after 3), and the newest (6)
        assert mgr.steps() == [0, 3, 6]
    # A restarted manager (no cached entries) dates the checkpoints from their manifests alike.
    clock.now += 1500.0
    with open_manager(backend, keep=KeepEveryDuration(seconds=3600)) as mgr:
        mgr.save(7, make_state(7))
        assert mgr.steps() == [0, 3, 6, 7]


class _KeepNothing(RetentionPolicy):
    def keep(self, entries):
        return set()


def test_retention_never_removes_the_newest(backend):
    with open_manager(backend, keep=_KeepNothing()) as mgr:
        for s in range(4):
            mgr.save(s, make_state(s))
            assert mgr.steps() == [s]
    with open_manager(backend, "best", keep=KeepBest("loss")) as mgr:
        mgr.save(1, make_state(1), metrics={"loss": 0.1})
        mgr.save(2, make_state(2), metrics={"loss": 9.0})  # worse, but the newest
        mgr.save(3, make_state(3))  # no metric at all, and the newest
        assert mgr.steps() == [1, 3]


def test_retention_deletes_manifest_first_and_only_after_the_successor_commits(backend, hook):
    with open_manager(backend, keep=KeepLast(1)) as mgr:
        mgr.save(1, make_state(1))
        ops = hook(Gate(block_op="")).ops
        mgr.save(2, make_state(2))
    _storage._op_hook = None
    names = [(op, path.rstrip("/")) for op, path, _ in ops]
    step1 = mgr.root.child("step-000000000001").path
    commit = next(i for i, (op, path) in enumerate(names)
                  if op in ("rename", "publish") and "step-000000000002" in path)
    removals = [i for i, (op, path) in enumerate(names) if path.startswith(step1)]
    assert removals, names
    assert min(removals) > commit, "a step was removed before its successor was committed"
    first_op, first_path = names[removals[0]]
    assert (first_op, first_path) == ("delete", f"{step1}/manifest.msgpack"
                                      if not mgr.root.local else os.path.join(step1, "manifest.msgpack"))
    rest = [names[i] for i in removals[1:]]
    if mgr.root.local:
        assert rest[-1] == ("delete_tree", step1)
    else:  # an object store: the objects listed before the lock was asked, one by one
        assert rest and all(op == "delete" and "/shard-" in p for op, p in rest), rest


def test_retention_never_deletes_a_checkpoint_it_cannot_read(backend):
    with open_manager(backend) as mgr:
        for s in range(3):
            mgr.save(s, make_state(s))
    backend.write(b"not a manifest", "run", "step-000000000001", "manifest.msgpack")
    # What retention knows of each step comes from the writer record when it names the step
    # (docs/RELIABILITY.md, "The record is the root's index"); a root written by a release
    # before the record carried it, as here, has only the manifests to tell.
    for name in backend.listdir("run", ".ckptcore.gen"):
        if name.endswith(".index"):
            backend.delete("run", ".ckptcore.gen", name)
    # A restarted manager with keep=None (keep everything) must keep it, and a policy cannot
    # judge what it cannot read: it is left for the user, like gc() leaves it.
    with pytest.warns(CheckpointFallbackWarning):
        with open_manager(backend) as mgr:
            mgr.save(3, make_state(3))
            assert mgr.steps() == [0, 1, 2, 3]
            mgr.delete(3)
            mgr.delete(2)
            assert_state_of(mgr.restore(), 0)  # falls back over the unreadable step 1
    with open_manager(backend, keep=KeepLast(1)) as mgr:
        mgr.save(4, make_state(4))
        assert mgr.steps() == [1, 4]


# ------------------------------------------------------------------------------------ async
def test_async_save_returns_before_the_write_and_snapshots_the_state(backend, hook):
    gate = hook(Gate())
    with open_manager(backend, async_save=True) as mgr:
        state = make_state(1)
        handle = mgr.save(1, state)
        assert gate.reached.wait(10), "the background save never reached its commit"
        assert not handle.done()
        assert mgr.steps() == []  # not committed yet: the caller got control back first
        # Keep training on the very arrays that were handed to save().
        state.model["dense/kernel"] += 100.0
        state.model["dense/bias"][:] = -1
        state.optimizer.slots["dense/kernel"]["m"] *= 0
        gate.open()
        assert handle.result(10).step == 1
        assert mgr.steps() == [1]
        assert_state_of(mgr.restore(), 1)  # the values at the time of save()
        writer_threads = {t for op, _, t in gate.ops if op in ("open_write", "rename", "publish")}
        assert "MainThread" not in writer_threads


def test_async_consecutive_saves_keep_their_own_snapshots(backend):
    with open_manager(backend, async_save=True) as mgr:
        state = make_state(1)
        for step in (1, 2, 3):
            if step > 1:  # "train": the same arrays, updated in place
                state.model["dense/kernel"] += 1.0
                state.model["dense/bias"] += 1
                state.optimizer.slots["dense/kernel"]["m"] += 0.5
                state.step = step
            mgr.save(step, state)
        mgr.wait()
        for step in (1, 2, 3):
            assert_state_of(mgr.restore(step=step), step)


def test_async_second_save_waits_for_the_first(backend, hook):
    gate = hook(Gate())
    with open_manager(backend, async_save=True) as mgr:
        first = mgr.save(1, make_state(1))
        assert gate.reached.wait(10)
        second: list = []
        t = threading.Thread(target=lambda: second.append(mgr.save(2, make_state(2))))
        t.start()
        t.join(0.3)
        assert t.is_alive() and not first.done(), "save(2) did not wait for save(1)"
        gate.open()
        t.join(10)
        assert not t.is_alive()
        assert first.done()  # save(2) returned only after save(1) finished
        second[0].result(10)
        mgr.wait()
        assert mgr.steps() == [1, 2]
    commits = [p for op, p, _ in gate.ops if op in ("rename", "publish")]
    assert "step-000000000001" in commits[0] and "step-000000000002" in commits[1]


@pytest.mark.parametrize("surface", ["save", "wait", "close"])
def test_async_background_error_surfaces(backend, surface):
    mgr = open_manager(backend, async_save=True)
    ckptcore.save_state(mgr.step_url(1), make_state(1), storage_options=backend.storage_options)
    handle = mgr.save(1, make_state(2))  # another run's step 1: fails in the background
    with pytest.raises(CheckpointExistsError):
        handle.result(10)
    with pytest.raises(CheckpointExistsError):  # and on the manager's next call, never silently
        if surface == "save":
            mgr.save(3, make_state(3))
        elif surface == "wait":
            mgr.wait()
        else:
            mgr.close()
    if surface != "close":
        mgr.save(3, make_state(3))  # raised once; the manager goes on working
        mgr.wait()
        mgr.close()
    with open_manager(backend, lock=False) as reader:
        assert reader.steps() == ([1] if surface == "close" else [1, 3])
        assert_state_of(reader.restore(step=1), 1)
    assert leftovers(*root_of(backend)) == []


def test_async_unstorable_value_is_never_silent(backend):
    mgr = open_manager(backend, async_save=True)
    bad = TrainingState(model={"w": np.zeros(3)}, extra={"handle": object()})
    try:
        mgr.save(1, bad)  # the snapshot may already find it (it encodes)...
    except TypeError as e:
        assert "handle" in str(e)
    else:
        with pytest.raises(TypeError, match="handle"):  # ...or the background write does
            mgr.wait()
    mgr.save(2, make_state(2))
    mgr.close()
    with open_manager(backend, lock=False) as reader:
        assert reader.steps() == [2]
    assert leftovers(*root_of(backend)) == []


def test_async_save_to_existing_step_surfaces_on_wait(backend):
    with open_manager(backend) as first:
        first.save(1, make_state(1))
    with open_manager(backend, async_save=True) as mgr:
        mgr.save(1, make_state(2))  # another manager's step: fails in the background
        with pytest.raises(CheckpointExistsError):
            mgr.wait()
        mgr.wait()  # surfaced once
        assert_state_of(mgr.restore(), 1)


_EXIT_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import ckptcore
    from _support import make_state
    root, bad = sys.argv[1], sys.argv[2] == "bad"
    mgr = ckptcore.CheckpointManager(root, async_save=True)
    mgr.save(1, make_state(1)).result()
    if bad:  # step 2 committed behind the manager's back: the background save of step 2 fails
        ckptcore.save_state(mgr.step_url(2), make_state(20))
    state = make_state(2)
    # Many tensors: the background thread is still encoding when the script ends.
    state.extra["many"] = {f"t{i}": np.full(8, i) for i in range(400)}
    mgr.save(2, state)
    print("exiting", flush=True)
""")


def _run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(__file__)] + sys.path))
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.slow
def test_async_save_in_flight_is_committed_at_interpreter_exit(tmp_path):
    for attempt in range(2):  # the save is caught at a different point each time
        root = str(tmp_path / f"run{attempt}")
        proc = _run_script(_EXIT_SCRIPT, root, "good")
        assert proc.returncode == 0, proc.stderr
        assert "exiting" in proc.stdout and "failed" not in proc.stderr, proc.stderr
        with CheckpointManager(root, lock=False) as mgr:
            assert mgr.steps() == [1, 2]
            assert ckptcore.verify(mgr.step_url(2)) == []
            assert_state_of(mgr.restore(), 2)
    # A failing background save at exit is reported, not swallowed.
    root = str(tmp_path / "bad")
    proc = _run_script(_EXIT_SCRIPT, root, "bad")
    assert "background save failed at exit" in proc.stderr, proc.stderr
    assert "CheckpointExistsError" in proc.stderr, proc.stderr
    mgr = CheckpointManager(root, lock=False)
    assert mgr.steps() == [1, 2]
    assert_state_of(mgr.restore(step=2), 20)  # the other writer's step 2 is untouched


# ------------------------------------------------------------------------------------ fallback
def _shard(backend, step):
    info = ckptcore.inspect(backend.url("run", f"step-{step:012d}"),
                            storage_options=backend.storage_options)
    return info.shards[0]


def _flip(backend, step):
    name = _shard(backend, step)
    data = bytearray(backend.read("run", f"step-{step:012d}", name))
    data[5] ^= 0x40  # inside the first tensor (it starts at offset 0)
    backend.write(bytes(data), "run", f"step-{step:012d}", name)


def _truncate(backend, step):
    name = _shard(backend, step)
    data = backend.read("run", f"step-{step:012d}", name)
    backend.write(data[: len(data) // 2], "run", f"step-{step:012d}", name)


def _extend(backend, step):
    name = _shard(backend, step)
    data = backend.read("run", f"step-{step:012d}", name)
    backend.write(data + b"\0" * 64, "run", f"step-{step:012d}", name)


def _delete_shard(backend, step):
    backend.delete("run", f"step-{step:012d}", _shard(backend, step))


def _garbage_manifest(backend, step):
    backend.write(os.urandom(300), "run", f"step-{step:012d}", "manifest.msgpack")


def _empty_manifest(backend, step):
    backend.write(b"", "run", f"step-{step:012d}", "manifest.msgpack")


def _flip_manifest(backend, step):
    data = bytearray(backend.read("run", f"step-{step:012d}", "manifest.msgpack"))
    data[len(data) // 2] ^= 0x01  # inside the checksummed body
    backend.write(bytes(data), "run", f"step-{step:012d}", "manifest.msgpack")


def _unsafe_manifest(backend, step):
    # A well-formed manifest, body checksum and all, that points a shard outside its folder.
    import crc32c
    import msgpack
    outer = msgpack.unpackb(backend.read("run", f"step-{step:012d}", "manifest.msgpack"))
    name = _shard(backend, step).encode()
    body = outer["body"].replace(name, b"../" + name[3:])  # same length: the msgpack stays valid
    assert body != outer["body"]
    outer.update(body=body, body_crc32c=crc32c.crc32c(body))
    backend.write(msgpack.packb(outer), "run", f"step-{step:012d}", "manifest.msgpack")


CORRUPTIONS = {
    "flip-shard-byte": (_flip, CorruptCheckpointError),
    "truncate-shard": (_truncate, IncompleteCheckpointError),
    "extend-shard": (_extend, CorruptCheckpointError),
    "delete-shard": (_delete_shard, IncompleteCheckpointError),
    "garbage-manifest": (_garbage_manifest, SchemaError),
    "empty-manifest": (_empty_manifest, SchemaError),
    "flip-manifest-byte": (_flip_manifest, CorruptCheckpointError),
    "unsafe-shard-path": (_unsafe_manifest, UnsafeCheckpointError),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_restore_falls_back_over_a_corrupt_newest(fast_backend, kind):
    _check_fallback(fast_backend, kind)


@pytest.mark.parametrize("kind", ["flip-shard-byte", "delete-shard", "garbage-manifest"])
@pytest.mark.slow
def test_restore_falls_back_over_a_corrupt_newest_on_s3(s3_backend, kind):
    _check_fallback(s3_backend, kind)


def _check_fallback(backend, kind):
    damage, error = CORRUPTIONS[kind]
    with open_manager(backend) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, make_state(s))
    damage(backend, 3)
    with open_manager(backend, lock=False) as mgr:
        with pytest.warns(CheckpointFallbackWarning) as caught:
            state = mgr.restore()
        assert_state_of(state, 2)
        messages = [str(w.message) for w in caught if w.category is CheckpointFallbackWarning]
        assert len(messages) == 1 and "step 3" in messages[0], messages
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an explicit step never falls back, silently or not
            with pytest.raises(error):
                mgr.restore(step=3)
            assert_state_of(mgr.restore(step=2), 2)
        # Fallback goes on past several bad ones; when none verifies, restore() raises.
        damage(backend, 2)
        with pytest.warns(CheckpointFallbackWarning) as caught:
            assert_state_of(mgr.restore(), 1)
        assert [("step 3" in str(w.message), "step 2" in str(w.message)) for w in caught] == [
            (True, False), (False, True)]
        damage(backend, 1)
        with pytest.warns(CheckpointFallbackWarning), pytest.raises(CorruptCheckpointError,
                                                                    match="none of the 3"):
            mgr.restore()


def test_resumed_run_saves_over_the_corrupt_step_it_fell_back_past(backend):
    # Steps 1-3 saved, step 3 corrupted; the resumed run restores step 2, trains on and saves
    # step 3 again: that replaces the corrupt one instead of raising CheckpointExistsError.
    with open_manager(backend) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, make_state(s))
    _flip(backend, 3)
    with open_manager(backend) as mgr:
        with pytest.warns(CheckpointFallbackWarning):
            assert_state_of(mgr.restore(), 2)
        with pytest.warns(CheckpointFallbackWarning, match="replacing checkpoint step 3"):
            mgr.save(3, make_state(30))
        assert mgr.steps() == [1, 2, 3]
        assert_state_of(mgr.restore(), 30)
        assert api.verify(mgr.step_url(3), storage_options=backend.storage_options) == []
        # Only what restore() skipped is replaced; an intact step below is refused.
        with pytest.raises(ValueError, match=r"below the newest committed step 3"):
            mgr.save(2, make_state(20))
    with open_manager(backend, lock=False) as reader:
        assert_state_of(reader.restore(step=2), 2)


def _newer_format(backend, step):
    import msgpack
    from ckptcore._manifest import READ_VERSIONS
    outer = msgpack.unpackb(backend.read("run", f"step-{step:012d}", "manifest.msgpack"))
    outer["version"] = max(READ_VERSIONS) + 1  # a future ckptcore's: intact, just not readable here
    backend.write(msgpack.packb(outer), "run", f"step-{step:012d}", "manifest.msgpack")


def test_a_skipped_step_is_replaced_only_if_its_data_is_still_damaged(local_backend):
    backend = local_backend
    with open_manager(backend) as mgr:
        for s in (1, 2, 3, 4):
            mgr.save(s, make_state(s))
    _newer_format(backend, 4)  # unreadable here, perhaps intact: never replaced
    shard = _shard(backend, 3)
    good = backend.read("run", "step-000000000003", shard)
    _flip(backend, 3)
    with open_manager(backend) as mgr:
        with pytest.warns(CheckpointFallbackWarning):
            assert_state_of(mgr.restore(), 2)
        with pytest.raises(CheckpointExistsError):
            mgr.save(4, make_state(40))
        # Step 3 repaired behind this manager's back (restore() took no lock): kept, not replaced.
        backend.write(good, "run", "step-000000000003", shard)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(CheckpointExistsError):
                mgr.save(3, make_state(30))
        assert mgr.steps() == [1, 2, 3, 4]
        assert_state_of(mgr.restore(step=3), 3)


def test_a_failed_restore_marks_nothing_for_replacement(local_backend):
    # Nothing verifies, restore() raises, the script starts afresh: its saves at the old step
    # numbers must not delete the old (damaged, but perhaps salvageable) checkpoints.
    with open_manager(local_backend) as mgr:
        mgr.save(1, make_state(1))
    _flip(local_backend, 1)
    with open_manager(local_backend) as mgr:
        with pytest.warns(CheckpointFallbackWarning), pytest.raises(CorruptCheckpointError):
            mgr.restore()
        with pytest.raises(CheckpointExistsError):
            mgr.save(1, make_state(1))


def test_retention_after_a_fallback_keeps_the_resumed_runs_saves(fast_backend):
    # Steps 10, 20, 30 with KeepLast(2); 30 is corrupt and the run resumes from 20.  The corrupt
    # step must not count as "the newest": the resumed run's saves 21-23 are what is kept.
    with open_manager(fast_backend, keep=KeepLast(2)) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, make_state(s))
        assert mgr.steps() == [20, 30]
    _flip(fast_backend, 30)
    with open_manager(fast_backend, keep=KeepLast(2)) as mgr:
        with pytest.warns(CheckpointFallbackWarning):
            assert_state_of(mgr.restore(), 20)
        for s in (21, 22, 23):
            mgr.save(s, make_state(s))
        assert mgr.steps() == [22, 23, 30]  # the corrupt 30 stays, for inspection, until replaced
        with pytest.warns(CheckpointFallbackWarning, match="replacing checkpoint step 30"):
            mgr.save(30, make_state(30))
        assert mgr.steps() == [23, 30]
        assert_state_of(mgr.restore(), 30)
