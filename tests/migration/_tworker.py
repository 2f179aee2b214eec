"""PyTorch half of the torch migration tests: ``python _tworker.py source|target|jax <dir>``.

``source`` trains the torch twins and saves the checkpoints the Keras and Paddle workers continue
(and the torch reference continuations); ``target`` loads the Keras and Paddle workers'
checkpoints into torch objects and continues them; ``jax`` is the PyTorch side of the JAX pairs
(``_jpairs.py``).  Results go to ``<dir>/torch_<phase>.json``
(an ``error`` entry per failed task).  Imports torch only.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
import warnings

import numpy as np

import _torch_models as tm  # noqa: I001  (sets torch's thread count first)
import torch
import ckptcore
from _common import STEPS, TORCH_OPTS, TORCH_TWIN_OPT, TORCH_TWINS, max_diff, pair_batches, pair_probe, write_json

PARTNERS = ("keras", "paddle")
DATA_SEED = {"torch": 700, "keras": 800, "paddle": 900}


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, ckptcore.MigrationWarning)]


def _opt(name: str, partner: str, net):
    return tm.optimizer(*TORCH_OPTS[TORCH_TWIN_OPT[name]][f"torch_{partner}"], net.parameters())


def _save_logits(d: str, prefix: str, net, name: str, tag: str) -> None:
    np.save(f"{d}/{prefix}_logits{tag}.npy", tm.logits(net, pair_probe(name, nchw=True)))
    if tag == "1":
        np.save(f"{d}/{prefix}_logits1t.npy", tm.logits(net, pair_probe(name, nchw=True), training=True))


# ----------------------------------------------------------------------------- source


def twins_source(d: str) -> dict:
    for i, name in enumerate(TORCH_TWINS):
        for partner in PARTNERS:
            net = tm.twin(name, 100 + i)
            opt = _opt(name, partner, net)
            data = pair_batches(name, DATA_SEED["torch"] + i, 2 * STEPS, nchw=True)
            for x, y in data[:STEPS]:
                tm.train_step(net, opt, x, y)
            prefix = f"t_{name}_{partner}"
            ckptcore.save_state(f"{d}/{prefix}", model=net, optimizer=opt)
            _save_logits(d, prefix, net, name, "0")
            for x, y in data[STEPS:]:
                tm.train_step(net, opt, x, y)
            _save_logits(d, prefix, net, name, "1")
    ckptcore.save_state(f"{d}/t_branches", model=tm.twin("branches", 3))
    return {"ok": True}


def structure(d: str) -> dict:
    """What the traced forward pass records for the Transformer block and the BatchNorms."""
    import ckptcore_torch
    st = ckptcore_torch.capture(tm.twin("transformer"))
    inputs = {i.layer: i.attrs.get("inputs") for i in st.params.values()}
    roles = {k: str(i.role) for k, i in st.params.items() if i.layer == "attn"}
    bn = ckptcore_torch.capture(tm.twin("resnet")).params["stem_bn.running_var"].attrs
    return {"inputs": inputs, "roles": roles, "bn": {k: bn.get(k) for k in ("momentum", "torch_momentum",
                                                                           "variance_update")}}


_SCHEDULERS = {
    "StepLR": {"step_size": 3, "gamma": 0.5}, "ExponentialLR": {"gamma": 0.9},
    "MultiStepLR": {"milestones": [4, 7, 7], "gamma": 0.5}, "CosineAnnealingLR": {"T_max": 8, "eta_min": 0.01},
    "PolynomialLR": {"total_iters": 8, "power": 2.0},
    "CosineAnnealingWarmRestarts": {"T_0": 3, "T_mult": 2, "eta_min": 0.01},
}


def schedules(d: str) -> dict:
    """Each scheduler's canonical formula against torch's own rates (10 steps past step 5, also past
    a cosine's end), and the dialect's positioned state restored into a fresh scheduler."""
    from ckptcore.migrate.schedules import value
    from ckptcore_torch._dialect import DIALECT
    import ckptcore_torch

    out = {}
    for kind, kw in _SCHEDULERS.items():
        def make():
            p = torch.nn.Parameter(torch.zeros(2))
            opt = torch.optim.SGD([p], lr=0.1)
            return opt, getattr(torch.optim.lr_scheduler, kind)(opt, **kw)
        opt, sch = make()
        for _ in range(5):
            opt.step()
            sch.step()
        st = ckptcore_torch.capture(torch.nn.Linear(1, 1), scheduler=sch).schedule
        form = DIALECT.schedule_to_canonical(st)
        ref = []
        for t in range(5, 15):
            ref.append(opt.param_groups[0]["lr"])
            opt.step()
            sch.step()
        formula = [value(form, t, DIALECT.cosine_past_end) for t in range(5, 15)]
        # a fresh scheduler positioned at step 5 by the dialect, its optimizer at that rate
        opt2, sch2 = make()
        moved, _ = DIALECT.schedule_from_canonical(form, st, 5, value(form, 5, DIALECT.cosine_past_end))
        sch2.load_state_dict(moved.state)
        opt2.param_groups[0]["lr"] = moved.last_lr
        cont = []
        for _ in range(10):
            cont.append(opt2.param_groups[0]["lr"])
            opt2.step()
            sch2.step()
        out[kind] = {"formula_diff": max_diff(formula, ref), "restored_diff": max_diff(cont, ref)}
    return out


def rng(d: str) -> dict:
    from ckptcore.migrate.rng import convert_rng
    from ckptcore_torch._dialect import DIALECT

    entry = convert_rng({"keras": {"state": [1, 2], "seed": 1}}, DIALECT, 7)["torch"]
    torch.manual_seed(int(np.frombuffer(entry[:8].tobytes(), "<u8")[0]))
    return {"state_equal": bool(np.array_equal(torch.get_rng_state().numpy(), entry))}


# ----------------------------------------------------------------------------- target


def twins_target(d: str) -> dict:
    out: dict = {}
    for i, name in enumerate(TORCH_TWINS):
        for partner in PARTNERS:
            prefix = f"{partner[0]}_{name}"
            net = tm.twin(name, 200 + i)
            opt = _opt(name, partner, net)
            try:
                _, warns = _caught(lambda: ckptcore.load_state(f"{d}/{prefix}", model=net, optimizer=opt))
            except ckptcore.MigrationError as e:
                out[f"{partner}/{name}"] = {"error": str(e)}
                continue
            probe = pair_probe(name, nchw=True)
            before = max_diff(tm.logits(net, probe), np.load(f"{d}/{prefix}_logits0.npy"))
            for x, y in pair_batches(name, DATA_SEED[partner] + i, 2 * STEPS, nchw=True)[STEPS:]:
                tm.train_step(net, opt, x, y)
            out[f"{partner}/{name}"] = {
                "logits_diff": before, "warnings": warns,
                "after_eval_diff": max_diff(tm.logits(net, probe), np.load(f"{d}/{prefix}_logits1.npy")),
                "after_train_diff": max_diff(tm.logits(net, probe, training=True),
                                             np.load(f"{d}/{prefix}_logits1t.npy"))}
    for partner in PARTNERS:
        try:
            ckptcore.load_state(f"{d}/{partner[0]}_branches", model=tm.twin("branches", 4))
            out[f"{partner}/branches"] = {"error": None}
        except ckptcore.MigrationError as e:
            out[f"{partner}/branches"] = {"error": str(e)}
    return out


def cli(d: str) -> dict:
    """``ckpt convert`` of the Keras Transformer run to a torch checkpoint, loaded by torch."""
    from ckptcore import cli as ckpt

    rc = ckpt.main(["convert", f"{d}/k_transformer", f"{d}/k2t_transformer", "--to", "torch",
                    "--model", "_torch_models:cli_transformer"])
    net, opt = tm.cli_transformer()
    ckptcore.load_state(f"{d}/k2t_transformer", model=net, optimizer=opt)
    return {"rc": rc, "logits_diff": max_diff(tm.logits(net, pair_probe("transformer", nchw=True)),
                                              np.load(f"{d}/k_transformer_logits0.npy")),
            "step": int(max(float(s["step"]) for s in opt.state.values()))}


def jax_pairs(d: str) -> dict:
    """PyTorch <-> JAX: continue the JAX worker's runs here, and train the runs it continues."""
    from _jpairs import jax_pairs as pairs
    return pairs(d, tm, "torch", lambda spec, net: tm.optimizer(*spec, net.parameters()), nchw=True)


PHASES = {"source": [rng, structure, schedules, twins_source], "target": [twins_target, cli], "jax": [jax_pairs]}


def main(phase: str, d: str) -> None:
    results = {}
    for task in PHASES[phase]:
        t0 = time.perf_counter()
        try:
            results[task.__name__] = task(d)
        except Exception:  # reported to the test, which fails with the traceback
            results[task.__name__] = {"error": traceback.format_exc()}
        results[task.__name__ + "_seconds"] = time.perf_counter() - t0
    write_json(d, f"torch_{phase}", results)


if __name__ == "__main__":
    main(*sys.argv[1:])
