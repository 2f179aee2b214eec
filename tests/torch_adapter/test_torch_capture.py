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
from _torch_models import (OPTIMIZERS, SCHEDULERS, X, Y, Reordered, assert_same, make_optimizer,  # noqa: E402
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
    assert "params" not in state.optimizer.hyperparams
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
    with pytest.raises(CaptureError, match="lazy"):
        ckptcore_torch.capture(torch.nn.LazyLinear(2))
    with pytest.raises(RestoreError, match="meta device"):
        ckptcore_torch.restore(ckptcore_torch.capture(torch.nn.Linear(2, 2)), torch.nn.Linear(2, 2, device="meta"))
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
    with pytest.raises(RestoreError, match="holds Adam state but the optimizer given is a AdamW"):
        ckptcore_torch.restore(state, fresh, make_optimizer("adamw", fresh))
    one_group = torch.optim.Adam(fresh.parameters())
    with pytest.raises(RestoreError, match="2 parameter groups"):
        ckptcore_torch.restore(state, fresh, one_group)


class _Block(torch.nn.Module):
    """A CNN with a depthwise conv, a skip connection and every normalisation torch has."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.dw = torch.nn.Conv2d(4, 8, 3, groups=4, padding=1)
        self.gn = torch.nn.GroupNorm(2, 8)
        self.skip = torch.nn.Conv2d(3, 8, 1)
        self.pool = torch.nn.AdaptiveAvgPool2d(2)
        self.fc = torch.nn.Linear(32, 5)
        self.ln = torch.nn.LayerNorm(5)
        self.up = torch.nn.ConvTranspose2d(8, 2, 2)

    def forward(self, x):
        h = self.gn(self.dw(torch.relu(self.bn(self.conv(x))))) + self.skip(x)
        return self.ln(self.fc(torch.flatten(self.pool(h), 1))) + self.up(h).mean()


class _Seq(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 6)
        self.lstm = torch.nn.LSTM(6, 4, num_layers=2, bidirectional=True, batch_first=True)
        self.gru = torch.nn.GRU(8, 3, batch_first=True)
        self.mha = torch.nn.MultiheadAttention(3, 1, batch_first=True)

    def forward(self, tokens):
        h, _ = self.lstm(self.emb(tokens))
        h, _ = self.gru(h)
        return self.mha(h, h, h)[0]


def _info(state, name):
    p = state.params[name]
    return p.kind, p.role, p.layout


def test_param_info_kinds_roles_layouts_and_structure():
    block = _Block()
    rng = torch.get_rng_state()
    state = ckptcore_torch.capture(block, rng=False)
    assert torch.equal(rng, torch.get_rng_state())  # the structure probe draws nothing
    assert block.training  # and leaves the mode as it was
    assert set(state.params) == set(state.model)
    assert _info(state, "conv.weight") == ("conv2d", "kernel", "oihw")
    assert _info(state, "conv.bias") == ("conv2d", "bias", "o")
    assert _info(state, "bn.weight")[:2] == ("batch_norm", "gamma")
    assert _info(state, "bn.running_var")[:2] == ("batch_norm", "moving_variance")
    assert _info(state, "dw.weight") == ("depthwise_conv2d", "kernel", "oihw")
    assert state.params["dw.weight"].attrs["depth_multiplier"] == 2
    assert _info(state, "gn.weight")[:2] == ("group_norm", "gamma")
    assert _info(state, "ln.bias")[:2] == ("layer_norm", "beta")
    assert _info(state, "fc.weight") == ("dense", "kernel", "oi")
    assert _info(state, "up.weight") == ("conv2d_transpose", "kernel", "iohw")
    fc = state.params["fc.weight"].attrs
    assert fc["inputs"] == ["gn", "skip"] and fc["input_shape"] == [8, 2, 2]
    assert state.params["skip.weight"].attrs["inputs"] == []
    assert state.params["ln.weight"].attrs["order"] > fc["order"] > state.params["gn.bias"].attrs["order"]

    seq = ckptcore_torch.capture(_Seq(), rng=False)
    assert _info(seq, "emb.weight") == ("embedding", "embeddings", "vd")
    assert _info(seq, "lstm.weight_hh_l1_reverse") == ("lstm", "recurrent_kernel", "ifco")
    attrs = seq.params["lstm.weight_hh_l1_reverse"].attrs
    assert (attrs["layer_index"], attrs["direction"], attrs["axes"]) == (1, "reverse", "oi")
    assert _info(seq, "gru.bias_ih_l0") == ("gru", "bias", "rzc")
    assert _info(seq, "mha.in_proj_weight") == ("multi_head_attention", "kernel", "oi")
    assert seq.params["mha.in_proj_weight"].attrs["projection"] == "qkv"
    assert seq.params["mha.out_proj.weight"].attrs["projection"] == "attention_output"
    assert seq.params["mha.in_proj_weight"].attrs["inputs"] == ["gru"]
    assert seq.params["gru.weight_ih_l0"].attrs["inputs"] == ["lstm"]


def test_dtypes_round_trip_bitwise(tmp_path):
    """bfloat16, float16, complex, bool and integer buffers, through a real directory."""
    def build():
        m = torch.nn.Linear(3, 2).to(torch.bfloat16)
        m.register_buffer("f16", torch.randn(4).half())
        m.register_buffer("cplx", torch.randn(2, dtype=torch.complex64))
        m.register_buffer("mask", torch.rand(5) > 0.5)
        m.register_buffer("ids", torch.randint(-9, 9, (3,), dtype=torch.int32))
        return m
    torch.manual_seed(0)
    m = build()
    url = str(tmp_path / "ckpt")
    ckptcore.save_state(url, model=m)
    torch.manual_seed(1)
    m2 = build()
    state = ckptcore.load_state(url, model=m2)
    assert state.model["weight"].dtype.name == "bfloat16"
    for k, v in m.state_dict().items():
        w = m2.state_dict()[k]
        assert v.dtype == w.dtype and v.view(torch.uint8).numpy().tobytes() == w.view(torch.uint8).numpy().tobytes(), k


def test_copy_false_views_follow_training():
    m = mlp(0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    train(m, opt, 1)
    state = ckptcore_torch.capture(m, opt, copy=False)
    train(m, opt, 1)
    assert state.model["0.weight"].tobytes() == m[0].weight.detach().numpy().tobytes()


def test_unapplied_parts_warn_and_lambdas_stay_live(tmp_path):
    m = mlp(0)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5 ** e)
    train(m, opt, 2, sched)
    state = ckptcore_torch.capture(m, opt, scheduler=sched)
    assert state.schedule.state["lr_lambdas"] == [None]  # code is not state
    other = mlp(1)
    with pytest.warns(ckptcore.errors.UnappliedStateWarning, match="schedule"):
        ckptcore_torch.restore(state, other, torch.optim.SGD(other.parameters(), lr=0.1))
    m2 = mlp(1)
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    live = lambda e: 0.5 ** e  # noqa: E731
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, live)
    ckptcore_torch.restore(state, m2, opt2, scheduler=sched2)
    assert sched2.lr_lambdas == [live] and sched2.last_epoch == 2 and sched2.get_last_lr() == sched.get_last_lr()


def test_wrapped_either_way():
    """Names without wrapper components: a compiled model (never called: only its names matter),
    a DataParallel inside a Sequential, and a plain model restore into each other."""
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    inner = torch.nn.Sequential(torch.nn.DataParallel(torch.nn.Linear(3, 2)), torch.nn.BatchNorm1d(2))
    assert "0.module.weight" in inner.state_dict()
    state = ckptcore_torch.capture(plain)
    assert list(ckptcore_torch.capture(inner).model) == list(state.model) == list(plain.state_dict())
    ckptcore_torch.restore(state, inner)
    compiled = torch.compile(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2)))
    assert next(iter(compiled.state_dict())).startswith("_orig_mod.")
    ckptcore_torch.restore(ckptcore_torch.capture(inner), compiled)
    back = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    ckptcore_torch.restore(ckptcore_torch.capture(compiled), back)
    for k, v in plain.state_dict().items():
        assert v.numpy().tobytes() == back.state_dict()[k].numpy().tobytes(), k


def test_checkpoint_manager_with_every_object(tmp_path):
    """CheckpointManager.save/restore dispatch to the torch adapter with scheduler=, scaler= and
    cursor=; the newest step comes back into fresh objects, which then train on identically."""
    def build(seed):
        m = mlp(seed)
        opt = make_optimizer("adamw", m)
        return {"model": m, "optimizer": opt, "scheduler": SCHEDULERS["OneCycleLR"](opt),
                "scaler": torch.amp.GradScaler("cpu", init_scale=256.0), "cursor": ckptcore.DataCursor(8, 4, seed=1)}

    def steps(objs, n):
        for _ in range(n):
            idx = torch.from_numpy(np.asarray(objs["cursor"].next_batch(), dtype=np.int64))
            loss = torch.nn.functional.cross_entropy(objs["model"](X[idx]), Y[idx])
            objs["scaler"].scale(loss).backward()
            objs["scaler"].step(objs["optimizer"])
            objs["scaler"].update()
            objs["optimizer"].zero_grad()
            objs["scheduler"].step()

    fresh = build(1)
    objs = build(0)
    mgr = ckptcore.CheckpointManager(str(tmp_path / "run"))
    for step in (2, 4):
        steps(objs, 2)
        mgr.save(step, **objs)
    steps(objs, 3)
    assert mgr.restore(**fresh).step == 4
    steps(fresh, 3)
    assert_same(model_arrays(objs["model"]), model_arrays(fresh["model"]), "weights")
    assert_same(optimizer_arrays(objs["optimizer"]), optimizer_arrays(fresh["optimizer"]), "optimizer")
    assert fresh["scaler"].state_dict() == objs["scaler"].state_dict()
    assert fresh["cursor"].state_dict() == objs["cursor"].state_dict()
    mgr.close()
