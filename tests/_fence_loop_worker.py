"""One writer of the fencing loop (tests/test_fencing_loop.py).

Loops until the stop file exists: open a CheckpointManager on the shared bucket root, take the
root's writer lease (``gc()``: the lease first, so that what it restores is the newest step
nobody else can commit beside it), ``restore()`` the newest step (or start at step 0), then save
step after step, each state naming this writer, its incarnation (one per manager), the step, the
step it restored from and a nonce its payload derives from.  A LockedError (the lease is held)
or FencedError (the root was taken over) is reported and a new manager is opened.

Every event is one JSON line, written with a single ``os.write`` to an O_APPEND descriptor (a
SIGSTOP or SIGKILL never leaves half a line):

    open, locked, takeover, hold, restored, attempt, ack, error, reclaim, close_error, exit

usage: _fence_loop_worker.py ROOT OPTIONS_JSON WRITER_ID LOG STOP_FILE MODE KEEP LEASE BEAT
  MODE: sync | async | mixed (async every other incarnation);  KEEP: N (keep=N) or lastN
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
import traceback
import warnings

import numpy as np

import ckptcore
from ckptcore import (CheckpointError, CheckpointManager, CheckpointNotFoundError, KeepLast,
                      LockedError, LockTakeoverWarning)

PAYLOAD = 4096  # bytes of pseudo-random payload per step (and as many float32 values / 4)


def payload(nonce: int) -> dict[str, np.ndarray]:
    """The arrays a save with ``nonce`` writes besides its identity (the test rebuilds them)."""
    rng = np.random.default_rng(nonce)
    return {"bytes": rng.integers(0, 256, PAYLOAD, dtype=np.uint8),
            "floats": rng.standard_normal(PAYLOAD // 4).astype(np.float32)}


def make_state(writer: int, inc: int, step: int, restored_from: int | None,
               nonce: int) -> ckptcore.TrainingState:
    ident = np.array([writer, inc, step, -1 if restored_from is None else restored_from, nonce],
                     np.int64)
    return ckptcore.TrainingState(model={"ident": ident, **payload(nonce)}, step=step)


def main() -> None:
    (root, options, wid, logpath, stopfile, mode, keep, lease, beat) = sys.argv[1:10]
    options, wid, lease, beat = json.loads(options), int(wid), float(lease), float(beat)
    keep_arg = KeepLast(int(keep[4:])) if keep.startswith("last") else int(keep)
    fd = os.open(logpath, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    rnd = random.Random(os.urandom(8))

    def log(ev: str, **kw: object) -> None:
        kw.update(ev=ev, w=wid, t=time.time(), pid=os.getpid())
        os.write(fd, (json.dumps(kw) + "\n").encode())

    class Spy(logging.Handler):  # the library's own reports of reclaims and fenced steps
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if "claimed the root again" in msg:
                log("reclaim", msg=msg[:300])
            elif "this writer (generation" in msg:
                log("fenced_log", msg=msg[:300])

    logging.getLogger("ckptcore").addHandler(Spy(logging.WARNING))

    def stopped() -> bool:
        return os.path.exists(stopfile)

    def failed(where: str, e: BaseException, lock: object = None, **kw: object) -> None:
        """Log error ``e``, with whether this writer had been superseded by then (a newer
        generation of the root exists)."""
        superseded = None
        if lock is not None:
            try:
                superseded = bool(lock._superseded())
            except Exception:  # noqa: BLE001 - unknown
                pass
        kw.update(where=where, type=type(e).__name__, msg=str(e)[:400], superseded=superseded,
                  checkpoint_error=isinstance(e, CheckpointError))
        if not isinstance(e, CheckpointError):
            kw["tb"] = traceback.format_exc()[-3000:]
        log("error", **kw)

    inc = 0
    log("start", mode=mode, keep=keep)
    while not stopped():
        inc += 1
        use_async = mode == "async" or (mode == "mixed" and inc % 2 == 0)
        save_error: BaseException | None = None
        mgr = CheckpointManager(root, storage_options=options, keep=keep_arg,
                                async_save=use_async, lease=ckptcore.Lease(seconds=lease,
                                heartbeat=beat), save_on_preemption=False)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", LockTakeoverWarning)
                mgr.gc(grace=3600)  # takes the lease (LockedError while a live writer holds it)
            for w in caught:
                if issubclass(w.category, LockTakeoverWarning):
                    log("takeover", inc=inc, msg=str(w.message)[:300])
            lock = mgr._lock
            log("hold", inc=inc, generation=lock.generation if lock is not None else None,
                async_save=use_async)
            t_restore = time.time()
            try:
                restored = mgr.restore()
                r: int | None = int(restored.step)
                log("restored", inc=inc, step=r, t_start=t_restore,
                    ident=[int(x) for x in restored.model["ident"]])
            except CheckpointNotFoundError:
                r = None
                log("restored", inc=inc, step=None, t_start=t_restore)
            except Exception as e:  # noqa: BLE001 - reported, with whether it lost the root
                failed("restore", e, lock, inc=inc)
                continue  # (closes this manager first) and opens a new one
            step = 0 if r is None else r + 1
            while not stopped():
                nonce = rnd.getrandbits(62)
                log("attempt", inc=inc, step=step, restored_from=r, nonce=nonce,
                    async_save=use_async)
                try:
                    handle = mgr.save(step, make_state(wid, inc, step, r, nonce))
                    if use_async:
                        time.sleep(rnd.uniform(0.0, 0.1))  # "training" while the save runs
                    info = handle.result()
                except Exception as e:  # noqa: BLE001 - reported to the test
                    failed("save", e, mgr._lock, inc=inc, step=step, nonce=nonce)
                    save_error = e
                    break
                log("ack", inc=inc, step=step, nonce=nonce, id=info.writer["id"],
                    generation=info.writer.get("generation"))
                step += 1
                time.sleep(rnd.uniform(0.0, 0.05))
        except LockedError as e:  # the lease is held by a live writer (or a claim race lost)
            log("locked", inc=inc, type=type(e).__name__, msg=str(e)[:200])
            time.sleep(rnd.uniform(0.2, 0.6))
        except Exception as e:  # noqa: BLE001 - reported to the test
            failed("open", e, mgr._lock, inc=inc)
            time.sleep(0.2)
        finally:
            try:
                mgr.close()
            except Exception as e:  # noqa: BLE001 - the save's error once more, or another
                # An async save's error is raised by its handle and once more by the manager's
                # next call (close() here): marked as a repeat, not counted twice.
                repeat = save_error is not None and (type(e), str(e)) == (type(save_error),
                                                                          str(save_error))
                log("close_error", inc=inc, type=type(e).__name__, msg=str(e)[:300],
                    checkpoint_error=isinstance(e, CheckpointError), repeat=repeat)
    log("exit", incarnations=inc)


if __name__ == "__main__":
    main()
