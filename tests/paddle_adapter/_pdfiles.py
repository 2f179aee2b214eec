"""The Paddle halves of test_paddle_files.py: real ``paddle.save`` files of several models and
optimizers with what Paddle itself reads back, and Paddle's own loader on files we export."""

from __future__ import annotations

import os
import pickle

import numpy as np
import paddle

import ckptcore_paddle as cp
from _models import OPTIMIZERS, SCHEDULERS, Mnist, Tiny, Zoo, make, snapshot, train_step
from _roundtrip import batches


def save_files(d: str) -> dict[str, dict]:
    """Real ``paddle.save`` files of several models/optimizers, with what Paddle itself reads back."""
    os.makedirs(d, exist_ok=True)
    ref: dict[str, dict] = {}
    cases = {
        "mlp_adam_warmup": (lambda: Tiny(), "adam", "LinearWarmup", {}),
        "cnn_momentum_poly": (Mnist, "momentum", "PolynomialDecay", {}),
        "zoo_rmsprop": (Zoo, "rmsprop", "constant", {}),
        "mlp_adagrad_named": (lambda: Tiny(), None, "constant", {}),
        "mlp_adamw_second_cawr": (lambda: Tiny(), "adamw", "CosineAnnealingWarmRestarts", {"second": True}),
        "mlp_momentum_protocol2": (lambda: Tiny(), "momentum", "StepDecay", {"protocol": 2}),
    }
    for case, (build, o, s, opts) in cases.items():
        paddle.seed(7)
        model = build()
        sch = SCHEDULERS[s]()
        lr = sch if sch is not None else 0.05
        if o is None:
            opt = paddle.optimizer.Adagrad(lr, parameters=model.parameters(), name="myopt")
        else:
            if opts.get("second"):  # accumulator keys of this second optimizer end in _1
                OPTIMIZERS[o](0.1, model.parameters())._create_accumulators(
                    paddle.static.default_main_program().global_block(), list(model.parameters()))
            opt = OPTIMIZERS[o](lr, model.parameters())
        for i in range(5):
            _zoo_or_plain_step(model, opt, sch, i)
        prefix = os.path.join(d, case)
        protocol = opts.get("protocol", 4)
        paddle.save(model.state_dict(), prefix + ".pdparams", protocol=protocol)
        paddle.save(opt.state_dict(), prefix + ".pdopt", protocol=protocol)
        arrays = {f"pdparams/{k}": v for k, v in paddle.load(prefix + ".pdparams", return_numpy=True).items()}
        arrays.update(snapshot(model, opt))
        np.savez(prefix + ".ref.npz", **arrays)
        info = {"lr_scheduler": opt.state_dict().get("LR_Scheduler"),
                "names": {k: p.name for k, p in model.state_dict().items()}}
        if s == "CosineAnnealingWarmRestarts":
            info["next_lrs"] = []
            for _ in range(4):
                sch.step()
                info["next_lrs"].append(sch.last_lr)
        ref[case] = info
    # Static-mode tensors are saved through the builtins.eval pattern.
    t = paddle.to_tensor(np.arange(6, dtype="float32").reshape(2, 3))
    dense = t.value().get_tensor()
    paddle.save({"w": dense, "more": [dense]}, os.path.join(d, "dense_tensor.pd"))
    paddle.save({"nested": {"w": t}, "n": 3}, os.path.join(d, "nested.pd"))
    _clean_capture(d)
    return ref


def _zoo_or_plain_step(model, opt, sch, i: int) -> None:
    rs = np.random.RandomState(i)
    if isinstance(model, Zoo):
        seq = model.emb(paddle.to_tensor(rs.randint(0, 10, (2, 7))))
        h = model.conv1d(seq.transpose([0, 2, 1])).transpose([0, 2, 1])
        h, _ = model.lstm(h)
        h, _ = model.gru(h)
        img = model.ln(h).transpose([0, 2, 1]).unsqueeze(-1).expand([2, 3, 5, 5])
        loss = model.bn(model.convt(model.dw(img))).square().mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        return
    x = rs.randn(4, 1, 8, 8) if isinstance(model, Mnist) else rs.randn(6, 4)
    train_step(model, opt, sch, x.astype("float32"))


def _clean_capture(d: str) -> None:
    """A state captured with the name counters of a fresh process, and its next step."""
    paddle.seed(3)
    with paddle.utils.unique_name.guard():
        model, opt, sch = make("adam", "StepDecay", model=Tiny())
        _clean_run(d, model, opt, sch)


def _clean_run(d: str, model, opt, sch) -> None:
    xs = batches(77)
    for x in xs[:3]:
        train_step(model, opt, sch, x)
    pickle.dump(cp.capture(model, opt), open(os.path.join(d, "clean_state.pkl"), "wb"))
    train_step(model, opt, sch, xs[3])
    np.savez(os.path.join(d, "clean_next.npz"), **snapshot(model, opt))


def load_exported(d: str, cawr_state) -> dict:
    """Paddle's own loader on files we wrote: ``paddle.load`` + ``set_state_dict``, then one step;
    and ``cawr_state`` (imported from a CosineAnnealingWarmRestarts run's files) restored."""
    out: dict = {}
    with paddle.utils.unique_name.guard():  # the runtime names of a fresh process, as when exported
        model, opt, sch = make("adam", "StepDecay", model=Tiny())
        missing, unexpected = model.set_state_dict(paddle.load(os.path.join(d, "export.pdparams")))
        out["set_state_dict"] = [list(missing), list(unexpected)]
        opt.set_state_dict(paddle.load(os.path.join(d, "export.pdopt")))
        out["loaded"] = {k: v.numpy().tolist() for k, v in model.state_dict().items()}
        train_step(model, opt, sch, batches(77)[3])
        np.savez(os.path.join(d, "exported_next.npz"), **snapshot(model, opt))
    # Files exported from an imported .pdopt of a CosineAnnealingWarmRestarts run: Paddle's own
    # set_state_dict loses T_cur/T_i; ckptcore_paddle.restore recomputes them.
    model, opt, sch = make("adamw", "CosineAnnealingWarmRestarts", model=Tiny())
    out["cawr_report"] = list(cp.restore(cawr_state, model, opt).missing)
    out["cawr_lrs"] = []
    for _ in range(4):
        sch.step()
        out["cawr_lrs"].append(sch.last_lr)
    return out
