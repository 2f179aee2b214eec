"""The hapi Checkpoint callback over ckptcore_paddle.DataLoader: exact resume, metrics on every
save, save-best, lock=, and SIGTERM preemption (save the batch in progress, stop fit cleanly)."""

from __future__ import annotations

import logging
import os
import signal

import numpy as np
import pytest

paddle = pytest.importorskip("paddle", reason="paddlepaddle is not installed")

import ckptcore  # noqa: E402
import ckptcore_paddle as cp  # noqa: E402
from _models import snapshot  # noqa: E402

N, BS, EPOCHS = 90, 8, 3  # 12 batches an epoch, the last of 2


class _Data(paddle.io.Dataset):
    def __init__(self):
        rs = np.random.RandomState(5)
        self.x, self.y = rs.randn(N, 4).astype("float32"), rs.randint(0, 3, (N, 1)).astype("int64")

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __len__(self):
        return N


class _Sigterm(paddle.callbacks.Callback):
    """Sends this process SIGTERM as batch number ``at`` (counted over the whole fit) begins."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.seen = at, 0

    def on_train_batch_begin(self, step, logs=None):
        self.seen += 1
        if self.seen == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def _fit(root: str, seed: int, *, callbacks=(), workers: int = 0, use_cursor: bool = True, **kw):
    paddle.seed(seed)
    np.random.seed(seed)
    net = paddle.nn.Sequential(paddle.nn.Linear(4, 8), paddle.nn.Dropout(0.2), paddle.nn.Linear(8, 3))
    sch = paddle.optimizer.lr.StepDecay(0.1, step_size=4, gamma=0.7)
    opt = paddle.optimizer.Momentum(learning_rate=sch, parameters=net.parameters())
    model = paddle.Model(net)
    model.prepare(opt, paddle.nn.CrossEntropyLoss(), paddle.metric.Accuracy())
    if use_cursor:
        loader = cp.DataLoader(_Data(), ckptcore.DataCursor(N, BS, seed=11), num_workers=workers)
    else:
        loader = paddle.io.DataLoader(_Data(), batch_size=BS, shuffle=True)
    kw.setdefault("keep", None)
    ckpt = cp.Checkpoint(root, cursor=loader if use_cursor else None, **kw)
    model.fit(loader, epochs=EPOCHS, callbacks=[*callbacks, ckpt], verbose=0)
    return model, net, opt, ckpt


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


def _steps(root: str) -> list[int]:
    return ckptcore.CheckpointManager(root, lock=False, save_on_preemption=False).steps()


def _metrics(root: str, step: int) -> dict:
    return ckptcore.load_state(os.path.join(root, f"step-{step:012d}")).metadata.get("metrics")


@pytest.mark.parametrize("workers", [0, 2])
def test_fit_over_the_loader_resumes_mid_epoch_exactly(tmp_path, workers):
    """hapi fetches the next batch before on_train_batch_begin, where due saves are written; the
    saved position is still the batches trained."""
    ref_root, root = str(tmp_path / "ref"), str(tmp_path / "run")
    _, net, opt, _ = _fit(ref_root, 1, save_freq=5, workers=workers)
    assert _steps(ref_root) == [5, 10, 12, 15, 20, 24, 25, 30, 35, 36]
    # Keep only the checkpoint of batch 15 (epoch 1, batch 3), then resume from another seed.
    mgr = ckptcore.CheckpointManager(ref_root, save_on_preemption=False)
    state = mgr.restore(15)
    mgr.close()
    assert (state.data["epoch"], state.data["position"]) == (1, 3 * BS)
    ckptcore.save_state(os.path.join(root, f"step-{15:012d}"), state)
    _, net2, opt2, ckpt = _fit(root, 2, save_freq=5, workers=workers)
    assert ckpt.restored.step == 15
    _equal(snapshot(net2, opt2), snapshot(net, opt))


def test_every_save_carries_hapis_metrics_and_keep_best_works_through_them(tmp_path):
    root = str(tmp_path / "m")
    _fit(root, 1, save_freq=4, keep=ckptcore.KeepBest("loss", n=2))
    kept = {s: _metrics(root, s) for s in _steps(root)}
    assert all(set(m) >= {"loss", "acc"} and "step" not in m for m in kept.values()), kept
    other = str(tmp_path / "all")
    _fit(other, 1, save_freq=4)
    everything = {s: _metrics(other, s) for s in _steps(other)}
    assert len(everything) == 9 and {s: everything[s] for s in kept} == kept  # the same run
    best = sorted(everything, key=lambda s: everything[s]["loss"])[:2]
    # The two best by loss, and the manager's newest (kept so that a run can always resume).
    assert set(kept) == {*best, max(everything)}, (kept, everything)


def test_save_best_only_writes_only_improvements(tmp_path, caplog):
    root = str(tmp_path / "best")
    with caplog.at_level(logging.INFO, logger="ckptcore"):
        _, _, _, ckpt = _fit(root, 1, save_freq=2, save_best_only=True, monitor="loss")
    steps = _steps(root)
    values = [_metrics(root, s)["loss"] for s in steps]
    assert values == sorted(values, reverse=True) and len(set(values)) == len(values), values
    assert len(steps) < EPOCHS * 12 // 2 and "does not improve" in caplog.text
    assert ckpt.best == values[-1] and ckpt.mode == "min"
    assert cp.Checkpoint(root, monitor="acc").mode == "max"
    with pytest.raises(ValueError, match="mode"):
        cp.Checkpoint(root, mode="lowest")
    with pytest.warns(RuntimeWarning, match="no 'eval_loss'"):
        _fit(str(tmp_path / "noeval"), 1, save_best_only=True, monitor="eval_loss")


def test_lock_is_passed_to_the_manager(tmp_path):
    root = str(tmp_path / "locked")
    holder = ckptcore.CheckpointManager(root, save_on_preemption=False)
    holder.save(1, ckptcore.TrainingState(framework="paddle", model={"w": np.zeros(2, np.float32)}))
    holder.delete(1)  # the root is empty again, but its writer lock stays held
    try:
        with pytest.raises(ckptcore.errors.LockedError):
            _fit(root, 1, save_freq=4)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the failed fit let go of it
        _fit(root, 1, save_freq=4, lock=False)
        assert _steps(root)[-1] == 36
    finally:
        holder.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_sigterm_saves_the_batch_in_progress_stops_fit_and_resumes_bitwise(tmp_path, workers):
    ref_root, root = str(tmp_path / "ref"), str(tmp_path / "run")
    _, net, opt, _ = _fit(ref_root, 1, save_freq=5, workers=workers)
    model, _, _, ckpt = _fit(root, 1, save_freq=5, workers=workers, callbacks=[_Sigterm(17)])
    assert _steps(root) == [5, 10, 12, 15, 17]  # batch 17 finished, saved, and nothing after it
    assert model.stop_training is False and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    state = ckptcore.load_state(os.path.join(root, f"step-{17:012d}"))
    assert (state.data["epoch"], state.data["position"]) == (1, 5 * BS)
    _, net2, opt2, ckpt2 = _fit(root, 2, save_freq=5, workers=workers)
    assert ckpt2.restored.step == 17
    _equal(snapshot(net2, opt2), snapshot(net, opt))


def test_sigterm_without_a_cursor_stops_without_an_inexact_save(tmp_path, caplog):
    root = str(tmp_path / "nocursor")
    with caplog.at_level(logging.WARNING, logger="ckptcore"):
        model, _, _, _ = _fit(root, 1, use_cursor=False, callbacks=[_Sigterm(17)])
    assert _steps(root) == [12] and "without a save" in caplog.text
    assert model.stop_training is False


def test_preemption_can_be_turned_off(tmp_path):
    ckpt = cp.Checkpoint(str(tmp_path / "off"), save_on_preemption=False)
    assert ckpt.save_on_preemption is False
