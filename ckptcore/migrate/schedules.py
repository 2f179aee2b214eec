"""Learning-rate schedules in neutral terms: canonical formulas, their values, and continuation.

Each framework's dialect reduces a schedule to a canonical form, a tuple naming a formula and its
parameters; two schedules continue each other exactly when their canonical forms are equal
(:func:`same`).  The forms, with ``t`` the step the schedule is evaluated at:

==========================================  ==================================================
form                                        rate at step ``t``
==========================================  ==================================================
``("const", lr)``                           ``lr`` (a float learning rate, no schedule)
``("exp", lr0, q)``                         ``lr0 · qᵗ``
``("stair", lr0, n, r)``                    ``lr0 · r^⌊t/n⌋``
``("piecewise", bounds, values)``           ``values[i]``, ``i`` = how many bounds ``t`` has
                                            reached (``t >= b``)
``("poly", lr0, n, end, power, cycle)``     ``(lr0-end)·(1-t'/n')^power + end`` (``cycle``
                                            stretches ``n`` to the next multiple past ``t``)
``("inv", lr0, k)``                         ``lr0 / (1 + k·t)``
``("cos", lr0, n, eta)``                    ``eta + (lr0-eta)·(1+cos(π·t/n))/2``
``("warmcos", start, w, peak, n, eta)``     linear from ``start`` to ``peak`` over ``w`` steps,
                                            then ``("cos", peak, n, eta)`` at ``t-w``
``("sgdr", lr0, T0, mult, eta)``            cosine restarts: periods ``T0, T0·mult, ...``
==========================================  ==================================================

A cosine past its last step is the one place two frameworks may compute the same form
differently: the dialect's ``cosine_past_end`` says whether its rate holds the final value
(``"hold"``) or follows the cosine up again (``"rise"``).

Positions: a dialect whose ``schedule_follows_optimizer`` is true evaluates the schedule at the
optimizer's update count (micro-steps under gradient accumulation); others at the schedule's own
position.  The converted state carries the target's ``last_lr`` computed with the target's own
convention, and the target dialect adds whatever runtime state its schedulers keep.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import MigrationError
from ..state import ScheduleState
from .dialect import Canon, Dialect

__all__ = ["Canon", "value", "same", "sgdr_position", "canonical", "convert_schedule"]


def canonical(dialect: Dialect, schedule: ScheduleState, problems: list[str] | None = None) -> Canon | None:
    """``schedule``'s canonical form through ``dialect``, or None (a dialect that has no schedules
    at all says why in ``problems``)."""
    try:
        return dialect.schedule_to_canonical(schedule)
    except MigrationError as e:
        if problems is None:
            raise
        problems.append(f"schedule: {e}")
        return None
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
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


def sgdr_position(t: int, t0: int, mult: int) -> tuple[int, int]:
    """Position ``t`` in cosine restarts: ``(steps into the current period, its length)``."""
    if mult == 1:
        return t % t0, t0
    cur, ti = t, t0
    while cur >= ti:
        cur, ti = cur - ti, ti * mult
    return cur, ti


def value(c: Canon, t: int, past_end: str = "hold") -> float:
    """The rate of form ``c`` at step ``t``; ``past_end`` is the cosine's behaviour past its end."""
    tag = c[0]
    if tag == "const":
        return c[1]
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
        s = min(t, ds) if past_end == "hold" else t
        return eta + (lr0 - eta) * (1 + math.cos(math.pi * s / ds)) / 2
    if tag == "warmcos":
        start, w, peak, ds, eta = c[1:]
        if t < w:
            return (peak - start) * t / w + start
        return value(("cos", peak, ds, eta), t - w, past_end)
    if tag == "sgdr":
        lr0, t0, mult, eta = c[1:]
        cur, ti = sgdr_position(t, t0, mult)
        return eta + (lr0 - eta) * (1 + math.cos(math.pi * cur / ti)) / 2
    raise ValueError(f"unknown schedule form {tag!r}")


_PAST_END = {"hold": "stays at the final rate", "rise": "rises again"}


def _horizon(c: Canon) -> int | None:
    """The last step up to which the ``hold`` and ``rise`` conventions agree (cosine without restarts)."""
    if c[0] == "cos":
        return c[2]
    if c[0] == "warmcos":
        return c[2] + c[4]
    return None


def _describe(s: ScheduleState | None, fw: str) -> str:
    if s is None:
        return f"a constant {fw} learning rate"
    return f"{fw} {s.kind}({', '.join(f'{k}={v}' for k, v in (s.config or {}).items() if k != 'name')})"


def convert_schedule(src: ScheduleState | None, src_d: Dialect, src_lr: float | None, dst: ScheduleState | None,
                     dst_d: Dialect, step: int, *, warnings: list[str], problems: list[str],
                     approximate: bool) -> tuple[ScheduleState | None, dict | None, float | None]:
    """``(target ScheduleState, the target dialect's private schedule state, constant lr for the
    optimizer)``.  ``step`` is the schedule position the target continues from."""
    if src is None and dst is None:
        return None, None, src_lr
    src_fw, dst_fw = src_d.name, dst_d.name
    sc = canonical(src_d, src, problems) if src is not None else ("const", src_lr)
    dc = canonical(dst_d, dst, problems) if dst is not None else None
    here = value(sc, step, src_d.cosine_past_end) if src is not None and sc is not None else (
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
        there = value(dc, step, dst_d.cosine_past_end) if dc is not None else dst.last_lr
        msg = (f"schedule: the target's {_describe(dst, dst_fw)} does not continue the source's "
               f"{_describe(src, src_fw)} exactly (at step {step}: source lr {here}, target lr {there})")
        if not approximate:
            problems.append(msg + "; see docs/MIGRATION.md for the exact pairs and their parameter "
                            "mappings (or pass approximate=True)")
            return None, None, None
        warnings.append(msg + "; the target's schedule continues from this step")
    form = dc
    horizon = _horizon(form) if form is not None else None
    # Past a cosine's end the two sides part only when their conventions differ; a float source
    # rate ("const") never reaches this point with a cosine target unless approximate.
    src_end = src_d.cosine_past_end if src is not None else dst_d.cosine_past_end
    if horizon is not None and src_end != dst_d.cosine_past_end:
        after = (f"the source's schedule {_PAST_END.get(src_end, src_end)} while the target's "
                 f"{_PAST_END.get(dst_d.cosine_past_end, dst_d.cosine_past_end)}")
        if step > horizon:
            msg = f"schedule: step {step} is past the cosine's end (step {horizon}), where {after}"
            (warnings if approximate else problems).append(msg)
        else:
            warnings.append(f"schedule: exact up to step {horizon}; after it {after}")
    if form is None:
        return ScheduleState(kind=dst.kind, config=dict(dst.config), step=int(step), last_lr=dst.last_lr), None, None
    last = value(form, step, dst_d.cosine_past_end)
    try:
        out, extra = dst_d.schedule_from_canonical(form, dst, int(step), last)
    except MigrationError as e:
        problems.append(f"schedule: {e}")
        return None, None, None
    return out, extra, None
