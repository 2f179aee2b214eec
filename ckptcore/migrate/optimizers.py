"""Optimizer state in neutral terms: comparing two optimizers, and what continues exactly.

Each side's :class:`~ckptcore.OptimizerState` is first read into a :class:`~.dialect.Neutral` by
its framework's dialect: the family (``adam``, ``momentum``, ``rmsprop``, ``adagrad``), its
hyperparameters under one set of names, the conventions that differ between frameworks (where
Adam and Adagrad add ε, where SGD momentum keeps the learning rate) and the step count.  Slots go
through neutral names and conventions the same way (:mod:`.dialect` lists them), so this module
only compares: what makes the continued run differ becomes a warning that states the expected
deviation, and what cannot continue becomes a problem (a :class:`~ckptcore.errors.MigrationError`
unless ``approximate=True``).  The conventions are described in docs/MIGRATION.md, section
"Framework facts migration relies on".
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .dialect import Neutral

__all__ = ["Neutral", "compare", "effective_epsilon"]


# ----------------------------------------------------------------------------- checks


_LABEL = {"beta1": "beta1", "beta2": "beta2", "momentum": "momentum", "nesterov": "nesterov",
          "rho": "rho", "centered": "centered", "amsgrad": "amsgrad", "decoupled_wd": "decoupled weight decay"}

# How each convention reads in a message.
_EPS_TEXT = {"uncorrected": "adds ε to √v", "corrected": "adds ε to √v̂",
             "inside_sqrt": "divides by √(acc+ε)", "outside_sqrt": "divides by √acc+ε"}
_MOMENTUM_TEXT = {"update": "folds each step's lr into its momentum",
                  "gradient": "applies the current lr to a momentum of raw gradients"}


def compare(src: Neutral, dst: Neutral, *, scheduled: bool, slots: dict[str, dict[str, np.ndarray]],
            step: int, warnings: list[str], problems: list[str], approximate: bool = False) -> None:
    """Warnings for what makes the continued run differ, problems for what cannot continue.

    ``slots`` are the source's slots under neutral names (for the deviation estimates).
    """
    problems.extend(src.unsupported + dst.unsupported)
    if src.family != dst.family:
        problems.append(f"optimizer: the source's {src.framework} {src.kind} cannot continue as a "
                        f"{dst.framework} {dst.kind}; use the counterpart family ({src.family})")
        return
    for key, label in _LABEL.items():
        a, b = src.hp.get(key), dst.hp.get(key)
        if a is not None and b is not None and not _close(a, b):
            warnings.append(f"optimizer: the target's {label} is {b} but the source used {a}; the continued "
                            "run follows the target's value (construct the target optimizer with the "
                            "source's value to continue exactly)")
    a, b = src.hp.get("coupled_wd") or 0.0, dst.hp.get("coupled_wd") or 0.0
    if not _close(a, b):
        (warnings if approximate else problems).append(
            f"optimizer: L2 weight decay added to the gradient differs (source {a}, target {b}) and is "
            "not the same as decoupled weight decay (applied to the weights), so it cannot be carried "
            "over; use decoupled weight decay (an AdamW-style optimizer) on both sides")
    if src.hp.get("clip") != dst.hp.get("clip"):
        warnings.append(f"optimizer: gradient clipping differs (source {src.hp.get('clip')}, target "
                        f"{dst.hp.get('clip')}); it is not converted")
    if src.family == "adam":
        _adam_epsilon(src, dst, slots, step, warnings)
    elif src.family == "momentum":
        fs, fd = src.hp.get("momentum_form"), dst.hp.get("momentum_form")
        if scheduled and fs != fd and (src.hp.get("momentum") or dst.hp.get("momentum")):
            warnings.append(f"optimizer: SGD momentum under a changing learning rate is approximate: the source "
                            f"{_MOMENTUM_TEXT.get(fs, fs)}, the target {_MOMENTUM_TEXT.get(fd, fd)}; the "
                            "momentum is converted with the current lr (b = -m/lr)")
    elif src.family == "rmsprop":
        ms, md = src.hp.get("eps_mode") or "inside_sqrt", dst.hp.get("eps_mode") or "inside_sqrt"
        if ms != md:
            _rmsprop_epsilon(src, dst, slots, warnings)
        elif not _close(src.hp.get("epsilon"), dst.hp.get("epsilon")):
            warnings.append(f"optimizer: RMSprop epsilon differs (source {src.hp.get('epsilon')}, target "
                            f"{dst.hp.get('epsilon')}); both add it inside the square root")
    elif src.family == "adagrad":
        _adagrad_epsilon(src, dst, slots, warnings)


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return a == b
    return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-12)


def effective_epsilon(n: Neutral, t: int) -> float:
    """The ε that the ``uncorrected`` formula ``m/(√v + ε)`` needs to match ``n``'s update at step ``t``."""
    eps = float(n.hp["epsilon"])
    if n.hp.get("eps_mode") == "corrected":
        return eps * math.sqrt(max(0.0, 1.0 - float(n.hp["beta2"]) ** t))
    return eps


def _adam_epsilon(src: Neutral, dst: Neutral, slots: dict, step: int, warnings: list[str]) -> None:
    t = step + 1
    es, ed = effective_epsilon(src, t), effective_epsilon(dst, t)
    ms, md = src.hp.get("eps_mode"), dst.hp.get("eps_mode")
    if math.isclose(es, ed, rel_tol=1e-6) and ms == md:
        return
    b1, b2 = float(dst.hp["beta1"]), float(dst.hp["beta2"])
    alpha = (dst.lr or src.lr or 0.0) * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    dev = 0.0
    for s in slots.values():
        m, v = s.get("m"), s.get("v")
        if m is None or v is None:
            continue
        sv = np.sqrt(np.maximum(v.astype(np.float64), 0))
        d = alpha * np.abs(m) * np.abs(1 / (sv + es) - 1 / (sv + ed))
        dev = max(dev, float(d.max(initial=0.0)))
    hint = ""
    if ms != md and dst.counterparts.get(ms):
        hint = f" Use {dst.counterparts[ms]} on the target side for an exact continuation."
    elif ms != md and src.counterparts.get(md):
        hint = f" Runs trained with {src.counterparts[md]} on the source side continue exactly."
    warnings.append(f"optimizer: Adam's epsilon enters the update differently (effective ε at step {t}: "
                    f"source {es:.3g}, target {ed:.3g}; the source {_EPS_TEXT.get(ms, ms)}, the target "
                    f"{_EPS_TEXT.get(md, md)}); the first continued step may move a weight up to {dev:.2e} "
                    f"differently, more where √v is near ε.{hint}")


def _rmsprop_epsilon(src: Neutral, dst: Neutral, slots: dict, warnings: list[str]) -> None:
    """RMSprop with ε inside √ on one side and outside on the other: the first step's deviation."""
    def denom(n: Neutral, ms: np.ndarray) -> np.ndarray:
        eps = float(n.hp.get("epsilon") or 0.0)
        return np.sqrt(ms + eps) if (n.hp.get("eps_mode") or "inside_sqrt") == "inside_sqrt" else np.sqrt(ms) + eps
    lr = dst.lr or src.lr or 0.0
    dev = 0.0
    for s in slots.values():
        ms = s.get("ms")
        if ms is None:
            continue
        a = np.maximum(ms.astype(np.float64), 0)
        d = lr * np.sqrt(a) * np.abs(1 / denom(src, a) - 1 / denom(dst, a))
        dev = max(dev, float(d.max(initial=0.0)))
    es, ed = src.hp.get("eps_mode") or "inside_sqrt", dst.hp.get("eps_mode") or "inside_sqrt"
    warnings.append(f"optimizer: RMSprop adds epsilon differently (the source {_EPS_TEXT.get(es, es).replace('acc', 'ms')}, "
                    f"the target {_EPS_TEXT.get(ed, ed).replace('acc', 'ms')}; source ε {src.hp.get('epsilon')}, target ε "
                    f"{dst.hp.get('epsilon')}); each continued step may move a weight up to {dev:.2e} differently "
                    "(lr·max √ms·|1/d_src − 1/d_dst|)")


def _adagrad_epsilon(src: Neutral, dst: Neutral, slots: dict, warnings: list[str]) -> None:
    ms, md = src.hp.get("eps_mode"), dst.hp.get("eps_mode")
    if ms == md and _close(src.hp.get("epsilon"), dst.hp.get("epsilon")):
        return

    def denom(n: Neutral, acc: np.ndarray) -> np.ndarray:
        eps = float(n.hp["epsilon"])
        return np.sqrt(acc + eps) if n.hp.get("eps_mode") == "inside_sqrt" else np.sqrt(acc) + eps
    lr = dst.lr or src.lr or 0.0
    dev = 0.0
    for s in slots.values():
        acc = s.get("acc")
        if acc is None:
            continue
        a = np.maximum(acc.astype(np.float64), 0)
        # |g| <= sqrt(acc) once g² is in the accumulator, so lr*|g/d_s - g/d_d| <= lr*sqrt(a)*|1/d_s - 1/d_d|
        d = lr * np.sqrt(a) * np.abs(1 / denom(src, a) - 1 / denom(dst, a))
        dev = max(dev, float(d.max(initial=0.0)))
    warnings.append(f"optimizer: Adagrad has no exact mapping (the source {_EPS_TEXT.get(ms, ms)}, the target "
                    f"{_EPS_TEXT.get(md, md)}; source ε {src.hp['epsilon']}, target ε {dst.hp['epsilon']}); "
                    f"each continued step may move a weight up to {dev:.2e} differently "
                    "(lr·max √acc·|1/d_src − 1/d_dst|)")
