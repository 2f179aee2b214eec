"""The adapter conformance suite: what every ckptcore adapter must do, as tests to subclass.

An adapter's test module subclasses :class:`AdapterTests`, names its adapter and fills in a few
hooks; pytest then runs every test of the contract against it::

    from ckptcore.testing import AdapterTests

    class TestMyFrameworkConformance(AdapterTests):
        adapter_name = "myfw"

        def make(self, seed):             # a tiny model and optimizer, trained one step
            ...
            return {"model": model, "optimizer": optimizer}

        def train(self, objects, steps):  # deterministic given the objects and the global RNG
            ...

        def model_arrays(self, objects):  # {name: ndarray}, compared by position
            ...

        def optimizer_arrays(self, objects):
            ...

        def draw_rng(self):               # one draw from the framework's global RNG
            ...

The suite covers capture/restore round trips (in memory and through ``save_state``/``load_state``
on disk), strict and non-strict restores and their :class:`~ckptcore.RestoreReport` names
(:func:`ckptcore.adapter.qualified`), the one refusal message
(:func:`ckptcore.adapter.mismatch_message`), ``rng=True``/``rng=False``, the data cursor, copy
semantics (``copy=True``/``copy=False`` against :attr:`~ckptcore.adapter.Adapter.capture_views`),
unknown objects, the registry, and the migration dialect.

This module imports pytest; it is meant for test processes only (``import ckptcore`` never imports
it).  Each framework runs its subclass in a pytest process of its own: some frameworks cannot
share a process.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from . import DataCursor, load_state, registry, save_state
from .adapter import Adapter, FileFormat, mismatch_message, qualified
from .errors import RestoreError
from .registry import adapter_for, get_adapter
from .state import OptimizerState, RestoreReport, TrainingState

__all__ = ["AdapterTests", "assert_bitwise"]

UNEXPECTED = "conformance_extra/kernel"  # a tensor no target has


def assert_bitwise(expected: Mapping[str, Any], got: Mapping[str, Any], what: str) -> None:
    """Assert two ``{name: array}`` dicts hold the same arrays bit for bit, compared by position
    (frameworks may name two instances of one model differently); names are for the message."""
    exp, act = list(expected.items()), list(got.items())
    assert len(exp) == len(act), (f"{what}: {len(exp)} arrays expected, got {len(act)}: "
                                  f"{[k for k, _ in exp]} vs {[k for k, _ in act]}")
    for (ke, e), (ka, a) in zip(exp, act):
        e, a = np.asarray(e), np.asarray(a)
        assert e.shape == a.shape and e.dtype == a.dtype, (
            f"{what}: {ke} is {e.dtype}{list(e.shape)}, {ka} is {a.dtype}{list(a.shape)}")
        assert e.tobytes() == a.tobytes(), f"{what}: {ke} and {ka} differ"


def _frozen(arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {k: np.array(v, copy=True) for k, v in arrays.items()}


def _state_arrays(state: TrainingState) -> dict[str, np.ndarray]:
    out = {qualified("model", n): a for n, a in state.model.items()}
    if state.optimizer is not None:
        out.update({qualified("optimizer", p, s): a for p, slots in state.optimizer.slots.items()
                    for s, a in slots.items()})
    return out


def _same_draw(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


class AdapterTests:
    """Base class of an adapter's conformance tests.  Not collected itself (no ``Test`` prefix).

    Hooks a subclass provides:

    * ``adapter_name``: the adapter's registry name (also ``TrainingState.framework``).
    * ``make(seed) -> dict``: fresh framework objects as ``capture``/``restore`` keywords
      (``{"model": ..., "optimizer": ..., ...}``): a tiny model and its optimizer, trained one
      step so every optimizer slot exists.  Different seeds give different weights.
    * ``train(objects, steps)``: train ``steps`` steps; deterministic given the objects' state and
      the framework's global RNG (fixed data, no fresh seeding).
    * ``model_arrays(objects)`` / ``optimizer_arrays(objects)``: the live weights and optimizer
      slots as ``{name: numpy array}``, read from the objects themselves (not through the
      adapter), in a stable order: compared by position.
    * ``draw_rng()``: one draw from the framework's global RNG (anything ``numpy.asarray`` takes).

    Optional: ``check_migration_dialect(dialect, objects, state)`` (see
    :meth:`test_migration_dialect`).
    """

    adapter_name: str = ""

    # --- hooks ----------------------------------------------------------------------------------
    def make(self, seed: int) -> dict[str, Any]:
        raise NotImplementedError

    def train(self, objects: Mapping[str, Any], steps: int) -> None:
        raise NotImplementedError

    def model_arrays(self, objects: Mapping[str, Any]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def optimizer_arrays(self, objects: Mapping[str, Any]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def draw_rng(self) -> Any:
        raise NotImplementedError

    def check_migration_dialect(self, dialect: Any, objects: Mapping[str, Any],
                                state: TrainingState) -> None:
        """Migration to and from the neutral form through ``dialect`` (``ckptcore.migrate.dialect``).

        The captured optimizer goes to the neutral form and back: its family, learning rate and
        hyperparameters read back the same from the optimizer the dialect builds, and every slot
        array comes back with its dtype and values; a schedule the dialect can express goes through
        its canonical formula and back to the same kind and rate.  An adapter whose optimizer in
        ``make`` the dialect does not support fails here: pick one it supports.
        """
        from ckptcore.migrate.dialect import Dialect

        assert dialect is not None, f"{self.adapter_name}: ADAPTER.dialect is None"
        assert isinstance(dialect, Dialect), f"{type(dialect).__name__} lacks Dialect members"
        assert dialect.name == self.adapter_name
        opt = state.optimizer
        neutral = dialect.optimizer_to_neutral(opt, state.schedule)
        assert not neutral.unsupported, neutral.unsupported
        kind, hyper = dialect.optimizer_from_neutral(neutral)
        again = dialect.optimizer_to_neutral(OptimizerState(kind, opt.step, hyper), state.schedule)
        assert (again.family, again.lr) == (neutral.family, neutral.lr)
        assert ({k: v for k, v in again.hp.items() if v is not None}
                == {k: v for k, v in neutral.hp.items() if v is not None})
        for param, native in opt.slots.items():
            common = dialect.slots_to_neutral(neutral, native)
            back = dialect.slots_from_neutral(neutral, common, source=neutral, like=state.model[param],
                                              current=None)
            assert set(back) == set(native), (param, sorted(back), sorted(native))
            for slot, arr in native.items():
                assert back[slot].dtype == arr.dtype, (param, slot)
                np.testing.assert_allclose(back[slot], arr, rtol=1e-6, err_msg=f"{param}/{slot}")
        if state.schedule is not None:
            form = dialect.schedule_to_canonical(state.schedule)
            if form is not None:
                sched, _ = dialect.schedule_from_canonical(form, state.schedule, state.schedule.step,
                                                           state.schedule.last_lr)
                assert sched.kind == state.schedule.kind

    # --- helpers --------------------------------------------------------------------------------
    @property
    def adapter(self) -> Adapter:
        return get_adapter(self.adapter_name)

    def capture(self, objects: Mapping[str, Any], **kw: Any) -> TrainingState:
        return self.adapter.capture(**objects, **kw)

    def restore(self, state: TrainingState, objects: Mapping[str, Any], **kw: Any) -> RestoreReport:
        return self.adapter.restore(state, **objects, **kw)

    def arrays(self, objects: Mapping[str, Any]) -> dict[str, np.ndarray]:
        out = {f"model/{k}": v for k, v in self.model_arrays(objects).items()}
        out.update({f"optimizer/{k}": v for k, v in self.optimizer_arrays(objects).items()})
        return _frozen(out)

    @pytest.fixture
    def objects(self) -> dict[str, Any]:
        return self.make(0)

    # --- the contract ---------------------------------------------------------------------------
    def test_adapter_declares_the_contract(self):
        adapter = self.adapter
        # Looked up statically: isinstance(adapter, Adapter) would run the dialect property.
        missing = [m for m in registry.CONTRACT if not registry.declares(adapter, m)]
        assert not missing, f"{adapter!r} lacks {missing} of the adapter contract"
        assert adapter.name == self.adapter_name
        assert isinstance(adapter.capture_views, bool)
        for fmt in adapter.formats:
            assert isinstance(fmt, FileFormat) and fmt.framework == adapter.name, fmt

    def test_registry_finds_the_adapter(self, objects):
        assert adapter_for(objects["model"]) is self.adapter
        state = self.capture(objects)
        assert state.framework == self.adapter.name == self.adapter_name

    def test_round_trip_is_bitwise(self, objects):
        state = self.capture(objects)
        fresh = self.make(1)
        before = self.arrays(fresh)
        assert any(a.tobytes() != b.tobytes() for a, b in zip(before.values(), self.arrays(objects).values())), \
            "make(0) and make(1) built identical objects: the round trip would prove nothing"
        report = self.restore(state, fresh)
        assert isinstance(report, RestoreReport) and report.ok, report
        assert_bitwise(self.model_arrays(objects), self.model_arrays(fresh), "model")
        assert_bitwise(self.optimizer_arrays(objects), self.optimizer_arrays(fresh), "optimizer")
        assert len(self.optimizer_arrays(fresh)) > 0, "make() must train a step so slots exist"

    def test_restored_run_continues_bit_exactly(self, objects):
        state = self.capture(objects)
        fresh = self.make(1)
        self.restore(state, objects)  # rewinds the global RNG too, for an equal start
        self.train(objects, 2)
        expected = self.arrays(objects)
        self.restore(state, fresh)
        self.train(fresh, 2)
        assert_bitwise(expected, self.arrays(fresh), "after two more steps")

    def test_save_and_load_state_round_trip(self, objects, tmp_path):
        url = str(tmp_path / "ckpt")
        info = save_state(url, **objects)
        assert info.framework == self.adapter_name
        fresh = self.make(1)
        state = load_state(url, **fresh)
        assert state.framework == self.adapter_name
        assert_bitwise(self.arrays(objects), self.arrays(fresh), "after load_state")

    def test_load_state_passes_rng_false(self, objects, tmp_path):
        url = str(tmp_path / "ckpt")
        save_state(url, **objects)
        fresh = self.make(1)
        load_state(url, rng=False, **fresh)
        assert_bitwise(self.arrays(objects), self.arrays(fresh), "after load_state(rng=False)")

    def _mismatched(self, state: TrainingState, target: Mapping[str, Any]
                    ) -> tuple[TrainingState, str, int]:
        """``state`` without its last model tensor and with one that no target has; the target's
        name of the dropped tensor (two instances of a model may be named apart, and a report
        names a missing tensor as the target calls it), and its position."""
        state = copy.copy(state)
        model = dict(state.model)
        index = len(model) - 1
        dropped = list(model)[index]
        extra = np.zeros((2, 2), np.asarray(model[dropped]).dtype)
        del model[dropped]
        model[UNEXPECTED] = extra
        state.model = model
        return state, self._target_name(target, index), index

    def _target_name(self, target: Mapping[str, Any], index: int) -> str:
        return list(self.capture(target, rng=False).model)[index]

    def test_strict_restore_refuses_with_the_one_message(self, objects):
        full = self.capture(objects)
        fresh = self.make(1)
        state, missing, index = self._mismatched(full, fresh)
        if state.optimizer is not None:  # a state has no slots for a tensor it does not have
            state.optimizer = copy.copy(state.optimizer)
            state.optimizer.slots = {p: s for p, s in state.optimizer.slots.items()
                                     if p != list(full.model)[index]}
        before = self.arrays(fresh)
        with pytest.raises(RestoreError) as e:
            self.restore(state, fresh)
        assert_bitwise(before, self.arrays(fresh), "a refused restore changed the target")
        # The one wording, listing what a non-strict restore of the same target reports.
        report = self.restore(state, fresh, strict=False)
        assert qualified("model", missing) in report.missing, report
        assert qualified("model", UNEXPECTED) in report.unexpected, report
        assert str(e.value) == mismatch_message(report.missing, report.unexpected)

    def test_non_strict_restore_reports_qualified_names(self, objects):
        fresh = self.make(1)
        full = self.capture(objects)
        state, missing, index = self._mismatched(full, fresh)
        assert state.optimizer is not None and state.optimizer.slots, "make() must train a step"
        opt = copy.copy(state.optimizer)
        slots = {p: dict(s) for p, s in opt.slots.items()}
        # The dropped tensor's slots go too (a state has no slots for a tensor it does not have).
        gone = [qualified("optimizer", missing, s) for s in slots.pop(list(full.model)[index], {})]
        param = next(p for p in slots if slots[p] and p in state.model)
        slot = next(iter(slots[param]))
        del slots[param][slot]
        slots[UNEXPECTED] = {slot: np.zeros((2, 2), np.float32)}
        opt.slots = slots
        state.optimizer = opt
        target_param = self._target_name(fresh, list(full.model).index(param))
        report = self.restore(state, fresh, strict=False)
        assert isinstance(report, RestoreReport) and not report.ok
        assert set(report.missing) == {qualified("model", missing),
                                       qualified("optimizer", target_param, slot), *gone}, report
        assert set(report.unexpected) == {qualified("model", UNEXPECTED),
                                          qualified("optimizer", UNEXPECTED, slot)}, report
        # Everything that matched was restored (by position: two instances may be named apart).
        saved = list(full.model.items())
        got = list(self.capture(fresh, rng=False).model.items())
        keep = [i for i in range(len(saved)) if i != index]
        assert_bitwise(dict(saved[i] for i in keep), dict(got[i] for i in keep),
                       "the tensors that matched")

    def test_rng_true_restores_the_global_rng(self, objects):
        self.draw_rng()  # a framework may create its global generator on the first draw
        state = self.capture(objects, rng=True)
        expected = self.draw_rng()
        fresh = self.make(1)
        self.draw_rng()
        self.restore(state, fresh, rng=True)
        assert _same_draw(self.draw_rng(), expected), "restore(rng=True) did not rewind the RNG"

    def test_rng_false_leaves_the_global_rng_alone(self, objects):
        self.draw_rng()
        old = self.capture(objects, rng=True)
        self.draw_rng()
        self.draw_rng()
        fresh = self.make(1)
        here = self.capture(fresh, rng=True)  # the RNG's position now
        expected = self.draw_rng()
        self.restore(here, fresh, rng=True)  # back to that position
        self.restore(old, fresh, rng=False)
        assert _same_draw(self.draw_rng(), expected), "restore(rng=False) moved the global RNG"

    def test_capture_rng_false_leaves_rng_empty(self, objects):
        assert self.capture(objects, rng=False).rng == {}

    def test_cursor_round_trip(self, objects):
        cursor = DataCursor(64, 8, seed=3)
        for _ in range(3):
            cursor.next_batch()
        state = self.capture(objects, cursor=cursor)
        follow = DataCursor(64, 8, seed=3)
        self.restore(state, self.make(1), cursor=follow)
        assert follow.state_dict() == cursor.state_dict()
        assert follow.next_batch().tolist() == cursor.next_batch().tolist()

    def test_copy_true_snapshots_do_not_follow_training(self, objects):
        state = self.capture(objects, copy=True)
        saved = _frozen(_state_arrays(state))
        self.train(objects, 2)
        assert_bitwise(saved, _state_arrays(state), "a copy=True capture changed with training")

    def test_copy_false_is_accepted(self, objects):
        copied = _frozen(_state_arrays(self.capture(objects, copy=True, rng=False)))
        state = self.capture(objects, copy=False, rng=False)
        assert_bitwise(copied, _state_arrays(state), "copy=False captured other values")
        self.train(objects, 2)
        if not self.adapter.capture_views:
            assert_bitwise(copied, _state_arrays(state),
                           "capture_views is False but a copy=False capture changed with training")

    def test_unknown_objects_are_a_type_error(self, objects):
        with pytest.raises(TypeError, match="conformance_bogus"):
            self.capture(objects, conformance_bogus=object())
        state = self.capture(objects)
        with pytest.raises(TypeError, match="conformance_bogus"):
            self.restore(state, self.make(1), conformance_bogus=object())

    def test_migration_dialect(self, objects):
        try:
            dialect = self.adapter.dialect
        except ImportError:
            pytest.skip("dialect conformance lands with the migration dialects")
        self.check_migration_dialect(dialect, objects, self.capture(objects))
