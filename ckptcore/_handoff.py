"""The arrays an async save writes before it gives the caller back its state (staging budget).

An async save copies the state's arrays into staging buffers so the caller may change its own
while a thread writes the copies.  With a budget (the ``staging_bytes`` knob) smaller than the
state, the arrays that did not fit are not copied: the save writes them first, straight from the
caller's memory, and ``save()`` waits until they are written (:class:`Handoff`).  The save
thread finds the handoff in a context variable (``current()``), which ``_io.write_payload``
reads to order its shards: the caller's arrays first, then :meth:`Handoff.release`, then the
copies.
"""

from __future__ import annotations

import bisect
import contextvars
import threading
from typing import Any, Callable, Sequence

import numpy as np

from .errors import CheckpointError

_current: contextvars.ContextVar[Handoff | None] = contextvars.ContextVar(
    "ckptcore_handoff", default=None)


def current() -> Handoff | None:
    """The handoff of the save running in this context, if any."""
    return _current.get()


class Handoff:
    """The caller's arrays one background save reads before ``save()`` returns.

    ``holds(a)``: whether ``a`` lies in the memory of one of them (an encoded array may be a view
    of the caller's, or a copy the encoder made, which is the save's own).  ``release()`` lets
    the caller go on; once released, the caller's arrays must not be read again (``released``).
    """

    def __init__(self, arrays: Sequence[np.ndarray]):
        spans = sorted((lo, hi) for lo, hi in map(_span, arrays) if hi > lo)
        self._starts = [lo for lo, _ in spans]
        # the furthest end among the spans starting at or before each one (spans may overlap:
        # two of the caller's arrays can share memory)
        self._reach: list[int] = []
        for _, hi in spans:
            self._reach.append(max(hi, self._reach[-1]) if self._reach else hi)
        self.nbytes = sum(int(a.nbytes) for a in arrays)
        self._done = threading.Event()

    def holds(self, array: np.ndarray) -> bool:
        lo, hi = _span(array)
        if hi <= lo:
            return False  # nothing to read
        k = bisect.bisect_left(self._starts, hi) - 1  # the last span starting before ``hi``
        return k >= 0 and self._reach[k] > lo

    @property
    def released(self) -> bool:
        return self._done.is_set()

    def release(self) -> None:
        self._done.set()

    def wait(self) -> None:
        """Block until the save has written the caller's arrays (or ended, either way)."""
        self._done.wait()

    def bind(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` to run in the save's thread with this handoff current, releasing the caller
        when it ends if the writes did not already (a save that fails, or never writes)."""
        def run(*args: Any) -> Any:
            token = _current.set(self)
            try:
                return fn(*args)
            finally:
                _current.reset(token)
                self.release()
        return run


def _span(array: np.ndarray) -> tuple[int, int]:
    """The byte range of ``array``'s memory (its bounds; strides may leave gaps inside)."""
    if array.size == 0:
        return 0, 0
    lo, hi = np.lib.array_utils.byte_bounds(array) if hasattr(np.lib, "array_utils") \
        else np.byte_bounds(array)
    return int(lo), int(hi)


def first_writes(handoff: Handoff | None, arrays: Sequence[np.ndarray]) -> list[int]:
    """Indices of the arrays still in the caller's memory, written before ``save()`` returns."""
    if handoff is None:
        return []
    first = [i for i, a in enumerate(arrays) if handoff.holds(a)]
    if first and handoff.released:
        # A second attempt of the same save (after another writer's step was cleared out of the
        # way): the caller has its arrays back and may have changed them since.
        raise CheckpointError(
            f"an async save that wrote {len(first)} array(s) beyond its staging budget straight "
            "from the caller's memory cannot write them again once save() returned: save this "
            "step again (or raise the staging_bytes knob)")
    return first
