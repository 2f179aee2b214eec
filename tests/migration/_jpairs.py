"""The partner half of the JAX pairs, the same in the PyTorch, Keras and Paddle workers (imports no
framework itself: ``xm`` is the worker's models module, ``make_opt(spec, net)`` its optimizer).

For each twin: load the JAX run (``_jworker.py source``) into the partner's twin and continue it for
5 steps on the JAX run's data, comparing logits with the JAX run's own; then train the partner's run
the JAX worker continues (``_jworker.py target``): 5 steps, save, logits; 5 more, logits.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import numpy as np

import ckptcore
from _common import JAX_DATA_SEED, JAX_TWINS, STEPS, jax_opt, jax_source, max_diff, pair_batches, pair_probe


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, ckptcore.MigrationWarning)]


def jax_pairs(d: str, xm: Any, partner: str, make_opt: Callable[[tuple, Any], Any], *, nchw: bool) -> dict:
    out: dict = {}
    for i, name in enumerate(JAX_TWINS):
        probe = pair_probe(name, nchw=nchw)
        spec = jax_opt(name, partner, partner)
        net = xm.twin(name, 1700 + i)
        opt = make_opt(spec, net)
        prefix = jax_source(name, partner)
        try:
            _, warns = _caught(lambda: ckptcore.load_state(f"{d}/{prefix}", model=net, optimizer=opt))
        except ckptcore.MigrationError as e:
            out[name] = {"error": str(e)}
        else:
            before = max_diff(xm.logits(net, probe), np.load(f"{d}/{prefix}_logits0.npy"))
            for x, y in pair_batches(name, JAX_DATA_SEED["jax"] + i, 2 * STEPS, nchw=nchw)[STEPS:]:
                xm.train_step(net, opt, x, y)
            out[name] = {"logits_diff": before, "warnings": warns,
                         "after_eval_diff": max_diff(xm.logits(net, probe), np.load(f"{d}/{prefix}_logits1.npy")),
                         "after_train_diff": max_diff(xm.logits(net, probe, training=True),
                                                      np.load(f"{d}/{prefix}_logits1t.npy"))}
        src = xm.twin(name, 1800 + i)
        sopt = make_opt(spec, src)
        data = pair_batches(name, JAX_DATA_SEED[partner] + i, 2 * STEPS, nchw=nchw)
        for x, y in data[:STEPS]:
            xm.train_step(src, sopt, x, y)
        save = f"{d}/{partner[0]}2j_{name}"
        ckptcore.save_state(save, model=src, optimizer=sopt)
        np.save(f"{save}_logits0.npy", xm.logits(src, probe))
        for x, y in data[STEPS:]:
            xm.train_step(src, sopt, x, y)
        np.save(f"{save}_logits1.npy", xm.logits(src, probe))
        np.save(f"{save}_logits1t.npy", xm.logits(src, probe, training=True))
    try:
        ckptcore.load_state(f"{d}/j_branches", model=xm.twin("branches", 5))
        out["branches"] = {"error": None}
    except ckptcore.MigrationError as e:
        out["branches"] = {"error": str(e)}
    ckptcore.save_state(f"{d}/{partner[0]}2j_branches", model=xm.twin("branches", 6))
    return out
