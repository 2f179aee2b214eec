"""Single-process Paddle behaviours: DataParallel names, strict mode and reports, typed mismatch
errors, GradScaler, hapi Model, ParamInfo, step counting, optimizer lifecycle, cursor, RNG, the
keyword objects the adapter takes, and two DataParallel processes over gloo."""

from __future__ import annotations

import os
import pickle
import random

import numpy as np
import pytest

paddle = pytest.importorskip("paddle", reason="paddlepaddle is not installed")

import ckptcore_paddle as cp  # noqa: E402
from _models import Mnist, Tiny, Zoo, make, snapshot, train_step  # noqa: E402
from ckptcore.errors import RestoreError, UnappliedStateWarning  # noqa: E402

X = np.random.RandomState(0).randn(6, 4).astype("float32")


@pytest.fixture(autouse=True)
def _seeded():
    paddle.seed(0)


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k].view(np.uint8), b[k].view(np.uint8)), k


def _raises(fn, *needles: str, error: type[Exception] = RestoreError) -> str:
    with pytest.raises(error) as info:
        fn()
    for n in needles:
        assert n in str(info.value)
    return str(info.value)


def _trained(opt_name: str = "adam", sch_name: str = "StepDecay", model=None):
    model, opt, sch = make(opt_name, sch_name, model=model)
    for _ in range(2):
        train_step(model, opt, sch, X)
    return model, opt, sch


def test_dataparallel_names(tmp_path) -> None:
    net = Tiny()
    dp = paddle.DataParallel(net)
    opt = paddle.optimizer.Adam(0.01, parameters=dp.parameters())
    train_step(dp, opt, None, X)
    plain, wrapped = cp.capture(net, opt, rng=False), cp.capture(dp, opt, rng=False)
    assert list(plain.model) == list(wrapped.model) and not any("_layers" in k for k in plain.model)
    assert plain.params == wrapped.params and wrapped.optimizer.slots.keys() == plain.optimizer.slots.keys()
    into_plain, into_dp = Tiny(), paddle.DataParallel(Tiny())
    assert cp.restore(wrapped, into_plain).ok and cp.restore(plain, into_dp).ok
    expected = {k: v.numpy() for k, v in net.state_dict().items()}
    _equal({k: v.numpy() for k, v in into_plain.state_dict().items()}, expected)
    _equal({k: v.numpy() for k, v in into_dp.state_dict().items()}, expected)


def test_strict_and_report(tmp_path) -> None:
    src, opt, _ = _trained()
    state = cp.capture(src, opt, rng=False)
    state.model["ghost.weight"] = np.zeros((2, 2), "float32")
    dst = Tiny(extra=True)
    before = {k: v.numpy() for k, v in dst.state_dict().items()}
    _raises(lambda: cp.restore(state, dst), "extra.weight", "extra.bias", "ghost.weight", "strict=False")
    _equal({k: v.numpy() for k, v in dst.state_dict().items()}, before)  # nothing assigned
    with pytest.warns(UnappliedStateWarning, match=r"optimizer \(pass optimizer="):
        report = cp.restore(state, dst, strict=False)  # no optimizer target: named, not a mismatch
    assert report.missing == ("extra.weight", "extra.bias") and report.unexpected == ("ghost.weight", "optimizer")
    assert np.array_equal(dst.fc1.weight.numpy(), state.model["fc1.weight"])
    # Adam slots into a Momentum optimizer: names on both sides, reported per parameter and slot.
    del state.model["ghost.weight"]
    target = Tiny()
    mom = paddle.optimizer.Momentum(0.1, parameters=target.parameters())
    _raises(lambda: cp.restore(state, target, mom), "optimizer/fc1.weight/moment1")
    report = cp.restore(state, target, mom, strict=False)
    assert "optimizer/fc1.weight/velocity" in report.missing, report
    assert "optimizer/fc1.weight/moment1" in report.unexpected, report


def test_mismatch_errors(tmp_path) -> None:
    src, opt, sch = _trained()
    dst, dst_opt, dst_sch = make("adam", "StepDecay", model=Tiny())
    before = {k: v.numpy() for k, v in dst.state_dict().items()}

    def variant(edit):
        state = cp.capture(src, opt, rng=False)
        edit(state)
        return state

    for strict in (True, False):
        shape = variant(lambda s: s.model.__setitem__("fc1.weight", np.zeros((5, 8), "float32")))
        _raises(lambda: cp.restore(shape, dst, dst_opt, strict=strict), "fc1.weight", "[5, 8]", "[4, 8]")
        dtype = variant(lambda s: s.model.__setitem__("fc1.bias", s.model["fc1.bias"].astype("float64")))
        _raises(lambda: cp.restore(dtype, dst, dst_opt, strict=strict), "fc1.bias", "float64")
        slot = variant(lambda s: s.optimizer.slots["fc2.weight"].__setitem__("moment1", np.zeros((1, 1), "float32")))
        _raises(lambda: cp.restore(slot, dst, dst_opt, strict=strict), "optimizer/fc2.weight/moment1")
    _equal({k: v.numpy() for k, v in dst.state_dict().items()}, before)
    keras = variant(lambda s: setattr(s, "framework", "keras"))
    # Another framework's state is converted first (ckptcore.migrate); this one cannot be.
    from ckptcore.errors import MigrationError
    _raises(lambda: cp.restore(keras, dst), "keras", error=MigrationError)
    other = paddle.optimizer.lr.ExponentialDecay(0.1, 0.5)
    _raises(lambda: cp.restore(variant(lambda s: None), dst, scheduler=other), "StepDecay", "ExponentialDecay")


def _forced_scaler(scale: float) -> paddle.amp.GradScaler:
    # GradScaler disables itself on CPU; give it the fields an enabled one has, to test the plumbing.
    s = paddle.amp.GradScaler(init_loss_scaling=scale)
    s._enable, s._use_dynamic_loss_scaling = True, True
    s._scale = paddle.to_tensor(np.array([scale], "float32"))
    s._incr_ratio, s._decr_ratio, s._incr_every_n_steps, s._decr_every_n_nan_or_inf = 2.0, 0.5, 1000, 2
    s._incr_count, s._decr_count = 0, 0
    return s


def test_grad_scaler(tmp_path) -> None:
    src, opt, _ = _trained()
    s1 = _forced_scaler(1024.0)
    s1._incr_count, s1._decr_count = 7, 1
    state = cp.capture(src, opt, scaler=s1, rng=False)
    saved = state.optimizer.extra["grad_scaler"]
    assert saved["incr_count"] == 7 and saved["scale"].tolist() == [1024.0], saved
    dst, dst_opt, _ = make("adam", "StepDecay", model=Tiny())
    s2 = _forced_scaler(1.0)
    assert cp.restore(state, dst, dst_opt, scaler=s2).ok
    a, b = s1.state_dict(), s2.state_dict()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), (a, b)
    off = cp.capture(src, opt, scaler=paddle.amp.GradScaler(), rng=False)
    assert off.optimizer.extra["grad_scaler"] == {"enabled": False}
    assert cp.restore(off, dst, dst_opt, scaler=paddle.amp.GradScaler()).ok  # disabled target: nothing to do
    _raises(lambda: cp.restore(off, dst, dst_opt, scaler=_forced_scaler(8.0)), "grad_scaler")


def test_hapi_model_and_handles(tmp_path) -> None:
    adapter = cp.ADAPTER
    net = Tiny()
    model = paddle.Model(net)
    opt = paddle.optimizer.Adam(0.01, parameters=model.parameters())
    model.prepare(opt, paddle.nn.MSELoss())
    model.train_batch([X], [np.zeros((6, 3), "float32")])
    assert adapter.handles(model) and adapter.handles(net) and adapter.handles(paddle.DataParallel(Tiny()))
    assert not adapter.handles(opt) and not adapter.handles(np.zeros(2)) and not adapter.handles(object())
    state = adapter.capture(model=model)
    assert state.optimizer is not None and "fc1.weight" in state.optimizer.slots
    new_net = Tiny()
    new = paddle.Model(new_net)
    new_opt = paddle.optimizer.Adam(0.01, parameters=new.parameters())
    new.prepare(new_opt, paddle.nn.MSELoss())
    assert adapter.restore(state, model=new).ok
    _equal(snapshot(new_net, new_opt), snapshot(net, opt))


def test_param_info(tmp_path) -> None:
    zoo = Zoo()
    state = cp.capture(zoo, rng=False)
    p, aliases = state.params, state.extra["paddle"]["aliases"]
    assert "lstm.0.cell_fw.weight_ih" in aliases and "lstm.0.cell_fw.weight_ih" not in state.model
    assert set(p) == set(state.model)

    def facts(name):
        return (p[name].kind, p[name].role, p[name].layout)

    assert facts("emb.weight") == ("embedding", "embeddings", "vd")
    assert facts("conv1d.weight") == ("conv1d", "kernel", "oik") and facts("conv1d.bias") == ("conv1d", "bias", "o")
    assert facts("lstm.weight_ih_l0") == ("lstm", "kernel", "ifco")
    assert facts("lstm.weight_hh_l1_reverse") == ("lstm", "recurrent_kernel", "ifco")
    assert p["lstm.weight_hh_l1_reverse"].attrs["layer_index"] == 1
    assert p["lstm.weight_hh_l1_reverse"].attrs["direction"] == "reverse"
    assert facts("lstm.bias_hh_l0") == ("lstm", "recurrent_bias", "ifco")
    assert facts("gru.weight_ih_l0") == ("gru", "kernel", "rzc") and p["gru.weight_ih_l0"].attrs["axes"] == "oi"
    assert facts("ln.weight") == ("layer_norm", "gamma", None) and facts("ln.bias")[1] == "beta"
    assert facts("dw.weight") == ("depthwise_conv2d", "kernel", "oihw")
    assert p["dw.weight"].attrs["groups"] == 3 and p["dw.weight"].attrs["depth_multiplier"] == 2
    assert facts("convt.weight") == ("conv2d_transpose", "kernel", "iohw")
    assert [facts(f"bn.{n}")[1] for n in ("weight", "bias", "_mean", "_variance")] == \
        ["gamma", "beta", "moving_mean", "moving_variance"]
    order = [p[k].index for k in state.model]
    assert order == sorted(order) and len(set(order)) == 8, order
    fresh = Zoo()
    assert cp.restore(state, fresh).ok
    _equal({k: v.numpy() for k, v in fresh.state_dict().items()}, {k: v.numpy() for k, v in zoo.state_dict().items()})
    fc = cp.capture(Mnist(), rng=False).params["fc.weight"]
    assert (fc.kind, fc.layout, fc.attrs["input_shape"], fc.attrs["input_order"]) == \
        ("dense", "io", [4, 2, 2], "channels_first"), fc


def test_step_counting(tmp_path) -> None:
    w = paddle.create_parameter([1], "float32")
    opt = paddle.optimizer.Adam(0.001, parameters=[w])

    class One(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.w = w

    layer = One()
    for _ in range(1200):  # beta1_pow_acc underflows and sticks after about 966 updates
        (w * w).sum().backward()
        opt.step()
        opt.clear_grad()
    state = cp.capture(layer, opt, rng=False)
    assert (state.optimizer.step, state.optimizer.extra["step_source"]) == (1200, "beta_pow_acc"), state.optimizer
    assert float(state.optimizer.slots["w"]["beta1_pow_acc"][0]) < 1e-40
    model, opt, sch = _trained("momentum", "StepDecay")
    assert (cp.capture(model, opt).optimizer.step, cp.capture(model, opt).optimizer.extra["step_source"]) == \
        (2, "scheduler")
    model, opt, sch = _trained("momentum", "constant")
    assert cp.capture(model, opt).optimizer.extra["step_source"] == "none"
    assert cp.capture(model, opt, step=42).optimizer.step == 42


def test_optimizer_lifecycle(tmp_path) -> None:
    # A state captured before the first step restores into an optimizer that already stepped:
    # its accumulators go away, so the next step is the first one again.
    model, opt, sch = make("adam", "constant", model=Tiny())
    state = cp.capture(model, opt, rng=False)
    assert state.optimizer.slots == {}
    other, other_opt, other_sch = _trained("adam", "constant")
    assert cp.restore(state, other, other_opt).ok
    train_step(model, opt, sch, X)
    train_step(other, other_opt, other_sch, X)
    _equal(snapshot(other, other_opt), snapshot(model, opt))
    # Paddle's own set_state_dict before any step parks values in a holder; capture reads them.
    src, src_opt, _ = _trained("rmsprop", "constant")
    holder_opt = paddle.optimizer.RMSProp(0.05, parameters=src.parameters())
    holder_opt.set_state_dict(src_opt.state_dict())
    assert not holder_opt._accumulators and holder_opt._accumulators_holder
    a, b = cp.capture(src, src_opt, rng=False), cp.capture(src, holder_opt, rng=False)
    assert a.optimizer.slots.keys() == b.optimizer.slots.keys()
    for k in a.optimizer.slots:
        _equal(a.optimizer.slots[k], b.optimizer.slots[k])
    # An optimizer built with name= prefixes its accumulators; the slots do not carry it.
    named = Tiny()
    nopt = paddle.optimizer.Adagrad(0.1, parameters=named.parameters(), name="myopt")
    train_step(named, nopt, None, X)
    st = cp.capture(named, nopt, rng=False)
    assert set(st.optimizer.slots["fc1.weight"]) == {"moment"} and st.optimizer.extra["name"] == "myopt"
    again = Tiny()
    again_opt = paddle.optimizer.Adagrad(0.1, parameters=again.parameters(), name="myopt")
    assert cp.restore(st, again, again_opt).ok
    _equal(snapshot(again, again_opt), snapshot(named, nopt))
    # Parameter groups with their own hyperparameters.
    def grouped():
        m = Tiny()
        return m, paddle.optimizer.Adam(0.01, parameters=[
            {"params": [m.fc1.weight, m.fc1.bias], "learning_rate": 0.5, "beta1": 0.8},
            {"params": [p for n, p in m.named_parameters() if not n.startswith("fc1.")]}])
    g1, gopt1 = grouped()
    train_step(g1, gopt1, None, X)
    st = cp.capture(g1, gopt1, rng=False)
    assert st.optimizer.hyperparams["param_groups"][0] == \
        {"params": ["fc1.weight", "fc1.bias"], "learning_rate": 0.5, "beta1": 0.8}, st.optimizer.hyperparams
    g2, gopt2 = grouped()
    assert cp.restore(st, g2, gopt2).ok
    train_step(g1, gopt1, None, X)
    train_step(g2, gopt2, None, X)
    _equal(snapshot(g2, gopt2), snapshot(g1, gopt1))
    # A float learning rate changed with set_lr is restored too.
    m, o, _ = _trained("momentum", "constant")
    o.set_lr(0.0123)
    m2, o2, _ = make("momentum", "constant", model=Tiny())
    cp.restore(cp.capture(m, o), m2, o2)
    assert o2.get_lr() == 0.0123


class _Cursor:
    def __init__(self):
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos, "seed": 5}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def test_cursor_and_plain_values(tmp_path) -> None:
    model, opt, sch = _trained("adam", "ReduceOnPlateau")
    cur = _Cursor()
    cur.pos = 17
    state = cp.capture(model, opt, cursor=cur, scaler=paddle.amp.GradScaler())
    assert state.data == {"pos": 17, "seed": 5}
    fresh = _Cursor()
    m2, o2, s2 = make("adam", "ReduceOnPlateau", model=Tiny())
    cp.restore(state, m2, o2, cursor=fresh)
    assert fresh.pos == 17
    _raises(lambda: cp.restore(cp.capture(model, opt), m2, o2, cursor=_Cursor()), "data")

    def check(value, where):  # what msgpack (and the core's codec) can hold
        if isinstance(value, dict):
            for k, v in value.items():
                assert isinstance(k, str), where
                check(v, f"{where}.{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                check(v, f"{where}[{i}]")
        elif isinstance(value, int) and not isinstance(value, bool):
            assert -(2**63) <= value < 2**64, where
        else:
            assert value is None or type(value) in (bool, float, str, bytes, np.ndarray), (where, type(value))

    for section in ("rng", "data", "metadata", "extra"):
        check(getattr(state, section), section)
    check(state.optimizer.hyperparams, "hyperparams")
    check(state.optimizer.extra, "optimizer.extra")
    check(state.schedule.config, "schedule.config")
    check({k: v.to_dict() for k, v in state.params.items()}, "params")
    assert all(type(v) is np.ndarray for v in state.model.values())


def test_core_save_load(tmp_path) -> None:
    """Through ckptcore.save_state / load_state with keyword objects, if the core provides them."""
    from ckptcore import load_state, save_state
    model, opt, sch = _trained("adamw", "CosineAnnealingWarmRestarts")
    url = os.path.join(tmp_path, "core_ckpt")
    save_state(url, model=model, optimizer=opt)
    m2, o2, s2 = make("adamw", "CosineAnnealingWarmRestarts", model=Tiny())
    load_state(url, model=m2, optimizer=o2)
    _equal(snapshot(m2, o2), snapshot(model, opt))
    assert (s2.T_cur, s2.T_i, s2.last_lr) == (sch.T_cur, sch.T_i, sch.last_lr)


def test_schedule_state(tmp_path) -> None:
    """Scheduler runtime state lives in ScheduleState.state (with what Paddle's state_dict lacks);
    states that kept it in extra["paddle"]["scheduler"] still restore."""
    model, opt, sch = _trained("adamw", "CosineAnnealingWarmRestarts")
    for _ in range(3):
        sch.step()
    state = cp.capture(model, opt, rng=False)
    assert state.schedule.state == {**sch.state_dict(), "T_cur": sch.T_cur, "T_i": sch.T_i}, state.schedule
    assert "scheduler" not in state.extra["paddle"]
    legacy = cp.capture(model, opt, rng=False)
    full = dict(legacy.schedule.state)
    legacy.extra["paddle"]["scheduler"] = {"state": {k: full[k] for k in sch.state_dict()},
                                           "attrs": {"T_cur": full["T_cur"], "T_i": full["T_i"]}}
    legacy.schedule.state = {}
    for saved in (state, legacy):
        m2, o2, s2 = make("adamw", "CosineAnnealingWarmRestarts", model=Tiny())
        assert cp.restore(saved, m2, o2).ok
        assert (s2.T_cur, s2.T_i, s2.last_epoch, s2.last_lr) == (sch.T_cur, sch.T_i, sch.last_epoch, sch.last_lr)
    warm = make("adam", "LinearWarmup", model=Tiny())
    train_step(*warm, X)
    nested = cp.capture(warm[0], warm[1], rng=False).schedule.state
    assert nested["LinearWarmup_LR"] == warm[2].state_dict()["LinearWarmup_LR"], nested


def test_capture_error(tmp_path) -> None:
    from ckptcore.errors import CaptureError
    model, opt, _ = _trained("adam", "constant")
    with pytest.raises(CaptureError, match="not part of the model") as info:
        cp.capture(Tiny(), opt)  # an optimizer over another model's parameters
    assert isinstance(info.value, ValueError)


# ----------------------------------------------------------------------------- the adapter contract


def test_unknown_objects_are_a_type_error_naming_them():
    model, opt, _ = _trained()
    state = cp.capture(model, opt, rng=False)
    with pytest.raises(TypeError, match="sampler"):
        cp.ADAPTER.capture(model=model, optimizer=opt, sampler=object())
    with pytest.raises(TypeError, match="ema, sampler"):
        cp.ADAPTER.restore(state, model=Tiny(), ema=object(), sampler=object())
    with pytest.raises(TypeError, match="sampler"):
        cp.capture(model, opt, sampler=object())
    with pytest.raises(TypeError, match="sampler"):
        cp.restore(state, Tiny(), sampler=object())
    # The contract's own keywords pass through ADAPTER.
    assert cp.ADAPTER.restore(cp.ADAPTER.capture(model=model, optimizer=opt, copy=False, rng=False),
                              model=Tiny(), strict=True, rng=False).ok


def _draws() -> list:
    return [paddle.rand([3]).numpy().tolist(), np.random.rand(3).tolist(), random.random()]


def test_rng_false_captures_and_restores_no_rng():
    model, opt, _ = _trained()
    assert cp.capture(model, opt, rng=False).rng == {}
    state = cp.capture(model, opt)
    assert set(state.rng) >= {"python", "numpy", "paddle"}
    expected = _draws()
    paddle.seed(123)
    np.random.seed(123)
    random.seed(123)
    untouched = _draws()
    paddle.seed(123)
    np.random.seed(123)
    random.seed(123)
    assert cp.restore(state, model, opt, rng=False).ok
    assert _draws() == untouched  # every generator left as it was
    assert cp.restore(state, model, opt).ok
    assert _draws() == expected


def test_report_names_are_qualified():
    model, opt, sch = _trained("adam", "StepDecay")
    state = cp.capture(model, opt, rng=False)  # no cursor: no data
    state.model["ghost.weight"] = np.zeros((2, 2), "float32")
    state.optimizer.slots["ghost.weight"] = {"moment1": np.zeros((2, 2), "float32")}
    state.optimizer.slots["fc1.weight"]["velocity"] = np.zeros((4, 8), "float32")
    del state.optimizer.slots["fc1.bias"]["moment2"]
    state.schedule = None
    dst, dst_opt, _ = make("adam", "StepDecay", model=Tiny(extra=True))
    cursor = type("Cursor", (), {"load_state_dict": lambda self, s: None, "state_dict": lambda self: {}})()
    msg = _raises(lambda: cp.restore(state, dst, dst_opt, cursor=cursor), "the checkpoint does not fit")
    report = cp.restore(state, dst, dst_opt, cursor=cursor, strict=False)
    assert set(report.missing) == {"extra.weight", "extra.bias", "optimizer/fc1.bias/moment2",
                                   "schedule", "data"}, report
    assert set(report.unexpected) == {"ghost.weight", "optimizer/ghost.weight/moment1",
                                      "optimizer/fc1.weight/velocity"}, report
    for name in report.missing + report.unexpected:
        assert name in msg
    # A gradient saved for a parameter whose shape changed is named under accumulation/.
    src, src_opt, _ = _trained("momentum", "constant")
    (src(paddle.to_tensor(X)).square().mean()).backward()
    grads = cp.capture(src, src_opt, rng=False)
    grads.accumulation.buffers["fc1.weight"] = np.zeros((1, 1), "float32")
    _raises(lambda: cp.restore(grads, Tiny(), strict=False), "accumulation/fc1.weight")
    assert cp.restore(cp.capture(src, src_opt, rng=False), Tiny(), None).ok


def test_strict_false_drops_a_parameter_with_its_gradient():
    """A fine-tune loading into a model without the saved one's ``extra`` layer: its gradients
    (set at the save, as mid-step they are) are refused by a strict restore and reported by a
    lenient one, as the parameters are, never an error about a missing parameter."""
    src, opt, _ = _trained(model=Tiny(extra=True))
    (src(paddle.to_tensor(X)).square().mean()).backward()
    state = cp.capture(src, opt, rng=False)
    assert "extra.weight" in state.accumulation.buffers
    _raises(lambda: cp.restore(state, Tiny()), "accumulation/extra.weight", "extra.weight", "strict=False")
    dst = Tiny()
    report = cp.restore(state, dst, strict=False)
    assert {"extra.weight", "extra.bias", "accumulation/extra.weight",
            "accumulation/extra.bias"} <= set(report.unexpected), report
    assert np.array_equal(dst.fc1.weight.numpy(), state.model["fc1.weight"])
    assert np.array_equal(dst.fc1.weight.grad.numpy(), state.accumulation.buffers["fc1.weight"])


def test_two_process_dataparallel_on_cpu(tmp_path, run_python):
    """Paddle's gloo backend: 2 ranks train, capture, and share names with the plain model."""
    run_python("_dataparallel.py", tmp_path, timeout=600)
    states = [pickle.loads((tmp_path / f"dp_rank{r}.pkl").read_bytes()) for r in (0, 1)]
    assert list(states[0].model) == list(states[1].model)
    assert not any("_layers" in k for k in states[0].model)
    for k, v in states[0].model.items():
        if not k.startswith("bn._"):  # DataParallel syncs gradients, not batch-norm statistics
            assert np.array_equal(v, states[1].model[k]), k
    for p, slots in states[0].optimizer.slots.items():
        for s, v in slots.items():
            assert np.array_equal(v, states[1].optimizer.slots[p][s]), (p, s)
    model, opt, _ = make("adam", "constant", model=Tiny())
    report = cp.restore(states[0], model, opt)
    assert (report.missing, report.unexpected) == ((), ())
    for k, v in model.state_dict().items():
        assert np.array_equal(v.numpy(), states[0].model[k]), k
