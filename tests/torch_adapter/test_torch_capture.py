"""ckptcore_torch.capture/restore: the state layout, and bitwise resumes through real directories.

The resume tests train N steps, save through ``ckptcore.save_state`` into a real directory, keep
training M more steps (the uninterrupted run), then load into fresh objects built from another
seed (after scrambling the global RNG) and train the same M steps: every weight, every optimizer
slot and every group's lr must equal the uninterrupted run's bit for bit.  Once per built-in
optimizer (on a model with BatchNorm, Dropout, an Embedding, an LSTM and a tied weight, two
param groups) and once per built-in LR scheduler.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ckptcore  # noqa: E402
import ckptcore_torch  # noqa: E402
from ckptcore.errors import CaptureError, RestoreError  # noqa: E402
from _torch_models import (OPTIMIZERS, SCHEDULERS, Mixed, Reordered, assert_same, make_optimizer,  # noqa: E402
                           mixed, mlp, model_arrays, optimizer_arrays, train)


def _resume(tmp_path, build, steps=(3, 3), tokens=False, rebuild=None):
    """(uninterrupted, resumed) snapshots: ``build(seed) -> (model, opt, sched)``."""
    url = str(tmp_path / "ckpt")
    m, o, s = build(0)
    torch.manual_seed(123)
    train(m, o, steps[0], s, tokens)
    ckptcore.save_state(url, model=m, optimizer=o, scheduler=s)
    train(m, o, steps[1], s, tokens)
    expected = (model_arrays(m), optimizer_arrays(o))
    m2, o2, s2 = (rebuild or build)(1)
    torch.manual_seed(999)
    state = ckptcore.load_state(url, model=m2, optimizer=o2, scheduler=s2)
    train(m2, o2, steps[1], s2, tokens)
    assert_same(expected[0], model_arrays(m2), "weights")
    assert_same(expected[1], optimizer_arrays(o2), "optimizer")
    if s is not None:
        assert s.get_last_lr() == s2.get_last_lr()
        assert getattr(s, "last_epoch", None) == getattr(s2, "last_epoch", None)
    return state


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_resumes_bitwise(tmp_path, name):
    def build(seed):
        m = mixed(seed)
        return m, make_optimizer(name, m), None
    state = _resume(tmp_path, build, tokens=True)
    assert state.optimizer.kind == OPTIMIZERS[name](mlp().parameters()).__class__.__name__.lower()
    assert len(state.optimizer.extra["param_groups"]) == 2


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_every_scheduler_resumes_bitwise(tmp_path, name):
    def build(seed):
        m = mlp(seed)
        opt = make_optimizer("sgd" if name == "CyclicLR" else "adam", m)
        return m, opt, SCHEDULERS[name](opt)
    state = _resume(tmp_path, build)
    assert state.schedule.kind == name and state.schedule.step == 3


def test_reordered_parameters_and_wrappers_restore(tmp_path):
    """Optimizer state re-keyed by name: a model registering its parameters in another order,
    wrapped in DataParallel, restores a state saved from the plain model."""
    def build(seed):
        m = mixed(seed)
        return m, make_optimizer("adam", m), None

    def rebuild(seed):
        m = mixed(seed, Reordered)
        wrapped = torch.nn.DataParallel(m)
        opt = torch.optim.Adam([{"params": [p for n, p in m.named_parameters() if not n.startswith("head.")]},
                                {"params": list(m.head.parameters()), "lr": 0.003, "weight_decay": 0.01}],
                               lr=0.01)
        return wrapped, opt, None
    url = str(tmp_path / "ckpt")
    m, o, _ = build(0)
    train(m, o, 2, tokens=True)
    ckptcore.save_state(url, model=m, optimizer=o)
    wrapped, o2, _ = rebuild(1)
    ckptcore.load_state(url, model=wrapped, optimizer=o2)
    got = model_arrays(wrapped.module)
    exp = model_arrays(m)
    assert_same(exp, {k: got[k] for k in exp}, "weights")
    # By name, not by position: the same slots under the same parameter.
    by_name = {n: p for n, p in m.named_parameters()}
    by_name2 = {n: p for n, p in wrapped.module.named_parameters()}
    for n in by_name:
        for k, v in o.state[by_name[n]].items():
            assert o2.state[by_name2[n]][k].numpy().tobytes() == v.numpy().tobytes(), (n, k)
    assert [g["lr"] for g in o2.param_groups] == [g["lr"] for g in o.param_groups]
    assert [g["weight_decay"] for g in o2.param_groups] == [0, 0.01]


def test_layout(tmp_path):
    m = mixed(0)
    opt = make_optimizer("adam", m)
    train(m, opt, 2, tokens=True)
    state = ckptcore_torch.capture(torch.nn.DataParallel(m), opt)
    assert state.framework == "torch"
    assert "emb.weight" in state.model and "out.weight" not in state.model
    assert state.extra["torch"]["aliases"] == {"out.weight": "emb.weight"}
    assert state.model["bn.num_batches_tracked"].dtype == np.int64
    assert state.optimizer.kind == "adam" and state.optimizer.step == 2
    assert state.optimizer.extra["step_source"] == "slots"
    assert set(state.optimizer.slots["fc.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    step = state.optimizer.slots["fc.weight"]["step"]
    assert step.shape == () and step.dtype == np.float32 and float(step) == 2.0
    assert state.optimizer.hyperparams["lr"] == 0.01 and state.optimizer.hyperparams["betas"] == [0.9, 0.999]
    assert state.optimizer.extra["param_groups"][1]["params"] == ["head.weight", "head.bias"]
    assert state.rng["torch"].dtype == np.uint8 and {"python", "numpy"} <= set(state.rng)
    assert set(state.params) == set(state.model)
    compiled = torch.compile(m)  # never called: only its state_dict names matter here
    assert list(ckptcore_torch.capture(compiled).model) == list(state.model)


def test_unsupported_optimizers_are_capture_errors():
    m = mlp()
    with pytest.raises(CaptureError, match="LBFGS"):
        ckptcore_torch.capture(m, torch.optim.LBFGS(m.parameters()))

    class Custom(torch.optim.SGD):
        def step(self, closure=None):
            super().step(closure)
            for p in self.param_groups[0]["params"]:
                self.state[p]["ema"] = p.detach().clone()

    opt = Custom(m.parameters(), lr=0.1, momentum=0.9)
    train(m, opt, 1)
    with pytest.raises(CaptureError, match=r"Custom keeps optimizer state \['ema'\]"):
        ckptcore_torch.capture(m, opt)
    other = torch.nn.Linear(2, 2)
    with pytest.raises(CaptureError, match="not part of the model"):
        ckptcore_torch.capture(m, torch.optim.SGD(other.parameters(), lr=0.1))


def test_gradients_in_flight_none_and_zero(tmp_path):
    """Mid-accumulation gradients restore bit for bit; None and zeros stay apart."""
    m = mlp(0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    train(m, opt, 1)
    torch.nn.functional.cross_entropy(m(torch.ones(2, 6)), torch.tensor([0, 1])).backward()
    m[3].bias.grad = torch.zeros(3)   # zeros: weight decay and momentum still apply
    m[0].bias.grad = None             # None: the optimizer skips it
    state = ckptcore_torch.capture(m, opt, accumulate_every=4, accumulated=1)
    assert state.accumulation.every == 4 and state.accumulation.count == 1
    assert set(state.accumulation.buffers) == {"0.weight", "3.weight"}
    assert state.extra["torch"]["zero_grads"] == ["3.bias"]
    url = str(tmp_path / "ckpt")
    ckptcore.save_state(url, state)
    m2 = mlp(1)
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    train(m2, opt2, 1)
    m2[0].bias.grad = torch.ones(8)
    ckptcore_torch.restore(ckptcore.load_state(url), m2, opt2)
    assert m2[0].bias.grad is None and m2[3].bias.grad is not None and not m2[3].bias.grad.any()
    assert m2[0].weight.grad.numpy().tobytes() == m[0].weight.grad.numpy().tobytes()
    opt.step()
    opt2.step()
    assert_same(model_arrays(m), model_arrays(m2), "after the accumulated step")


def test_grad_scaler_round_trip(tmp_path):
    m = mlp(0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    assert scaler.is_enabled()
    for _ in range(3):
        scaler.scale(torch.nn.functional.cross_entropy(m(torch.ones(2, 6)), torch.tensor([0, 1]))).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    url = str(tmp_path / "ckpt")
    ckptcore.save_state(url, model=m, optimizer=opt, scaler=scaler)
    fresh = torch.amp.GradScaler("cpu")
    m2 = mlp(1)
    ckptcore.load_state(url, model=m2, optimizer=torch.optim.SGD(m2.parameters(), lr=0.1), scaler=fresh)
    assert fresh.state_dict() == scaler.state_dict()


def test_refusals_change_nothing():
    m = mixed(0)
    opt = make_optimizer("adam", m)
    train(m, opt, 1, tokens=True)
    state = ckptcore_torch.capture(m, opt)
    small = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(RestoreError, match="fc.weight"):
        ckptcore_torch.restore(state, small)
    fresh = mixed(1)
    before = model_arrays(fresh)
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(fresh.parameters(), lr=0.1), 2)
    state.schedule = ckptcore_torch.capture(m, opt, scheduler=torch.optim.lr_scheduler.ExponentialLR(
        opt, 0.9)).schedule
    with pytest.raises(RestoreError, match="ExponentialLR schedule but the scheduler given is a StepLR"):
        ckptcore_torch.restore(state, fresh, make_optimizer("adam", fresh), scheduler=sched)
    assert_same(before, model_arrays(fresh), "a refused restore")
    one_group = torch.optim.Adam(fresh.parameters())
    with pytest.raises(RestoreError, match="2 parameter groups"):
        ckptcore_torch.restore(state, fresh, one_group)
