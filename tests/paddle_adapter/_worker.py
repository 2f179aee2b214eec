"""Paddle-side halves of the tests, run as ``python _worker.py <command> <dir>`` in fresh processes.

The pytest process never imports Paddle (it must not share a process with TensorFlow); it starts
this script, which writes ``.npz``/``.json``/pickled states into ``<dir>`` for the tests to compare.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import sys
import traceback
import warnings

warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import paddle  # noqa: E402

import ckptcore_paddle as cp  # noqa: E402
from _models import (OPTIMIZERS, SCHEDULERS, Mnist, Tiny, Zoo, make, shift_name_counters,  # noqa: E402
                     snapshot, train_step)

K, N = 3, 3  # steps before the capture, steps after it


def combos() -> list[tuple[str, str]]:
    return [(o, s) for o in OPTIMIZERS for s in SCHEDULERS]


def batches(idx: int, n: int = K + N) -> list[np.ndarray]:
    rs = np.random.RandomState(1000 + idx)
    return [rs.randn(6, 4).astype("float32") for _ in range(n)]


def draws() -> dict[str, list]:
    """Values that depend on every RNG the adapter captures (DataLoader order = numpy's legacy RNG)."""
    ds = paddle.io.TensorDataset([paddle.arange(10, dtype="float32")])
    order = [b[0].numpy().astype(int).tolist() for b in paddle.io.DataLoader(ds, batch_size=3, shuffle=True)]
    return {"paddle": paddle.rand([3]).numpy().tolist(), "numpy": np.random.rand(3).tolist(),
            "python": [random.random() for _ in range(3)], "loader": order,
            "dropout": paddle.nn.functional.dropout(paddle.ones([8]), 0.5).numpy().tolist()}


def _save(d: str, name: str, arrays: dict, info: dict) -> None:
    np.savez(os.path.join(d, f"{name}.npz"), **arrays)
    with open(os.path.join(d, f"{name}.json"), "w") as f:
        json.dump(info, f)


# ----------------------------------------------------------------------------- cross-process round trips


def _special(name: str, phase: str, idx: int, state_path: str, arrays: dict, info: dict) -> None:
    """``accumulation``: captured inside a 4-batch window; ``branch``: a layer that stops being used
    after the capture keeps being updated by Adam through its zero gradient."""
    xs = batches(idx, 16)
    if name == "accumulation":
        if phase == "resume":
            shift_name_counters("momentum")
        model, opt, sch = make("momentum", "PolynomialDecay")
        if phase == "resume":
            state = pickle.load(open(state_path, "rb"))
            report = cp.restore(state, model, opt)
            info["report"] = [list(report.missing), list(report.unexpected)]
            for k, p in model.state_dict().items():
                if k in state.accumulation.buffers:
                    arrays[f"grad/{k}"] = p.grad.numpy()
        plan = range(6, 16) if phase == "resume" else range(16)
        for i in plan:
            (model(paddle.to_tensor(xs[i])).square().mean() / 4).backward()
            if (i + 1) % 4 == 0:
                opt.step()
                opt.clear_grad()
                sch.step()
            if phase == "train" and i == 5:
                state = cp.capture(model, opt, accumulate_every=4, accumulated=2)
                pickle.dump(state, open(state_path, "wb"))
                info["accumulation"] = [state.accumulation.every, state.accumulation.count,
                                        sorted(state.accumulation.buffers)]
                for k, v in state.accumulation.buffers.items():
                    arrays[f"grad/{k}"] = v
    else:
        if phase == "resume":
            shift_name_counters("adam")
        model, opt, sch = make("adam", "constant", model=Tiny(extra=True))
        if phase == "resume":
            state = pickle.load(open(state_path, "rb"))
            cp.restore(state, model, opt)
        for i in range(K, 2 * K) if phase == "resume" else range(2 * K):
            model.use_extra = i < K
            train_step(model, opt, sch, xs[i])
            if phase == "train" and i == K - 1:
                pickle.dump(cp.capture(model, opt), open(state_path, "wb"))
    arrays.update({f"final/{k}": v for k, v in snapshot(model, opt).items()})


def roundtrip(d: str, phase: str) -> None:
    """``train``: K steps, capture, N more steps.  ``resume``: restore in this process, N steps."""
    os.makedirs(os.path.join(d, "states"), exist_ok=True)
    results: dict[str, dict] = {}
    for idx, (o, s) in enumerate(combos() + [("special", "accumulation"), ("special", "branch")]):
        key = f"{o}+{s}"
        arrays: dict[str, np.ndarray] = {}
        info: dict = {}
        path = os.path.join(d, "states", f"{key}.pkl")
        try:
            if o == "special":
                _special(s, phase, idx, path, arrays, info)
            else:
                _roundtrip_one(o, s, idx, phase, path, arrays, info)
        except Exception:  # recorded per combo so that one failure does not hide the others
            info["error"] = traceback.format_exc()
        _save_part(d, phase, key, arrays, info, results)
    with open(os.path.join(d, f"{phase}.json"), "w") as f:
        json.dump(results, f)


def _roundtrip_one(o: str, s: str, idx: int, phase: str, path: str, arrays: dict, info: dict) -> None:
    xs = batches(idx)
    paddle.seed(idx if phase == "train" else idx + 5000)  # the restore must overwrite everything
    if phase == "resume":
        shift_name_counters(o)
    model, opt, sch = make(o, s)
    if phase == "train":
        for x in xs[:K]:
            train_step(model, opt, sch, x)
        state = cp.capture(model, opt)
        pickle.dump(state, open(path, "wb"))
        info["step"], info["step_source"] = state.optimizer.step, state.optimizer.extra["step_source"]
        info["schedule"] = None if state.schedule is None else [state.schedule.kind, state.schedule.step]
    else:
        state = pickle.load(open(path, "rb"))
        report = cp.restore(state, model, opt)
        info["report"] = [list(report.missing), list(report.unexpected)]
    info["draws"] = draws()
    info["lrs"], info["losses"] = [], []
    for x in xs[K:]:
        info["lrs"].append(opt.get_lr())
        info["losses"].append(train_step(model, opt, sch, x))
    info["last_lr"] = None if sch is None else sch.last_lr
    arrays.update({f"final/{k}": v for k, v in snapshot(model, opt).items()})


def _save_part(d: str, phase: str, key: str, arrays: dict, info: dict, results: dict) -> None:
    np.savez(os.path.join(d, "states", f"{key}.{phase}.npz"), **arrays)
    results[key] = info


# ----------------------------------------------------------------------------- paddle.save files


def save_files(d: str) -> None:
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
    with open(os.path.join(d, "ref.json"), "w") as f:
        json.dump(ref, f)
    _clean_capture(d)


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
    for x in xs[:K]:
        train_step(model, opt, sch, x)
    pickle.dump(cp.capture(model, opt), open(os.path.join(d, "clean_state.pkl"), "wb"))
    train_step(model, opt, sch, xs[K])
    np.savez(os.path.join(d, "clean_next.npz"), **snapshot(model, opt))


def load_exported(d: str) -> None:
    """Paddle's own loader on files we wrote: ``paddle.load`` + ``set_state_dict``, then one step."""
    out: dict = {}
    model, opt, sch = make("adam", "StepDecay", model=Tiny())
    missing, unexpected = model.set_state_dict(paddle.load(os.path.join(d, "export.pdparams")))
    out["set_state_dict"] = [list(missing), list(unexpected)]
    opt.set_state_dict(paddle.load(os.path.join(d, "export.pdopt")))
    out["loaded"] = {k: v.numpy().tolist() for k, v in model.state_dict().items()}
    train_step(model, opt, sch, batches(77)[K])
    np.savez(os.path.join(d, "exported_next.npz"), **snapshot(model, opt))
    # Files exported from an imported .pdopt of a CosineAnnealingWarmRestarts run: Paddle's own
    # set_state_dict loses T_cur/T_i; ckptcore_paddle.restore recomputes them.
    state = pickle.load(open(os.path.join(d, "imported_cawr.pkl"), "rb"))
    model, opt, sch = make("adamw", "CosineAnnealingWarmRestarts", model=Tiny())
    out["cawr_report"] = list(cp.restore(state, model, opt).missing)
    out["cawr_lrs"] = []
    for _ in range(4):
        sch.step()
        out["cawr_lrs"].append(sch.last_lr)
    with open(os.path.join(d, "load_exported.json"), "w") as f:
        json.dump(out, f)


def _dp_rank(d: str) -> None:
    import paddle.distributed as dist
    dist.init_parallel_env()
    rank = dist.get_rank()
    paddle.seed(0)
    net = Tiny()
    dp = paddle.DataParallel(net)
    opt = paddle.optimizer.Adam(0.01, parameters=dp.parameters())
    for x in batches(rank, 2):
        train_step(dp, opt, None, x)
    pickle.dump(cp.capture(dp, opt, rng=False), open(os.path.join(d, f"dp_rank{rank}.pkl"), "wb"))


def dataparallel(d: str) -> None:
    """Two CPU processes (gloo) train a DataParallel model; rank 0's state restores into a plain model."""
    import paddle.distributed as dist
    dist.spawn(_dp_rank, args=(d,), nprocs=2, backend="gloo")
    state = pickle.load(open(os.path.join(d, "dp_rank0.pkl"), "rb"))
    model, opt, _ = make("adam", "constant", model=Tiny())
    report = cp.restore(state, model, opt)
    out = {"report": [list(report.missing), list(report.unexpected)],
           "equal": all(np.array_equal(v.numpy(), state.model[k]) for k, v in model.state_dict().items())}
    with open(os.path.join(d, "dataparallel.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    command, directory = sys.argv[1], sys.argv[2]
    if command in ("train", "resume"):
        roundtrip(directory, command)
    elif command == "save_files":
        save_files(directory)
    elif command == "dataparallel":
        dataparallel(directory)
    elif command == "load_exported":
        load_exported(directory)
    elif command == "scenarios":
        from _scenarios import run_all
        run_all(directory)
    else:
        raise SystemExit(f"unknown command {command}")
