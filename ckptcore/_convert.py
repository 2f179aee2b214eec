"""Conversion of a state for a restore's target objects: the one place a restore dispatches it.

``convert_for`` is what an adapter's ``restore`` calls first (through :mod:`ckptcore.adapter`):
the state itself when it is the framework's (or neutral), else converted by the migration.  A
restore through the core (``load_state(..., model=...)``, ``CheckpointManager.restore``) converts
in ``restore_converted`` with the restore's options (``name_map``, ``approximate``) and every
target object it was given, then hands the result to the adapter marked as converted, so the
adapter's own ``convert_for`` passes it straight through: one conversion per restore.
``ckptcore.convert`` (public, in ``api``) converts without restoring, through ``convert_state_for``.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any, Mapping

from ._contract import Adapter
from .registry import get_adapter
from .state import TrainingState

log = logging.getLogger("ckptcore")

# Keywords of a restore that are not target objects: conversion never needs them (the cursor's
# position is carried over from the state as it is, and the RNG is reseeded by the migration).
NOT_TARGETS = frozenset({"model", "optimizer", "cursor", "strict", "rng"})

# The state a restore in progress already converted, and for which framework.
_CONVERTED: contextvars.ContextVar[tuple[TrainingState, str] | None] = contextvars.ContextVar(
    "ckptcore_converted_state", default=None)


def convert_state_for(state: TrainingState, to: str, model: Any, optimizer: Any = None, *,
                      name_map: Mapping[str, str | None] | None = None, approximate: bool = False,
                      **objects: Any) -> TrainingState:
    """``ckptcore.convert`` of a state in memory (see its docstring)."""
    from .migrate import convert_state

    if state.framework == to:
        return state
    adapter = get_adapter(to)
    if not adapter.handles(model):
        raise TypeError(f"convert(to={to!r}) needs a {to} model as the target; got "
                        f"{type(model).__module__}.{type(model).__qualname__}")
    reserved = sorted(NOT_TARGETS & set(objects))
    if reserved:
        raise TypeError(f"convert() does not take {reserved} as target objects")
    targets: dict[str, Any] = {"model": model, "rng": False}
    if optimizer is not None:
        targets["optimizer"] = optimizer
    targets.update((k, v) for k, v in objects.items() if v is not None)
    template = adapter.capture(**targets)
    return convert_state(state, template, name_map=name_map, approximate=approximate)


def convert_for(state: TrainingState, framework: str, objects: Mapping[str, Any], *,
                name_map: Mapping[str, str | None] | None = None, approximate: bool = False) -> TrainingState:
    """``state`` itself when it is ``framework``'s (or neutral), or when the restore in progress
    already converted it (``restore_converted``); else converted for the target ``objects``
    (``model=``, ``optimizer=`` and every framework-specific one, e.g. ``scheduler=``).
    Adapters' own ``restore`` functions call it first."""
    converted = _CONVERTED.get()
    if converted is not None and converted[0] is state and converted[1] == framework:
        return state
    if state.framework in (None, framework):
        return state
    log.info("restore: the state was saved by %s; converting it for %s", state.framework, framework)
    targets = {k: v for k, v in objects.items() if k not in NOT_TARGETS}
    return convert_state_for(state, framework, objects["model"], objects.get("optimizer"),
                             name_map=name_map, approximate=approximate, **targets)


def restore_converted(adapter: Adapter, state: TrainingState, objects: Mapping[str, Any], *,
                      name_map: Mapping[str, str | None] | None = None,
                      approximate: bool = False) -> TrainingState:
    """Convert ``state`` for ``adapter`` and the restore's ``objects`` (every one of them, so a
    framework-specific target the adapter's own call would not name still shapes the
    conversion), then ``adapter.restore`` it, marked as converted.  Returns the state restored."""
    state = convert_for(state, adapter.name, objects, name_map=name_map, approximate=approximate)
    token = _CONVERTED.set((state, adapter.name))
    try:
        adapter.restore(state, **objects)
    finally:
        _CONVERTED.reset(token)
    return state
