"""The snapshot a save writes, and the handle of a save (:class:`SaveHandle`).

The snapshot: the state captured now, copied when the save runs in the background.

``CheckpointManager.save()`` returns before an async save is written, while the caller keeps
training on its buffers; so a state whose arrays are borrowed views (a capture that did not
copy, or a ``TrainingState`` the caller built) is copied first.  The copies land in staging
buffers kept from the previous async save: reusing them avoids faulting in fresh pages on every
save, which costs more than the copy itself, and they are free to reuse because at most one
save is in flight.

A staging budget (the ``staging_bytes`` knob) bounds the copies: the arrays that fit are copied,
the others are written first from the caller's own memory while ``save()`` waits
(:class:`ckptcore._handoff.Handoff`), so a state larger than free memory can be saved in the
background too.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping

import numpy as np

from . import _knobs, api
from ._handoff import Handoff
from .state import TrainingState

log = logging.getLogger("ckptcore")


class Staging:
    """One manager's staging buffers (see the module docstring)."""

    def __init__(self) -> None:
        self._buffers: dict[int, np.ndarray] = {}

    def snapshot(self, step: int, state: TrainingState | None, metrics: Mapping[str, float] | None,
                 objects: Mapping[str, Any], background: bool
                 ) -> tuple[TrainingState, Handoff | None]:
        """The state to save as ``step``: ``state`` or the objects' capture, with ``metrics``
        in its metadata; copied into the staging buffers when ``background`` and borrowed.
        With a staging budget smaller than the arrays, also the :class:`Handoff` of the arrays
        left uncopied, which the save must write before ``save()`` returns (else None)."""
        state, borrowed = api.capture_state(state, dict(objects))
        handoff = None
        if borrowed and background:
            state, live = self._copy(state)
            handoff = Handoff(live) if live else None
        metadata = dict(state.metadata)
        if metrics is not None:
            metadata["metrics"] = metrics
        return dataclasses.replace(state, metadata=metadata, step=state.step or step), handoff

    def _copy(self, state: TrainingState) -> tuple[TrainingState, list[np.ndarray]]:
        """``state`` rebuilt around copies of its arrays, as many as the staging budget holds;
        and the arrays left as they are (the caller's own)."""
        arrays: list[np.ndarray] = []
        _arrays_in(state, arrays, set())
        staged = _within_budget([a.nbytes for a in arrays], _budget())
        previous, self._buffers = self._buffers, {}

        def copy_one(i: int) -> np.ndarray:
            # Buffers are matched by position in the walk and checked by shape and dtype: the
            # same model saves the same tree in the same order every time.
            src, buf = arrays[i], previous.get(i)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = np.empty(src.shape, src.dtype)
            np.copyto(buf, src)
            return buf

        def copy_run(run: range) -> list[np.ndarray]:
            return [copy_one(staged[k]) for k in run]

        # One task per thread over runs of about equal bytes, not one per array: a model of
        # hundreds of small tensors spent more of the caller's blocked time handing arrays to
        # the pool than copying them.
        with ThreadPoolExecutor(_knobs.threads()) as pool:
            runs = pool.map(copy_run, _runs([arrays[i].nbytes for i in staged], _knobs.threads()))
            copies = [c for run in runs for c in run]
        previous.clear()  # (buffers of arrays no longer staged go now, not with the next save)
        self._buffers = dict(zip(staged, copies))
        subst = {id(a): a for a in arrays}  # the arrays not staged stay the caller's own
        subst.update((id(arrays[i]), c) for i, c in zip(staged, copies))
        live = [a for i, a in enumerate(arrays) if i not in self._buffers]
        if live:
            log.debug("async save: %d array(s), %d bytes, copied into staging (staging_bytes=%d); "
                      "%d, %d bytes, written from the caller's arrays before save() returns",
                      len(copies), sum(c.nbytes for c in copies), _knobs.staging_bytes(),
                      len(live), sum(a.nbytes for a in live))
        # The tree is rebuilt around the copies: containers anew (the caller may change its own
        # after save() returns), immutable leaves shared.  A walk of our own, not deepcopy, and
        # no encoding: on ResNet-50's 800 tensors those two took a third of the blocked time.
        return _rebuilt(state, subst), live


def _budget() -> int:
    """The ``staging_bytes`` knob, checked: 0 for no limit."""
    budget = _knobs.staging_bytes()
    if budget < 0:
        raise ValueError(f"the staging_bytes knob is {budget}: give a number of bytes, or 0 for "
                         "no limit")
    return budget


def _within_budget(sizes: list[int], budget: int) -> list[int]:
    """Indices of the arrays to copy: all of them without a budget (0), else in walk order each
    that still fits (a large one that does not is skipped, smaller ones after it may fit)."""
    if budget <= 0:
        return list(range(len(sizes)))
    out, left = [], budget
    for i, n in enumerate(sizes):
        if n <= left:
            out.append(i)
            left -= n
    return out


_ATOMS = (str, int, float, bool, bytes, type(None), np.generic)


def _arrays_in(value: Any, out: list[np.ndarray], seen: set[int]) -> None:
    """Append every distinct ndarray reachable from ``value`` (containers, dataclasses) to ``out``."""
    if isinstance(value, np.ndarray):
        if id(value) not in seen:
            seen.add(id(value))
            out.append(value)
    elif isinstance(value, _ATOMS):
        return
    elif isinstance(value, dict):
        for v in value.values():
            _arrays_in(v, out, seen)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _arrays_in(v, out, seen)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _arrays_in(getattr(value, f.name), out, seen)


def _rebuilt(value: Any, copies: dict[int, np.ndarray]) -> Any:
    """``value`` with every array in ``copies`` replaced by its copy and every container anew."""
    if isinstance(value, np.ndarray):
        return copies.get(id(value), value)
    if isinstance(value, _ATOMS):
        return value
    if type(value) is dict:
        return {k: _rebuilt(v, copies) for k, v in value.items()}
    if type(value) is list:
        return [_rebuilt(v, copies) for v in value]
    if type(value) is tuple:
        return tuple(_rebuilt(v, copies) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        new = copy.copy(value)  # no __init__ or __post_init__ again; frozen ones too
        for f in dataclasses.fields(value):
            object.__setattr__(new, f.name, _rebuilt(getattr(value, f.name), copies))
        return new
    return copy.deepcopy(value, dict(copies))  # anything else (a dict subclass, ...): as before


def _runs(sizes: list[int], parts: int) -> list[range]:
    """``range(len(sizes))`` cut into at most ``parts`` consecutive runs of about equal bytes."""
    total, runs, start, acc = sum(sizes), [], 0, 0
    for i, n in enumerate(sizes):
        acc += n
        if acc * parts >= total * (len(runs) + 1) and len(runs) < parts - 1:
            runs.append(range(start, i + 1))
            start = i + 1
    runs.append(range(start, len(sizes)))
    return [r for r in runs if len(r)]


class SaveHandle:
    """The future of one save: ``result()`` blocks until it is committed and returns its info."""

    def __init__(self, step: int, url: str, future: Future):
        self.step, self.url, self._future = step, url, future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> api.CheckpointInfo:
        return self._future.result(timeout)

    wait = result

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, done={self.done()})"


def completed(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class InFlight:
    """The one background save a manager may have in flight: at most one at a time (a second
    waits for the first), its failure raised once, by the next :meth:`wait`."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future | None = None
        self._error: BaseException | None = None

    def submit(self, fn: Any, *args: Any, handoff: Any = None) -> Future:
        """Run ``fn(*args)`` in the background; with a ``handoff`` (a staging budget), return
        only once the arrays beyond the budget are written: the caller's arrays are its again."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptcore-save")
        self._future = self._pool.submit(fn if handoff is None else handoff.bind(fn), *args)
        if handoff is not None:
            handoff.wait()
        return self._future

    def wait(self) -> None:
        """Block until the save in flight is done; raise its error (or one kept since)."""
        fut, self._future = self._future, None
        if fut is not None:
            try:
                fut.result()
            except BaseException as e:  # surfaced once, here
                self._error = e
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

