"""The adapter contract: what a framework package provides, and the restore planning the core does.

An adapter is one object per framework, registered under the ``ckptcore.adapters`` entry-point
group (see :mod:`ckptcore.registry`).  It *discovers* the framework's objects (which tensors a model
has, under which names, with which optimizer slots) and *moves bytes* (framework tensor to NumPy
array and back).  Everything else is the core's: validating a state against the targets, deciding
what is missing or unexpected, the error messages, the :class:`~ckptcore.RestoreReport`, migration
between frameworks (through the adapter's :attr:`Adapter.dialect`), the command line's import and
export verbs (through :attr:`Adapter.formats`) and ``ckpt demo`` (through :meth:`Adapter.demo`).

An adapter module must not import its framework at import time: the registry imports adapters
to ask them questions (``handles``), and ``import ckptcore`` stays free of every framework.

Restoring goes in two phases, so a failed restore leaves every target untouched::

    plan = RestorePlan()
    for name, target in discovered.items():           # the adapter's discovery
        value = state.model.get(name)
        if value is None:
            plan.missing(name)
        else:
            plan.assign(name, value, shape=target.shape, dtype=target_dtype,
                        put=lambda t=target, v=value: write_into(t, v))
    plan.unexpected_from(state.model, discovered)      # saved names nothing took
    return plan.apply(strict)                          # raises, or writes everything and reports

This module is the whole service-provider interface: an adapter imports from ``ckptcore`` and
``ckptcore.adapter`` only, never a private ``ckptcore._...`` module (tests/test_boundaries.py
checks).  Besides the contract and the planning above it offers:

* :func:`convert_for` -- what an adapter's ``restore`` calls first: the state itself when it is
  the framework's (or neutral) or was already converted by the restore in progress, else the
  state converted for the target objects.  A restore through the core converts once, before it
  calls the adapter (``ckptcore._convert.restore_converted``), and this call passes it through.
* :func:`check_url` -- a URL or path argument checked (non-empty, not a chained fsspec URL).
* :func:`open_regular` -- a local file opened for reading without following links (native
  checkpoint readers share the core's containment).
* :func:`parse_dtype` -- the NumPy dtype a stored dtype name denotes (``SchemaError`` if unknown).
* :class:`RestrictedUnpickler` (with :func:`restricted_load`, :func:`check_plain`,
  :func:`plain_records`, :class:`Record`, :func:`brief`) -- native files that are pickles
  (``paddle.save``, ``torch.save``, distributed checkpoints' metadata) read without running code.
* :func:`plan_training_parts` and :func:`finish_restore` -- the common steps of an adapter's
  ``restore`` around its own planning: the optimizer, schedule and grad scaler into the targets
  given (or noted as unapplied), then the cursor, the RNGs, :meth:`RestorePlan.apply` and the
  warnings about what was left unapplied.
* :func:`value_check` -- for a put planned with ``assign_many(..., verifies=True)``: verifies
  each value in the thread that copies it, right before the copy (a streaming load then
  verifies nothing ahead; an adapter says so with ``checks_values = True``).
* :func:`check_keywords` and :func:`lazy_attributes` -- an adapter package's ``__init__``: the
  keywords its :class:`Adapter` methods take, and names imported from its modules on first use.
* ``knobs`` -- the tunables, read through typed accessors: ``knobs.group_timeout()`` (seconds a
  collective may wait), ``knobs.threads()``, ``knobs.shard_size()``, ... (one per knob, each
  with its ``CKPTCORE_<NAME>`` environment override).
"""

from __future__ import annotations

import contextlib
import contextvars
import contextlib
import contextvars
import functools
import importlib
import logging
import sys
import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

import numpy as np

from . import _knobs as knobs
from ._codec import parse_dtype
from ._contract import Adapter, DemoProgram, FileFormat
from ._convert import convert_for
from ._localfs import open_regular
from ._storage import check_url
from ._unpickle import (MAX_DEPTH, PLAIN_KEYS, Record, RecordClass, RestrictedUnpickler, brief,
                        brief_error, check_plain, plain_records, restricted_load)
from .errors import RestoreError, UnappliedStateWarning, warn_and_log
from .state import RestoreReport

__all__ = ["Adapter", "any_bit", "PackageAdapter", "FileFormat", "DemoProgram", "RestorePlan", "qualified",
           "mismatch_message", "warn_unapplied", "warn_and_log", "CALLBACK_KEEP", "open_regular",
           "check_url", "convert_for", "parse_dtype", "knobs", "tiers", "RestrictedUnpickler",
           "Record", "RecordClass", "restricted_load", "plain_records", "check_plain", "brief",
           "brief_error", "PLAIN_KEYS", "MAX_DEPTH", "plan_training_parts", "finish_restore",
           "check_keywords", "lazy_attributes", "value_check", "unapplied_parts"]

# How many checkpoints a framework callback keeps when the user does not say: the same number in
# every adapter, so switching frameworks does not change how much disk a run uses.
CALLBACK_KEEP = 3

_log = logging.getLogger("ckptcore")


class PackageAdapter:
    """A base for an adapter laid out by the adapter module map (docs/ARCHITECTURE.md): the dialect,
    file formats and demo live in the package's ``_dialect``, ``_files`` and ``_demo`` modules,
    imported on first use (they may import the framework; the package itself must not).

    A subclass sets ``name`` and ``capture_views`` and defines ``handles``, ``capture`` and
    ``restore``.
    """

    name: str
    capture_views: bool = False
    # Whether restore verifies each value as it copies it (value_check, assign_many(verifies=)):
    # a streaming load then verifies nothing ahead of it (see ckptcore.api._checks_values).
    checks_values: bool = False

    def _module(self, name: str) -> Any:
        package = type(self).__module__
        return importlib.import_module(f"{package}.{name}")

    @property
    def dialect(self) -> Any:
        return self._module("_dialect").DIALECT

    @property
    def formats(self) -> Sequence[FileFormat]:
        return tuple(self._module("_files").FORMATS)

    def demo(self, *, seed: int, features: int, classes: int) -> DemoProgram:
        return self._module("_demo").demo(seed=seed, features=features, classes=classes)

    def __repr__(self) -> str:
        return f"<{type(self).__module__}.ADAPTER>"


def qualified(section: str, *parts: str) -> str:
    """The one naming scheme of :class:`~ckptcore.RestoreReport` entries.

    Model tensors are reported by their own name; everything else as ``section/part/...``:
    ``optimizer/dense/kernel/m`` (a slot), ``schedule``, ``data``, ``accumulation/dense/kernel``,
    ``rng/aug`` (a named generator).

    >>> qualified("model", "dense/kernel"), qualified("optimizer", "dense/kernel", "m")
    ('dense/kernel', 'optimizer/dense/kernel/m')
    """
    if section == "model":
        return "/".join(parts)
    return "/".join((section, *parts))


_unapplied_seen: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "ckptcore_unapplied", default=None)


@contextlib.contextmanager
def unapplied_parts() -> Iterator[set[str]]:
    """The parts :func:`warn_unapplied` names while the block runs (in this thread), whether
    or not the warning is shown: what a ``CheckpointManager.restore`` left unapplied."""
    seen: set[str] = set()
    token = _unapplied_seen.set(seen)
    try:
        yield seen
    finally:
        _unapplied_seen.reset(token)


def warn_unapplied(parts: Mapping[str, str], *, stacklevel: int = 3) -> None:
    """Warn, once per restore, about saved parts of the state that this restore does not apply.

    ``parts`` maps each part (``"data"``: the data cursor, ``"optimizer"``, ``"optimizer slots"``,
    ``"accumulation"``, ``"schedule"``...) to the fix, e.g. ``{"data": "pass cursor=..."}``.  The
    one wording of :class:`~ckptcore.errors.UnappliedStateWarning`, used by every adapter and the
    core alike, and logged on the ``ckptcore`` logger (:func:`warn_and_log`: shown once on a
    console where logging is not set up).
    """
    if not parts:
        return
    seen = _unapplied_seen.get()
    if seen is not None:  # a manager's restore records them in the run's lineage
        seen.update(parts)
    listed = "; ".join(f"{part} ({fix})" for part, fix in parts.items())
    message = (f"the checkpoint holds training state this restore leaves unapplied: {listed}. "
               "A run resumed this way does not continue where it stopped. To leave a part out on "
               "purpose, load with keys=[...] without it (e.g. keys=['model']).")
    warn_and_log(message, UnappliedStateWarning, stacklevel=stacklevel)


def _show(names: Sequence[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" ... ({len(names) - limit} more)" if len(names) > limit else "")


def mismatch_message(missing: Sequence[str], unexpected: Sequence[str]) -> str:
    """The one wording of a strict restore's refusal."""
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {_show(list(missing))}")
    if unexpected:
        parts.append(f"in the checkpoint but not in the target: {_show(list(unexpected))}")
    return ("the checkpoint does not fit the target: " + "; ".join(parts)
            + ". Pass strict=False to restore what matches and get a RestoreReport.")


class RestoreGate(Protocol):
    """What a streaming load (``ckptcore.load_state`` with framework objects) offers
    :meth:`RestorePlan.apply`: waiting until a value read from the checkpoint is verified."""

    def wait_for(self, value: Any) -> None:
        """Return once ``value`` is verified; raise ``CorruptCheckpointError`` if it is damaged."""

    def wait_all(self) -> None:
        """Return once every tensor of the load is verified (raise the first damage found)."""

    def check(self, value: Any) -> None:
        """Verify ``value`` now, in the calling thread (any thread); raise
        ``CorruptCheckpointError`` if it is damaged."""


_GATE: contextvars.ContextVar[RestoreGate | None] = contextvars.ContextVar(
    "ckptcore_restore_gate", default=None)


@contextlib.contextmanager
def restore_gate(gate: RestoreGate) -> Iterator[None]:
    """Make every :meth:`RestorePlan.apply` in this context wait on ``gate`` before each put.

    Set by the core's ``load_state`` while it restores into framework objects, so the framework's
    copies into its variables overlap with the reading and verification of later tensors."""
    token = _GATE.set(gate)
    try:
        yield
    finally:
        _GATE.reset(token)


def value_check() -> Callable[[Any], None]:
    """What a put planned with ``assign_many(..., verifies=True)`` calls on each value right
    before it reads it, in whichever thread reads it: inside a streaming ``load_state`` the
    value's checksum is verified there and then (``CorruptCheckpointError`` if damaged), and the
    bytes are still in the CPU's cache for the copy that follows; elsewhere it does nothing.
    Call it in the put itself (the applying thread) and hand the result to helper threads."""
    gate = _GATE.get()
    return _no_check if gate is None else gate.check


def _no_check(value: Any) -> None:
    return None


class RestorePlan:
    """Everything a restore will do, checked before any of it is done.

    Adapters record assignments (checked here for shape and dtype at once, naming the tensor),
    names missing on either side, and deferred actions (setting a schedule, positioning a cursor).
    :meth:`apply` then raises one :class:`~ckptcore.errors.RestoreError` listing every mismatch, or
    performs all assignments, then all actions, in the order recorded.

    Inside ``ckptcore.load_state(url, model=...)`` the tensors are still being verified while
    :meth:`apply` runs: each put waits until its own values are (or verifies them itself:
    ``assign_many(..., verifies=True)``), so a damaged tensor raises ``CorruptCheckpointError``
    before it is assigned (the puts before it have run).
    """

    def __init__(self) -> None:
        self._puts: list[tuple[Callable[[], None], tuple[Any, ...]]] = []
        self._actions: list[Callable[[], None]] = []
        self._missing: list[str] = []
        self._unexpected: list[str] = []
        self._applied = False

    def assign(self, name: str, value: np.ndarray, *, shape: Iterable[int] | None,
               dtype: Any, put: Callable[[], None]) -> None:
        """Plan ``put()``, which writes ``value`` into the target tensor called ``name``.

        ``shape`` and ``dtype`` are the target's (``dtype`` anything ``np.dtype`` accepts, or None
        to skip the dtype check where the framework converts exactly itself).

        Raises:
            RestoreError: the saved array does not fit the target (names the tensor); raised now,
                whatever ``strict`` says, since nothing can put it there.
        """
        check_fits(name, value, shape, dtype)
        self._puts.append((put, (value,)))

    def assign_many(self, items: Iterable[tuple[str, Any, Iterable[int] | None, Any]],
                    put: Callable[[], None], *, verifies: bool = False) -> None:
        """Plan one ``put()`` that writes several values at once (a framework's bulk assignment):
        ``items`` are ``(name, value, shape, dtype)``, each checked as :meth:`assign` does, and a
        streaming restore runs ``put`` once all of these values are verified.  With
        ``verifies``, it runs ``put`` at once instead, and ``put`` verifies them itself through
        :func:`value_check` before it writes any of them into the target.

        Raises:
            RestoreError: a saved array does not fit its target (names the tensor).
        """
        values = []
        for name, value, shape, dtype in items:
            check_fits(name, value, shape, dtype)
            values.append(value)
        self._puts.append((put, () if verifies else tuple(values)))

    def then(self, action: Callable[[], None]) -> None:
        """Plan an action to run after every assignment (a schedule, a cursor, gradients)."""
        self._actions.append(action)

    def missing(self, *names: str) -> None:
        """Names the target has and the state does not (already :func:`qualified`)."""
        self._missing.extend(names)

    def unexpected(self, *names: str) -> None:
        """Names the state has and nothing in the target takes (already :func:`qualified`)."""
        self._unexpected.extend(names)

    def unexpected_from(self, saved: Iterable[str], taken: Iterable[str], section: str = "model") -> None:
        """Report every name of ``saved`` not in ``taken``, qualified under ``section``."""
        taken = set(taken)
        self.unexpected(*(qualified(section, n) for n in saved if n not in taken))

    @property
    def report(self) -> RestoreReport:
        return RestoreReport(missing=tuple(self._missing), unexpected=tuple(self._unexpected))

    def apply(self, strict: bool = True) -> RestoreReport:
        """Raise on mismatches when ``strict``; otherwise (or when all fits) do everything planned."""
        if self._applied:
            raise RuntimeError("this RestorePlan was already applied")
        if strict and (self._missing or self._unexpected):
            raise RestoreError(mismatch_message(self._missing, self._unexpected))
        self._applied = True
        gate = _GATE.get()
        for put, values in self._puts:
            if gate is not None:
                for value in values:
                    gate.wait_for(value)
            put()
        if gate is not None:  # actions may read any part of the state
            gate.wait_all()
        for action in self._actions:
            action()
        return self.report


def check_fits(name: str, value: Any, shape: Iterable[int] | None, dtype: Any) -> None:
    """Raise :class:`RestoreError` naming ``name`` unless ``value`` has ``shape`` and ``dtype``."""
    # The common case (an array that fits: hundreds per restore) in two comparisons; anything
    # else, a mismatch included, takes the general way below for its message.
    if type(value) is np.ndarray and shape is not None and dtype is not None:
        if (value.shape == shape if type(shape) is tuple else value.shape == tuple(shape)) \
                and value.dtype == dtype:
            return
    got_shape = tuple(int(d) for d in np.shape(value))
    if shape is not None:
        want_shape = tuple(int(d) for d in shape)
        if got_shape != want_shape:
            raise RestoreError(f"{name}: the checkpoint holds shape {list(got_shape)}, the target "
                               f"has {list(want_shape)}")
    if dtype is not None:
        got, want = np.asarray(value).dtype if not hasattr(value, "dtype") else value.dtype, np.dtype(dtype)
        if got != want:
            raise RestoreError(f"{name}: the checkpoint holds {got}, the target is {want}")


def tiers(backup: Any, lease: Any, backup_keep: Any = None,
          backup_storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A callback's ``backup=``/``lease=`` as ``CheckpointManager`` keywords.  ``backup_keep`` and
    ``backup_storage_options``, the spellings before ``ckptcore.Backup``, are passed on for the
    manager to fold in with a ``DeprecationWarning``."""
    out = {"backup": backup, "lease": lease}
    out.update({k: v for k, v in (("backup_keep", backup_keep),
                                  ("backup_storage_options", backup_storage_options))
                if v is not None})
    return out



def plan_training_parts(plan: RestorePlan, state: Any, *, optimizer: Any, scheduler: Any,
                        scaler: Any, saved_scaler: Any, strict: bool, unapplied: dict[str, str],
                        plan_optimizer: Callable[[], None], plan_schedule: Callable[[], None],
                        plan_scaler: Callable[[], None], hints: Mapping[str, str]) -> bool:
    """An adapter restore's optimizer, schedule and grad scaler: each planned (by the adapter's
    callables) into its target when one is given, else noted in ``unapplied`` with the fix from
    ``hints`` (keys ``"optimizer"``, ``"schedule"``, ``"grad scaler"``).  ``scheduler`` is the
    target scheduler the adapter found (None: none); ``saved_scaler`` is whether a scaler state
    that matters was saved.  Returns whether the state holds no optimizer section for a target
    optimizer: that optimizer, and its scheduler unless a schedule was saved, are then left as
    they are (the caller warns, through :func:`finish_restore`)."""
    no_slots = optimizer is not None and state.optimizer is None
    if optimizer is not None and not no_slots:
        plan_optimizer()
    elif state.optimizer is not None:
        unapplied["optimizer"] = hints["optimizer"]
        if not strict:
            plan.unexpected(qualified("optimizer"))
    elif no_slots and not strict:
        plan.missing(qualified("optimizer"))
    if scheduler is not None and not (no_slots and state.schedule is None):
        plan_schedule()
    elif scheduler is None and state.schedule is not None:
        unapplied["schedule"] = hints["schedule"]
    if scaler is not None:
        plan_scaler()
    elif saved_scaler:
        unapplied["grad scaler"] = hints["grad scaler"]
    return no_slots


def finish_restore(plan: RestorePlan, state: Any, strict: bool, *, cursor: Any,
                   restore_rng: Callable[[Any], None] | None, unapplied: dict[str, str],
                   warn_data: bool, no_slots_message: str | None = None) -> RestoreReport:
    """The end of an adapter's ``restore``: the data cursor (``cursor.load_state_dict``, or the
    saved position noted as unapplied), the RNGs (``restore_rng(state.rng)``; None: left alone),
    :meth:`RestorePlan.apply`, then :func:`warn_unapplied` and, when given, the warning that the
    target optimizer got no saved state (``no_slots_message``), both pointing at the user's line."""
    if cursor is not None:
        if state.data:
            plan.then(functools.partial(cursor.load_state_dict, state.data))
        else:
            plan.missing(qualified("data"))
    elif state.data and warn_data:
        unapplied["data"] = "pass cursor=... (the run's DataCursor) to continue at the saved sample"
    if restore_rng is not None and state.rng:
        plan.then(functools.partial(restore_rng, state.rng))
    report = plan.apply(strict)
    warn_unapplied(unapplied, stacklevel=_user_level())
    if no_slots_message:
        _log.warning("%s", no_slots_message)
        warnings.warn(no_slots_message, UnappliedStateWarning, stacklevel=_user_level())
    return report


def _user_level() -> int:
    """The ``stacklevel``, seen from a function this module calls, of the first frame outside
    ckptcore and its adapters: the user's ``restore``/``load_state`` line (or a fit loop's)."""
    frame, level = sys._getframe(2), 3
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("ckptcore"):
        frame, level = frame.f_back, level + 1
    return level


def check_keywords(package: str, verb: str, objects: Mapping[str, Any], known: Iterable[str]) -> None:
    """Raise ``TypeError`` naming the keywords of ``objects`` that ``package.verb`` does not take."""
    known = set(known)
    unknown = sorted(set(objects) - known)
    if unknown:
        raise TypeError(f"{package}.{verb} does not take {', '.join(unknown)} "
                        f"(it takes {', '.join(sorted(known))})")


def lazy_attributes(module_name: str, lazy: Mapping[str, str], after: Callable[[], None] | None = None
                    ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` for names imported on first use: ``lazy`` maps
    each name to the (relative) module defining it; ``after()`` runs after each such import."""

    def __getattr__(name: str) -> Any:
        if name in lazy:
            value = getattr(importlib.import_module(lazy[name], module_name), name)
            if after is not None:
                after()
            vars(sys.modules[module_name])[name] = value
            return value
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[module_name])) | set(lazy))

    return __getattr__, __dir__


_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def any_bit(arr: np.ndarray) -> bool:
    """Whether any bit of ``arr`` is set (so -0.0 counts as a value, where ``any`` would not):
    the largest element as an unsigned integer of the same width (``max`` is vectorised, about
    twice as fast as ``any``).  Adapters tell a cleared gradient from one in flight with it."""
    flat = np.ascontiguousarray(arr).reshape(-1)
    word = _WORDS.get(flat.dtype.itemsize)
    if word is None:  # complex128 and the like: bytes
        flat, word = flat.view(np.uint8), np.uint8
    if flat.size <= _SMALL:  # count_nonzero's call costs a third of max's; its loop is slower
        return bool(np.count_nonzero(flat.view(word)))
    return bool(flat.view(word).max(initial=0))


_SMALL = 4096
