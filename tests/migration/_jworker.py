"""JAX half of the JAX migration tests: ``python _jworker.py source|target|both <dir>``.

``source`` trains the Flax NNX twins with Optax and saves the checkpoints the PyTorch, Keras and
Paddle workers continue (``_jpairs.py``), with the JAX reference continuations; it also checks what
the capture reads from Optax transformations and each Optax schedule's canonical formula.
``target`` loads the partners' checkpoints into JAX objects and continues them.  ``both`` runs
``source``, waits until ``<dir>/partners.done`` exists, then runs ``target`` in the same process,
whose compiled training steps it reuses (compiling them is most of a JAX phase's time).  Results go
to ``<dir>/jax_<phase>.json`` (an ``error`` entry per failed task).  Imports JAX only.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
import traceback
import warnings

import numpy as np

import _jax_models as jm  # noqa: I001  (sets JAX_PLATFORMS first)
import jax
import optax
from flax import nnx

import ckptcore
import ckptcore_jax
from _common import (JAX_DATA_SEED, JAX_PARTNERS, JAX_TWINS, STEPS, jax_opt, jax_source, max_diff,
                     pair_batches, pair_probe, write_json)



def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, ckptcore.MigrationWarning)]


def _save_logits(prefix: str, net, name: str, tags: str) -> None:
    probe = pair_probe(name, nchw=False)
    np.save(f"{prefix}_logits{tags[0]}.npy", jm.logits(net, probe))
    if tags == "1t":
        np.save(f"{prefix}_logits1t.npy", jm.logits(net, probe, training=True))


# ----------------------------------------------------------------------------- source


def twins_source(d: str) -> dict:
    """Each twin with the optimizer of its PyTorch/Paddle partners and with Keras' (Nesterov SGD)."""
    for i, name in enumerate(JAX_TWINS):
        for partner in {jax_source(name, p): p for p in JAX_PARTNERS}.values():
            net = jm.twin(name, 100 + i)
            opt = jm.optimizer(*jax_opt(name, partner, "jax"), net)
            data = pair_batches(name, JAX_DATA_SEED["jax"] + i, 2 * STEPS, nchw=False)
            for x, y in data[:STEPS]:
                jm.train_step(net, opt, x, y)
            prefix = f"{d}/{jax_source(name, partner)}"
            ckptcore.save_state(prefix, model=net, optimizer=opt)
            _save_logits(prefix, net, name, "0")
            for x, y in data[STEPS:]:
                jm.train_step(net, opt, x, y)
            _save_logits(prefix, net, name, "1t")
    ckptcore.save_state(f"{d}/j_branches", model=jm.twin("branches", 3))
    rms = jm.twin("transformer", 9)   # an optimizer migration refuses (test_migration_jax.py)
    ckptcore.save_state(f"{d}/j_rmsprop", model=rms, optimizer=jm.optimizer("rmsprop", {"learning_rate": 1e-3}, rms))
    return {"ok": True}


def structure(d: str) -> dict:
    """What the traced forward pass records for the Transformer block, the U-Net's transposed
    convolutions, the MobileNet's depthwise convolutions and a BatchNorm."""
    st = ckptcore_jax.capture(jm.twin("transformer"))
    inputs = {i.layer: i.attrs.get("inputs") for i in st.params.values()}
    roles = {k: [str(i.role), i.layout] for k, i in st.params.items() if i.layer == "attn"}
    unet = ckptcore_jax.capture(jm.twin("unet")).params
    mobile = ckptcore_jax.capture(jm.twin("mobilenet")).params
    bn = ckptcore_jax.capture(jm.twin("resnet")).params["stem_bn/var"].attrs
    return {"inputs": inputs, "roles": roles,
            "up": [unet["up1/kernel"].kind, unet["up1/kernel"].layout, dict(unet["up1/kernel"].attrs)],
            "dec2_inputs": unet["dec2/kernel"].attrs.get("inputs"),
            "dw": [mobile["blocks/1/dw/kernel"].kind, mobile["blocks/1/dw/kernel"].layout],
            "bn": {k: bn.get(k) for k in ("momentum", "epsilon", "variance_update")}}


_OPTAX = {
    "adam": lambda: optax.adam(1e-3), "adamw": lambda: optax.adamw(1e-3, weight_decay=0.05),
    "sgd_nesterov": lambda: optax.sgd(0.01, momentum=0.9, nesterov=True), "sgd": lambda: optax.sgd(0.1),
    "rmsprop": lambda: optax.rmsprop(1e-3), "nadam": lambda: optax.nadam(1e-3),
    "masked_adamw": lambda: optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda _: True, p)),
}


def optax_reading(d: str) -> dict:
    """Kind and hyperparameters the capture reads from each Optax transformation, and what the
    dialect makes of them."""
    from ckptcore_jax._dialect import DIALECT

    out = {}
    for key, make in _OPTAX.items():
        net = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        st = ckptcore_jax.capture(net, nnx.Optimizer(net, make(), wrt=nnx.Param))
        n = DIALECT.optimizer_to_neutral(st.optimizer, st.schedule)
        out[key] = {"kind": st.optimizer.kind, "hp": st.optimizer.hyperparams, "family": n.family,
                    "unsupported": n.unsupported, "slots": sorted(st.optimizer.slots.get("kernel", {}))}
    return out


_SCHEDULES = {
    "exponential": lambda: optax.exponential_decay(0.1, 10, 0.5),
    "staircase": lambda: optax.exponential_decay(0.1, 3, 0.5, staircase=True),
    "cosine": lambda: optax.cosine_decay_schedule(0.1, 8, alpha=0.1),
    "piecewise": lambda: optax.piecewise_constant_schedule(0.1, {7: 0.5, 9: 0.5}),
    "polynomial": lambda: optax.polynomial_schedule(0.1, 0.01, 0.5, 8),
    "warmup_cosine": lambda: optax.warmup_cosine_decay_schedule(0.0, 0.1, 7, 15, 0.01),
}


def schedules(d: str) -> dict:
    """Each schedule as the capture describes it (after 5 updates), its canonical formula against
    Optax's own rates for 10 steps from there (past a cosine's end too)."""
    from ckptcore.migrate.schedules import value
    from ckptcore_jax._dialect import DIALECT

    out = {}
    for key, make in _SCHEDULES.items():
        fn = make()
        net = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(net, optax.sgd(fn), wrt=nnx.Param)
        grads = jax.tree.map(jax.numpy.zeros_like, nnx.state(net, nnx.Param))
        for _ in range(5):
            opt.update(net, grads)
        st = ckptcore_jax.capture(net, opt)
        form = DIALECT.schedule_to_canonical(st.schedule)
        ref = [float(fn(t)) for t in range(5, 15)]
        got = [value(form, t, DIALECT.cosine_past_end) for t in range(5, 15)] if form else []
        out[key] = {"kind": st.schedule.kind, "step": st.schedule.step, "form": list(form or ()),
                    "formula_diff": max_diff(got, ref), "last_lr_diff": abs(st.schedule.last_lr - ref[0])}
    return out


# ----------------------------------------------------------------------------- target


def twins_target(d: str) -> dict:
    out: dict = {}
    for partner in JAX_PARTNERS:
        for i, name in enumerate(JAX_TWINS):
            prefix = f"{d}/{partner[0]}2j_{name}"
            net = jm.twin(name, 200 + i)
            opt = jm.optimizer(*jax_opt(name, partner, "jax"), net)
            try:
                _, warns = _caught(lambda: ckptcore.load_state(prefix, model=net, optimizer=opt))
            except ckptcore.MigrationError as e:
                out[f"{partner}/{name}"] = {"error": str(e)}
                continue
            probe = pair_probe(name, nchw=False)
            before = max_diff(jm.logits(net, probe), np.load(f"{prefix}_logits0.npy"))
            step = int(opt.step.get_value())
            counts = {k: int(v) for k, v in ckptcore_jax.capture(net, opt).optimizer.extra["leaves"].items()}
            for x, y in pair_batches(name, JAX_DATA_SEED[partner] + i, 2 * STEPS, nchw=False)[STEPS:]:
                jm.train_step(net, opt, x, y)
            out[f"{partner}/{name}"] = {
                "logits_diff": before, "warnings": warns, "step": step, "counts": counts,
                "after_eval_diff": max_diff(jm.logits(net, probe), np.load(f"{prefix}_logits1.npy")),
                "after_train_diff": max_diff(jm.logits(net, probe, training=True),
                                             np.load(f"{prefix}_logits1t.npy"))}
        try:
            ckptcore.load_state(f"{d}/{partner[0]}2j_branches", model=jm.twin("branches", 4))
            out[f"{partner}/branches"] = {"error": None}
        except ckptcore.MigrationError as e:
            out[f"{partner}/branches"] = {"error": str(e)}
    return out


PHASES = {"source": [structure, optax_reading, schedules, twins_source], "target": [twins_target]}


def main(phase: str, d: str) -> None:
    if phase == "both":
        main("source", d)
        done, deadline = Path(d, "partners.done"), time.monotonic() + 900
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        phase = "target"
    results = {}
    for task in PHASES[phase]:
        t0 = time.perf_counter()
        try:
            results[task.__name__] = task(d)
        except Exception:  # reported to the test, which fails with the traceback
            results[task.__name__] = {"error": traceback.format_exc()}
        results[task.__name__ + "_seconds"] = time.perf_counter() - t0
    write_json(d, f"jax_{phase}", results)


if __name__ == "__main__":
    main(*sys.argv[1:])
