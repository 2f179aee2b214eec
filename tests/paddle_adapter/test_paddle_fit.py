"""ResumableBatchSampler with real DataLoaders, and the hapi Checkpoint callback.

A "resume" here restores, in the same process, into a model built from another seed: the callback
restores the RNGs, so only the checkpoint can make the runs agree.
"""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest

paddle = pytest.importorskip("paddle", reason="paddlepaddle is not installed")

import ckptcore  # noqa: E402
import ckptcore_paddle as cp  # noqa: E402
from _models import snapshot  # noqa: E402

N, BS, EPOCHS = 90, 8, 3  # 12 batches an epoch, the last of 2


class _Data(paddle.io.Dataset):
    def __init__(self, n: int = N):
        rs = np.random.RandomState(5)
        self.x, self.y = rs.randn(n, 4).astype("float32"), rs.randint(0, 3, (n, 1)).astype("int64")

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __len__(self):
        return len(self.x)


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)), k


def test_loader_prefetch_and_workers(tmp_path) -> None:
    """A prefetching DataLoader (buffer thread; 2 worker processes) fetches ahead of training; the
    saved position is the batches trained, and resuming from it yields exactly the rest."""
    reference = [b.tolist() for b in ckptcore.DataCursor(N, BS, seed=3).iter_epoch()]
    for workers in (0, 2):
        cursor = ckptcore.DataCursor(N, BS, seed=3)
        sampler = cp.ResumableBatchSampler(cursor)
        loader = paddle.io.DataLoader(_Data(), batch_sampler=sampler, num_workers=workers)
        trained = []
        it = iter(loader)  # kept alive while we look at what it fetched
        for i, (x, y) in enumerate(it):
            trained.append(_rows(loader.dataset, x))
            sampler.advance()
            if i == 4:
                break
        deadline = time.monotonic() + 10  # the loader's thread/workers fetch ahead, in their own time
        while sampler._pass.yielded <= 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sampler._pass.yielded > sampler._pass.advanced == 5, (workers, sampler._pass.yielded)
        saved = cursor.state_dict()
        assert saved["position"] == 5 * BS, saved
        del it, loader
        resumed = ckptcore.DataCursor.from_state(saved)
        sampler2 = cp.ResumableBatchSampler(resumed)
        rest = []
        for x, y in paddle.io.DataLoader(_Data(), batch_sampler=sampler2, num_workers=workers):
            rest.append(_rows(_Data(), x))
            sampler2.advance()
        assert trained + rest == reference, workers
        assert (resumed.epoch, resumed.position) == (1, 0)


def _rows(data: _Data, x) -> list[int]:
    """The dataset indices of a batch, recovered from its features."""
    xs = x.numpy()
    return [int(np.flatnonzero((data.x == row).all(axis=1))[0]) for row in xs]


def _fit(root: str, seed: int, *, accumulate: int = 1, save_freq="epoch", use_cursor: bool = True,
         epochs: int = EPOCHS):
    paddle.seed(seed)
    np.random.seed(seed)
    net = paddle.nn.Linear(4, 3)
    sch = paddle.optimizer.lr.StepDecay(0.1, step_size=4, gamma=0.7)
    opt = paddle.optimizer.Momentum(learning_rate=sch, parameters=net.parameters())
    model = paddle.Model(net)
    model.prepare(opt, paddle.nn.CrossEntropyLoss())
    if use_cursor:
        sampler = cp.ResumableBatchSampler(ckptcore.DataCursor(N, BS, seed=11))
        loader = paddle.io.DataLoader(_Data(), batch_sampler=sampler)
    else:
        sampler = None  # the order comes from numpy's global RNG, which the checkpoint holds
        loader = paddle.io.DataLoader(_Data(), batch_size=BS, shuffle=True)
    ckpt = cp.Checkpoint(root, save_freq=save_freq, cursor=sampler, keep=None)
    model.fit(loader, epochs=epochs, callbacks=[ckpt], verbose=0, accumulate_grad_batches=accumulate)
    return model, net, opt, ckpt


def _steps(root: str) -> list[int]:
    return ckptcore.CheckpointManager(root, lock=False).steps()


def _copy_step(src: str, dst: str, step: int) -> None:
    name = f"step-{step:012d}"
    shutil.copytree(os.path.join(src, name), os.path.join(dst, name))


def test_fit_accumulate_resume(tmp_path) -> None:
    """hapi's accumulate_grad_batches counts windows from the start of each loop pass, so due saves
    wait for a window boundary; a resumed pass then updates on the same batches, including the
    forced update at the end of the epoch (12 batches, windows of 5)."""
    src, dst = os.path.join(tmp_path, "acc_src"), os.path.join(tmp_path, "acc_dst")
    _, net, opt, _ = _fit(src, 1, accumulate=5, save_freq=3)
    final = snapshot(net, opt)
    steps = _steps(src)
    assert all((s % 12) % 5 == 0 or s % 12 == 0 for s in steps), steps
    mid = [s for s in steps if s % 12]
    assert mid and 12 < mid[len(mid) // 2] < 36, steps
    start = [s for s in mid if 12 < s < 24][0]
    _copy_step(src, dst, start)
    model, net2, opt2, ckpt = _fit(dst, 2, accumulate=5, save_freq=3)
    assert ckpt.restored.step == start and ckpt.initial_epoch == 1
    _equal(snapshot(net2, opt2), final)
    assert opt2._learning_rate.last_epoch == opt._learning_rate.last_epoch
    assert model.stop_training is False  # reset after the callback ended hapi's loop early


def test_fit_finished_run_trains_nothing(tmp_path) -> None:
    root = os.path.join(tmp_path, "done")
    _, net, opt, _ = _fit(root, 1, save_freq=4)
    before, steps = snapshot(net, opt), _steps(root)
    assert steps[-1] == EPOCHS * 12, steps
    model, net2, opt2, ckpt = _fit(root, 3, save_freq=4)
    assert ckpt.initial_epoch == EPOCHS and _steps(root) == steps
    _equal(snapshot(net2, opt2), before)
    assert model.stop_training is False


def test_fit_epoch_checkpoints_without_cursor(tmp_path) -> None:
    """Without a cursor only epoch ends are exact: DataLoader(shuffle=True) draws each epoch's order
    from numpy's global RNG when the epoch starts, and the checkpoint restores that RNG."""
    src, dst = os.path.join(tmp_path, "ep_src"), os.path.join(tmp_path, "ep_dst")
    _, net, opt, _ = _fit(src, 1, use_cursor=False)
    assert _steps(src) == [12, 24, 36]
    _copy_step(src, dst, 12)
    _, net2, opt2, ckpt = _fit(dst, 2, use_cursor=False)
    assert ckpt.initial_epoch == 1
    _equal(snapshot(net2, opt2), snapshot(net, opt))
    with pytest.raises(ValueError, match="cursor"):
        cp.Checkpoint(dst, save_freq=5)
    with pytest.raises(ValueError, match="already completed"):
        _fit(dst, 2, use_cursor=False, epochs=2)  # the checkpoint has 3 epochs already


def test_checkpoint_defaults_and_persisted_progress(tmp_path):
    """The callback keeps ckptcore.adapter.CALLBACK_KEEP checkpoints unless told, and records its
    progress under extra["paddle"]["fit"]."""
    from ckptcore.adapter import CALLBACK_KEEP
    assert cp.Checkpoint(str(tmp_path / "k")).keep == CALLBACK_KEEP
    root = str(tmp_path / "fit")
    _fit(root, 1, save_freq=4)
    state = ckptcore.load_state(os.path.join(root, f"step-{_steps(root)[-1]:012d}"))
    assert state.extra["paddle"]["fit"] == {"batches": EPOCHS * 12, "epoch": EPOCHS}


def test_two_samplers_over_one_cursor_is_a_value_error(tmp_path):
    cursor = ckptcore.DataCursor(N, BS, seed=3)
    a, b = cp.ResumableBatchSampler(cursor), cp.ResumableBatchSampler(cursor)
    next(iter(a)), next(iter(b))
    ckpt = cp.Checkpoint(str(tmp_path), cursor=cursor)
    with pytest.raises(ValueError, match="2 ResumableBatchSamplers"):
        ckpt._advance()


class _EpochLogs(paddle.callbacks.Callback):
    """What the callbacks after ckptcore's see at each epoch's end."""

    def __init__(self):
        super().__init__()
        self.epochs: list[dict] = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs or {}))


def test_epoch_logs_carry_the_last_saves_figures(tmp_path):
    paddle.seed(1)
    net = paddle.nn.Linear(4, 3)
    model = paddle.Model(net)
    model.prepare(paddle.optimizer.SGD(0.1, parameters=net.parameters()),
                  paddle.nn.CrossEntropyLoss())
    sampler = cp.ResumableBatchSampler(ckptcore.DataCursor(N, BS, seed=11))
    loader = paddle.io.DataLoader(_Data(), batch_sampler=sampler)
    root, after, seen = str(tmp_path / "run"), _EpochLogs(), []
    with ckptcore.on_event(seen.append):
        model.fit(loader, epochs=2, verbose=0, callbacks=[
            cp.Checkpoint(root, save_freq=4, cursor=sampler, keep=None), after])
    saves = {e.step: e for e in seen if e.kind == "save"}
    assert sorted(saves) == [4, 8, 12, 16, 20, 24]
    # A due save is written as the next batch starts: epoch 0 ends with step 8 its last one.
    first, second = after.epochs
    assert first["ckpt_save_seconds"] == saves[8].seconds_total
    assert first["ckpt_bytes"] == saves[8].bytes > 0
    assert second["ckpt_blocked_seconds"] == saves[20].seconds_blocked
    metrics = ckptcore.load_state(os.path.join(root, f"step-{24:012d}")).metadata["metrics"]
    assert "loss" in metrics and not [k for k in metrics if k.startswith("ckpt_")]
