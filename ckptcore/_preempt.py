"""The process around the managers: SIGTERM (the preemption notice) and interpreter exit.

Exit: :func:`drain_at_exit` registers a manager to be closed when the interpreter exits, so a
finished script never drops its last save or replication (a failure then is logged and warned).

SIGTERM: one handler for the process, shared by every manager.

The handler is installed by the first :class:`Watch` (a manager made with
``save_on_preemption``) and put back to what it replaced when the last one is released, by
``close()`` or, for a manager dropped without ``close()``, when it is garbage-collected (only the
main thread can install a handler: a release seen on another thread leaves ours in place, and it
then only chains to the previous one).  The handler only sets flags: the loop asks
(``mgr.preempted``, ``mgr.save_if_preempted``) and saves in its own time.

Until a loop has asked once, SIGTERM keeps its usual effect, so a loop that never checks still
terminates on it.  A forked child (a data-loader worker) inherits the handler but trains
nothing: there SIGTERM keeps its previous effect.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook is registered before ours
import logging
import os
import signal
import threading
import warnings
import weakref
from typing import Any

log = logging.getLogger("ckptcore")

_watches: weakref.WeakSet[Watch] = weakref.WeakSet()
_previous: Any = None  # the handler ours replaced
_owner_pid = 0  # the pid that installed it: a forked child is not the trainer
_in_handler = False


class Watch:
    """One manager's view of SIGTERM: ``requested`` once it arrived, ``asked`` once the loop
    checked for it (see the module docstring)."""

    def __init__(self, owner: Any) -> None:
        self.requested = False
        self.asked = False
        self._owner = weakref.ref(owner)

    @property
    def owner(self) -> Any:
        """The manager watching (None once it is gone)."""
        return self._owner()


def owners() -> list[Any]:
    """The live managers whose watch keeps the handler installed (for tests and diagnostics)."""
    return [o for o in (w.owner for w in list(_watches)) if o is not None]


def on_sigterm(signum: int, frame: Any) -> None:
    """The process's SIGTERM handler.  Runs in the main thread between two bytecodes: it only
    sets flags (no I/O, no locks) and chains to the handler it replaced."""
    global _in_handler
    if _in_handler:  # a chained handler that chains back to us
        return
    _in_handler = True
    try:
        if os.getpid() != _owner_pid:
            _pass_on_in_child(signum, frame)
            return
        watches = list(_watches)
        for w in watches:
            w.requested = True
        previous = _previous
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL and not any(w.asked for w in watches):
            # No loop ever checks for preemption: nobody would save and stop, so keep SIGTERM's
            # usual effect (the process ends, as it would without ckptcore).
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        _in_handler = False


def _pass_on_in_child(signum: int, frame: Any) -> None:
    # A forked child (a data-loader worker) inherited the handler but trains nothing: its parent
    # stops it with SIGTERM, which must keep its previous effect here.
    previous = _previous if _previous is not None else signal.SIG_DFL
    signal.signal(signal.SIGTERM, previous)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        os.kill(os.getpid(), signal.SIGTERM)


def watch(owner: Any) -> Watch:
    """A :class:`Watch` for ``owner``, with the handler installed if this is the main thread
    (elsewhere no handler can be installed: logged, and the watch never fires)."""
    global _previous, _owner_pid
    w = Watch(owner)
    current = signal.getsignal(signal.SIGTERM)
    if current is not on_sigterm:
        if threading.current_thread() is not threading.main_thread():
            log.info("save_on_preemption: %r was created outside the main thread, where no "
                     "SIGTERM handler can be installed; SIGTERM is not caught", owner)
            return w
        if current is None:  # a handler installed from C: it could not be put back
            log.info("save_on_preemption: SIGTERM has a handler not installed from Python; "
                     "leaving it alone, SIGTERM is not caught")
            return w
        _previous, _owner_pid = current, os.getpid()
        signal.signal(signal.SIGTERM, on_sigterm)
    _watches.add(w)
    # A manager dropped without close() gives the handler back when it is collected.
    weakref.finalize(w, _restore_if_unwatched)
    return w


def release(w: Watch | None) -> None:
    """``close()``: this watch ends; the last one puts the previous handler back."""
    if w is not None:
        _watches.discard(w)
    _restore_if_unwatched()


def _restore_if_unwatched() -> None:
    global _previous
    # (``list``: a watch being collected right now may still sit in the set, dead)
    if (not list(_watches) and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is on_sigterm):
        try:
            signal.signal(signal.SIGTERM, _previous if _previous is not None else signal.SIG_DFL)
        except (ValueError, TypeError):  # interpreter shutting down: nothing left to protect
            return
        _previous = None


_live: weakref.WeakSet[Any] = weakref.WeakSet()  # managers to close at exit


def drain_at_exit(mgr: Any) -> None:
    """Close ``mgr`` (waiting for its saves in flight) when the interpreter exits."""
    _live.add(mgr)


def _drain() -> None:
    # Interpreter exit waits for saves in flight, so a finished script never drops its last save.
    for mgr in list(_live):
        try:
            mgr.close()
        except BaseException as e:  # noqa: BLE001 - nothing left to raise to at exit
            what = "save or replication" if mgr.backups else "save"
            log.error("closing %s at exit: a background %s failed: %r", mgr.root.url, what, e)
            warnings.warn(f"ckptcore: a background {what} failed at exit ({mgr.root.url}): {e!r}")


# A plain atexit hook runs too late: concurrent.futures refuses new thread pools once the
# interpreter starts shutting down (before atexit hooks run), and a save uses pools to write
# its shards.  threading's own exit hooks run first, in reverse order of registration, so this
# one (registered after concurrent.futures.thread's) drains saves while pools still work.
try:
    threading._register_atexit(_drain)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # pragma: no cover - other interpreters
    atexit.register(_drain)
