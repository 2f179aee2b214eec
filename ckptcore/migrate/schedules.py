"""Learning-rate schedules: which Keras schedule a Paddle scheduler continues, and at which step.

Each schedule is reduced to a canonical formula (:func:`canonical`); two schedules continue each
other exactly when their canonical forms are equal, which encodes every exact pair of
FRAMEWORKS.md §4.2 with its parameter mapping:

=============================  ==========================================  ==================
Keras                          Paddle                                      canonical
=============================  ==========================================  ==================
ExponentialDecay(l, d, r)      ExponentialDecay(l, r**(1/d)),              ``exp`` l, q
                               NaturalExpDecay(l, -log q)
ExponentialDecay(staircase)    StepDecay(l, d, r)                          ``stair`` l, d, r
PiecewiseConstantDecay(b, v)   PiecewiseDecay(b+1, v),                     ``piecewise`` b+1, v
                               MultiStepDecay(l, b+1, γ) if v = l·γ^i
PolynomialDecay                PolynomialDecay (same arguments)            ``poly``
InverseTimeDecay(l, d, r)      InverseTimeDecay(l, r/d)                    ``inv`` l, r/d
CosineDecay(l, d, α)           CosineAnnealingDecay(l, d, α·l)             ``cos`` (to step d)
CosineDecay(warmup)            LinearWarmup(CosineAnnealingDecay(...))     ``warmcos``
CosineDecayRestarts(m_mul=1)   CosineAnnealingWarmRestarts(l, T0, int)     ``sgdr``
=============================  ==========================================  ==================

Positions: a Keras schedule is evaluated at ``optimizer.iterations`` (micro-steps with gradient
accumulation); a Paddle scheduler at ``last_epoch``, which equals it when ``sch.step()`` follows
every ``opt.step()``.  The converted state carries the target's ``last_lr`` computed with the
target's own formula, so recursive Paddle schedulers (CosineAnnealingDecay) go on correctly.
"""

from __future__ import annotations

import math
from typing import Any

from ..state import ScheduleState

__all__ = ["canonical", "value", "same", "convert_schedule"]

Canon = tuple


def _f(x: Any) -> float:
    return float(x)


def canonical(kind: str, config: dict[str, Any], framework: str) -> Canon | None:
    """The schedule's formula as a tuple, or None when it has no counterpart in the other framework."""
    c = config or {}
    try:
        if framework == "keras":
            return _keras(kind, c)
        return _paddle(kind, c)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def _keras(kind: str, c: dict) -> Canon | None:
    if kind == "ExponentialDecay":
        lr0, ds, r = _f(c["initial_learning_rate"]), _f(c["decay_steps"]), _f(c["decay_rate"])
        return ("stair", lr0, int(ds), r) if c.get("staircase") else ("exp", lr0, r ** (1 / ds))
    if kind == "PiecewiseConstantDecay":
        return ("piecewise", tuple(int(b) + 1 for b in c["boundaries"]), tuple(_f(v) for v in c["values"]))
    if kind == "PolynomialDecay":
        return ("poly", _f(c["initial_learning_rate"]), int(c["decay_steps"]), _f(c["end_learning_rate"]),
                _f(c["power"]), bool(c["cycle"]))
    if kind == "InverseTimeDecay":
        if c.get("staircase"):
            return None
        return ("inv", _f(c["initial_learning_rate"]), _f(c["decay_rate"]) / _f(c["decay_steps"]))
    if kind == "CosineDecay":
        lr0, ds, alpha = _f(c["initial_learning_rate"]), int(c["decay_steps"]), _f(c.get("alpha", 0.0))
        target, w = c.get("warmup_target"), int(c.get("warmup_steps") or 0)
        if target is None or w == 0:
            return ("cos", lr0, ds, alpha * lr0)
        return ("warmcos", lr0, w, _f(target), ds, alpha * _f(target))
    if kind == "CosineDecayRestarts":
        if not math.isclose(_f(c.get("m_mul", 1.0)), 1.0) or _f(c["t_mul"]) != int(_f(c["t_mul"])):
            return None
        lr0 = _f(c["initial_learning_rate"])
        return ("sgdr", lr0, int(c["first_decay_steps"]), int(_f(c["t_mul"])), _f(c.get("alpha", 0.0)) * lr0)
    return None


def _paddle(kind: str, c: dict) -> Canon | None:
    lr0 = c.get("learning_rate")
    if kind == "ExponentialDecay":
        return ("exp", _f(lr0), _f(c["gamma"]))
    if kind == "NaturalExpDecay":
        return ("exp", _f(lr0), math.exp(-_f(c["gamma"])))
    if kind == "StepDecay":
        return ("stair", _f(lr0), int(c["step_size"]), _f(c["gamma"]))
    if kind == "PiecewiseDecay":
        return ("piecewise", tuple(int(b) for b in c["boundaries"]), tuple(_f(v) for v in c["values"]))
    if kind == "MultiStepDecay":
        ms = tuple(int(b) for b in c["milestones"])
        return ("piecewise", ms, tuple(_f(lr0) * _f(c["gamma"]) ** i for i in range(len(ms) + 1)))
    if kind == "PolynomialDecay":
        return ("poly", _f(lr0), int(c["decay_steps"]), _f(c["end_lr"]), _f(c["power"]), bool(c["cycle"]))
    if kind == "InverseTimeDecay":
        return ("inv", _f(lr0), _f(c["gamma"]))
    if kind == "CosineAnnealingDecay":
        return ("cos", _f(lr0), int(c["T_max"]), _f(c["eta_min"]))
    if kind == "CosineAnnealingWarmRestarts":
        return ("sgdr", _f(lr0), int(c["T_0"]), int(c["T_mult"]), _f(c["eta_min"]))
    if kind == "LinearWarmup":
        inner = c.get("learning_rate")
        if not isinstance(inner, dict) or inner.get("kind") != "CosineAnnealingDecay":
            return None
        ic = inner["config"]
        if not math.isclose(_f(ic["learning_rate"]), _f(c["end_lr"]), rel_tol=1e-9):
            return None
        return ("warmcos", _f(c["start_lr"]), int(c["warmup_steps"]), _f(c["end_lr"]), int(ic["T_max"]),
                _f(ic["eta_min"]))
    return None


def same(a: Canon | None, b: Canon | None) -> bool:
    if a is None or b is None or a[0] != b[0] or len(a) != len(b):
        return False
    return all(_eq(x, y) for x, y in zip(a[1:], b[1:]))


def _eq(x: Any, y: Any) -> bool:
    if isinstance(x, tuple):
        return isinstance(y, tuple) and len(x) == len(y) and all(_eq(a, b) for a, b in zip(x, y))
    if isinstance(x, bool) or isinstance(x, int) and isinstance(y, int):
        return x == y
    return math.isclose(float(x), float(y), rel_tol=1e-9, abs_tol=1e-15)


def _sgdr_position(t: int, t0: int, mult: int) -> tuple[int, int]:
    if mult == 1:
        return t % t0, t0
    cur, ti = t, t0
    while cur >= ti:
        cur, ti = cur - ti, ti * mult
    return cur, ti


def value(c: Canon, t: int, framework: str) -> float:
    """The rate at step ``t`` as ``framework`` computes it (they differ only past a cosine's end)."""
    tag = c[0]
    if tag == "exp":
        return c[1] * c[2] ** t
    if tag == "stair":
        return c[1] * c[3] ** (t // c[2])
    if tag == "piecewise":
        bounds, vals = c[1], c[2]
        return vals[sum(1 for b in bounds if t >= b)]
    if tag == "poly":
        lr0, ds, end, power, cycle = c[1:]
        if cycle:
            steps = ds * (1 if t == 0 else math.ceil(t / ds))
            done = t
        else:
            steps, done = ds, min(t, ds)
        return (lr0 - end) * (1 - done / steps) ** power + end
    if tag == "inv":
        return c[1] / (1 + c[2] * t)
    if tag == "cos":
        lr0, ds, eta = c[1:]
        s = min(t, ds) if framework == "keras" else t
        return eta + (lr0 - eta) * (1 + math.cos(math.pi * s / ds)) / 2
    if tag == "warmcos":
        start, w, peak, ds, eta = c[1:]
        if t < w:
            return (peak - start) * t / w + start
        return value(("cos", peak, ds, eta), t - w, framework)
    if tag == "sgdr":
        lr0, t0, mult, eta = c[1:]
        cur, ti = _sgdr_position(t, t0, mult)
        return eta + (lr0 - eta) * (1 + math.cos(math.pi * cur / ti)) / 2
    raise ValueError(f"unknown schedule form {tag!r}")


def _horizon(c: Canon) -> int | None:
    """The last step up to which Keras and Paddle agree (cosine decay without restarts)."""
    if c[0] == "cos":
        return c[2]
    if c[0] == "warmcos":
        return c[2] + c[4]
    return None


def _describe(s: ScheduleState | None, fw: str) -> str:
    if s is None:
        return f"a constant {fw} learning rate"
    return f"{fw} {s.kind}({', '.join(f'{k}={v}' for k, v in (s.config or {}).items() if k != 'name')})"


def convert_schedule(src: ScheduleState | None, src_fw: str, src_lr: float | None, dst: ScheduleState | None,
                     dst_fw: str, step: int, *, warnings: list[str], problems: list[str],
                     approximate: bool) -> tuple[ScheduleState | None, dict | None, float | None]:
    """``(target ScheduleState, Paddle scheduler extra, constant lr for the optimizer)``.

    ``step`` is the schedule position the target continues from.
    """
    if src is None and dst is None:
        return None, None, src_lr
    sc = canonical(src.kind, src.config, src_fw) if src is not None else ("const", src_lr)
    dc = canonical(dst.kind, dst.config, dst_fw) if dst is not None else None
    here = value(sc, step, src_fw) if src is not None and sc is not None else (
        src.last_lr if src is not None else src_lr)
    if dst is None:  # the target uses a float learning rate
        msg = (f"schedule: the source's {_describe(src, src_fw)} at step {step} cannot continue as a "
               f"constant learning rate")
        if approximate:
            warnings.append(msg + f"; the target keeps the current rate {here} from now on")
        else:
            problems.append(msg + "; give the target optimizer the matching scheduler (or approximate=True)")
        return None, None, here
    if not same(sc, dc):
        there = value(dc, step, dst_fw) if dc is not None else dst.last_lr
        msg = (f"schedule: the target's {_describe(dst, dst_fw)} does not continue the source's "
               f"{_describe(src, src_fw)} exactly (at step {step}: source lr {here}, target lr {there})")
        if not approximate:
            problems.append(msg + "; see docs/MIGRATION.md for the exact pairs and their parameter "
                            "mappings (or pass approximate=True)")
            return None, None, None
        warnings.append(msg + "; the target's schedule continues from this step")
    form = dc
    horizon = _horizon(form) if form is not None else None
    if horizon is not None:
        if step > horizon:
            msg = (f"schedule: step {step} is past the cosine's end (step {horizon}), where Keras stays at "
                   "the final rate and Paddle rises again")
            (warnings if approximate else problems).append(msg)
        else:
            warnings.append(f"schedule: exact up to step {horizon}; after it Keras' CosineDecay stays at the "
                            "final rate while Paddle's CosineAnnealingDecay rises again")
    last = value(form, step, dst_fw) if form is not None else dst.last_lr
    out = ScheduleState(kind=dst.kind, config=dict(dst.config), step=int(step), last_lr=last)
    extra = _paddle_state(dst, form, step, last) if dst_fw == "paddle" and form is not None else None
    return out, extra, None


def _paddle_state(dst: ScheduleState, form: Canon, step: int, last: float) -> dict:
    """What ``restore_schedule`` of the Paddle adapter puts back: Paddle's own ``state_dict()``."""
    state: dict[str, Any] = {"last_epoch": int(step), "last_lr": float(last)}
    out: dict[str, Any] = {"state": state}
    if dst.kind == "LinearWarmup":
        start, w, peak, ds, eta = form[1:]
        inner_t = max(step - w, 0)
        state["LinearWarmup_LR"] = {"last_epoch": inner_t,
                                    "last_lr": float(value(("cos", peak, ds, eta), inner_t, "paddle"))}
    if dst.kind == "CosineAnnealingWarmRestarts":
        cur, ti = _sgdr_position(step, form[2], form[3])
        out["attrs"] = {"T_cur": cur, "T_i": ti}
    return out
