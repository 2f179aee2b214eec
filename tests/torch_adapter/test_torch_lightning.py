"""ckptcore_torch.Checkpoint in Lightning's ``trainer.fit``: a fit SIGKILLed mid-epoch, resumed,
preempted by SIGTERM on an epoch's last batch and resumed again ends bit for bit equal to an
uninterrupted fit (real processes); resumes in-process keep Lightning's counters, so max_steps and
max_epochs are totals; SIGTERM mid-epoch saves and returns from fit; misuse is refused.

Every fit logs each trained batch (epoch, batch_idx, global_step, sample ids, lr, a dropout-era
RNG draw): the logs of the pieces of an interrupted fit, joined, are the uninterrupted fit's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("lightning")

import ckptcore  # noqa: E402
from ckptcore.errors import RestoreError  # noqa: E402
import ckptcore_torch  # noqa: E402
from _support import subprocess_env  # noqa: E402

import _torch_lightning_worker as W  # noqa: E402

HERE = Path(__file__).resolve().parent
TIMEOUT = 240


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _latest(root: Path) -> ckptcore.TrainingState:
    mgr = ckptcore.CheckpointManager(str(root), lock=False, save_on_preemption=False)
    return ckptcore.load_state(mgr.step_url(mgr.latest_step()))


def _same_state(a: ckptcore.TrainingState, b: ckptcore.TrainingState) -> None:
    """Bit for bit: weights, optimizer slots, schedule, RNGs, data position and Lightning's counters."""
    assert a.model.keys() == b.model.keys()
    for k in a.model:
        assert a.model[k].dtype == b.model[k].dtype and a.model[k].tobytes() == b.model[k].tobytes(), k
    assert a.optimizer.step == b.optimizer.step and a.optimizer.slots.keys() == b.optimizer.slots.keys()
    for p, slots in a.optimizer.slots.items():
        for name, value in slots.items():
            assert value.tobytes() == b.optimizer.slots[p][name].tobytes(), (p, name)
    assert a.schedule.step == b.schedule.step and a.schedule.last_lr == b.schedule.last_lr
    assert a.rng["torch"].tobytes() == b.rng["torch"].tobytes()
    assert a.data == b.data and (a.step, a.epoch) == (b.step, b.epoch)
    assert a.extra["torch"]["lightning"] == b.extra["torch"]["lightning"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted fit: 3 epochs of 5 batches, a checkpoint every 3 batches."""
    d = tmp_path_factory.mktemp("reference")
    trainer, _, _ = W.fit(str(d / "root"), log=str(d / "log"), max_epochs=3, every_n_steps=3)
    return {"log": _log(d / "log"), "state": _latest(d / "root"), "counters": W.counters(trainer)}


def _run(tmp_path: Path, name: str, **spec) -> dict:
    """The worker as a real process; returns its out file (None if it was SIGKILLed)."""
    out = tmp_path / f"{name}.json"
    spec_path = tmp_path / f"{name}.spec.json"
    spec_path.write_text(json.dumps({**spec, "out": str(out)}))
    proc = subprocess.run([sys.executable, str(HERE / "_torch_lightning_worker.py"), str(spec_path)],
                          env=subprocess_env(HERE), capture_output=True, text=True, timeout=TIMEOUT)
    if spec.get("signal") == "SIGKILL":
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
        return {}
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_killed_and_preempted_fit_resumes_bit_for_bit(tmp_path, reference):
    root, log = str(tmp_path / "root"), str(tmp_path / "log")
    common = {"root": root, "log": log, "max_epochs": 3, "every_n_steps": 3}
    # 1: SIGKILL as batch 8 (epoch 1, batch_idx 2) starts: the newest checkpoint is batch 6,
    #    mid-epoch 1 (batch 5 was the end of epoch 0).
    _run(tmp_path, "killed", signal="SIGKILL", at=8, **common)
    assert ckptcore.CheckpointManager(root, lock=False, save_on_preemption=False).steps() == [3, 5, 6]
    first = _log(Path(log))
    assert len(first) == 7
    # 2: resumes at batch 7; SIGTERM as its 4th batch (batch 10, the last of epoch 1) starts: that
    #    batch is saved after the epoch-end work and fit returns normally.
    second = _run(tmp_path, "preempted", signal="SIGTERM", at=4, **common)
    assert second["restored"] == 6 and second["preempted"] is True
    assert second["global_step"] == 10 and second["current_epoch"] == 2
    assert ckptcore.CheckpointManager(root, lock=False, save_on_preemption=False).latest_step() == 10
    # 3: resumes at the start of epoch 2 and finishes (here: this process, also a fresh one to it).
    trainer, _, ckpt = W.fit(root, log=log, max_epochs=3, every_n_steps=3)
    assert ckpt.restored.step == 10 and not ckpt.preempted
    joined = _log(Path(log))
    assert joined[:6] + joined[7:] == reference["log"]  # batch 7 was trained twice: killed, then redone
    assert W.counters(trainer) == reference["counters"]
    _same_state(_latest(Path(root)), reference["state"])


@pytest.mark.parametrize("limit, first, total", [
    ("max_steps", 7, 13),    # stops mid-epoch 1: resumes there, batch_idx 2 next
    ("max_steps", 10, 13),   # stops at the end of epoch 1: with max_steps Lightning would restart it
    ("max_epochs", 1, 3),    # an epoch-end checkpoint, resumed on that epoch's end
])
def test_resume_continues_lightnings_counters(tmp_path, limit, first, total):
    """A second fit with a larger limit continues the first: max_steps/max_epochs are totals,
    and global_step, current_epoch and batch_idx go on as in one fit."""
    a, b = tmp_path / "a", tmp_path / "b"
    trainer, _, _ = W.fit(str(a / "root"), log=str(a / "log"), every_n_steps=2, **{limit: total})
    whole = W.counters(trainer)
    W.fit(str(b / "root"), log=str(b / "log"), every_n_steps=2, **{limit: first})
    trainer, _, ckpt = W.fit(str(b / "root"), log=str(b / "log"), every_n_steps=2, **{limit: total})
    assert ckpt.restored is not None and ckpt.restored.step == (first if limit == "max_steps" else 5 * first)
    assert W.counters(trainer) == whole
    assert _log(b / "log") == _log(a / "log")
    _same_state(_latest(b / "root"), _latest(a / "root"))


def test_finished_fit_trains_nothing_more(tmp_path):
    root = str(tmp_path / "root")
    W.fit(root, log=str(tmp_path / "log"), max_epochs=1)
    trainer, _, ckpt = W.fit(root, log=str(tmp_path / "log"), max_epochs=1)
    assert ckpt.restored.step == 5 and trainer.global_step == 5
    assert len(_log(tmp_path / "log")) == 5


def test_sigterm_mid_epoch_saves_that_batch_and_returns(tmp_path, reference):
    root, log = str(tmp_path / "root"), str(tmp_path / "log")
    trainer, _, ckpt = W.fit(root, log=log, signal_at=(signal.SIGTERM, 7), max_epochs=3, every_n_steps=3)
    assert ckpt.preempted and trainer.global_step == 7 and not trainer.received_sigterm
    assert ckptcore.CheckpointManager(root, lock=False, save_on_preemption=False).steps() == [3, 5, 6, 7]
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)  # the handlers are gone
    trainer, _, ckpt = W.fit(root, log=log, max_epochs=3, every_n_steps=3)
    assert ckpt.restored.step == 7 and not ckpt.preempted
    # The callback tells its manager what the state went into: ckpt log judges the resume.
    session = ckptcore.run_log(root)["runs"][0]["sessions"][-1]
    assert session["verdict"] == "exact", session
    assert _log(Path(log)) == reference["log"]
    assert W.counters(trainer) == reference["counters"]
    _same_state(_latest(Path(root)), reference["state"])


def test_a_loader_that_runs_ahead_of_training_is_refused(tmp_path):
    """A cursor that moves as torch draws indices ahead (here: a worker process) would be saved
    past the batches trained; the callback notices after the first batch."""
    cursor = ckptcore.DataCursor(W.N, W.BS, seed=3)
    loader = torch.utils.data.DataLoader(W.dataset(), batch_sampler=cursor, num_workers=1)
    ckpt = ckptcore_torch.Checkpoint(str(tmp_path / "root"), cursor=cursor)
    trainer = _trainer(ckpt, max_epochs=1)
    with pytest.raises(RuntimeError, match="advance the cursor as it hands each batch"):
        trainer.fit(W.Net(), loader)


def test_limit_train_batches_is_refused_with_a_cursor(tmp_path):
    cursor = ckptcore.DataCursor(W.N, W.BS, seed=3)
    ckpt = ckptcore_torch.Checkpoint(str(tmp_path / "root"), cursor=cursor)
    with pytest.raises(ValueError, match="limit_train_batches"):
        _trainer(ckpt, max_epochs=1, limit_train_batches=2).fit(W.Net(), W.loader(cursor))


def test_a_foreign_checkpoint_is_not_resumed(tmp_path):
    root = str(tmp_path / "root")
    with ckptcore.CheckpointManager(root) as mgr:
        mgr.save(1, ckptcore.TrainingState(model={"w": torch.zeros(2).numpy()}))
    cursor = ckptcore.DataCursor(W.N, W.BS, seed=3)
    with pytest.raises(RestoreError, match="not written by ckptcore_torch.Checkpoint"):
        _trainer(ckptcore_torch.Checkpoint(root, cursor=cursor), max_epochs=1).fit(W.Net(), W.loader(cursor))
    assert signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)


def test_arguments_are_checked_before_anything_is_created(tmp_path):
    with pytest.raises(ValueError, match="needs the data position"):
        ckptcore_torch.Checkpoint(str(tmp_path / "a"), every_n_steps=10)
    with pytest.raises(TypeError, match="cursor must be"):
        ckptcore_torch.Checkpoint(str(tmp_path / "a"), cursor=[1, 2])
    with pytest.raises(ValueError, match="every_n_steps"):
        ckptcore_torch.Checkpoint(str(tmp_path / "a"), cursor=ckptcore.DataCursor(4, 2), every_n_steps=0)
    with pytest.raises(ValueError):
        ckptcore_torch.Checkpoint("", cursor=ckptcore.DataCursor(4, 2))
    assert not (tmp_path / "a").exists()
    assert "Checkpoint" in ckptcore_torch.__all__


def _trainer(*callbacks, **limits):
    import lightning.pytorch as L
    return L.Trainer(accelerator="cpu", devices=1, enable_progress_bar=False, logger=False,
                     enable_checkpointing=False, deterministic=True, enable_model_summary=False,
                     callbacks=list(callbacks), **limits)


def test_each_saves_figures_are_logged_through_lightning(tmp_path):
    seen = []
    with ckptcore.on_event(seen.append):
        trainer, _, _ = W.fit(str(tmp_path / "root"), max_epochs=1, every_n_steps=2)
    saves = {e.step: e for e in seen if e.kind == "save"}
    assert sorted(saves) == [2, 4, 5]
    # Step 4 is written as batch 5 starts and logged as it ends; step 5 once fit ends (unlogged).
    logged = trainer.callback_metrics
    assert float(logged["ckpt_save_seconds"]) == pytest.approx(saves[4].seconds_total, rel=1e-6)
    assert float(logged["ckpt_bytes"]) == saves[4].bytes > 0
    assert float(logged["ckpt_requests"]) == saves[4].requests
    metrics = _latest(tmp_path / "root").metadata["metrics"]
    assert "train_loss" in metrics and not [k for k in metrics if k.startswith("ckpt_")]
