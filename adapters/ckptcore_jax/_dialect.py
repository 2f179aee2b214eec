"""JAX's migration dialect: Optax optimizers and schedules in ckptcore's neutral terms.

Pure Python/NumPy (imports neither JAX nor Optax).  What the capture reads from an Optax
transformation (``_optax.py``) arrives as ``OptimizerState.kind``/``hyperparams``; the
conventions translated here are listed in docs/MIGRATION.md, section "Framework facts migration
relies on" (JAX part):

* ``optax.adam``/``adamw`` add ε to the bias-corrected √v̂ (``eps_mode="corrected"``, as PyTorch
  and Paddle); ``eps_root`` (ε inside the root) and ``nesterov=True`` (NAdam) have no neutral
  form; ``adamw``'s ``weight_decay`` is decoupled (w ← w − lr·λ·w), masks are refused;
* ``optax.sgd``'s ``trace`` keeps ``t ← μ·t + g; w ← w − lr·t`` (``nesterov``: ``w ← w −
  lr·(g + μ·t)``): the neutral gradient form;
* the moments are the per-parameter leaves ``<i>/mu``, ``<i>/nu`` (``scale_by_adam``) and
  ``<i>/trace`` (``trace``) of the chain's ``i``-th state; every ``count`` leaf (the bias
  correction's and a schedule's) and an ``nnx.Optimizer``'s ``step`` count the updates;
* a schedule is a function of its ``count`` leaf, which counts the optimizer's updates (so it
  follows the optimizer, like Keras); ``cosine_decay_schedule`` holds its final rate after
  ``decay_steps``; schedules are recorded by constructor name and arguments;
* JAX has no global generator (keys are arrays of the run's own), so only Python's and NumPy's
  states are carried; a Linear after a flattened NHWC map reads it channels-last.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ckptcore.errors import MigrationError
from ckptcore.migrate.dialect import BaseDialect, Canon, Neutral, number, slots_by_table
from ckptcore.state import OptimizerState, ScheduleState, TrainingState

__all__ = ["DIALECT", "JaxDialect"]

# The last path component of a moment leaf -> its neutral name, per family.
_SLOTS = {"adam": {"mu": "m", "nu": "v"}, "momentum": {"trace": "momentum"}}
_SUPPORTED = ("optax.adam, optax.adamw and optax.sgd (with or without momentum/nesterov), each with a "
              "float learning rate or an Optax schedule")


class JaxDialect(BaseDialect):
    name = "jax"
    default_flatten_order = "channels_last"
    schedule_follows_optimizer = True   # cosine schedules hold their floor past the end: the default

    # ------------------------------------------------------------------ optimizer

    def optimizer_to_neutral(self, opt: OptimizerState, schedule: ScheduleState | None) -> Neutral:
        hp, kind = opt.hyperparams or {}, opt.kind
        out = Neutral(family=kind, framework=self.name, kind=kind, lr=number(hp.get("learning_rate")),
                      step=_step(opt), counterparts={"corrected": "optax.adam/optax.adamw"})
        if kind in ("adam", "adamw"):
            out.family = "adam"
            out.hp = {"beta1": number(hp.get("b1"), 0.9), "beta2": number(hp.get("b2"), 0.999),
                      "epsilon": number(hp.get("eps"), 1e-8), "eps_mode": "corrected", "amsgrad": False}
            if number(hp.get("eps_root"), 0.0):
                out.unsupported.append(f"optax {kind} eps_root={hp['eps_root']} (ε inside the square root) "
                                       "has no counterpart elsewhere; use eps_root=0")
            if hp.get("nesterov"):
                out.unsupported.append(f"optax {kind} nesterov=True (NAdam) has no counterpart elsewhere")
        elif kind == "sgd":
            out.family = "momentum"
            out.hp = {"momentum": number(hp.get("momentum"), 0.0), "nesterov": bool(hp.get("nesterov", False)),
                      "momentum_form": "gradient"}
        else:
            found = ", ".join(hp.get("transforms") or ()) or "no transformation (a bare state without tx=)"
            out.unsupported.append(f"the Optax optimizer ({found}) cannot be migrated: supported are "
                                   f"{_SUPPORTED}; a bare Optax state needs ckptcore_jax.Ref(state, tx=tx)")
        if out.lr is None and not out.unsupported:
            out.unsupported.append("the Optax optimizer's learning rate could not be read")
        out.hp["decoupled_wd"] = number(hp.get("weight_decay"), 0.0) or 0.0
        out.hp["coupled_wd"] = 0.0
        out.hp["slot_prefix"] = str(hp.get("slot_prefix", "0/"))   # where this state keeps its moments
        return out

    def optimizer_from_neutral(self, n: Neutral) -> tuple[str, dict[str, Any]]:
        h = n.hp
        if n.family == "adam":
            kind = "adamw" if h.get("decoupled_wd") else "adam"
            return kind, {"learning_rate": n.lr, "b1": h.get("beta1", 0.9), "b2": h.get("beta2", 0.999),
                          "eps": h.get("epsilon", 1e-8), "eps_root": 0.0, "nesterov": False,
                          "weight_decay": h.get("decoupled_wd") or 0.0, "slot_prefix": h.get("slot_prefix", "0/")}
        if n.family == "momentum":
            if h.get("coupled_wd"):
                raise MigrationError("optax.sgd has no L2 weight decay; chain optax.add_decayed_weights "
                                     "yourself and give the target optimizer")
            return "sgd", {"learning_rate": n.lr, "momentum": h.get("momentum", 0.0),
                           "nesterov": bool(h.get("nesterov", False)), "slot_prefix": h.get("slot_prefix", "0/")}
        raise MigrationError(f"no Optax optimizer is built for a {n.framework} {n.kind} ({n.family}); "
                             f"supported are {_SUPPORTED}")

    def slots_to_neutral(self, n: Neutral, slots: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        table = _SLOTS.get(n.family, {})
        return {table[k.rpartition("/")[2]]: v for k, v in slots.items() if k.rpartition("/")[2] in table}

    def slots_from_neutral(self, n: Neutral, slots: Mapping[str, np.ndarray], *, source: Neutral,
                           like: np.ndarray, current: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        table = _SLOTS.get(n.family, {})
        if current is not None:   # the live state's own leaves, wherever the chain keeps them
            native = {k: table[k.rpartition("/")[2]] for k in current if k.rpartition("/")[2] in table}
        else:
            prefix = str(n.hp.get("slot_prefix", "0/"))
            wanted = table if n.family != "momentum" or n.hp.get("momentum") else {}
            native = {prefix + k: v for k, v in wanted.items()}
        return slots_by_table(native, slots, like)

    def finish_optimizer(self, out: OptimizerState, template: OptimizerState | None) -> OptimizerState:
        """Every counter of the template (the ``count`` leaves, an ``nnx.Optimizer``'s ``step``) at the
        migrated step, and zeros for parameters the source had no moments for (Optax keeps moments
        for every parameter)."""
        if template is None:
            return out
        for p, tslots in template.slots.items():
            for s, arr in tslots.items():
                out.slots.setdefault(p, {}).setdefault(s, np.zeros_like(arr))
        extra = dict(template.extra)
        leaves = dict(extra.get("leaves") or {})
        for name, arr in leaves.items():
            if name.rpartition("/")[2] in ("count", "step") and np.ndim(arr) == 0:
                leaves[name] = np.asarray(out.step, np.asarray(arr).dtype)
        extra["leaves"] = leaves
        out.extra = extra
        return out

    # ------------------------------------------------------------------ schedules

    def schedule_to_canonical(self, schedule: ScheduleState) -> Canon | None:
        return _canonical(schedule.kind, schedule.config or {})

    def schedule_from_canonical(self, form: Canon, template: ScheduleState, step: int,
                                last_lr: float) -> tuple[ScheduleState, dict[str, Any] | None]:
        # An Optax schedule is a function of its count leaf, which finish_optimizer sets to the step.
        return ScheduleState(kind=template.kind, config=dict(template.config or {}), step=int(step),
                             last_lr=float(last_lr)), None

    # ------------------------------------------------------------------ extra

    def extra(self, template: TrainingState, produced: Mapping[str, Any]) -> dict[str, Any]:
        return {"jax": dict((template.extra or {}).get("jax") or {})}


def _step(opt: OptimizerState) -> int:
    """Updates applied: the optimizer's step, else (a bare Optax state) its largest count leaf."""
    if int(opt.step):
        return int(opt.step)
    counts = [int(np.asarray(v)) for k, v in ((opt.extra or {}).get("leaves") or {}).items()
              if k.rpartition("/")[2] == "count" and np.ndim(v) == 0]
    return max(counts, default=0)


def _canonical(kind: str, c: Mapping[str, Any]) -> Canon | None:
    f = float
    if kind == "exponential_decay":
        if c.get("transition_begin") or c.get("end_value") is not None:
            return None
        lr0, n, r = f(c["init_value"]), int(c["transition_steps"]), f(c["decay_rate"])
        return ("stair", lr0, n, r) if c.get("staircase") else ("exp", lr0, r ** (1 / n))
    if kind == "cosine_decay_schedule":
        if not math.isclose(f(c.get("exponent", 1.0)), 1.0):
            return None
        lr0 = f(c["init_value"])
        return ("cos", lr0, int(c["decay_steps"]), f(c.get("alpha", 0.0)) * lr0)
    if kind == "piecewise_constant_schedule":   # scaled once the count reaches each boundary
        values = [f(c["init_value"])]
        pairs = sorted(zip((int(b) for b in c["boundaries"]), (f(s) for s in c["scales"])))
        for _, s in pairs:
            values.append(values[-1] * s)
        return ("piecewise", tuple(b for b, _ in pairs), tuple(values))
    if kind == "polynomial_schedule":
        if c.get("transition_begin"):
            return None
        return ("poly", f(c["init_value"]), int(c["transition_steps"]), f(c["end_value"]), f(c["power"]), False)
    if kind == "join_schedules":   # warmup_cosine_decay_schedule: linear warmup, then a cosine
        parts, bounds = c.get("schedules") or [], c.get("boundaries") or []
        if len(parts) != 2 or len(bounds) != 1:
            return None
        warm = _canonical(parts[0]["kind"], parts[0]["config"])
        cos = _canonical(parts[1]["kind"], parts[1]["config"])
        if warm is None or cos is None or warm[0] != "poly" or cos[0] != "cos" or warm[4] != 1.0:
            return None
        w = int(bounds[0])
        if warm[2] != w or not math.isclose(warm[3], cos[1]):
            return None
        return ("warmcos", warm[1], w, cos[1], cos[2], cos[3])
    return None


DIALECT = JaxDialect()
