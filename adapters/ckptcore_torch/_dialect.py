"""PyTorch's migration dialect: its optimizers, LR schedulers and RNG in ckptcore's neutral terms.

Pure Python/NumPy (does not import PyTorch).  The conventions translated here are listed in
docs/MIGRATION.md, section "Framework facts migration relies on" (PyTorch part):

* ``Adam``/``AdamW`` add ε to the bias-corrected √v̂ (``eps_mode="corrected"``, as Paddle);
  :mod:`ckptcore_torch.keras_adam`'s ``KerasAdam``/``KerasAdamW`` add it to √v (their param
  groups say so: ``eps_mode="uncorrected"``); ``AdamW``'s ``weight_decay`` is decoupled, every
  other optimizer's is L2 added to the gradient (coupled);
* ``SGD`` keeps ``buf ← μ·buf + (1-dampening)·g; w −= lr·buf`` (the neutral gradient form when
  ``dampening == 0``; the first step stores ``g`` undamped, so a dampened buffer has no neutral form);
* ``RMSprop`` adds ε outside the square root and keeps its momentum buffer without the learning
  rate (the neutral ``mom`` has it folded in: ``mom = lr·buf``); ``Adagrad`` divides by √acc+ε;
* every Adam/RMSprop/Adagrad parameter keeps its own ``step`` tensor (float32, the update count);
* a scheduler is at its own ``last_epoch`` and reads the optimizer's current ``lr`` (chainable
  form), so the converted param groups carry the rate at the migrated step;
  ``CosineAnnealingLR`` rises again after ``T_max``;
* accumulated gradients are ``param.grad`` of ``(loss / N).backward()``: means;
* the CPU generator is a 32-bit Mersenne Twister seeded as ``std::mt19937(seed)``; its state is
  torch's 5056-byte ``get_rng_state()`` layout (:func:`cpu_generator_state`);
* a ``Linear`` after a flattened feature map reads it channels-first (NCHW).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ckptcore.errors import MigrationError
from ckptcore.migrate.dialect import BaseDialect, Canon, Neutral, number, slots_by_table
from ckptcore.migrate.rng import mt19937_state
from ckptcore.migrate.schedules import sgdr_position
from ckptcore.state import OptimizerState, ScheduleState, TrainingState

__all__ = ["DIALECT", "TorchDialect", "cpu_generator_state"]

# Slot name -> neutral name, per family (the per-parameter "step" is the step counter).
_ALL = {"adam": {"exp_avg": "m", "exp_avg_sq": "v", "max_exp_avg_sq": "vmax"},
        "momentum": {"momentum_buffer": "momentum"},
        "rmsprop": {"square_avg": "ms", "momentum_buffer": "mom", "grad_avg": "mg"},
        "adagrad": {"sum": "acc"}}
_FAMILY = {"adam": "adam", "adamw": "adam", "sgd": "momentum", "rmsprop": "rmsprop", "adagrad": "adagrad"}
# Options with no neutral form: (group key, the value that is harmless).
_UNSUPPORTED = (("maximize", False), ("differentiable", False), ("decoupled_weight_decay", False))


def _slot_table(n: Neutral) -> dict[str, str]:
    f, h = n.family, n.hp
    if f == "adam":
        return {"exp_avg": "m", "exp_avg_sq": "v", **({"max_exp_avg_sq": "vmax"} if h.get("amsgrad") else {})}
    if f == "momentum":
        return {"momentum_buffer": "momentum"} if h.get("momentum") else {}
    if f == "rmsprop":
        return {"square_avg": "ms", **({"momentum_buffer": "mom"} if h.get("momentum") else {}),
                **({"grad_avg": "mg"} if h.get("centered") else {})}
    if f == "adagrad":
        return {"sum": "acc"}
    return {}


def _lr(n: Neutral) -> float:
    if not n.lr:
        raise MigrationError("converting RMSprop momentum needs a non-zero learning rate")
    return float(n.lr)


class TorchDialect(BaseDialect):
    name = "torch"
    default_flatten_order = "channels_first"
    cosine_past_end = "rise"
    accumulation_form = "mean"

    # ------------------------------------------------------------------ optimizer

    def optimizer_to_neutral(self, opt: OptimizerState, schedule: ScheduleState | None) -> Neutral:
        hp, kind = opt.hyperparams or {}, opt.kind
        step = int(opt.step)
        if (opt.extra or {}).get("step_source") == "none" and schedule is not None:
            step = max(int(schedule.step), 0)   # a scheduler stepped once per update counts them
        lr = number(hp.get("lr"), None)
        if lr is None:
            lr = number(hp.get("learning_rate"))
        out = Neutral(family=_FAMILY.get(kind, kind), framework=self.name, kind=kind, lr=lr, step=step,
                      counterparts={"uncorrected": "ckptcore_torch.keras_adam.KerasAdam/KerasAdamW",
                                    "corrected": "torch.optim.Adam/AdamW"})
        wd = number(hp.get("weight_decay"), 0.0) or 0.0
        coupled, decoupled = wd, 0.0
        if kind in ("adam", "adamw"):
            b1, b2 = (hp.get("betas") or (0.9, 0.999))[:2]
            out.hp = {"beta1": number(b1, 0.9), "beta2": number(b2, 0.999), "epsilon": number(hp.get("eps"), 1e-8),
                      "eps_mode": "uncorrected" if hp.get("eps_mode") == "uncorrected" else "corrected",
                      "amsgrad": bool(hp.get("amsgrad", False))}
            if kind == "adamw" or hp.get("decoupled_weight_decay"):
                coupled, decoupled = 0.0, wd
        elif kind == "sgd":
            out.hp = {"momentum": number(hp.get("momentum"), 0.0), "nesterov": bool(hp.get("nesterov", False)),
                      "momentum_form": "gradient"}
            if (number(hp.get("dampening"), 0.0) or 0.0) != 0.0:
                out.unsupported.append(f"torch SGD dampening={hp['dampening']} has no neutral form (its first "
                                       "step stores the gradient undamped); use dampening=0")
        elif kind == "rmsprop":
            out.hp = {"rho": number(hp.get("alpha"), 0.99), "momentum": number(hp.get("momentum"), 0.0),
                      "epsilon": number(hp.get("eps"), 1e-8), "centered": bool(hp.get("centered", False)),
                      "eps_mode": "outside_sqrt"}
        elif kind == "adagrad":
            out.hp = {"epsilon": number(hp.get("eps"), 1e-10), "eps_mode": "outside_sqrt",
                      "initial_accumulator_value": number(hp.get("initial_accumulator_value"), 0.0)}
            if (number(hp.get("lr_decay"), 0.0) or 0.0) != 0.0:
                out.unsupported.append(f"torch Adagrad lr_decay={hp['lr_decay']} has no neutral form; use "
                                       "lr_decay=0 (or an LR scheduler)")
        else:
            out.unsupported.append(f"the torch optimizer {kind!r} cannot be migrated "
                                   "(supported: Adam, AdamW, SGD, RMSprop, Adagrad)")
        for key, fine in _UNSUPPORTED:
            if key == "decoupled_weight_decay":
                continue
            if hp.get(key, fine) != fine:
                out.unsupported.append(f"torch {kind} {key}={hp[key]} has no neutral form")
        out.hp["decoupled_wd"] = decoupled
        out.hp["coupled_wd"] = coupled
        return out

    def optimizer_from_neutral(self, n: Neutral) -> tuple[str, dict[str, Any]]:
        f, h = n.family, n.hp
        hp: dict[str, Any] = {"lr": n.lr}
        if f == "adam":
            kind = "adamw" if h.get("decoupled_wd") else "adam"
            hp.update(betas=[h.get("beta1", 0.9), h.get("beta2", 0.999)], eps=h.get("epsilon", 1e-8),
                      amsgrad=bool(h.get("amsgrad", False)),
                      weight_decay=h.get("decoupled_wd") or h.get("coupled_wd") or 0.0)
            if h.get("eps_mode") == "uncorrected":
                hp["eps_mode"] = "uncorrected"
        elif f == "momentum":
            kind = "sgd"
            hp.update(momentum=h.get("momentum", 0.0), nesterov=bool(h.get("nesterov", False)), dampening=0.0,
                      weight_decay=h.get("coupled_wd") or 0.0)
        elif f == "rmsprop":
            kind = "rmsprop"
            hp.update(alpha=h.get("rho"), momentum=h.get("momentum", 0.0), eps=h.get("epsilon"),
                      centered=bool(h.get("centered", False)), weight_decay=h.get("coupled_wd") or 0.0)
        else:
            kind = f
            hp.update(eps=h.get("epsilon"), initial_accumulator_value=h.get("initial_accumulator_value", 0.0),
                      lr_decay=0.0, weight_decay=h.get("coupled_wd") or 0.0)
        return kind, hp

    def slots_to_neutral(self, n: Neutral, slots: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        table = _ALL.get(n.family, {})
        out = {table[k]: v for k, v in slots.items() if k in table}
        if "mom" in out:   # torch's RMSprop buffer has no lr in it; the neutral one has
            out["mom"] = out["mom"] * np.float32(_lr(n))
        return out

    def slots_from_neutral(self, n: Neutral, slots: Mapping[str, np.ndarray], *, source: Neutral,
                           like: np.ndarray, current: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        def convert(name: str, value: np.ndarray) -> np.ndarray:
            if name == "mom":
                return value * np.float32(1.0 / _lr(source))   # with the lr it was accumulated with
            return value
        out = slots_by_table(_slot_table(n), slots, like, convert)
        if n.family in ("adam", "rmsprop", "adagrad") and (out or n.family == "rmsprop"):
            # each parameter's own update count, a 0-d float32 tensor in torch >= 1.12
            out = {"step": np.asarray(float(source.step), np.float32), **out}
        if n.family == "adagrad" and "sum" in out and "acc" not in slots:
            out["sum"] = np.full(like.shape, n.hp.get("initial_accumulator_value") or 0.0, like.dtype)
        return out

    def finish_optimizer(self, out: OptimizerState, template: OptimizerState | None) -> OptimizerState:
        """Param groups from the template, each at the rate the run continues with (torch schedulers
        read the group's current ``lr``)."""
        lr = out.hyperparams.pop("learning_rate", None)
        if lr is not None:
            out.hyperparams["lr"] = float(lr)
        extra = dict(template.extra) if template is not None else {}
        groups = [dict(g) for g in extra.get("param_groups") or ()]
        for g in groups:
            if lr is not None:
                g["lr"] = float(lr)
        if groups:
            extra["param_groups"] = groups
        extra["step_source"] = "migrated"
        out.extra = extra
        return out

    # ------------------------------------------------------------------ schedulers

    def schedule_to_canonical(self, schedule: ScheduleState) -> Canon | None:
        kind, s = schedule.kind, schedule.state or {}
        f = float
        base = s.get("base_lrs")
        if not base:
            return None
        if len({f(b) for b in base}) > 1:
            return None   # several groups on different base rates: no single formula
        lr0 = f(base[0])
        if kind == "StepLR":
            return ("stair", lr0, int(s["step_size"]), f(s["gamma"]))
        if kind == "ExponentialLR":
            return ("exp", lr0, f(s["gamma"]))
        if kind == "MultiStepLR":
            ms = s["milestones"]
            bounds = sorted(int(m) for m, c in (ms.items() if isinstance(ms, dict) else ((m, 1) for m in ms))
                            for _ in range(int(c)))
            return ("piecewise", tuple(bounds), tuple(lr0 * f(s["gamma"]) ** i for i in range(len(bounds) + 1)))
        if kind == "CosineAnnealingLR":
            return ("cos", lr0, int(s["T_max"]), f(s["eta_min"]))
        if kind == "PolynomialLR":
            return ("poly", lr0, int(s["total_iters"]), 0.0, f(s["power"]), False)
        if kind == "CosineAnnealingWarmRestarts":
            return ("sgdr", lr0, int(s["T_0"]), int(s["T_mult"]), f(s["eta_min"]))
        return None

    def schedule_from_canonical(self, form: Canon, template: ScheduleState, step: int,
                                last_lr: float) -> tuple[ScheduleState, dict[str, Any] | None]:
        """The template's scheduler ``state_dict()`` moved to ``step`` (its rate there ``last_lr``)."""
        state = dict(template.state or {})
        n = len(state.get("_last_lr") or state.get("base_lrs") or [0])
        state.update(last_epoch=int(step), _step_count=int(step) + 1, _last_lr=[float(last_lr)] * n)
        if template.kind == "CosineAnnealingWarmRestarts":
            cur, ti = sgdr_position(step, form[2], form[3])
            state.update(T_cur=cur, T_i=ti)
        return ScheduleState(kind=template.kind, config=dict(template.config or {}), step=int(step),
                             last_lr=float(last_lr), state=state), None

    # ------------------------------------------------------------------ RNG and extra

    def rng_from_seed(self, seed: int) -> dict[str, Any]:
        return {"torch": cpu_generator_state(seed)}

    def extra(self, template: TrainingState, produced: Mapping[str, Any]) -> dict[str, Any]:
        own = dict((template.extra or {}).get("torch") or {})
        return {"torch": {k: own[k] for k in ("aliases",) if k in own}}


# torch's CPU generator state (aten CPUGeneratorImpl: THGeneratorState and its successor's two fields).
_CPU_STATE = np.dtype([("the_initial_seed", "<u8"), ("left", "<i4"), ("seeded", "<i4"), ("next", "<u8"),
                       ("state", "<u8", (624,)), ("normal_x", "<f8"), ("normal_y", "<f8"), ("normal_rho", "<f8"),
                       ("normal_is_valid", "<i4"), ("_pad", "<u4"), ("next_float_normal_sample", "<f4"),
                       ("is_next_float_normal_sample_valid", "u1"), ("_pad2", "u1", (3,))])


def cpu_generator_state(seed: int) -> np.ndarray:
    """``torch.get_rng_state()`` right after ``torch.manual_seed(seed)``, as a uint8 array (5056 bytes):
    the Mersenne Twister words of ``std::mt19937(seed)``, ``left = 1``, no cached normal sample."""
    rec = np.zeros((), _CPU_STATE)
    rec["the_initial_seed"] = seed
    rec["left"], rec["seeded"], rec["next"] = 1, 1, 0
    rec["state"] = np.asarray(mt19937_state(seed & 0xFFFFFFFF), np.uint64)
    return np.frombuffer(rec.tobytes(), np.uint8).copy()


DIALECT = TorchDialect()
