"""Paddle's migration dialect: its optimizers, schedulers and RNG in ckptcore's neutral terms.

Pure Python/NumPy (does not import Paddle).  The conventions translated here are listed in
docs/MIGRATION.md, section "Framework facts migration relies on":

* ``paddle.optimizer.Adam`` adds ε to the bias-corrected √v̂ (``eps_mode="corrected"``); the
  ``KerasAdam``/``KerasAdamW`` of :mod:`ckptcore_paddle.keras_adam` add it to √v; Adagrad divides
  by √acc+ε;
* Momentum keeps a buffer of raw gradients (``v ← μv + g; w −= lr·v``), the neutral form;
* ``weight_decay=<float>`` and ``L2Decay`` regularization add L2 decay to the gradient (coupled);
  only AdamW's ``weight_decay`` is decoupled;
* optimizers keep no step counter; Adam's ``beta{1,2}_pow_acc`` hold β^(t+1) (the adapter reads
  ``t`` from them at capture), otherwise a scheduler's ``last_epoch`` (stepped once per update)
  is the best record of it;
* a scheduler is at its own ``last_epoch``; ``CosineAnnealingDecay`` rises again after ``T_max``;
  restoring needs its ``state_dict()`` (``last_epoch``, ``last_lr``, a ``LinearWarmup``'s inner
  state, ``CosineAnnealingWarmRestarts``' ``T_cur``/``T_i``), kept in ``extra["paddle"]["scheduler"]``;
* accumulated gradients are ``param.grad`` of ``(loss / N).backward()``: means, not sums;
* the global generator is ``std::mt19937_64`` seeded through ``std::seed_seq`` (what ``paddle.seed``
  does), kept as its engine text;
* a ``Linear`` after a reshape of a feature map reads it channels-first unless the adapter knows better.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ckptcore.migrate.dialect import BaseDialect, Canon, Neutral, number, read_hyperparams, slots_by_table
from ckptcore.migrate.rng import mt19937_64_text
from ckptcore.migrate.schedules import sgdr_position, value
from ckptcore.state import OptimizerState, ScheduleState, TrainingState

__all__ = ["DIALECT", "PaddleDialect"]

# Hyperparameter names: neutral -> Paddle.
_NAMES = {"beta1": "beta1", "beta2": "beta2", "epsilon": "epsilon", "amsgrad": "amsgrad",
          "momentum": "momentum", "nesterov": "use_nesterov", "rho": "rho", "centered": "centered",
          "initial_accumulator_value": "initial_accumulator_value"}
# Accumulator name -> neutral slot (the beta powers are the step counter, carried as the step).
_NEUTRAL = {"moment1": "m", "moment2": "v", "moment2_max": "vmax", "velocity": "momentum",
            "mean_square": "ms", "momentum": "mom", "mean_grad": "mg", "moment": "acc"}
_POWS = ("beta1_pow_acc", "beta2_pow_acc")


def _slot_table(n: Neutral) -> dict[str, str]:
    f, h = n.family, n.hp
    if f == "adam":
        return {"moment1": "m", "moment2": "v", **({"moment2_max": "vmax"} if h.get("amsgrad") else {})}
    if f == "momentum":
        return {} if n.kind == "sgd" else {"velocity": "momentum"}
    if f == "rmsprop":
        return {"momentum": "mom", "mean_square": "ms", "mean_grad": "mg"}
    if f == "adagrad":
        return {"moment": "acc"}
    return {}


# Neutral hyperparameter -> (Paddle's name, Paddle's default).
_RMSPROP = {"rho": ("rho", 0.95), "momentum": ("momentum", 0.0), "epsilon": ("epsilon", 1e-6),
            "centered": ("centered", False)}
_ADAGRAD = {"epsilon": ("epsilon", 1e-6), "initial_accumulator_value": ("initial_accumulator_value", 0.0)}


class PaddleDialect(BaseDialect):
    name = "paddle"
    default_flatten_order = "channels_first"
    cosine_past_end = "rise"
    accumulation_form = "mean"

    # ------------------------------------------------------------------ optimizer

    def optimizer_to_neutral(self, opt: OptimizerState, schedule: ScheduleState | None) -> Neutral:
        hp, kind = opt.hyperparams or {}, opt.kind
        step = int(opt.step)
        if opt.extra.get("step_source") == "none" and schedule is not None:
            # No beta powers and no step argument at capture: the scheduler's position is the best
            # record of the step count (last_epoch == updates when stepped once per update).
            step = int(schedule.step)
        out = Neutral(family=kind, framework=self.name, kind=kind, lr=number(hp.get("learning_rate")), step=step,
                      counterparts={"uncorrected": "ckptcore_paddle.keras_adam.KerasAdam/KerasAdamW",
                                    "corrected": "paddle.optimizer.Adam/AdamW"})
        coupled = 0.0
        reg = hp.get("regularization")
        if isinstance(reg, dict):
            if reg.get("kind") == "L2Decay":
                coupled = float(reg.get("coeff", 0.0))
            else:
                out.unsupported.append(f"Paddle regularization {reg.get('kind')} cannot be migrated "
                                       "(only L2Decay has a neutral form)")
        if hp.get("regularization_method") == "l2_decay":
            coupled = float(hp.get("regularization_coeff") or 0.0)
        decoupled = 0.0
        if kind in ("adam", "adamw", "kerasadam", "kerasadamw"):
            out.family = "adam"
            out.hp = {"beta1": number(hp.get("beta1"), 0.9), "beta2": number(hp.get("beta2"), 0.999),
                      "epsilon": number(hp.get("epsilon"), 1e-8),
                      "eps_mode": "uncorrected" if kind.startswith("keras") else "corrected",
                      "amsgrad": bool(hp.get("amsgrad", False))}
            decoupled = (number(hp.get("weight_decay"), 0.0) or 0.0) if kind.endswith("w") else 0.0
        elif kind in ("momentum", "sgd"):
            out.family = "momentum"
            out.hp = {"momentum": number(hp.get("momentum"), 0.0) if kind == "momentum" else 0.0,
                      "nesterov": bool(hp.get("use_nesterov", False)), "momentum_form": "gradient"}
        elif kind == "rmsprop":
            out.hp = read_hyperparams(hp, _RMSPROP)
        elif kind == "adagrad":
            out.hp = {**read_hyperparams(hp, _ADAGRAD), "eps_mode": "outside_sqrt"}
        else:
            out.unsupported.append(f"the Paddle optimizer {kind!r} cannot be migrated "
                                   "(supported: Adam, AdamW, Momentum, SGD, RMSProp, Adagrad)")
        out.hp["decoupled_wd"] = decoupled
        out.hp["coupled_wd"] = coupled
        if isinstance(hp.get("grad_clip"), dict):
            out.hp["clip"] = str(hp["grad_clip"].get("kind"))
        return out

    def optimizer_from_neutral(self, n: Neutral) -> tuple[str, dict[str, Any]]:
        f = n.family
        if f == "adam":
            kind = "adamw" if n.hp.get("decoupled_wd") else "adam"
        elif f == "momentum":
            kind = "momentum" if n.hp.get("momentum") else "sgd"
        else:
            kind = f
        hp: dict[str, Any] = {"learning_rate": n.lr}
        if kind.endswith("adamw"):
            hp["weight_decay"] = n.hp.get("decoupled_wd", 0.0)
        hp.update({_NAMES[k]: v for k, v in n.hp.items() if k in _NAMES})
        return kind, hp

    def slots_to_neutral(self, n: Neutral, slots: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {_NEUTRAL[k]: v for k, v in slots.items() if k in _NEUTRAL}

    def slots_from_neutral(self, n: Neutral, slots: Mapping[str, np.ndarray], *, source: Neutral,
                           like: np.ndarray, current: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        out = slots_by_table(_slot_table(n), slots, like)
        if n.family == "adam" and out:
            # β^(t+1) in float32, computed as the Keras optimizer does (one pow), so that a Keras
            # run continued here takes exactly the next step.
            b1, b2, t = np.float32(n.hp["beta1"]), np.float32(n.hp["beta2"]), np.float32(source.step + 1)
            pows = {"beta1_pow_acc": np.array([b1 ** t], np.float32),
                    "beta2_pow_acc": np.array([b2 ** t], np.float32)}
            out = {**{k: v for k, v in out.items() if k in ("moment1", "moment2")}, **pows,
                   **{k: v for k, v in out.items() if k not in ("moment1", "moment2")}}
        return out

    def finish_optimizer(self, out: OptimizerState, template: OptimizerState | None) -> OptimizerState:
        out.extra = {**(template.extra if template is not None else {}), "step_source": "migrated"}
        return out

    # ------------------------------------------------------------------ schedulers

    def schedule_to_canonical(self, schedule: ScheduleState) -> Canon | None:
        kind, c = schedule.kind, schedule.config or {}
        f = float
        lr0 = c.get("learning_rate")
        if kind == "ExponentialDecay":
            return ("exp", f(lr0), f(c["gamma"]))
        if kind == "NaturalExpDecay":
            return ("exp", f(lr0), math.exp(-f(c["gamma"])))
        if kind == "StepDecay":
            return ("stair", f(lr0), int(c["step_size"]), f(c["gamma"]))
        if kind == "PiecewiseDecay":
            return ("piecewise", tuple(int(b) for b in c["boundaries"]), tuple(f(v) for v in c["values"]))
        if kind == "MultiStepDecay":
            ms = tuple(int(b) for b in c["milestones"])
            return ("piecewise", ms, tuple(f(lr0) * f(c["gamma"]) ** i for i in range(len(ms) + 1)))
        if kind == "PolynomialDecay":
            return ("poly", f(lr0), int(c["decay_steps"]), f(c["end_lr"]), f(c["power"]), bool(c["cycle"]))
        if kind == "InverseTimeDecay":
            return ("inv", f(lr0), f(c["gamma"]))
        if kind == "CosineAnnealingDecay":
            return ("cos", f(lr0), int(c["T_max"]), f(c["eta_min"]))
        if kind == "CosineAnnealingWarmRestarts":
            return ("sgdr", f(lr0), int(c["T_0"]), int(c["T_mult"]), f(c["eta_min"]))
        if kind == "LinearWarmup":
            inner = c.get("learning_rate")
            if not isinstance(inner, dict) or inner.get("kind") != "CosineAnnealingDecay":
                return None
            ic = inner["config"]
            if not math.isclose(f(ic["learning_rate"]), f(c["end_lr"]), rel_tol=1e-9):
                return None
            return ("warmcos", f(c["start_lr"]), int(c["warmup_steps"]), f(c["end_lr"]), int(ic["T_max"]),
                    f(ic["eta_min"]))
        return None

    def schedule_from_canonical(self, form: Canon, template: ScheduleState, step: int,
                                last_lr: float) -> tuple[ScheduleState, dict[str, Any] | None]:
        """The target scheduler, and what the adapter's restore puts back: its ``state_dict()``."""
        out = ScheduleState(kind=template.kind, config=dict(template.config), step=int(step), last_lr=last_lr)
        state: dict[str, Any] = {"last_epoch": int(step), "last_lr": float(last_lr)}
        extra: dict[str, Any] = {"state": state}
        if template.kind == "LinearWarmup":
            start, w, peak, ds, eta = form[1:]
            inner_t = max(step - w, 0)
            state["LinearWarmup_LR"] = {"last_epoch": inner_t,
                                        "last_lr": float(value(("cos", peak, ds, eta), inner_t, self.cosine_past_end))}
        if template.kind == "CosineAnnealingWarmRestarts":
            cur, ti = sgdr_position(step, form[2], form[3])
            extra["attrs"] = {"T_cur": cur, "T_i": ti}
        return out, extra

    # ------------------------------------------------------------------ RNG and extra

    def rng_from_seed(self, seed: int) -> dict[str, Any]:
        return {"paddle": [{"device": -1, "seed": seed, "offset": 0, "engine": mt19937_64_text(seed)}]}

    def extra(self, template: TrainingState, produced: Mapping[str, Any]) -> dict[str, Any]:
        tp = dict((template.extra or {}).get("paddle") or {})
        mine = {k: tp[k] for k in ("param_names", "aliases") if k in tp}
        if produced.get("scheduler") is not None:
            mine["scheduler"] = produced["scheduler"]
        return {"paddle": mine}


DIALECT = PaddleDialect()
