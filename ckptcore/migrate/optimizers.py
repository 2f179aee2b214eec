"""Optimizer state between Keras 3 and Paddle: slots, step counters, hyperparameters.

Each side's :class:`~ckptcore.OptimizerState` is first read into a framework-neutral
description (:func:`describe`): the family (``adam``, ``momentum``, ``rmsprop``, ``adagrad``), its
hyperparameters under one set of names, and the epsilon convention of Adam (FRAMEWORKS.md §0.1:
Keras adds ε to the uncorrected √v, Paddle to the corrected one; ``kerasadam``/``kerasadamw``, the
Paddle optimizers in ``ckptcore_paddle.keras_adam``, follow Keras).  Slots are renamed through
neutral names and converted where their meaning differs:

* SGD momentum: Keras ``m ← μm − lr·g; w += m``, Paddle ``v ← μv + g; w −= lr·v``, so ``v = −m/lr``
  (exact for a constant learning rate only, §0.3);
* Adam's step count: Paddle keeps no counter but ``beta{1,2}_pow_acc = β^(t+1)`` (§0.5);
* everything else is the same quantity under another name (§2.4).

What cannot continue exactly becomes a warning that states the expected deviation, or a problem
(a :class:`~ckptcore.errors.MigrationError` unless ``approximate=True``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..state import OptimizerState

__all__ = ["describe", "Neutral", "target_kind", "slot_names", "neutral_slot", "convert_slot", "fallback",
           "scalar_slots", "compare", "synthesize_hyperparams", "NEUTRAL_SLOTS"]


@dataclass
class Neutral:
    family: str
    framework: str
    kind: str
    lr: float | None
    hp: dict[str, Any] = field(default_factory=dict)   # beta1, beta2, epsilon, eps_mode, amsgrad, ...
    unsupported: list[str] = field(default_factory=list)


# slot name -> neutral name, per framework
NEUTRAL_SLOTS = {
    "keras": {"momentum@adam": "m", "velocity": "v", "velocity_hat": "vmax",
              "momentum@momentum": "keras_m",
              "velocity@rmsprop": "ms", "momentum@rmsprop": "mom", "average_gradient": "mg",
              "accumulator": "acc"},
    "paddle": {"moment1": "m", "moment2": "v", "moment2_max": "vmax", "velocity": "paddle_v",
               "mean_square": "ms", "momentum": "mom", "mean_grad": "mg", "moment": "acc"},
}


def _num(x: Any, default: float | None = None) -> float | None:
    if isinstance(x, bool) or x is None:
        return default
    return float(x) if isinstance(x, (int, float)) else default


def describe(opt: OptimizerState, framework: str) -> Neutral:
    hp = opt.hyperparams or {}
    kind = opt.kind
    lr = _num(hp.get("learning_rate"))
    if framework == "keras":
        return _describe_keras(kind, hp, lr)
    return _describe_paddle(kind, hp, lr)


def _describe_keras(kind: str, hp: dict, lr: float | None) -> Neutral:
    wd = _num(hp.get("weight_decay"), 0.0) or 0.0
    out = Neutral(family=kind, framework="keras", kind=kind, lr=lr)
    if kind in ("adam", "adamw"):
        out.family = "adam"
        out.hp = {"beta1": _num(hp.get("beta_1"), 0.9), "beta2": _num(hp.get("beta_2"), 0.999),
                  "epsilon": _num(hp.get("epsilon"), 1e-7), "eps_mode": "keras",
                  "amsgrad": bool(hp.get("amsgrad", False))}
    elif kind == "sgd":
        out.family = "momentum"
        out.hp = {"momentum": _num(hp.get("momentum"), 0.0), "nesterov": bool(hp.get("nesterov", False))}
    elif kind == "rmsprop":
        out.hp = {"rho": _num(hp.get("rho"), 0.9), "momentum": _num(hp.get("momentum"), 0.0),
                  "epsilon": _num(hp.get("epsilon"), 1e-7), "centered": bool(hp.get("centered", False))}
    elif kind == "adagrad":
        out.hp = {"epsilon": _num(hp.get("epsilon"), 1e-7), "eps_mode": "inside_sqrt",
                  "initial_accumulator_value": _num(hp.get("initial_accumulator_value"), 0.1)}
    else:
        out.unsupported.append(f"the Keras optimizer {kind!r} has no Paddle counterpart here "
                               "(supported: Adam, AdamW, SGD, RMSprop, Adagrad)")
    out.hp["decoupled_wd"] = wd
    out.hp["coupled_wd"] = 0.0
    for key in ("clipnorm", "clipvalue", "global_clipnorm"):
        if hp.get(key) is not None:
            out.hp["clip"] = f"{key}={hp[key]}"
    if hp.get("use_ema"):
        out.unsupported.append("Keras use_ema=True keeps moving averages Paddle's optimizers do not have")
    return out


def _describe_paddle(kind: str, hp: dict, lr: float | None) -> Neutral:
    out = Neutral(family=kind, framework="paddle", kind=kind, lr=lr)
    coupled = 0.0
    reg = hp.get("regularization")
    if isinstance(reg, dict):
        if reg.get("kind") == "L2Decay":
            coupled = float(reg.get("coeff", 0.0))
        else:
            out.unsupported.append(f"Paddle regularization {reg.get('kind')} has no Keras optimizer "
                                   "counterpart")
    if hp.get("regularization_method") == "l2_decay":
        coupled = float(hp.get("regularization_coeff") or 0.0)
    if kind in ("adam", "adamw", "kerasadam", "kerasadamw"):
        out.family = "adam"
        out.hp = {"beta1": _num(hp.get("beta1"), 0.9), "beta2": _num(hp.get("beta2"), 0.999),
                  "epsilon": _num(hp.get("epsilon"), 1e-8),
                  "eps_mode": "keras" if kind.startswith("keras") else "paddle",
                  "amsgrad": bool(hp.get("amsgrad", False))}
        decoupled = (_num(hp.get("weight_decay"), 0.0) or 0.0) if kind.endswith("w") else 0.0
    elif kind in ("momentum", "sgd"):
        out.family = "momentum"
        out.hp = {"momentum": _num(hp.get("momentum"), 0.0) if kind == "momentum" else 0.0,
                  "nesterov": bool(hp.get("use_nesterov", False))}
        decoupled = 0.0
    elif kind == "rmsprop":
        out.hp = {"rho": _num(hp.get("rho"), 0.95), "momentum": _num(hp.get("momentum"), 0.0),
                  "epsilon": _num(hp.get("epsilon"), 1e-6), "centered": bool(hp.get("centered", False))}
        decoupled = 0.0
    elif kind == "adagrad":
        out.hp = {"epsilon": _num(hp.get("epsilon"), 1e-6), "eps_mode": "outside_sqrt",
                  "initial_accumulator_value": _num(hp.get("initial_accumulator_value"), 0.0)}
        decoupled = 0.0
    else:
        out.unsupported.append(f"the Paddle optimizer {kind!r} has no Keras counterpart here "
                               "(supported: Adam, AdamW, Momentum, SGD, RMSProp, Adagrad)")
        decoupled = 0.0
    out.hp["decoupled_wd"] = decoupled
    out.hp["coupled_wd"] = coupled
    if isinstance(hp.get("grad_clip"), dict):
        out.hp["clip"] = str(hp["grad_clip"].get("kind"))
    return out


def target_kind(src: Neutral, to: str) -> str:
    """The natural counterpart when no target optimizer is given."""
    f = src.family
    if to == "paddle":
        if f == "adam":
            return "adamw" if src.hp.get("decoupled_wd") else "adam"
        if f == "momentum":
            return "momentum" if src.hp.get("momentum") else "sgd"
        return f
    if f == "adam":
        return "adamw" if src.hp.get("decoupled_wd") else "adam"
    if f == "momentum":
        return "sgd"
    return f


def synthesize_hyperparams(src: Neutral, to: str, kind: str) -> dict[str, Any]:
    """Hyperparameters of ``kind`` in framework ``to`` that continue ``src`` (no target optimizer given)."""
    h = src.hp
    hp: dict[str, Any] = {"learning_rate": src.lr}
    if to == "paddle":
        names = {"beta1": "beta1", "beta2": "beta2", "epsilon": "epsilon", "amsgrad": "amsgrad",
                 "momentum": "momentum", "nesterov": "use_nesterov", "rho": "rho", "centered": "centered",
                 "initial_accumulator_value": "initial_accumulator_value"}
        if kind.endswith("adamw"):
            hp["weight_decay"] = h.get("decoupled_wd", 0.0)
    else:
        names = {"beta1": "beta_1", "beta2": "beta_2", "epsilon": "epsilon", "amsgrad": "amsgrad",
                 "momentum": "momentum", "nesterov": "nesterov", "rho": "rho", "centered": "centered",
                 "initial_accumulator_value": "initial_accumulator_value"}
        hp["weight_decay"] = h.get("decoupled_wd") or None
    for k, v in h.items():
        if k in names:
            hp[names[k]] = v
    return hp


def slot_names(n: Neutral, framework: str) -> list[str]:
    """The slots a ``framework`` optimizer described by ``n`` keeps per parameter."""
    f, h = n.family, n.hp
    if framework == "paddle":
        if f == "adam":
            return ["moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc"] + (["moment2_max"] if h.get("amsgrad") else [])
        if f == "momentum":
            return [] if n.kind == "sgd" else ["velocity"]
        if f == "rmsprop":
            return ["momentum", "mean_square", "mean_grad"]
        if f == "adagrad":
            return ["moment"]
        return []
    if f == "adam":
        return ["momentum", "velocity"] + (["velocity_hat"] if h.get("amsgrad") else [])
    if f == "momentum":
        return ["momentum"] if h.get("momentum") else []
    if f == "rmsprop":
        return ["velocity"] + (["momentum"] if h.get("momentum") else []) + (["average_gradient"] if h.get("centered") else [])
    if f == "adagrad":
        return ["accumulator"]
    return []


def neutral_slot(framework: str, family: str, slot: str) -> str | None:
    table = NEUTRAL_SLOTS[framework]
    return table.get(f"{slot}@{family}", table.get(slot))


_MOMENTUM = {"keras_m", "paddle_v"}


def convert_slot(value: np.ndarray, src_neutral: str, dst_neutral: str, lr: float | None) -> np.ndarray:
    """A slot value from one convention to the other (only SGD momentum differs; a :func:`fallback`
    such as ``v`` standing in for AMSGrad's ``vmax`` is the same quantity)."""
    if {src_neutral, dst_neutral} == _MOMENTUM:
        if not lr:
            raise ValueError("converting SGD momentum needs a non-zero learning rate")
        return (value * np.float32(-1.0 / lr)) if src_neutral == "keras_m" else (value * np.float32(-lr))
    return value


def fallback(dst_neutral: str) -> str | None:
    """A source slot that stands in for a missing one (``vmax`` starts as ``v``)."""
    return {"vmax": "v", "keras_m": "paddle_v", "paddle_v": "keras_m"}.get(dst_neutral)


def scalar_slots(n: Neutral, step: int) -> dict[str, np.ndarray]:
    """Paddle Adam's ``beta{1,2}_pow_acc``: β^(t+1) in float32, computed as Keras does (one ``pow``)."""
    if n.family != "adam":
        return {}
    b1, b2 = np.float32(n.hp["beta1"]), np.float32(n.hp["beta2"])
    return {"beta1_pow_acc": np.array([b1 ** np.float32(step + 1)], np.float32),
            "beta2_pow_acc": np.array([b2 ** np.float32(step + 1)], np.float32)}


# ----------------------------------------------------------------------------- checks


_LABEL = {"beta1": "beta_1/beta1", "beta2": "beta_2/beta2", "momentum": "momentum", "nesterov": "nesterov",
          "rho": "rho", "centered": "centered", "amsgrad": "amsgrad", "decoupled_wd": "decoupled weight decay"}


def compare(src: Neutral, dst: Neutral, *, scheduled: bool, slots: dict[str, dict[str, np.ndarray]],
            step: int, warnings: list[str], problems: list[str], approximate: bool = False) -> None:
    """Warnings for what makes the continued run differ, problems for what cannot continue."""
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
    if src.hp.get("coupled_wd") or dst.hp.get("coupled_wd"):
        (warnings if approximate else problems).append("optimizer: L2 weight decay added to the gradient (Paddle weight_decay=<float> on "
                        "Adam/Momentum) has no Keras optimizer counterpart; Keras weight_decay is decoupled "
                        "(use paddle.optimizer.AdamW on the Paddle side)")
    if src.hp.get("clip") != dst.hp.get("clip"):
        warnings.append(f"optimizer: gradient clipping differs (source {src.hp.get('clip')}, target "
                        f"{dst.hp.get('clip')}); it is not converted")
    if src.family == "adam":
        _adam_epsilon(src, dst, slots, step, warnings)
    elif src.family == "momentum":
        if scheduled and (src.hp.get("momentum") or dst.hp.get("momentum")):
            warnings.append("optimizer: SGD momentum under a changing learning rate is approximate: Keras "
                            "folds each step's lr into its momentum, Paddle applies the current lr to the "
                            "raw velocity; the velocity is converted with the current lr (v = -m/lr)")
    elif src.family == "rmsprop":
        if not _close(src.hp.get("epsilon"), dst.hp.get("epsilon")):
            warnings.append(f"optimizer: RMSprop epsilon differs (source {src.hp.get('epsilon')}, target "
                            f"{dst.hp.get('epsilon')}); both add it inside the square root")
    elif src.family == "adagrad":
        _adagrad_epsilon(src, dst, slots, warnings)


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return a == b
    return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-12)


def _eff_eps(n: Neutral, t: int) -> float:
    """The ε that the Keras formula ``m/(√v + ε)`` would need to match ``n``'s update at step ``t``."""
    eps = float(n.hp["epsilon"])
    if n.hp.get("eps_mode") == "paddle":
        return eps * math.sqrt(max(0.0, 1.0 - float(n.hp["beta2"]) ** t))
    return eps


def _adam_epsilon(src: Neutral, dst: Neutral, slots: dict, step: int, warnings: list[str]) -> None:
    t = step + 1
    es, ed = _eff_eps(src, t), _eff_eps(dst, t)
    if math.isclose(es, ed, rel_tol=1e-6) and src.hp.get("eps_mode") == dst.hp.get("eps_mode"):
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
    hint = ("use ckptcore_paddle.keras_adam.KerasAdam/KerasAdamW on the Paddle side for an exact "
            "continuation" if dst.framework == "paddle" else
            "runs trained with ckptcore_paddle.keras_adam.KerasAdam continue exactly in Keras")
    warnings.append(f"optimizer: Adam's epsilon enters the update differently (effective ε at step {t}: "
                    f"source {es:.3g}, target {ed:.3g}; Keras adds ε to √v, Paddle to √v̂); the first "
                    f"continued step may move a weight up to {dev:.2e} differently, more where √v is "
                    f"near ε. {hint}")


def _adagrad_epsilon(src: Neutral, dst: Neutral, slots: dict, warnings: list[str]) -> None:
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
    warnings.append(f"optimizer: Adagrad has no exact mapping (Keras divides by √(acc+ε), Paddle by √acc+ε; "
                    f"source ε {src.hp['epsilon']}, target ε {dst.hp['epsilon']}); each continued step may "
                    f"move a weight up to {dev:.2e} differently (lr·max √acc·|1/d_src − 1/d_dst|)")
