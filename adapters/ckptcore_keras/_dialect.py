"""Keras 3's migration dialect: its optimizers, schedules and RNG in ckptcore's neutral terms.

Pure Python/NumPy (imports neither TensorFlow nor Keras).  The conventions translated here are
listed in docs/MIGRATION.md, section "Framework facts migration relies on":

* Adam adds ε to the uncorrected √v (``eps_mode="uncorrected"``); Adagrad divides by √(acc+ε);
* SGD momentum folds the learning rate into its slot (``m ← μm − lr·g; w += m``), so the neutral
  gradient-form buffer is ``−m/lr``;
* ``weight_decay`` of every Keras optimizer is decoupled;
* slot names depend on the family (``momentum`` is Adam's m, SGD's buffer and RMSprop's momentum);
* a schedule is evaluated at ``optimizer.iterations``, which counts micro-steps under
  ``gradient_accumulation_steps``; ``CosineDecay`` holds its final rate after ``decay_steps``;
* the optimizer keeps raw gradient sums while accumulating, and a slot for every variable;
* generators: TensorFlow's global Philox ``[seed, 0, 0]`` and Keras' ``SeedGenerator`` ``[seed, 0]``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ckptcore.errors import MigrationError
from ckptcore.migrate.dialect import BaseDialect, Canon, Neutral, number, read_hyperparams, slots_by_table
from ckptcore.state import OptimizerState, ScheduleState, TrainingState

__all__ = ["DIALECT", "KerasDialect"]

# Hyperparameter names: neutral -> Keras.
_NAMES = {"beta1": "beta_1", "beta2": "beta_2", "epsilon": "epsilon", "amsgrad": "amsgrad",
          "momentum": "momentum", "nesterov": "nesterov", "rho": "rho", "centered": "centered",
          "initial_accumulator_value": "initial_accumulator_value"}


def _slot_table(n: Neutral) -> dict[str, str]:
    """Keras slot name -> neutral name for an optimizer described by ``n``."""
    f, h = n.family, n.hp
    if f == "adam":
        return {"momentum": "m", "velocity": "v", **({"velocity_hat": "vmax"} if h.get("amsgrad") else {})}
    if f == "momentum":
        return {"momentum": "momentum"} if h.get("momentum") else {}
    if f == "rmsprop":
        return {"velocity": "ms", **({"momentum": "mom"} if h.get("momentum") else {}),
                **({"average_gradient": "mg"} if h.get("centered") else {})}
    if f == "adagrad":
        return {"accumulator": "acc"}
    return {}


# Every slot name each family may keep (to read a state whatever its flags).
_ALL = {"adam": {"momentum": "m", "velocity": "v", "velocity_hat": "vmax"},
        "momentum": {"momentum": "momentum"},
        "rmsprop": {"velocity": "ms", "momentum": "mom", "average_gradient": "mg"},
        "adagrad": {"accumulator": "acc"}}


# Neutral hyperparameter -> (Keras' name, Keras' default), for the families read by table alone.
_HYPERPARAMS = {
    "rmsprop": {"rho": ("rho", 0.9), "momentum": ("momentum", 0.0), "epsilon": ("epsilon", 1e-7),
                "centered": ("centered", False)},
    "adagrad": {"epsilon": ("epsilon", 1e-7), "initial_accumulator_value": ("initial_accumulator_value", 0.1)},
}


class KerasDialect(BaseDialect):
    name = "keras"
    # The adapter records every Flatten's map (no default order), cosine schedules hold their floor
    # past the end, and accumulated gradients are sums: BaseDialect's defaults.
    schedule_follows_optimizer = True
    accumulation_in_optimizer = True

    # ------------------------------------------------------------------ optimizer

    def optimizer_to_neutral(self, opt: OptimizerState, schedule: ScheduleState | None) -> Neutral:
        hp, kind = opt.hyperparams or {}, opt.kind
        out = Neutral(family=kind, framework=self.name, kind=kind, lr=number(hp.get("learning_rate")),
                      step=int(opt.step))
        if kind in ("adam", "adamw"):
            out.family = "adam"
            out.hp = {"beta1": number(hp.get("beta_1"), 0.9), "beta2": number(hp.get("beta_2"), 0.999),
                      "epsilon": number(hp.get("epsilon"), 1e-7), "eps_mode": "uncorrected",
                      "amsgrad": bool(hp.get("amsgrad", False))}
        elif kind == "sgd":
            out.family = "momentum"
            out.hp = {"momentum": number(hp.get("momentum"), 0.0), "nesterov": bool(hp.get("nesterov", False)),
                      "momentum_form": "update"}
        elif kind in _HYPERPARAMS:
            out.hp = read_hyperparams(hp, _HYPERPARAMS[kind])
            if kind == "adagrad":
                out.hp["eps_mode"] = "inside_sqrt"
        else:
            out.unsupported.append(f"the Keras optimizer {kind!r} cannot be migrated "
                                   "(supported: Adam, AdamW, SGD, RMSprop, Adagrad)")
        out.hp["decoupled_wd"] = number(hp.get("weight_decay"), 0.0) or 0.0
        out.hp["coupled_wd"] = 0.0
        for key in ("clipnorm", "clipvalue", "global_clipnorm"):
            if hp.get(key) is not None:
                out.hp["clip"] = f"{key}={hp[key]}"
        if hp.get("use_ema"):
            out.unsupported.append("Keras use_ema=True keeps moving averages of the weights that no "
                                   "neutral optimizer has")
        return out

    def optimizer_from_neutral(self, n: Neutral) -> tuple[str, dict[str, Any]]:
        if n.family == "adam":
            kind = "adamw" if n.hp.get("decoupled_wd") else "adam"
        elif n.family == "momentum":
            kind = "sgd"
        else:
            kind = n.family
        hp: dict[str, Any] = {"learning_rate": n.lr, "weight_decay": n.hp.get("decoupled_wd") or None}
        hp.update({_NAMES[k]: v for k, v in n.hp.items() if k in _NAMES})
        return kind, hp

    def slots_to_neutral(self, n: Neutral, slots: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        table = _ALL.get(n.family, {})
        out = {table[k]: v for k, v in slots.items() if k in table}
        if "momentum" in out and n.family == "momentum":
            out["momentum"] = out["momentum"] * np.float32(-1.0 / _lr(n))   # b = -m/lr
        return out

    def slots_from_neutral(self, n: Neutral, slots: Mapping[str, np.ndarray], *, source: Neutral,
                           like: np.ndarray, current: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        table = _slot_table(n)
        if current is not None:   # a built optimizer lists its slots per variable: take those
            table = {k: _ALL.get(n.family, {}).get(k, k) for k in current}

        def convert(name: str, value: np.ndarray) -> np.ndarray:
            if name == "momentum" and n.family == "momentum":
                return value * np.float32(-_lr(source))    # m = -lr·b, with the lr it was built with
            return value
        return slots_by_table(table, slots, like, convert)

    def finish_optimizer(self, out: OptimizerState, template: OptimizerState | None) -> OptimizerState:
        if template is not None:
            for p, tslots in template.slots.items():   # Keras keeps a slot for every variable
                for s, arr in tslots.items():
                    out.slots.setdefault(p, {}).setdefault(s, np.zeros_like(arr))
            out.extra = dict(template.extra)
        return out

    # ------------------------------------------------------------------ schedules

    def schedule_to_canonical(self, schedule: ScheduleState) -> Canon | None:
        kind, c = schedule.kind, schedule.config or {}
        f = float
        if kind == "ExponentialDecay":
            lr0, ds, r = f(c["initial_learning_rate"]), f(c["decay_steps"]), f(c["decay_rate"])
            return ("stair", lr0, int(ds), r) if c.get("staircase") else ("exp", lr0, r ** (1 / ds))
        if kind == "PiecewiseConstantDecay":   # Keras boundaries are inclusive: step <= b
            return ("piecewise", tuple(int(b) + 1 for b in c["boundaries"]), tuple(f(v) for v in c["values"]))
        if kind == "PolynomialDecay":
            return ("poly", f(c["initial_learning_rate"]), int(c["decay_steps"]), f(c["end_learning_rate"]),
                    f(c["power"]), bool(c["cycle"]))
        if kind == "InverseTimeDecay":
            if c.get("staircase"):
                return None
            return ("inv", f(c["initial_learning_rate"]), f(c["decay_rate"]) / f(c["decay_steps"]))
        if kind == "CosineDecay":
            lr0, ds, alpha = f(c["initial_learning_rate"]), int(c["decay_steps"]), f(c.get("alpha", 0.0))
            target, w = c.get("warmup_target"), int(c.get("warmup_steps") or 0)
            if target is None or w == 0:
                return ("cos", lr0, ds, alpha * lr0)
            return ("warmcos", lr0, w, f(target), ds, alpha * f(target))
        if kind == "CosineDecayRestarts":
            if not math.isclose(f(c.get("m_mul", 1.0)), 1.0) or f(c["t_mul"]) != int(f(c["t_mul"])):
                return None
            lr0 = f(c["initial_learning_rate"])
            return ("sgdr", lr0, int(c["first_decay_steps"]), int(f(c["t_mul"])), f(c.get("alpha", 0.0)) * lr0)
        return None

    def schedule_from_canonical(self, form: Canon, template: ScheduleState, step: int,
                                last_lr: float) -> tuple[ScheduleState, dict[str, Any] | None]:
        # Keras schedules are pure functions of the optimizer's step: the config is all there is.
        return ScheduleState(kind=template.kind, config=dict(template.config), step=int(step),
                             last_lr=last_lr), None

    # ------------------------------------------------------------------ RNG and extra
    # layer_seed_state is BaseDialect's: a layer's SeedGenerator state is [seed, 0].

    def rng_from_seed(self, seed: int) -> dict[str, Any]:
        return {"tensorflow": {"state": [seed, 0, 0], "algorithm": 1},   # Philox
                "keras": {"state": [seed, 0], "seed": seed}}

    def extra(self, template: TrainingState, produced: Mapping[str, Any]) -> dict[str, Any]:
        return {"keras": dict((template.extra or {}).get("keras") or {})}


def _lr(n: Neutral) -> float:
    if not n.lr:
        raise MigrationError("converting SGD momentum needs a non-zero learning rate")
    return float(n.lr)


DIALECT = KerasDialect()
