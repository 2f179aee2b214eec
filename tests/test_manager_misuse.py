"""CheckpointManager misuse is never silent: saves out of order, a step saved twice, restores that
leave saved state unapplied, and the log trail of every decision that deletes, skips, falls back
or takes over.  Real storage (conftest backends), no mocks."""
from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest

import ckptcore
from ckptcore import (CheckpointExistsError, CheckpointFallbackWarning, DataCursor, KeepLast,
                      UnappliedStateWarning)
from ckptcore_numpy import SGD, Model
from manager_support import leftovers, open_manager, root_of
from _support import assert_state_of, make_state


def _messages(caplog, level=logging.INFO):
    return [r.getMessage() for r in caplog.records if r.name == "ckptcore" and r.levelno >= level]


# ------------------------------------------------------------------------------ order of steps
def test_a_save_below_the_newest_step_is_refused_with_the_way_to_rewind(backend):
    with open_manager(backend) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, make_state(s))
    with open_manager(backend) as mgr:  # a run restarted without restoring
        with pytest.raises(ValueError) as err:
            mgr.save(5, make_state(5))
        message = str(err.value)
        assert "newest committed step 30" in message and "mgr.rewind(5)" in message
        assert "mgr.restore(" in message
        assert mgr.steps() == [10, 20, 30]  # nothing written
        assert leftovers(*root_of(backend)) == []


def test_rewind_deletes_the_newer_steps_newest_first_and_logs_each(backend, caplog):
    with open_manager(backend) as mgr:
        for s in (10, 20, 30):
            mgr.save(s, make_state(s))
    with open_manager(backend) as mgr, caplog.at_level(logging.INFO, logger="ckptcore"):
        assert_state_of(mgr.restore(step=10), 10)
        assert mgr.rewind(11) == [30, 20]
        assert mgr.steps() == [10]
        logged = [m for m in _messages(caplog) if m.startswith("rewind(11)")]
        assert ["step 30" in logged[0], "step 20" in logged[1]] == [True, True]
        mgr.save(11, make_state(11))  # the run goes on from there
        assert mgr.steps() == [10, 11]
        assert_state_of(mgr.restore(), 11)
        assert mgr.rewind(12) == []
        with pytest.raises(ValueError, match="non-negative int"):
            mgr.rewind(-1)


def test_a_step_saved_twice_in_one_run_is_replaced_and_logged(backend, caplog):
    with open_manager(backend, keep=KeepLast(2)) as mgr, \
            caplog.at_level(logging.INFO, logger="ckptcore"):
        mgr.save(1, make_state(1))
        mgr.save(2, make_state(2))  # a periodic save...
        mgr.save(2, make_state(20))  # ...and a final save of the same step
        assert mgr.steps() == [1, 2]
        assert_state_of(mgr.restore(), 20)
        assert ckptcore.verify(mgr.step_url(2), storage_options=backend.storage_options) == []
        assert any("replacing checkpoint step 2" in m and "earlier in this run" in m
                   for m in _messages(caplog))
        assert leftovers(*root_of(backend)) == []


def test_a_step_saved_twice_with_async_saves_is_replaced(backend):
    with open_manager(backend, async_save=True) as mgr:
        mgr.save(4, make_state(4))
        mgr.save(4, make_state(40))  # waits for the first, then replaces it
        mgr.wait()
        assert mgr.steps() == [4]
        assert_state_of(mgr.restore(), 40)


# ------------------------------------------------------------------------------ restore
def _numpy_run(backend):
    model = Model({"dense/kernel": np.arange(6, dtype=np.float32).reshape(3, 2)})
    opt = SGD(0.1, momentum=0.9)
    opt.step(model, {"dense/kernel": np.ones((3, 2), np.float32)})
    cursor = DataCursor(40, 8, seed=1)
    cursor.next_batch()
    with open_manager(backend) as mgr:
        mgr.save(1, model=model, optimizer=opt, cursor=cursor)
    return model, cursor


def _fresh():
    return Model({"dense/kernel": np.zeros((3, 2), np.float32)}), SGD(0.1, momentum=0.9)


def test_restore_without_objects_returns_the_state_and_never_warns(local_backend):
    _, cursor = _numpy_run(local_backend)
    with open_manager(local_backend) as mgr, warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mgr.restore().data == cursor.state_dict()  # the position is there, unapplied
        assert mgr.restore(step=1).data == cursor.state_dict()


def test_restore_with_keys_leaves_sections_out_on_purpose(local_backend):
    saved, _ = _numpy_run(local_backend)
    model, opt = _fresh()
    with open_manager(local_backend) as mgr, warnings.catch_warnings():
        warnings.simplefilter("error", UnappliedStateWarning)
        state = mgr.restore(keys=["model", "optimizer"], model=model, optimizer=opt)
        assert not state.data  # not even read
        assert model.params["dense/kernel"].tobytes() == saved.params["dense/kernel"].tobytes()
        state = mgr.restore(step=1, keys=["model"])
        assert not state.data and not state.optimizer
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a usage error, not a step to fall back over
            with pytest.raises(ValueError, match="unknown section"):
                mgr.restore(keys=["modle"])


def test_restore_without_cursor_warns_when_the_checkpoint_holds_a_position(local_backend):
    _numpy_run(local_backend)
    model, opt = _fresh()
    with open_manager(local_backend) as mgr:
        with pytest.warns(UnappliedStateWarning, match="cursor="):
            mgr.restore(model=model, optimizer=opt)


# ------------------------------------------------------------------------------ the log trail
def test_every_deletion_skip_and_fallback_is_logged(backend, caplog):
    with caplog.at_level(logging.INFO, logger="ckptcore"):
        with open_manager(backend, keep=KeepLast(2)) as mgr:
            for s in (1, 2, 3):
                mgr.save(s, make_state(s))
            assert any("retention: deleting checkpoint step 1" in m for m in _messages(caplog))
            mgr.delete(2)
            assert any("delete: deleting checkpoint step 2" in m for m in _messages(caplog))
            mgr.save(4, make_state(4))
        # Damage the newest step: restore() skips it with a warning and a log line.
        name = next(n for n in backend.listdir("run", "step-000000000004")
                    if n.startswith("shard-"))
        data = bytearray(backend.read("run", "step-000000000004", name))
        data[len(data) // 2] ^= 0xFF
        backend.write(bytes(data), "run", "step-000000000004", name)
        with open_manager(backend) as mgr:
            with pytest.warns(CheckpointFallbackWarning):
                assert_state_of(mgr.restore(), 3)
            assert any(r.levelno == logging.WARNING and "step 4" in r.getMessage()
                       and "falling back" in r.getMessage() for r in caplog.records)
            with pytest.warns(CheckpointFallbackWarning):
                mgr.save(4, make_state(44))  # replaces the damaged step: logged too
            assert any("replacing damaged checkpoint step 4" in m for m in _messages(caplog))
            backend.fs.makedirs(backend.path("run", "step-000000000009"), exist_ok=True)
            backend.write(b"x", "run", "step-000000000009", "shard-00000-0000000000000000.bin")
            assert mgr.gc(grace=0)
            assert any(m.startswith("gc: removing leftover") and "step-000000000009" in m
                       for m in _messages(caplog))


def test_manager_refuses_a_step_another_run_committed_even_when_newest(backend):
    with open_manager(backend) as first:
        first.save(7, make_state(7))
    with open_manager(backend) as mgr:
        with pytest.raises(CheckpointExistsError, match=r"mgr.rewind\(7\)"):
            mgr.save(7, make_state(70))
        assert mgr.rewind(7) == [7]
        mgr.save(7, make_state(70))
        assert_state_of(mgr.restore(), 70)
