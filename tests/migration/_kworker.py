"""Keras halves of the migration tests: ``python _kworker.py source|target|torch|jax <dir> [options json]``.

``source`` trains and saves the Keras-side checkpoints (and the Keras reference continuations);
``target`` loads the Paddle-side checkpoints into Keras objects and continues them.  Each task's
outcome goes into ``<dir>/keras_<phase>.json`` (an ``error`` entry on failure) for the tests.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
import warnings

import numpy as np

import _keras_models as km
import ckptcore
from _common import (E2E_BATCH, E2E_CONTINUE, E2E_FIRST, E2E_SAMPLES, E2E_SEED, LR_STEPS, OPT_CASES,
                     SCHEDULES, STEPS, TWIN_SGD, TWINS, batches, e2e_dataset, max_diff, probe_images,
                     twin_batches, twin_probe, write_json)


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, ckptcore.MigrationWarning)]


# ----------------------------------------------------------------------------- source (phase 1)


def cnn_source(d: str, opts: dict) -> dict:
    m = km.cnn(0)
    ckptcore.save_state(f"{d}/cnn_k", model=m)
    np.save(f"{d}/cnn_k_logits.npy", np.asarray(m(probe_images(False))))
    return {"ok": True}


def opt_source(d: str, opts: dict) -> dict:
    for i, (case, spec) in enumerate(OPT_CASES.items()):
        m = km.cnn(10 + i)
        opt = km.optimizer(*spec["keras"])
        data = batches(100 + i, 2 * STEPS, nchw=False)
        for x, y in data[:STEPS]:
            km.train_step(m, opt, x, y)
        ckptcore.save_state(f"{d}/opt_{case}_k5", model=m, optimizer=opt)
        for x, y in data[STEPS:]:
            km.train_step(m, opt, x, y)
        ckptcore.save_state(f"{d}/opt_{case}_k10", model=m, optimizer=opt)
    return {"ok": True}


def sched_source(d: str, opts: dict) -> dict:
    out = {}
    xs = np.random.RandomState(5).randn(STEPS + LR_STEPS, 3, 4).astype("float32")
    for name, (kspec, _) in SCHEDULES.items():
        m = km.tiny()
        opt = km.optimizer("SGD", {}, km.schedule(*kspec))
        for x in xs[:STEPS]:
            km.tiny_step(m, opt, x)
        ckptcore.save_state(f"{d}/sched_{name}_k5", model=m, optimizer=opt)
        lrs = []
        for x in xs[STEPS:]:
            lrs.append(float(opt.learning_rate))
            km.tiny_step(m, opt, x)
        out[name] = lrs
    return out


def zoo_source(d: str, opts: dict) -> dict:
    m = km.zoo(3)
    ckptcore.save_state(f"{d}/zoo_k", model=m)
    np.savez(f"{d}/zoo_k_out.npz", *km.zoo_outputs(m))
    return {"order": [v.path for v in m.weights]}


def e2e_source(d: str, opts: dict) -> dict:
    from ckptcore import DataCursor

    x, y = e2e_dataset()
    m = km.cnn(9)
    opt = km.optimizer("Adam", {"learning_rate": 1e-3})
    cursor = DataCursor(E2E_SAMPLES, E2E_BATCH, seed=E2E_SEED)

    def run(n: int) -> tuple[list, list]:
        seen, losses = [], []
        for _ in range(n):
            epoch, idx = cursor.epoch, cursor.next_batch()
            seen.append([epoch, idx.tolist()])
            losses.append(km.train_step(m, opt, x[idx], y[idx]))
        return seen, losses

    seen, _ = run(E2E_FIRST)
    info = ckptcore.save_state(opts["e2e_url"], model=m, optimizer=opt, cursor=cursor,
                               storage_options=opts["storage_options"])
    ref_seen, ref_losses = run(E2E_CONTINUE)
    return {"seen": seen, "ref_seen": ref_seen, "ref_losses": ref_losses, "url": info.url}


def _twin_logits(m) -> np.ndarray:
    return np.asarray(m(twin_probe(False), training=False))


def twins_source(d: str, opts: dict) -> dict:
    """Structure twins, Keras side: 5 steps, save, logits; 5 more steps on the same data, logits."""
    import keras

    for i, name in enumerate(TWINS):
        m = km.twin(name, 40 + i)
        opt = keras.optimizers.SGD(**TWIN_SGD)
        data = twin_batches(300 + i, 2 * STEPS, nchw=False)
        for x, y in data[:STEPS]:
            km.train_step(m, opt, x, y)
        ckptcore.save_state(f"{d}/twin_{name}_k", model=m, optimizer=opt)
        np.save(f"{d}/twin_{name}_k_logits0.npy", _twin_logits(m))
        for x, y in data[STEPS:]:
            km.train_step(m, opt, x, y)
        np.save(f"{d}/twin_{name}_k_logits1.npy", _twin_logits(m))
    ckptcore.save_state(f"{d}/twin_branches_k", model=km.twin("branches", 3))
    return {"layers": {name: [layer.name for layer in km.twin(name).layers] for name in TWINS}}


def transformer_source(d: str, opts: dict) -> dict:
    """The Transformer block, Keras side of the Keras <-> Paddle pair: 5 AdamW steps, save, logits;
    5 more on the same data, logits (inference and training mode)."""
    from _common import KP_TRANSFORMER_OPT, pair_batches, pair_probe

    probe = pair_probe("transformer", nchw=False)
    m = km.twin("transformer", 45)
    opt = km.optimizer(*KP_TRANSFORMER_OPT["keras"])
    data = pair_batches("transformer", 1100, 2 * STEPS, nchw=False)
    for x, y in data[:STEPS]:
        km.train_step(m, opt, x, y)
    ckptcore.save_state(f"{d}/kp_transformer_k", model=m, optimizer=opt)
    np.save(f"{d}/kp_transformer_k_logits0.npy", km.logits(m, probe))
    for x, y in data[STEPS:]:
        km.train_step(m, opt, x, y)
    np.save(f"{d}/kp_transformer_k_logits1.npy", km.logits(m, probe))
    np.save(f"{d}/kp_transformer_k_logits1t.npy", km.logits(m, probe, training=True))
    return {"ok": True}


# ----------------------------------------------------------------------------- target (phase 2)


def cnn_target(d: str, opts: dict) -> dict:
    m = km.cnn(1)
    _, warns = _caught(lambda: ckptcore.load_state(f"{d}/cnn_p", model=m))
    out = np.asarray(m(probe_images(False)))
    return {"logits_diff": max_diff(out, np.load(f"{d}/cnn_p_logits.npy")), "warnings": warns}


def opt_target(d: str, opts: dict) -> dict:
    out = {}
    for i, (case, spec) in enumerate(OPT_CASES.items()):
        m = km.cnn(30 + i)
        opt = km.optimizer(*spec["keras"])
        _, warns = _caught(lambda: ckptcore.load_state(f"{d}/opt_{case}_p5", model=m, optimizer=opt))
        data = batches(200 + i, 2 * STEPS, nchw=False)
        for x, y in data[STEPS:]:
            km.train_step(m, opt, x, y)
        ref, _ = _caught(lambda: ckptcore.convert(f"{d}/opt_{case}_p10", "keras", km.cnn(0)))
        names = [v.path for v in m.weights]
        ref_vals = [ref.model[n] for n in ref.extra["keras"]["variables"]]
        diff = max(max_diff(v.numpy(), r) for v, r in zip(m.weights, ref_vals))
        out[case] = {"weight_diff": diff, "warnings": warns, "iterations": int(opt.iterations.numpy()),
                     "names": names}
    return out


def sched_target(d: str, opts: dict) -> dict:
    out = {}
    xs = np.random.RandomState(6).randn(STEPS + LR_STEPS, 3, 4).astype("float32")
    for name, (kspec, _) in SCHEDULES.items():
        m = km.tiny()
        opt = km.optimizer("SGD", {}, km.schedule(*kspec))
        _, warns = _caught(lambda: ckptcore.load_state(f"{d}/sched_{name}_p5", model=m, optimizer=opt))
        lrs = []
        for x in xs[STEPS:]:
            lrs.append(float(opt.learning_rate))
            km.tiny_step(m, opt, x)
        out[name] = {"lrs": lrs, "warnings": warns}
    return out


def zoo_target(d: str, opts: dict) -> dict:
    m = km.zoo(5)
    _, warns = _caught(lambda: ckptcore.load_state(f"{d}/zoo_p", model=m))
    ref = np.load(f"{d}/zoo_p_out.npz")
    outs = km.zoo_outputs(m)
    return {"diffs": [max_diff(o, ref[f"arr_{i}"]) for i, o in enumerate(outs)], "warnings": warns}


def twins_target(d: str, opts: dict) -> dict:
    """Structure twins, Paddle -> Keras: load, logits; 5 steps on the Paddle run's data, logits."""
    import keras

    out = {}
    for i, name in enumerate(TWINS):
        m = km.twin(name, 60 + i)
        opt = keras.optimizers.SGD(**TWIN_SGD)
        _, warns = _caught(lambda: ckptcore.load_state(f"{d}/twin_{name}_p", model=m, optimizer=opt))
        before = max_diff(_twin_logits(m), np.load(f"{d}/twin_{name}_p_logits0.npy"))
        for x, y in twin_batches(500 + i, 2 * STEPS, nchw=False)[STEPS:]:
            km.train_step(m, opt, x, y)
        after = max_diff(_twin_logits(m), np.load(f"{d}/twin_{name}_p_logits1.npy"))
        out[name] = {"logits_diff": before, "after_steps_diff": after, "warnings": warns}
    try:
        ckptcore.load_state(f"{d}/twin_branches_p", model=km.twin("branches", 4))
        out["branches"] = {"error": None}
    except ckptcore.MigrationError as e:
        out["branches"] = {"error": str(e)}
    return out


def transformer_target(d: str, opts: dict) -> dict:
    """The Transformer block, Paddle -> Keras: load, logits; 5 AdamW steps on the Paddle run's data."""
    from _common import KP_TRANSFORMER_OPT, pair_batches, pair_probe

    probe = pair_probe("transformer", nchw=False)
    m = km.twin("transformer", 48)
    opt = km.optimizer(*KP_TRANSFORMER_OPT["keras"])
    _, warns = _caught(lambda: ckptcore.load_state(f"{d}/kp_transformer_p", model=m, optimizer=opt))
    before = max_diff(km.logits(m, probe), np.load(f"{d}/kp_transformer_p_logits0.npy"))
    for x, y in pair_batches("transformer", 1200, 2 * STEPS, nchw=False)[STEPS:]:
        km.train_step(m, opt, x, y)
    return {"logits_diff": before, "warnings": warns,
            "after_eval_diff": max_diff(km.logits(m, probe), np.load(f"{d}/kp_transformer_p_logits1.npy")),
            "after_train_diff": max_diff(km.logits(m, probe, training=True),
                                         np.load(f"{d}/kp_transformer_p_logits1t.npy"))}


def cli_back(d: str, opts: dict) -> dict:
    """Acceptance 5: Keras -> Paddle (the Paddle worker ran that leg) -> Keras with ``ckpt convert``."""
    from ckptcore import cli

    rc = cli.main(["convert", f"{d}/cli_p", f"{d}/cli_k", "--to", "keras",
                   "--model", "_keras_models:cli_cnn_adam"])
    a, b = ckptcore.load_state(f"{d}/opt_adam_k5"), ckptcore.load_state(f"{d}/cli_k")
    pa, pb = a.extra["keras"]["variables"], b.extra["keras"]["variables"]
    w = max(max_diff(a.model[x], b.model[y]) for x, y in zip(pa, pb))
    s = max(max_diff(a.optimizer.slots[x][k], b.optimizer.slots[y][k])
            for x, y in zip(pa, pb) for k in a.optimizer.slots[x])
    rc2 = cli.main(["convert", f"{d}/cli_p", f"{d}/cli_tf/ckpt", "--to", "tf-checkpoint",
                    "--model", "_keras_models:cli_cnn_adam"])
    m, opt = km.cli_cnn_adam()
    opt.build(m.trainable_variables)
    import tensorflow as tf
    tf.train.Checkpoint(model=m, optimizer=opt).restore(f"{d}/cli_tf/ckpt").assert_consumed()
    tfw = max(max_diff(v.numpy(), a.model[x]) for v, x in zip(m.weights, pa))
    return {"rc": [rc, rc2], "weight_diff": w, "slot_diff": s, "steps": [a.optimizer.step, b.optimizer.step],
            "same_names": len(pa) == len(pb), "tf_checkpoint_weight_diff": tfw,
            "tf_iterations": int(opt.iterations.numpy())}


# ----------------------------------------------------------------------------- torch pairs (phase "torch")


def torch_pairs(d: str, opts: dict) -> dict:
    """PyTorch <-> Keras: continue the torch worker's runs here, and train the runs it continues."""
    from _common import TORCH_OPTS, TORCH_TWIN_OPT, TORCH_TWINS, pair_batches, pair_probe

    out: dict = {}
    for i, name in enumerate(TORCH_TWINS):
        spec = TORCH_OPTS[TORCH_TWIN_OPT[name]]["keras"]
        probe = pair_probe(name, nchw=False)
        m = km.twin(name, 400 + i)
        opt = km.optimizer(*spec)
        prefix = f"t_{name}_keras"
        _, warns = _caught(lambda: ckptcore.load_state(f"{d}/{prefix}", model=m, optimizer=opt))
        before = max_diff(km.logits(m, probe), np.load(f"{d}/{prefix}_logits0.npy"))
        for x, y in pair_batches(name, 700 + i, 2 * STEPS, nchw=False)[STEPS:]:
            km.train_step(m, opt, x, y)
        out[name] = {"logits_diff": before, "warnings": warns,
                     "after_eval_diff": max_diff(km.logits(m, probe), np.load(f"{d}/{prefix}_logits1.npy")),
                     "after_train_diff": max_diff(km.logits(m, probe, training=True),
                                                  np.load(f"{d}/{prefix}_logits1t.npy"))}
        src = km.twin(name, 500 + i)
        sopt = km.optimizer(*spec)
        data = pair_batches(name, 800 + i, 2 * STEPS, nchw=False)
        for x, y in data[:STEPS]:
            km.train_step(src, sopt, x, y)
        ckptcore.save_state(f"{d}/k_{name}", model=src, optimizer=sopt)
        np.save(f"{d}/k_{name}_logits0.npy", km.logits(src, probe))
        for x, y in data[STEPS:]:
            km.train_step(src, sopt, x, y)
        np.save(f"{d}/k_{name}_logits1.npy", km.logits(src, probe))
        np.save(f"{d}/k_{name}_logits1t.npy", km.logits(src, probe, training=True))
    try:
        ckptcore.load_state(f"{d}/t_branches", model=km.twin("branches", 4))
        out["branches"] = {"error": None}
    except ckptcore.MigrationError as e:
        out["branches"] = {"error": str(e)}
    ckptcore.save_state(f"{d}/k_branches", model=km.twin("branches", 3))
    return out


def jax_pairs(d: str, opts: dict) -> dict:
    """Keras <-> JAX: continue the JAX worker's runs here, and train the runs it continues."""
    from _jpairs import jax_pairs as pairs
    return pairs(d, km, "keras", lambda spec, net: km.optimizer(*spec), nchw=False)


PHASES = {"source": [cnn_source, opt_source, sched_source, zoo_source, twins_source, transformer_source,
                     e2e_source],
          "torch": [torch_pairs],
          "jax": [jax_pairs],
          "target": [cnn_target, opt_target, sched_target, zoo_target, twins_target, transformer_target,
                     cli_back]}


def main(phase: str, d: str, options: str = "{}") -> None:
    opts = json.loads(options)
    results = {}
    for task in PHASES[phase]:
        if task is e2e_source and "e2e_url" not in opts:
            continue
        t0 = time.perf_counter()
        try:
            results[task.__name__] = task(d, opts)
        except Exception:  # reported to the test, which fails with the traceback
            results[task.__name__] = {"error": traceback.format_exc()}
        results[task.__name__ + "_seconds"] = time.perf_counter() - t0
    write_json(d, f"keras_{phase}", results)


if __name__ == "__main__":
    main(*sys.argv[1:])
