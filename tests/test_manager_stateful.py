"""A hypothesis state machine drives a CheckpointManager against a model of what must exist.

Rules: saves of random small states (also of a step that exists), saves that crash at a random
storage operation, deletes (also crashing ones), restores, listing, gc.  A crash is simulated by
an ``_op_hook`` that raises :class:`Crash` at operation k *and at every operation after it*, so
no clean-up code gets to run, as in a process that died there; the manager object is then
dropped and a new one opened, as a restarted process would.  (``lock=False``: the writer lock
is tested in test_manager.py; a crashed process's flock would only be released by the kernel.)

The model is the set of committed steps with their arrays.  After a crash the outcome is not
fixed (the save may have committed, and retention may have run partly), so the model adopts
what it finds, but only if that is one of the outcomes the protocol allows.  Invariants:
``steps()`` equals the model, ``restore()`` returns the newest model state's exact arrays.
"""

from __future__ import annotations

import uuid

import fsspec
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule,
                                 run_state_machine_as_test)

import ckptcore
from ckptcore import (CheckpointExistsError, CheckpointManager, CheckpointNotFoundError, KeepLast,
                      TrainingState, _storage)
from manager_support import leftovers

KEEP = 3
DTYPES = ["float32", "float64", "float16", "int8", "int64", "uint16", "bool", "complex64"]
SHAPES = [(), (0,), (1,), (7,), (3, 4), (2, 0, 3)]


class Crash(BaseException):
    """The simulated death of the process (a BaseException, like a KeyboardInterrupt)."""


def _arrays(seed: int, n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        dtype = np.dtype(DTYPES[rng.integers(len(DTYPES))])
        shape = SHAPES[rng.integers(len(SHAPES))]
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
        out[f"layer{i}/w"] = raw.view(dtype).reshape(shape)  # any bit pattern, NaNs included
    return out


def _same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, arr in want.items():
        g = got[name]
        assert (g.dtype, g.shape) == (arr.dtype, arr.shape), name
        assert g.tobytes() == arr.tobytes(), name


class _Dying:
    """An ``_op_hook`` that raises :class:`Crash` from the ``at``-th operation on."""

    def __init__(self, at: int):
        self.at, self.count = at, 0

    def __call__(self, op: str, path: str) -> None:
        self.count += 1
        if self.count >= self.at:
            raise Crash(f"died before {op} {path}")


class ManagerMachine(RuleBasedStateMachine):
    base: str = ""
    async_save = False

    def __init__(self):
        super().__init__()
        self.root = f"{self.base.rstrip('/')}/{uuid.uuid4().hex}"
        self.mgr = self._open()
        self.model: dict[int, dict[str, np.ndarray]] = {}
        self.mine: set[int] = set()  # steps the current manager committed (it may replace them)
        self.next_step = 1

    def _open(self) -> CheckpointManager:
        return CheckpointManager(self.root, keep=KeepLast(KEEP), async_save=self.async_save,
                                 lock=False)

    def _save(self, step: int, arrays: dict) -> None:
        handle = self.mgr.save(step, TrainingState(model=arrays, step=step))
        handle.result()
        self.mgr.wait()

    @staticmethod
    def _retained(steps) -> set[int]:
        return set(sorted(steps)[-KEEP:])

    # -- rules ----------------------------------------------------------------------------------
    @rule(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 3), gap=st.integers(1, 3))
    def save(self, seed, n, gap):
        step = self.next_step + gap - 1
        arrays = _arrays(seed, n)
        self._save(step, arrays)
        self.model[step] = arrays
        self.mine.add(step)
        self.model = {s: self.model[s] for s in self._retained(self.model)}
        self.next_step = step + 1

    @precondition(lambda self: self.model)
    @rule(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def save_existing_step(self, data, seed):
        step = data.draw(st.sampled_from(sorted(self.model)))
        arrays = _arrays(seed, 1)
        if step < max(self.model):  # below the newest: refused, naming the way to rewind
            with pytest.raises(ValueError, match=rf"mgr.rewind\({step}\)"):
                self._save(step, arrays)
        elif step in self.mine:  # this manager's own newest step: replaced
            self._save(step, arrays)
            self.model[step] = arrays
        else:  # another run's (a restarted manager's) step: never replaced
            with pytest.raises(CheckpointExistsError):
                self._save(step, arrays)
            if self.async_save:
                with pytest.raises(CheckpointExistsError):  # and it surfaces on the next call
                    self.mgr.wait()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def rewind(self, data):
        step = data.draw(st.sampled_from(sorted(self.model)))
        gone = self.mgr.rewind(step)
        assert gone == sorted((s for s in self.model if s >= step), reverse=True)
        self.model = {s: a for s, a in self.model.items() if s < step}
        self.next_step = step

    @rule(seed=st.integers(0, 2**32 - 1), at=st.integers(1, 12))
    def crash_during_save(self, seed, at):
        step = self.next_step
        arrays = _arrays(seed, 2)
        before = set(self.model)
        _storage._op_hook = _Dying(at)
        try:
            self._save(step, arrays)
            crashed = False
        except Crash:
            crashed = True
        finally:
            _storage._op_hook = None
        if not crashed:  # ``at`` lay beyond the save's last operation
            self.model[step] = arrays
            self.mine.add(step)
            self.model = {s: self.model[s] for s in self._retained(self.model)}
            self.next_step = step + 1
            return
        self._restart()
        found = set(self.mgr.steps())
        if step in found:  # committed; retention ran partly or not at all
            assert self._retained(before | {step}) <= found <= before | {step}, (before, found)
            self.model[step] = arrays
            self.model = {s: self.model[s] for s in found}
            self.next_step = step + 1
        else:  # not committed: retention never ran; the restarted run retries this step
            assert found == before, (before, found)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), at=st.sampled_from([0, 1, 2]))
    def delete(self, data, at):
        step = data.draw(st.sampled_from(sorted(self.model)))
        if at == 0:
            self.mgr.delete(step)
            del self.model[step]
            return
        _storage._op_hook = _Dying(at)  # 1: before the manifest goes, 2: after it, before the data
        try:
            with pytest.raises(Crash):
                self.mgr.delete(step)
        finally:
            _storage._op_hook = None
        self._restart()
        if at == 2:  # the manifest went first: the step is no longer committed
            del self.model[step]

    @rule()
    def restore_newest(self):
        if not self.model:
            with pytest.raises(CheckpointNotFoundError):
                self.mgr.restore()
            return
        newest = max(self.model)
        state = self.mgr.restore()
        assert state.step == newest
        _same(state.model, self.model[newest])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def restore_step(self, data):
        step = data.draw(st.sampled_from(sorted(self.model)))
        _same(self.mgr.restore(step=step).model, self.model[step])

    @rule()
    def gc(self):
        self.mgr.gc(grace=0)
        assert leftovers(self.root) == []
        for s in self.model:
            assert ckptcore.verify(self.mgr.step_url(s)) == []

    def _restart(self) -> None:
        # The dead process's manager is dropped; closing it touches no storage (lock=False and
        # nothing in flight any more), it only stops its thread.
        try:
            self.mgr.close()
        except Crash:
            pass
        self.mgr = self._open()
        self.mine = set()

    # -- invariants -----------------------------------------------------------------------------
    @invariant()
    def listing_matches_the_model(self):
        assert self.mgr.steps() == sorted(self.model)
        assert self.mgr.latest_step() == (max(self.model) if self.model else None)

    def teardown(self):
        _storage._op_hook = None
        self.mgr.close()
        fs, path = fsspec.core.url_to_fs(self.root)
        try:
            fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass


SETTINGS = settings(max_examples=30, stateful_step_count=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("where, async_save", [("local", False), ("memory", False),
                                               ("local", True)],
                         ids=["local", "memory", "local-async"])
@pytest.mark.slow
def test_manager_state_machine(tmp_path, where, async_save):
    base = str(tmp_path) if where == "local" else f"memory://stateful-{uuid.uuid4().hex}"

    class Machine(ManagerMachine):
        pass

    Machine.base, Machine.async_save = base, async_save
    # memory:// is cheap; on disk every save fsyncs, so fewer examples there.
    run_state_machine_as_test(Machine, settings=settings(
        SETTINGS, max_examples=SETTINGS.max_examples if where == "memory" else 12))
