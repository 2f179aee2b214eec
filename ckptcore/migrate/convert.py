"""Orchestration: a source state plus a template of the target (its adapter's capture of the live
target objects) gives the converted state.  Framework-free: the template carries everything
known about the target (names, shapes, ParamInfo, optimizer kind and hyperparameters, schedule)."""

from __future__ import annotations

import dataclasses
import warnings as _warnings
from typing import Any, Mapping

import numpy as np

from ..errors import MigrationError
from ..state import AccumulationState, OptimizerState, TrainingState
from . import optimizers as opt_mod
from .layouts import Move, Unit, layer_hyperparams
from .match import match_units, plan_moves, units_of
from .rng import convert_rng, derive_seed
from .schedules import convert_schedule

__all__ = ["convert_state", "MigrationWarning", "FRAMEWORKS"]

FRAMEWORKS = ("keras", "paddle")


class MigrationWarning(UserWarning):
    """A converted state continues the run, but not exactly; the message says how far off."""


def convert_state(state: TrainingState, template: TrainingState, *,
                  name_map: Mapping[str, str | None] | None = None, approximate: bool = False,
                  warn: bool = True) -> TrainingState:
    """Convert ``state`` into the framework and structure of ``template``.

    ``template`` is the target adapter's capture of the live target model (and optimizer, and
    scheduler).  Raises :class:`MigrationError` listing every problem found; emits a
    :class:`MigrationWarning` per inexact part (also kept in ``extra["migration"]["warnings"]``).
    """
    src_fw, dst_fw = state.framework, template.framework
    if src_fw not in FRAMEWORKS or dst_fw not in FRAMEWORKS:
        raise MigrationError(f"migration converts between {FRAMEWORKS}; got {src_fw!r} -> {dst_fw!r}")
    problems: list[str] = []
    notes: list[str] = []
    src_units, src_loose = units_of(state, "source")
    dst_units, dst_loose = units_of(template, "target")
    pairs = match_units(src_units, dst_units, name_map, problems)
    moves = plan_moves(pairs, problems)
    model = _weights(state, template, moves, src_loose, dst_loose, name_map, problems)
    layers = _layer_hyperparams(pairs, notes)
    notes += [f"{mv.dst}: {mv.note}" for mv in moves if "assumed" in mv.note]
    optimizer, schedule, sched_extra, accumulation = _training(state, template, moves, approximate,
                                                               notes, problems)
    if optimizer is not None and any(m.note.startswith("lstm_") for m in moves):
        notes.append("lstm: Paddle's LSTM adds two bias vectors (bias_ih + bias_hh) that get the same "
                      "gradient where Keras has one, so a continued run moves that bias twice as fast; "
                      "outputs at the moment of conversion are exact")
    if problems:
        raise MigrationError(_message(src_fw, dst_fw, problems))
    if warn:
        for n in notes:
            _warnings.warn(n, MigrationWarning, stacklevel=3)
    extra = _extra(template, dst_fw, sched_extra)
    extra["migration"] = {"from": src_fw, "warnings": list(notes), "layers": layers,
                          "pairs": {mv.dst: list(mv.src) for mv in moves}}
    return TrainingState(
        model=model, optimizer=optimizer, schedule=schedule,
        rng=convert_rng(state.rng, dst_fw, state.step), data=dict(state.data or {}),
        accumulation=accumulation, step=state.step, epoch=state.epoch, framework=dst_fw,
        metadata={**(template.metadata or {}),
                  "migrated_from": {"framework": src_fw, **(state.metadata or {})}},
        extra=extra, params=dict(template.params))


def _message(src: str, dst: str, problems: list[str]) -> str:
    lines = "\n".join(f"  - {p}" for p in problems)
    return (f"cannot convert this {src} state to {dst}:\n{lines}\n"
            "Pass name_map={source name or layer: target name or layer} to pair layers explicitly "
            "(None drops a source layer); see docs/MIGRATION.md.")


def _cast(arr: np.ndarray, like: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(arr, dtype=like.dtype)


def _weights(state: TrainingState, template: TrainingState, moves: list[Move], src_loose: dict,
             dst_loose: dict, name_map: Mapping | None, problems: list[str]) -> dict[str, np.ndarray]:
    model: dict[str, np.ndarray] = {}
    for mv in moves:
        model[mv.dst] = _cast(mv.weight([state.model[x] for x in mv.src]), template.model[mv.dst])
    direct = {s: d for s, d in (name_map or {}).items() if s in src_loose and d is not None}
    for s, d in direct.items():   # custom variables the user pairs by name: copied as they are
        if d in template.model and template.model[d].shape == state.model[s].shape:
            model[d] = _cast(state.model[s], template.model[d])
        else:
            problems.append(f"name_map: {s!r} -> {d!r}: the target has no variable of shape "
                            f"{list(state.model[s].shape)} under that name")
    for name, why in src_loose.items():
        if name not in direct and (name_map or {}).get(name, "") is not None:
            problems.append(f"source {name} {list(state.model[name].shape)}: cannot be placed: {why}")
    seed_step = 0
    for name, info in template.params.items():
        if info.role == "seed_state" and name in template.model:
            # per-layer generators (Dropout...): reseeded deterministically, like the global ones
            seed = derive_seed(state.rng, state.step, salt=f"{name}/{seed_step}")
            seed_step += 1
            model[name] = np.array([seed, 0], dtype=template.model[name].dtype).reshape(template.model[name].shape)
    for name, why in dst_loose.items():
        if name not in model:
            problems.append(f"target {name} {list(template.model[name].shape)}: nothing in the source "
                            f"fills it: {why}")
    return model


def _layer_hyperparams(pairs: list[tuple[Unit, Unit]], notes: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s, d in pairs:
        if s.kind not in ("batch_norm", "layer_norm", "group_norm"):
            continue
        sh, dh = layer_hyperparams(s), layer_hyperparams(d)
        out[d.layer] = {"source_layer": s.layer, **sh}
        for key, value in sh.items():
            if key in dh and not np.isclose(value, dh[key], rtol=1e-6, atol=0):
                effect = ("outputs change" if key == "epsilon" else
                          "the moving statistics follow the target's value in training")
                notes.append(f"{d.layer}: the target's {key} is {dh[key]} but the source's {s.layer} used "
                             f"{value}; {effect} (build the target layer with {key}={value} to match; "
                             "both frameworks use moving = moving*momentum + batch*(1-momentum))")
    return out


def _training(state: TrainingState, template: TrainingState, moves: list[Move], approximate: bool,
              notes: list[str], problems: list[str]):
    src_fw, dst_fw = state.framework, template.framework
    src_opt = state.optimizer
    if (src_opt is not None and src_fw == "paddle" and state.schedule is not None
            and src_opt.extra.get("step_source") == "none"):
        # Paddle keeps no step counter; without Adam's beta powers the scheduler's position is the best
        # record of it (FRAMEWORKS.md §4.1: last_epoch == steps when stepped once per step).
        src_opt = dataclasses.replace(src_opt, step=int(state.schedule.step))
        state = dataclasses.replace(state, optimizer=src_opt)
    every = _every(template, dst_fw)
    raw = src_opt.step * every + (state.accumulation.count if state.accumulation else 0) \
        if src_opt is not None and every else (src_opt.step if src_opt is not None else state.step)
    sched_step = state.schedule.step if state.schedule is not None else raw
    if dst_fw == "keras" and template.schedule is not None and sched_step != raw:
        msg = (f"schedule: the source's scheduler is at step {sched_step} but the optimizer has taken {raw} "
               "(micro-)steps; a Keras schedule is evaluated at the optimizer's step count, so it can only "
               "continue a scheduler stepped once per optimizer step")
        (notes if approximate else problems).append(msg)
    src_lr = (src_opt.hyperparams or {}).get("learning_rate") if src_opt is not None else None
    schedule, sched_extra, const_lr = convert_schedule(
        state.schedule, src_fw, src_lr, template.schedule, dst_fw, sched_step,
        warnings=notes, problems=problems, approximate=approximate)
    if src_opt is None:
        if template.optimizer is not None:
            notes.append("optimizer: the source state has no optimizer state; the target optimizer starts fresh")
        return None, schedule, sched_extra, None
    optimizer = _optimizer(state, template, moves, state.schedule is not None, const_lr, approximate,
                           notes, problems)
    accumulation = _accumulation(state, template, moves, every, approximate, notes, problems)
    return optimizer, schedule, sched_extra, accumulation


def _every(template: TrainingState, fw: str) -> int:
    if fw == "keras" and template.accumulation is not None:
        return int(template.accumulation.every)
    return 0


def _optimizer(state: TrainingState, template: TrainingState, moves: list[Move], scheduled: bool,
               const_lr: float | None, approximate: bool, notes: list[str], problems: list[str]
               ) -> OptimizerState | None:
    src_fw, dst_fw = state.framework, template.framework
    src_opt = state.optimizer
    src_n = opt_mod.describe(src_opt, src_fw)
    if template.optimizer is not None:
        kind, hyper = template.optimizer.kind, dict(template.optimizer.hyperparams or {})
    else:
        kind = opt_mod.target_kind(src_n, dst_fw)
        hyper = opt_mod.synthesize_hyperparams(src_n, dst_fw, kind)
    dst_n = opt_mod.describe(OptimizerState(kind=kind, hyperparams=hyper), dst_fw)
    if const_lr is not None:
        hyper["learning_rate"] = float(const_lr)
        dst_n.lr = float(const_lr)
    neutral = {p: {opt_mod.neutral_slot(src_fw, src_n.family, k) or k: v for k, v in s.items()}
               for p, s in src_opt.slots.items()}
    n_problems = len(problems)
    opt_mod.compare(src_n, dst_n, scheduled=scheduled, slots=neutral, step=src_opt.step,
                    warnings=notes, problems=problems, approximate=approximate)
    if len(problems) > n_problems:
        return None
    wanted = _wanted_slots(template, dst_n, dst_fw)
    scalars = opt_mod.scalar_slots(dst_n, src_opt.step) if dst_fw == "paddle" else {}
    slots: dict[str, dict[str, np.ndarray]] = {}
    for mv in moves:
        if all(x in neutral for x in mv.src):
            out = _move_slots(mv, [neutral[x] for x in mv.src], wanted(mv.dst), scalars, src_n.lr,
                              dst_n.family, dst_fw, template.model[mv.dst])
            if out:
                slots[mv.dst] = out
    if dst_fw == "keras" and template.optimizer is not None:
        for p, tslots in template.optimizer.slots.items():   # Keras keeps a slot for every variable
            for s, arr in tslots.items():
                slots.setdefault(p, {}).setdefault(s, np.zeros_like(arr))
    extra = dict(template.optimizer.extra) if template.optimizer is not None else {}
    if dst_fw == "paddle":
        extra["step_source"] = "migrated"
    return OptimizerState(kind=kind, step=int(src_opt.step), hyperparams=hyper, slots=slots, extra=extra)


def _move_slots(mv: Move, src_slots: list[dict[str, np.ndarray]], wanted: list[str],
                scalars: dict[str, np.ndarray], lr: float | None, family: str, fw: str,
                like: np.ndarray) -> dict[str, np.ndarray]:
    """The target slots of ``mv.dst`` from its source parameters' slots (under neutral names)."""
    out: dict[str, np.ndarray] = {}
    for slot in wanted:
        if slot in scalars:
            out[slot] = scalars[slot].copy()
            continue
        dn = opt_mod.neutral_slot(fw, family, slot)
        sn = next((c for c in (dn, opt_mod.fallback(dn or "")) if c and all(c in s for s in src_slots)), None)
        if sn is None:   # e.g. RMSprop's mean_grad when the source was not centered
            out[slot] = np.zeros(like.shape, like.dtype)
            continue
        vals = [opt_mod.convert_slot(s[sn], sn, dn, lr) for s in src_slots]
        out[slot] = _cast(mv.slot(vals), like)
    return out


def _wanted_slots(template: TrainingState, dst_n: opt_mod.Neutral, fw: str):
    table = opt_mod.slot_names(dst_n, fw)
    if fw == "keras" and template.optimizer is not None and template.optimizer.slots:
        return lambda p: list(template.optimizer.slots.get(p, {}))
    return lambda p: table


def _accumulation(state: TrainingState, template: TrainingState, moves: list[Move], every: int,
                  approximate: bool, notes: list[str], problems: list[str]) -> AccumulationState | None:
    src = state.accumulation
    src_every = int(src.every) if src is not None else 0
    pending = bool(src is not None and src.buffers)
    if template.framework == "keras":
        if not every:
            if pending:
                msg = ("accumulation: the source has gradients in flight but the target Keras optimizer has "
                       "no gradient_accumulation_steps")
                (notes if approximate else problems).append(msg + ("; they are dropped" if approximate else ""))
            return None
        if pending and src_every != every:
            problems.append(f"accumulation: the source accumulates {src_every or 'an unknown number of'} "
                            f"micro-batches, the target {every}")
            return None
        factor = float(every)   # Paddle keeps mean-scaled grads ((loss/N).backward()); Keras raw sums
    else:
        if src is None or (not pending and not src_every):
            return None
        every = src_every
        factor = 1.0 / every if every else 1.0
    buffers: dict[str, np.ndarray] = {}
    for mv in moves:
        if src is not None and all(x in src.buffers for x in mv.src):
            like = template.model[mv.dst]
            buffers[mv.dst] = _cast(mv.slot([src.buffers[x] * np.float32(factor) for x in mv.src]), like)
    if template.framework == "keras" and template.accumulation is not None:
        for p, arr in template.accumulation.buffers.items():
            buffers.setdefault(p, np.zeros_like(arr))
    return AccumulationState(every=every, count=int(src.count) if src is not None else 0, buffers=buffers)


def _extra(template: TrainingState, fw: str, sched_extra: dict | None) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if fw == "keras":
        extra["keras"] = dict((template.extra or {}).get("keras") or {})
    else:
        tp = dict((template.extra or {}).get("paddle") or {})
        mine = {k: tp[k] for k in ("param_names", "aliases") if k in tp}
        if sched_extra is not None:
            mine["scheduler"] = sched_extra
        extra["paddle"] = mine
    return extra
