"""Paddle half of the migration tests: ``python _pworker.py <dir> [options json]``.

Loads the Keras worker's checkpoints into Paddle objects and continues them, and trains and saves
the Paddle-side checkpoints the Keras worker's ``target`` phase continues.  Results go to
``<dir>/paddle.json`` (an ``error`` entry per failed task).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
import warnings

import numpy as np

import _paddle_models as pm  # noqa: I001  (imports Paddle first)
import paddle
import ckptcore
import ckptcore_paddle
from _common import (E2E_BATCH, E2E_CONTINUE, E2E_SAMPLES, LR_STEPS, OPT_CASES, SCHEDULES, STEPS, TWIN_SGD,
                     TWINS, batches, e2e_dataset, max_diff, probe_images, twin_batches, twin_probe,
                     write_json)


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, ckptcore.MigrationWarning)]


def cnn(d: str, opts: dict) -> dict:
    """Acceptance 1, Keras -> Paddle; and the Paddle CNN the Keras worker loads."""
    net = pm.cnn(1)
    _, warns = _caught(lambda: ckptcore.load_state(f"{d}/cnn_k", model=net))
    out = net(paddle.to_tensor(probe_images(True))).numpy()
    src = pm.cnn(2)
    ckptcore.save_state(f"{d}/cnn_p", model=src)
    np.save(f"{d}/cnn_p_logits.npy", src(paddle.to_tensor(probe_images(True))).numpy())
    return {"logits_diff": max_diff(out, np.load(f"{d}/cnn_k_logits.npy")), "warnings": warns}


def _weights_vs(net, reference_url: str) -> float:
    ref, _ = _caught(lambda: ckptcore.convert(reference_url, "paddle", pm.cnn(0)))
    return max(max_diff(t.numpy(), ref.model[k]) for k, t in net.state_dict().items())


def opt_k2p(d: str, opts: dict) -> dict:
    """Acceptance 2, Keras -> Paddle: 5 Keras steps, migrate, 5 more in both."""
    out = {}
    for i, (case, spec) in enumerate(OPT_CASES.items()):
        net = pm.cnn(20 + i)
        opt = pm.optimizer(*spec["paddle"], net.parameters())
        _, warns = _caught(lambda: ckptcore.load_state(f"{d}/opt_{case}_k5", model=net, optimizer=opt))
        for x, y in batches(100 + i, 2 * STEPS, nchw=True)[STEPS:]:
            pm.train_step(net, opt, x, y)
        out[case] = {"weight_diff": _weights_vs(net, f"{d}/opt_{case}_k10"), "warnings": warns}
    return out


def opt_source(d: str, opts: dict) -> dict:
    """Paddle runs for acceptance 2, Paddle -> Keras."""
    for i, (case, spec) in enumerate(OPT_CASES.items()):
        net = pm.cnn(40 + i)
        opt = pm.optimizer(*spec["paddle"], net.parameters())
        data = batches(200 + i, 2 * STEPS, nchw=True)
        for x, y in data[:STEPS]:
            pm.train_step(net, opt, x, y)
        ckptcore.save_state(f"{d}/opt_{case}_p5", model=net, optimizer=opt)
        for x, y in data[STEPS:]:
            pm.train_step(net, opt, x, y)
        ckptcore.save_state(f"{d}/opt_{case}_p10", model=net, optimizer=opt)
    return {"ok": True}


def sched_k2p(d: str, opts: dict) -> dict:
    out = {}
    xs = np.random.RandomState(5).randn(STEPS + LR_STEPS, 3, 4).astype("float32")
    for name, (_, pspec) in SCHEDULES.items():
        net, sch = pm.tiny(), pm.scheduler(*pspec)
        opt = paddle.optimizer.SGD(learning_rate=sch, parameters=net.parameters())
        _, warns = _caught(lambda: ckptcore.load_state(f"{d}/sched_{name}_k5", model=net, optimizer=opt,
                                                       scheduler=sch))
        lrs = []
        for x in xs[STEPS:]:
            lrs.append(float(opt.get_lr()))
            pm.tiny_step(net, opt, sch, x)
        out[name] = {"lrs": lrs, "warnings": warns}
    return out


def sched_source(d: str, opts: dict) -> dict:
    out = {}
    xs = np.random.RandomState(6).randn(STEPS + LR_STEPS, 3, 4).astype("float32")
    for name, (_, pspec) in SCHEDULES.items():
        net, sch = pm.tiny(), pm.scheduler(*pspec)
        opt = paddle.optimizer.SGD(learning_rate=sch, parameters=net.parameters())
        for x in xs[:STEPS]:
            pm.tiny_step(net, opt, sch, x)
        ckptcore.save_state(f"{d}/sched_{name}_p5", model=net, optimizer=opt)
        lrs = []
        for x in xs[STEPS:]:
            lrs.append(float(opt.get_lr()))
            pm.tiny_step(net, opt, sch, x)
        out[name] = lrs
    return out


def sched_mismatch(d: str, opts: dict) -> dict:
    """A schedule pair that is not exact (docs/MIGRATION.md) raises MigrationError; approximate=True converts with a warning."""
    net, sch = pm.tiny(), pm.scheduler("StepDecay", {"learning_rate": 0.1, "step_size": 3, "gamma": 0.5})
    opt = paddle.optimizer.SGD(learning_rate=sch, parameters=net.parameters())
    try:
        ckptcore.load_state(f"{d}/sched_exponential_k5", model=net, optimizer=opt)
        error = None
    except ckptcore.MigrationError as e:
        error = str(e)
    _, warns = _caught(lambda: ckptcore.load_state(f"{d}/sched_exponential_k5", model=net, optimizer=opt,
                                                   approximate=True))
    return {"error": error, "approx_warnings": warns, "last_epoch": sch.last_epoch}


def zoo(d: str, opts: dict) -> dict:
    """Acceptance 3 both ways (this side: Keras -> Paddle, and the Paddle model the Keras worker loads)."""
    z = pm.zoo(4)
    _, warns = _caught(lambda: ckptcore.load_state(f"{d}/zoo_k", model=z))
    ref = np.load(f"{d}/zoo_k_out.npz")
    diffs = [max_diff(o, ref[f"arr_{i}"]) for i, o in enumerate(pm.zoo_outputs(z))]
    src = pm.zoo(3)
    ckptcore.save_state(f"{d}/zoo_p", model=src)
    np.savez(f"{d}/zoo_p_out.npz", *pm.zoo_outputs(src))
    return {"diffs": diffs, "warnings": warns}


def e2e(d: str, opts: dict) -> dict:
    """Acceptance 4: continue the Keras run from the bucket, with its data cursor."""
    from ckptcore import DataCursor

    x, y = e2e_dataset()
    x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    net = pm.cnn(11)
    opt = pm.optimizer("KerasAdam", {"learning_rate": 1e-3}, net.parameters())
    cursor = DataCursor(E2E_SAMPLES, E2E_BATCH, seed=0)
    _, warns = _caught(lambda: ckptcore.load_state(opts["e2e_url"], model=net, optimizer=opt, cursor=cursor,
                                                   storage_options=opts["storage_options"]))
    seen, losses = [], []
    for _ in range(E2E_CONTINUE):
        epoch, idx = cursor.epoch, cursor.next_batch()
        seen.append([epoch, idx.tolist()])
        losses.append(pm.train_step(net, opt, x[idx], y[idx]))
    return {"seen": seen, "losses": losses, "warnings": warns}


def cli_to_paddle(d: str, opts: dict) -> dict:
    """Acceptance 5, first leg, plus ``--to pdparams`` loaded by Paddle itself."""
    from ckptcore import cli

    rc = cli.main(["convert", f"{d}/opt_adam_k5", f"{d}/cli_p", "--to", "paddle",
                   "--model", "_paddle_models:cli_cnn_adam"])
    rc2 = cli.main(["convert", f"{d}/opt_adam_k5", f"{d}/cli_pd", "--to", "pdparams",
                    "--model", "_paddle_models:cli_cnn_adam"])
    net, opt = pm.cli_cnn_adam()
    missing, unexpected = net.set_state_dict(paddle.load(f"{d}/cli_pd.pdparams"))
    opt.set_state_dict(paddle.load(f"{d}/cli_pd.pdopt"))
    state = ckptcore.load_state(f"{d}/cli_p")
    wdiff = max(max_diff(t.numpy(), state.model[k]) for k, t in net.state_dict().items())
    x, y = batches(100, 1, nchw=True)[0]
    pm.train_step(net, opt, x, y)   # the optimizer accepted the .pdopt: its beta powers moved on
    pows = [v.numpy().item() for k, per in opt._accumulators.items() if "beta2_pow" in k for v in per.values()]
    return {"rc": [rc, rc2], "report": [list(missing), list(unexpected)], "weight_diff": wdiff,
            "step": state.optimizer.step, "beta2_pow": pows[:1]}


def rng(d: str, opts: dict) -> dict:
    """The reseeded Paddle generator is exactly what ``paddle.seed`` gives (and it restores)."""
    from ckptcore.migrate.rng import convert_rng
    from ckptcore_paddle._dialect import DIALECT

    entry = convert_rng({"tensorflow": {"state": [1, 2, 3], "algorithm": 1}}, DIALECT, 7)["paddle"][0]
    paddle.seed(entry["seed"])
    _, seed, offset, engine = paddle.get_rng_state()[0].__getstate__()
    first = paddle.rand([4]).numpy().tolist()
    from ckptcore_paddle import _rng
    # The adapter module map names it restore_framework_rng; older trees call it restore_all_rng.
    restore = getattr(_rng, "restore_framework_rng", None) or _rng.restore_all_rng
    paddle.seed(0)
    restore({"paddle": [entry]})
    return {"engine_equal": bytes(engine).decode() == entry["engine"], "seed_equal": seed == entry["seed"],
            "draws_equal": paddle.rand([4]).numpy().tolist() == first}


def _twin_logits(net) -> np.ndarray:
    net.eval()
    out = net(paddle.to_tensor(twin_probe(True))).numpy()
    net.train()
    return out


def twins(d: str, opts: dict) -> dict:
    """Structure twins: Keras -> Paddle (load, logits, 5 steps on the Keras run's data, logits), and
    the Paddle runs the Keras worker continues; the ambiguous two-branch model both ways."""
    out = {}
    for i, name in enumerate(TWINS):
        net = pm.twin(name, 50 + i)
        opt = paddle.optimizer.Momentum(parameters=net.parameters(), **TWIN_SGD)
        _, warns = _caught(lambda: ckptcore.load_state(f"{d}/twin_{name}_k", model=net, optimizer=opt))
        before = max_diff(_twin_logits(net), np.load(f"{d}/twin_{name}_k_logits0.npy"))
        for x, y in twin_batches(300 + i, 2 * STEPS, nchw=True)[STEPS:]:
            pm.train_step(net, opt, x, y)
        after = max_diff(_twin_logits(net), np.load(f"{d}/twin_{name}_k_logits1.npy"))
        out[name] = {"logits_diff": before, "after_steps_diff": after, "warnings": warns,
                     "inputs": {i.layer: i.attrs.get("inputs")
                                for i in ckptcore_paddle.capture(model=net).params.values()}}
        src = pm.twin(name, 70 + i)
        sopt = paddle.optimizer.Momentum(parameters=src.parameters(), **TWIN_SGD)
        data = twin_batches(500 + i, 2 * STEPS, nchw=True)
        for x, y in data[:STEPS]:
            pm.train_step(src, sopt, x, y)
        ckptcore.save_state(f"{d}/twin_{name}_p", model=src, optimizer=sopt)
        np.save(f"{d}/twin_{name}_p_logits0.npy", _twin_logits(src))
        for x, y in data[STEPS:]:
            pm.train_step(src, sopt, x, y)
        np.save(f"{d}/twin_{name}_p_logits1.npy", _twin_logits(src))
    try:
        ckptcore.load_state(f"{d}/twin_branches_k", model=pm.twin("branches", 1))
        out["branches"] = {"error": None}
    except ckptcore.MigrationError as e:
        out["branches"] = {"error": str(e)}
    ckptcore.save_state(f"{d}/twin_branches_p", model=pm.twin("branches", 2))
    return out


def transformer(d: str, opts: dict) -> dict:
    """The Transformer block, Keras -> Paddle (load, logits, 5 AdamW steps on the Keras run's data),
    and the Paddle run the Keras worker continues.  ``KerasAdamW``: Keras' epsilon placement."""
    from _common import KP_TRANSFORMER_OPT, pair_batches, pair_probe

    probe = pair_probe("transformer", nchw=True)
    net = pm.twin("transformer", 46)
    opt = pm.optimizer(*KP_TRANSFORMER_OPT["paddle"], net.parameters())
    _, warns = _caught(lambda: ckptcore.load_state(f"{d}/kp_transformer_k", model=net, optimizer=opt))
    before = max_diff(pm.logits(net, probe), np.load(f"{d}/kp_transformer_k_logits0.npy"))
    for x, y in pair_batches("transformer", 1100, 2 * STEPS, nchw=True)[STEPS:]:
        pm.train_step(net, opt, x, y)
    out = {"logits_diff": before, "warnings": warns,
           "after_eval_diff": max_diff(pm.logits(net, probe), np.load(f"{d}/kp_transformer_k_logits1.npy")),
           "after_train_diff": max_diff(pm.logits(net, probe, training=True),
                                        np.load(f"{d}/kp_transformer_k_logits1t.npy")),
           "roles": {k: (i.kind, i.role, i.layout, i.attrs.get("inputs"))
                     for k, i in ckptcore_paddle.capture(model=net).params.items()}}
    src = pm.twin("transformer", 47)
    sopt = pm.optimizer(*KP_TRANSFORMER_OPT["paddle"], src.parameters())
    data = pair_batches("transformer", 1200, 2 * STEPS, nchw=True)
    for x, y in data[:STEPS]:
        pm.train_step(src, sopt, x, y)
    ckptcore.save_state(f"{d}/kp_transformer_p", model=src, optimizer=sopt)
    np.save(f"{d}/kp_transformer_p_logits0.npy", pm.logits(src, probe))
    for x, y in data[STEPS:]:
        pm.train_step(src, sopt, x, y)
    np.save(f"{d}/kp_transformer_p_logits1.npy", pm.logits(src, probe))
    np.save(f"{d}/kp_transformer_p_logits1t.npy", pm.logits(src, probe, training=True))
    return out


def torch_pairs(d: str, opts: dict) -> dict:
    """PyTorch <-> Paddle: continue the torch worker's runs here, and train the runs it continues."""
    from _common import TORCH_OPTS, TORCH_TWIN_OPT, TORCH_TWINS, pair_batches, pair_probe

    out: dict = {}
    for i, name in enumerate(TORCH_TWINS):
        spec = TORCH_OPTS[TORCH_TWIN_OPT[name]]["paddle"]
        probe = pair_probe(name, nchw=True)
        net = pm.twin(name, 600 + i)
        opt = pm.optimizer(*spec, net.parameters())
        prefix = f"t_{name}_paddle"
        try:
            _, warns = _caught(lambda: ckptcore.load_state(f"{d}/{prefix}", model=net, optimizer=opt))
        except ckptcore.MigrationError as e:
            out[name] = {"error": str(e)}
        else:
            before = max_diff(pm.logits(net, probe), np.load(f"{d}/{prefix}_logits0.npy"))
            for x, y in pair_batches(name, 700 + i, 2 * STEPS, nchw=True)[STEPS:]:
                pm.train_step(net, opt, x, y)
            out[name] = {"logits_diff": before, "warnings": warns,
                         "after_eval_diff": max_diff(pm.logits(net, probe), np.load(f"{d}/{prefix}_logits1.npy")),
                         "after_train_diff": max_diff(pm.logits(net, probe, training=True),
                                                      np.load(f"{d}/{prefix}_logits1t.npy"))}
        src = pm.twin(name, 650 + i)
        sopt = pm.optimizer(*spec, src.parameters())
        data = pair_batches(name, 900 + i, 2 * STEPS, nchw=True)
        for x, y in data[:STEPS]:
            pm.train_step(src, sopt, x, y)
        ckptcore.save_state(f"{d}/p_{name}", model=src, optimizer=sopt)
        np.save(f"{d}/p_{name}_logits0.npy", pm.logits(src, probe))
        for x, y in data[STEPS:]:
            pm.train_step(src, sopt, x, y)
        np.save(f"{d}/p_{name}_logits1.npy", pm.logits(src, probe))
        np.save(f"{d}/p_{name}_logits1t.npy", pm.logits(src, probe, training=True))
    try:
        ckptcore.load_state(f"{d}/t_branches", model=pm.twin("branches", 1))
        out["branches"] = {"error": None}
    except ckptcore.MigrationError as e:
        out["branches"] = {"error": str(e)}
    ckptcore.save_state(f"{d}/p_branches", model=pm.twin("branches", 2))
    return out


TASKS = [rng, cnn, opt_k2p, opt_source, sched_k2p, sched_source, sched_mismatch, zoo, twins, transformer, e2e,
         cli_to_paddle]


def jax_pairs(d: str, opts: dict) -> dict:
    """Paddle <-> JAX: continue the JAX worker's runs here, and train the runs it continues."""
    from _jpairs import jax_pairs as pairs
    return pairs(d, pm, "paddle", lambda spec, net: pm.optimizer(*spec, net.parameters()), nchw=True)


def main(d: str, options: str = "{}", mode: str = "keras") -> None:
    """``mode="torch"``/``"jax"`` runs the PyTorch/JAX pairs only (``python _pworker.py <dir> {} torch``)."""
    opts = json.loads(options)
    results = {}
    for task in {"torch": [torch_pairs], "jax": [jax_pairs]}.get(mode, TASKS):
        if task is e2e and "e2e_url" not in opts:
            continue
        t0 = time.perf_counter()
        try:
            results[task.__name__] = task(d, opts)
        except Exception:  # reported to the test, which fails with the traceback
            results[task.__name__] = {"error": traceback.format_exc()}
        results[task.__name__ + "_seconds"] = time.perf_counter() - t0
    write_json(d, f"paddle_{mode}" if mode in ("torch", "jax") else "paddle", results)


if __name__ == "__main__":
    main(*sys.argv[1:])
