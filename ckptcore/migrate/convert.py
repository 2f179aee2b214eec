"""Orchestration: a source state plus a template of the target (its adapter's capture of the live
target objects) gives the converted state.  Framework-free: the template carries everything known
about the target (names, shapes, ParamInfo, optimizer kind and hyperparameters, schedule), and
each side's dialect (:mod:`.dialect`) translates its own conventions to and from neutral terms."""

from __future__ import annotations

import dataclasses
import logging
import warnings as _warnings
from typing import Any, Mapping

import numpy as np

from ..errors import AdapterNotFoundError, MigrationError, MigrationWarning
from ..state import AccumulationState, OptimizerState, TrainingState
from ..vocab import Kind, Role
from .dialect import Dialect, Neutral
from .layouts import MERGED_BIAS, NORM_KINDS, SPLIT_BIAS, Move, Unit, layer_hyperparams, optional
from .match import match_units, plan_moves, units_of
from .optimizers import compare
from .rng import convert_rng, derive_seed
from .schedules import convert_schedule

__all__ = ["convert_state", "MigrationWarning", "dialect_for"]

_log = logging.getLogger("ckptcore")


def dialect_for(name: str | None, dialects: Mapping[str, Dialect] | None = None) -> Dialect:
    """The migration dialect of framework ``name``: from ``dialects`` when given there, else from
    the installed adapter (``get_adapter(name).dialect``)."""
    if dialects and name in dialects:
        return dialects[name]
    if not name:
        raise MigrationError("the state names no framework, so there is nothing to convert from")
    from ..registry import get_adapter

    try:
        return get_adapter(name).dialect
    except (AdapterNotFoundError, ImportError) as e:
        raise MigrationError(f"no migration dialect for {name!r}: {e}") from e


def convert_state(state: TrainingState, template: TrainingState, *,
                  name_map: Mapping[str, str | None] | None = None, approximate: bool = False,
                  warn: bool = True, dialects: Mapping[str, Dialect] | None = None) -> TrainingState:
    """Convert ``state`` into the framework and structure of ``template``.

    ``template`` is the target adapter's capture of the live target model (and optimizer, and
    scheduler).  Raises :class:`MigrationError` listing every problem found; emits a
    :class:`MigrationWarning` per inexact part (also kept in ``extra["migration"]["warnings"]``).
    ``dialects`` (``{framework: dialect}``) overrides the installed adapters' dialects.
    """
    src_d, dst_d = dialect_for(state.framework, dialects), dialect_for(template.framework, dialects)
    src_fw, dst_fw = src_d.name, dst_d.name
    problems: list[str] = []
    notes: list[str] = []
    src_units, src_loose = units_of(state, "source", src_d.default_flatten_order)
    dst_units, dst_loose = units_of(template, "target", dst_d.default_flatten_order)
    pairs = match_units(src_units, dst_units, name_map, problems)
    moves = plan_moves(pairs, problems)
    model = _weights(state, template, moves, src_loose, dst_loose, name_map, dst_d, problems)
    layers = _layer_hyperparams(pairs, notes)
    notes += [f"{mv.dst}: {mv.note}" for mv in moves if "assumed" in mv.note]
    optimizer, schedule, sched_extra, accumulation = _training(state, template, moves, src_d, dst_d,
                                                               approximate, notes, problems)
    if optimizer is not None and any(m.note in (SPLIT_BIAS, MERGED_BIAS) for m in moves):
        notes.append("lstm: one side keeps two LSTM bias vectors (input and recurrent) that get the same "
                     "gradient where the other keeps one, so a continued run with two moves that bias "
                     "twice as fast; outputs at the moment of conversion are exact")
    if problems:
        raise MigrationError(_message(src_fw, dst_fw, problems))
    if warn:
        for n in notes:
            _warnings.warn(n, MigrationWarning, stacklevel=3)
    extra = dst_d.extra(template, {"scheduler": sched_extra} if sched_extra is not None else {})
    extra["migration"] = {"from": src_fw, "warnings": list(notes), "layers": layers,
                          "pairs": {mv.dst: list(mv.src) for mv in moves}}
    return TrainingState(
        model=model, optimizer=optimizer, schedule=schedule,
        rng=convert_rng(state.rng, dst_d, state.step), data=dict(state.data or {}),
        accumulation=accumulation, step=state.step, epoch=state.epoch, framework=dst_fw,
        metadata={**(template.metadata or {}),
                  "migrated_from": {"framework": src_fw, **(state.metadata or {})}},
        extra=extra, params=dict(template.params))


# Problems of placing the model's parameters (a layer without a counterpart, a name_map entry):
# the only ones name_map can solve.  The optimizer's, the schedule's and the accumulation's
# problems say their own fix.
_PAIRING = ("source ", "target ", "name_map:")


def _message(src: str, dst: str, problems: list[str]) -> str:
    lines = "\n".join(f"  - {p}" for p in problems)
    hint = "See docs/MIGRATION.md."
    if any(p.startswith(_PAIRING) for p in problems):
        hint = ("Pass name_map={source name or layer: target name or layer} to pair layers "
                "explicitly (None drops a source layer); see docs/MIGRATION.md.")
    return f"cannot convert this {src} state to {dst}:\n{lines}\n{hint}"


def _cast(arr: np.ndarray, like: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(arr, dtype=like.dtype)


def _weights(state: TrainingState, template: TrainingState, moves: list[Move], src_loose: dict,
             dst_loose: dict, name_map: Mapping | None, dst_d: Dialect, problems: list[str]
             ) -> dict[str, np.ndarray]:
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
        if info.role == Role.SEED_STATE and name in template.model:
            # per-layer generators (Dropout...): reseeded deterministically, like the global ones
            seed = derive_seed(state.rng, state.step, salt=f"{name}/{seed_step}")
            seed_step += 1
            model[name] = dst_d.layer_seed_state(seed, template.model[name])
    for name, info in template.params.items():   # the target's own counters keep their values
        if name not in model and name in template.model and optional(info) and info.index >= 0:
            model[name] = template.model[name]
    for name, why in dst_loose.items():
        if name not in model:
            problems.append(f"target {name} {list(template.model[name].shape)}: nothing in the source "
                            f"fills it: {why}")
    return model


def _layer_hyperparams(pairs: list[tuple[Unit, Unit]], notes: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    drift: list[tuple[str, str, str]] = []
    for s, d in pairs:
        if s.kind not in NORM_KINDS:
            continue
        sh, dh = layer_hyperparams(s), layer_hyperparams(d)
        out[d.layer] = {"source_layer": s.layer, **sh}
        sv, dv = _variance_update(s), _variance_update(d)
        if s.kind == Kind.BATCH_NORM and sv != dv:
            drift.append((d.layer, sv, dv))
        for key, value in sh.items():
            if key in dh and not np.isclose(value, dh[key], rtol=1e-6, atol=0):
                effect = ("outputs change" if key == "epsilon" else
                          "the moving statistics follow the target's value in training")
                notes.append(f"{d.layer}: the target's {key} is {dh[key]} but the source's {s.layer} used "
                             f"{value}; {effect} (build the target layer with {key}={value} to match; "
                             "momentum as in moving = moving*momentum + batch*(1-momentum))")
    if drift:
        _, sv, dv = drift[0]
        notes.append(f"batch normalization: the source updates moving variances with the {sv} batch variance, "
                     f"the target with the {dv} one ({len(drift)} layers: {', '.join(x[0] for x in drift)}); "
                     "outputs at the moment of conversion are exact and trainable weights continue exactly, "
                     "but in training each moving variance moves by (1-momentum)·var/(n-1) differently per "
                     "step (n values per channel in a batch)")
    return out


def _variance_update(unit: Unit) -> str:
    """How a BatchNorm's moving variance takes in a batch: ``"biased"`` (divided by n, the
    convention unless ``attrs["variance_update"]`` says otherwise) or ``"unbiased"`` (by n-1)."""
    info = next(iter(unit.infos.values()), None)
    return str((info.attrs if info is not None else {}).get("variance_update", "biased"))


def _training(state: TrainingState, template: TrainingState, moves: list[Move], src_d: Dialect,
              dst_d: Dialect, approximate: bool, notes: list[str], problems: list[str]):
    src_opt = state.optimizer
    src_n = src_d.optimizer_to_neutral(src_opt, state.schedule) if src_opt is not None else None
    every = _every(template, dst_d)
    raw = src_n.step * every + (state.accumulation.count if state.accumulation else 0) \
        if src_n is not None and every else (src_n.step if src_n is not None else state.step)
    sched_step = state.schedule.step if state.schedule is not None else raw
    if dst_d.schedule_follows_optimizer and template.schedule is not None and sched_step != raw:
        msg = (f"schedule: the source's scheduler is at step {sched_step} but the optimizer has taken {raw} "
               f"(micro-)steps; a {dst_d.name} schedule is evaluated at the optimizer's step count, so it can "
               "only continue a scheduler stepped once per optimizer step")
        (notes if approximate else problems).append(msg)
    src_lr = src_n.lr if src_n is not None else None
    schedule, sched_extra, const_lr = convert_schedule(
        state.schedule, src_d, src_lr, template.schedule, dst_d, sched_step,
        warnings=notes, problems=problems, approximate=approximate)
    if src_n is None:
        if template.optimizer is not None:
            notes.append("optimizer: the source state has no optimizer state; the target optimizer starts fresh")
        return None, schedule, sched_extra, None
    if const_lr is None and schedule is not None and schedule.last_lr is not None:
        const_lr = schedule.last_lr   # the rate at the migrated step: the target continues from it
    optimizer = _optimizer(state, template, moves, src_n, src_d, dst_d, state.schedule is not None,
                           const_lr, approximate, notes, problems)
    accumulation = _accumulation(state, template, moves, every, src_d, dst_d, approximate, notes, problems)
    return optimizer, schedule, sched_extra, accumulation


def _every(template: TrainingState, dst_d: Dialect) -> int:
    if dst_d.accumulation_in_optimizer and template.accumulation is not None:
        return int(template.accumulation.every)
    return 0


def _optimizer(state: TrainingState, template: TrainingState, moves: list[Move], src_n: Neutral,
               src_d: Dialect, dst_d: Dialect, scheduled: bool, const_lr: float | None, approximate: bool,
               notes: list[str], problems: list[str]) -> OptimizerState | None:
    src_opt = state.optimizer
    if template.optimizer is not None:
        kind, hyper = template.optimizer.kind, dict(template.optimizer.hyperparams or {})
    else:
        kind, hyper = dst_d.optimizer_from_neutral(src_n)
        hyper = dict(hyper)
    dst_n = dst_d.optimizer_to_neutral(OptimizerState(kind=kind, hyperparams=hyper), None)
    if const_lr is not None:
        hyper["learning_rate"] = float(const_lr)
        dst_n.lr = float(const_lr)
    try:
        neutral = {p: src_d.slots_to_neutral(src_n, s) for p, s in src_opt.slots.items()}
    except (ValueError, ZeroDivisionError) as e:
        problems.append(f"optimizer: {e}")
        return None
    n_problems = len(problems)
    compare(src_n, dst_n, scheduled=scheduled, slots=neutral, step=src_n.step,
            warnings=notes, problems=problems, approximate=approximate)
    if len(problems) > n_problems:
        return None
    current = template.optimizer.slots if template.optimizer is not None else {}
    slots: dict[str, dict[str, np.ndarray]] = {}
    for mv in moves:
        if all(p in src_opt.slots for p in mv.src):
            moved = _move_slots(mv, [neutral[x] for x in mv.src])
            out = dst_d.slots_from_neutral(dst_n, moved, source=src_n, like=template.model[mv.dst],
                                           current=current.get(mv.dst))
            if out:
                slots[mv.dst] = out
    out = OptimizerState(kind=kind, step=int(src_n.step), hyperparams=hyper, slots=slots, extra={})
    return dst_d.finish_optimizer(out, template.optimizer)


def _move_slots(mv: Move, src_slots: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Every neutral slot the source parameters of ``mv`` share, in the target layout."""
    names = set(src_slots[0]).intersection(*src_slots[1:]) if src_slots else set()
    return {slot: mv.slot([s[slot] for s in src_slots]) for slot in sorted(names)}


def _accumulation(state: TrainingState, template: TrainingState, moves: list[Move], every: int,
                  src_d: Dialect, dst_d: Dialect, approximate: bool, notes: list[str], problems: list[str]
                  ) -> AccumulationState | None:
    src = state.accumulation
    src_every = int(src.every) if src is not None else 0
    pending = bool(src is not None and src.buffers)
    if dst_d.accumulation_in_optimizer:
        if not every:
            if pending:
                msg = ("accumulation: the source has gradients in flight but the target optimizer does not "
                       "accumulate gradients")
                (notes if approximate else problems).append(msg + ("; they are dropped" if approximate else ""))
                if approximate:
                    _log.warning("migration drops %d accumulated gradient buffers: %s", len(src.buffers), msg)
            return None
        if pending and src_every != every:
            problems.append(f"accumulation: the source accumulates {src_every or 'an unknown number of'} "
                            f"micro-batches, the target {every}")
            return None
    else:
        if src is None or (not pending and not src_every):
            return None
        every = src_every
    # Buffers go through the neutral form, raw sums: a "mean" side keeps each micro-batch's gradient
    # divided by the number of micro-batches.
    factor = (float(every) if src_d.accumulation_form == "mean" and every else 1.0)
    if dst_d.accumulation_form == "mean" and every:
        factor = factor / every
    buffers: dict[str, np.ndarray] = {}
    for mv in moves:
        if src is not None and all(x in src.buffers for x in mv.src):
            like = template.model[mv.dst]
            buffers[mv.dst] = _cast(mv.slot([src.buffers[x] * np.float32(factor) for x in mv.src]), like)
    if dst_d.accumulation_in_optimizer and template.accumulation is not None:
        for p, arr in template.accumulation.buffers.items():   # the optimizer keeps one per variable
            buffers.setdefault(p, np.zeros_like(arr))
    return AccumulationState(every=every, count=int(src.count) if src is not None else 0, buffers=buffers)
