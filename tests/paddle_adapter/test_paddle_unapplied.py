"""Restores that leave saved training state unapplied warn (UnappliedStateWarning, one wording with
the fix), never silently: a data position without a cursor, an optimizer without an optimizer, a
schedule without a scheduler; and a state saved without an optimizer restored into one."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

paddle = pytest.importorskip("paddle", reason="paddlepaddle is not installed")

import ckptcore  # noqa: E402
import ckptcore_paddle as cp  # noqa: E402
from ckptcore.errors import UnappliedStateWarning  # noqa: E402


def _make(seed: int = 0, *, schedule: bool = True):
    paddle.seed(seed)
    net = paddle.nn.Linear(4, 3)
    lr = paddle.optimizer.lr.StepDecay(0.1, step_size=2) if schedule else 0.1
    opt = paddle.optimizer.Adam(learning_rate=lr, parameters=net.parameters())
    loss = net(paddle.ones([2, 4])).sum()
    loss.backward()
    opt.step()
    opt.clear_grad()
    if schedule:
        lr.step()
    return net, opt


def _cursor():
    c = ckptcore.DataCursor(20, 4, seed=1)
    c.next_batch()
    return c


def _no_warnings(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnappliedStateWarning)
        return fn()


def test_each_part_left_out_is_named_with_its_fix():
    net, opt = _make()
    state = cp.capture(net, opt, cursor=_cursor())
    with pytest.warns(UnappliedStateWarning) as got:
        cp.restore(state, paddle.nn.Linear(4, 3))
    assert len(got) == 1  # one warning listing every part
    text = str(got[0].message)
    for part in ("optimizer (pass optimizer=", "schedule (pass scheduler=", "data (pass cursor="):
        assert part in text, text
    assert got[0].filename == __file__  # points at the caller's line
    # Everything given: silent.
    net2, opt2 = _make(1)
    _no_warnings(lambda: cp.restore(state, net2, opt2, cursor=ckptcore.DataCursor(20, 4, seed=1)))


def test_a_schedule_without_a_scheduler_warns():
    net, opt = _make()
    state = cp.capture(net, opt)
    net2, opt2 = _make(1, schedule=False)  # a float learning rate: nothing to put the schedule in
    with pytest.warns(UnappliedStateWarning, match=r"schedule \(pass scheduler=") as got:
        cp.restore(state, net2, opt2)
    assert "optimizer (" not in str(got[0].message) and "data (" not in str(got[0].message)


def test_a_state_without_an_optimizer_leaves_the_target_optimizer_alone_and_warns():
    net, _ = _make()
    state = cp.capture(net)  # saved without its optimizer
    net2, opt2 = _make(1)
    before = {k: v.numpy().copy() for k, v in opt2.state_dict().items() if hasattr(v, "numpy")}
    with pytest.warns(UnappliedStateWarning, match="holds no optimizer slots"):
        report = cp.restore(state, net2, opt2)  # not a RestoreError: there is nothing to mismatch
    assert report.ok
    after = {k: v.numpy() for k, v in opt2.state_dict().items() if hasattr(v, "numpy")}
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
    assert opt2._learning_rate.last_epoch == 1
    with pytest.warns(UnappliedStateWarning):
        report = cp.restore(state, net2, opt2, strict=False)
    assert report.missing == ("optimizer",)


def test_the_manager_path_warns_about_the_optimizer_and_keys_opt_out(tmp_path):
    net, opt = _make()
    with ckptcore.CheckpointManager(str(tmp_path / "run"), save_on_preemption=False) as mgr:
        mgr.save(1, model=net, optimizer=opt)
        with pytest.warns(UnappliedStateWarning, match=r"optimizer \(pass optimizer=.*schedule"):
            mgr.restore(model=paddle.nn.Linear(4, 3))
        _no_warnings(lambda: mgr.restore(model=paddle.nn.Linear(4, 3), keys=["model"]))
        # load_state the same way.
        url = mgr.step_url(1)
    with pytest.warns(UnappliedStateWarning, match="optimizer"):
        ckptcore.load_state(url, model=paddle.nn.Linear(4, 3))


def test_the_callback_restore_never_warns(tmp_path):
    """hapi's Checkpoint restores everything it saved: no warning on a resume."""
    class Data(paddle.io.Dataset):
        def __getitem__(self, i):
            return np.full(4, i, "float32"), np.array([i % 3], "int64")

        def __len__(self):
            return 16

    def fit():
        paddle.seed(0)
        net = paddle.nn.Linear(4, 3)
        sch = paddle.optimizer.lr.StepDecay(0.1, step_size=2)
        model = paddle.Model(net)
        model.prepare(paddle.optimizer.Adam(learning_rate=sch, parameters=net.parameters()),
                      paddle.nn.CrossEntropyLoss())
        loader = cp.DataLoader(Data(), ckptcore.DataCursor(16, 4, seed=2))
        model.fit(loader, epochs=2, verbose=0,
                  callbacks=[cp.Checkpoint(str(tmp_path / "fit"), save_freq=3, cursor=loader)])

    fit()
    _no_warnings(fit)
