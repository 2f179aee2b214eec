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
* ``knobs`` -- the tunables, read through typed accessors: ``knobs.group_timeout()`` (seconds a
  collective may wait), ``knobs.threads()``, ``knobs.shard_size()``, ... (one per knob, each
  with its ``CKPTCORE_<NAME>`` environment override).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
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

__all__ = ["Adapter", "PackageAdapter", "FileFormat", "DemoProgram", "RestorePlan", "qualified",
           "mismatch_message", "warn_unapplied", "warn_and_log", "CALLBACK_KEEP", "open_regular",
           "check_url", "convert_for", "parse_dtype", "knobs", "tiers", "RestrictedUnpickler",
           "Record", "RecordClass", "restricted_load", "plain_records", "check_plain", "brief",
           "brief_error", "PLAIN_KEYS", "MAX_DEPTH"]

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


class RestorePlan:
    """Everything a restore will do, checked before any of it is done.

    Adapters record assignments (checked here for shape and dtype at once, naming the tensor),
    names missing on either side, and deferred actions (setting a schedule, positioning a cursor).
    :meth:`apply` then raises one :class:`~ckptcore.errors.RestoreError` listing every mismatch, or
    performs all assignments, then all actions, in the order recorded.

    Inside ``ckptcore.load_state(url, model=...)`` the tensors are still being verified while
    :meth:`apply` runs: each put waits until its own values are, so a damaged tensor raises
    ``CorruptCheckpointError`` before it is assigned (the puts before it have run).
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
                    put: Callable[[], None]) -> None:
        """Plan one ``put()`` that writes several values at once (a framework's bulk assignment):
        ``items`` are ``(name, value, shape, dtype)``, each checked as :meth:`assign` does, and a
        streaming restore runs ``put`` once all of these values are verified.

        Raises:
            RestoreError: a saved array does not fit its target (names the tensor).
        """
        values = []
        for name, value, shape, dtype in items:
            check_fits(name, value, shape, dtype)
            values.append(value)
        self._puts.append((put, tuple(values)))

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

