"""Streaming restore: ``load_state(url, model=...)`` assigns each tensor as soon as its own
verification batch is done, while later batches are still being read and checked.

Run with the NumPy reference adapter (framework-free), whose puts copy into the model's arrays:
what has been assigned is visible in the target model itself.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import ckptcore
import ckptcore_numpy as cn
from ckptcore import _io, _knobs
from ckptcore._manifest import MANIFEST_NAME, Manifest
from ckptcore.adapter import RestorePlan, restore_gate
from ckptcore.errors import CorruptCheckpointError, RestoreError

LAYERS = 20
BAD = 10  # the corrupted layer, in the middle


def _names() -> list[str]:
    return [f"layer{i:02d}/kernel" for i in range(LAYERS)]


def _model(fill: float | None = None) -> cn.Model:
    rng = np.random.default_rng(0)
    return cn.Model({n: (np.full((25, 40), fill, np.float32) if fill is not None
                         else rng.standard_normal((25, 40)).astype(np.float32))
                     for n in _names()})


def _offset(url: str, tensor: str) -> tuple[str, int]:
    with open(f"{url}/{MANIFEST_NAME}", "rb") as f:
        m = Manifest.from_bytes(f.read())
    t = next(t for t in m.tensors if t.name == tensor)
    return m.shards[t.shard].path, t.offset


def _corrupt(url: str, tensor: str) -> str:
    shard, offset = _offset(url, tensor)
    with open(f"{url}/{shard}", "r+b") as f:
        f.seek(offset + 5)
        byte = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([byte[0] ^ 0x40]))
    return shard


def test_a_corrupt_tensor_stops_the_restore_before_it_is_assigned(tmp_path):
    url = str(tmp_path / "c")
    source = _model()
    ckptcore.save_state(url, model=source, rng=False)
    bad = f"model/{_names()[BAD]}"
    shard = _corrupt(url, bad)
    target = _model(fill=0.0)
    with _knobs.override(verify_batch=1):  # one batch per tensor: the finest gate
        with pytest.raises(CorruptCheckpointError) as exc:
            ckptcore.load_state(url, model=target, rng=False)
    assert exc.value.tensor == bad and exc.value.file.endswith(shard)
    assert bad in str(exc.value) and shard in str(exc.value)
    names = _names()
    for i, name in enumerate(names):
        got = target.params[name]
        if i < BAD:  # assigned before the damage was reached (documented in load_state)
            assert np.array_equal(got, source.params[name]), name
        else:  # the damaged tensor and everything after it: untouched
            assert not got.any(), f"{name} was assigned after the damaged {bad}"


def test_without_objects_or_verification_nothing_changes(tmp_path):
    url = str(tmp_path / "c")
    ckptcore.save_state(url, model=_model(), rng=False)
    bad = f"model/{_names()[BAD]}"
    _corrupt(url, bad)
    with pytest.raises(CorruptCheckpointError, match=bad):
        ckptcore.load_state(url)
    target = _model(fill=0.0)
    ckptcore.load_state(url, model=target, rng=False, verify=False)  # as before: unchecked
    assert all(target.params[n].any() for n in _names())


def test_puts_start_before_the_last_batch_is_verified(tmp_path):
    """The last tensor's verification is held until the first tensor has been put into the
    target: a load that verified everything before assigning would wait out the timeout, and
    record that no put had happened."""
    url = str(tmp_path / "c")
    source = _model()
    last = "tail/kernel"
    source.params[last] = np.ones(777, np.float32)  # a size no other tensor has
    ckptcore.save_state(url, model=source, rng=False)
    target = _model(fill=0.0)
    target.params[last] = np.zeros(777, np.float32)
    first = _names()[0]
    seen: dict[str, bool] = {}
    lock = threading.Lock()

    def report(nbytes: int) -> None:  # called by the verification threads after each tensor
        if nbytes != 777 * 4:
            return
        deadline = time.monotonic() + 20
        while not target.params[first].any() and time.monotonic() < deadline:
            time.sleep(0.001)
        with lock:
            seen["first put before the last verification"] = bool(target.params[first].any())

    token = _io.progress.set(report)
    try:
        with _knobs.override(verify_batch=1):
            ckptcore.load_state(url, model=target, rng=False)
    finally:
        _io.progress.reset(token)
    assert seen == {"first put before the last verification": True}
    for name, value in source.params.items():
        assert np.array_equal(target.params[name], value), name


def test_a_restore_after_a_stream_leaves_nothing_running(tmp_path):
    url = str(tmp_path / "c")
    source = _model()
    opt = cn.Adam(0.01)
    opt.step(source, {n: np.ones_like(a) for n, a in source.params.items()})  # slots m and v
    ckptcore.save_state(url, model=source, optimizer=opt)
    before = threading.active_count()
    target, target_opt = _model(fill=0.0), cn.Adam(0.01)
    state = ckptcore.load_state(url, model=target, optimizer=target_opt)
    assert all(np.array_equal(target.params[n], source.params[n]) for n in _names())
    assert all(np.array_equal(target_opt.slots[n]["v"], opt.slots[n]["v"]) for n in _names())
    assert set(state.model) == set(_names())
    assert threading.active_count() <= before


class _Recorder:
    """A gate that records what the plan waited for, in order (RestorePlan's side of the gate)."""

    def __init__(self, log: list) -> None:
        self.log = log

    def wait_for(self, value) -> None:
        self.log.append(("wait", int(value[0])))

    def wait_all(self) -> None:
        self.log.append(("all",))

    def check(self, value) -> None:
        self.log.append(("check", int(value[0])))


def test_plan_waits_for_each_value_before_its_put():
    log: list = []
    a, b, c = (np.full(2, i, np.float32) for i in range(3))
    plan = RestorePlan()
    plan.assign("a", a, shape=(2,), dtype=np.float32, put=lambda: log.append(("put", "a")))
    plan.assign_many([("b", b, (2,), np.float32), ("c", c, (2,), np.float32)],
                     put=lambda: log.append(("put", "b+c")))
    plan.then(lambda: log.append(("action",)))
    with restore_gate(_Recorder(log)):
        plan.apply()
    assert log == [("wait", 0), ("put", "a"), ("wait", 1), ("wait", 2), ("put", "b+c"), ("all",),
                   ("action",)]


def test_assign_many_checks_every_value():
    plan = RestorePlan()
    with pytest.raises(RestoreError, match="c: the checkpoint holds shape"):
        plan.assign_many([("b", np.zeros(2), (2,), None), ("c", np.zeros(3), (2,), None)],
                         put=lambda: None)


def test_without_a_gate_apply_runs_as_before():
    log: list = []
    plan = RestorePlan()
    plan.assign("a", np.zeros(2), shape=(2,), dtype=None, put=lambda: log.append("a"))
    plan.apply()
    assert log == ["a"]


def test_a_put_that_verifies_its_values_is_not_waited_for():
    """assign_many(verifies=True): apply runs the put at once and the put verifies each value
    through value_check (the gate's check), in whichever thread copies it; outside a load,
    value_check does nothing."""
    from ckptcore.adapter import value_check

    log: list = []
    b, c = (np.full(2, i, np.float32) for i in (1, 2))

    def put() -> None:
        check = value_check()
        helper = threading.Thread(target=check, args=(c,))
        helper.start()
        check(b)
        helper.join()
        log.append(("put", "b+c"))

    plan = RestorePlan()
    plan.assign_many([("b", b, (2,), np.float32), ("c", c, (2,), np.float32)], put=put, verifies=True)
    with restore_gate(_Recorder(log)):
        plan.apply()
    assert sorted(log[:2]) == [("check", 1), ("check", 2)] and log[2:] == [("put", "b+c"), ("all",)]
    assert value_check()(b) is None  # no load in progress


def test_a_lazy_reading_verifies_what_it_is_asked_then_the_rest(tmp_path):
    """_io.Reading(lazy=True) starts nothing: check(i) verifies tensor i in the calling thread
    (raising for a damaged one); result() verifies every tensor no check took."""
    url = str(tmp_path / "c")
    ckptcore.save_state(url, model=_model(), rng=False)
    bad = f"model/{_names()[BAD]}"
    _corrupt(url, bad)
    with open(f"{url}/{MANIFEST_NAME}", "rb") as f:
        m = Manifest.from_bytes(f.read())
    index = {name: i for i, name in enumerate(m.tensors.names)}
    from ckptcore._storage import Store

    store = Store(url)
    reading = _io.Reading(store, m, range(len(m.tensors)), lazy=True)
    try:
        assert not any(t.name.startswith("ckptcore-verify") for t in threading.enumerate())
        reading.check(index[f"model/{_names()[0]}"])  # a sound tensor: no error
        with pytest.raises(CorruptCheckpointError) as exc:
            reading.check(index[bad])
        assert exc.value.tensor == bad
        with pytest.raises(CorruptCheckpointError) as exc:
            reading.result()  # the batches, for the rest, find the same damage
        assert exc.value.tensor == bad
    finally:
        reading.close()


def test_background_fsyncs_are_bounded(tmp_path, monkeypatch) -> None:
    """However many shards a save writes, at most ``Syncs.LIMIT`` fsyncs are left running (each
    holds a thread and an open file); the rest are made durable at once, and every file is closed."""
    syncs = _io.Syncs()
    files = [open(tmp_path / f"s{k}", "wb") for k in range(3 * _io.Syncs.LIMIT)]
    hold = threading.Event()
    real = _io.fsync_close

    def slow(f):  # the first LIMIT fsyncs wait until released: the others must not pile up
        if threading.current_thread().name == "ckptcore-fsync":
            hold.wait(5)
        real(f)

    monkeypatch.setattr(_io, "fsync_close", slow)
    before = threading.active_count()
    try:
        for f in files:
            f.write(b"x" * 100)
            syncs.start(f)
        assert threading.active_count() <= before + _io.Syncs.LIMIT
        hold.set()
        syncs.wait()
    finally:
        hold.set()
    assert all(f.closed for f in files)


def test_a_lazy_reading_started_by_one_thread_is_seen_whole_by_another(tmp_path) -> None:
    """Threads waiting on a lazy reading while another starts its batches: each sees either the
    lazy reading or all of its batches, never a half-built one (a damaged tensor always raises)."""
    from ckptcore._storage import Store

    arrays = {f"t{k}": np.full(1 << 16, k, np.float32) for k in range(64)}
    url = str(tmp_path / "ck")
    ckptcore.save_state(url, model=cn.Model(arrays), rng=False)
    with open(f"{url}/{MANIFEST_NAME}", "rb") as f:
        m = Manifest.from_bytes(f.read())
    bad = next(i for i, t in enumerate(m.tensors) if t.name.endswith("t63"))
    t = m.tensors.entry(bad)
    with open(f"{url}/{m.shards[t.shard].path}", "r+b") as f:
        f.seek(t.offset)
        f.write(b"\xff\xff\xff\xff")
    for _ in range(20):
        reading = _io.Reading(Store(url), m, range(len(m.tensors)), lazy=True)
        seen: list[BaseException | None] = []
        barrier = threading.Barrier(2)

        def waiter() -> None:
            barrier.wait()
            try:
                reading.wait_for(bad)
                seen.append(None)
            except BaseException as e:  # noqa: BLE001
                seen.append(e)

        th = threading.Thread(target=waiter)
        th.start()
        barrier.wait()
        with pytest.raises(CorruptCheckpointError):
            reading.result()
        th.join()
        reading.close()
        assert isinstance(seen[0], CorruptCheckpointError), seen
