"""One rank of a gloo job for tests/torch_adapter/test_torch_group.py (see _torch_ranks.launch).

``basic``: gathers of unequal (and empty) byte strings, a 100 KB broadcast and barriers, checked
here and timed; with more than two ranks the same over ``new_group([1, world - 1])``, which the
other ranks must be refused.  ``killed`` and ``hung`` do the same, then the last rank SIGKILLs itself (``killed``) or
stops answering (``hung``: it sleeps) while the others wait in a gather (``hung``: 2 s deadline).
Every rank reports a JSON line (its checks and timings).
"""

from __future__ import annotations

import hashlib
import os
import signal
import statistics
import sys
import time

from _torch_ranks import init, report

import ckptcore_torch
from ckptcore.errors import CheckpointError, GroupError, GroupTimeoutError

T = 30.0  # every deadline but the hung one: a broken test ends, it does not wait for gloo


def _payload(rank: int) -> bytes:
    return bytes([rank % 256]) * (rank * 37)  # rank 0 sends nothing at all


def _median_ms(fn, n: int = 20) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1000, 2)


def _exercise(g, expect_rank: int, expect_size: int) -> dict:
    assert (g.rank, g.size) == (expect_rank, expect_size), (g.rank, g.size)
    got = g.gather(_payload(g.rank), timeout=T)
    if g.rank == 0:
        assert got == [_payload(r) for r in range(g.size)], [len(x) for x in got]
    else:
        assert got is None
    big = hashlib.sha256(b"seed").digest() * 3200  # 100 KB
    assert g.broadcast(big if g.rank == 0 else None, timeout=T) == big
    assert g.broadcast(b"" if g.rank == 0 else None, timeout=T) == b""
    g.barrier(timeout=T)
    small = b"x" * 100
    return {"rank": g.rank, "size": g.size, "type": type(g).__name__,
            "gather_ms": _median_ms(lambda: g.gather(small, timeout=T)),
            "broadcast_ms": _median_ms(lambda: g.broadcast(small if g.rank == 0 else None, timeout=T)),
            "barrier_ms": _median_ms(lambda: g.barrier(timeout=T))}


def _wait_for_failure(g, timeout: float) -> dict:
    t0 = time.monotonic()
    try:
        g.gather(b"after", timeout=timeout)
    except GroupError as e:
        took = time.monotonic() - t0
        t1 = time.monotonic()
        try:
            g.barrier(timeout=T)
            again = "returned"
        except GroupError as e2:
            again = f"{type(e2).__name__}: {e2}"
        return {"rank": g.rank, "error": type(e).__name__, "message": str(e), "took": took,
                "timeout": isinstance(e, GroupTimeoutError), "again": again,
                "again_took": time.monotonic() - t1}
    return {"rank": g.rank, "error": None}


def main(mode: str) -> None:
    rank, world = init()
    import torch.distributed as dist

    if mode == "basic":
        out = _exercise(ckptcore_torch.process_group(), rank, world)
        if world > 2:  # and a sub-group of two of the ranks, whose rank 0 is job rank 1
            members = [1, world - 1]
            sub = dist.new_group(members)
            if rank in members:
                out["sub"] = _exercise(ckptcore_torch.process_group(sub), members.index(rank), 2)
            else:
                try:
                    ckptcore_torch.process_group(sub)
                    out["refused"] = None
                except CheckpointError as e:
                    out["refused"] = str(e)
            dist.barrier()
        report(out)
    elif mode in ("killed", "hung"):
        g = ckptcore_torch.process_group()
        out = _exercise(g, rank, world)  # everything works until the peer is lost
        g.barrier(timeout=T)
        if rank == world - 1:
            time.sleep(0.5)  # the others are waiting in their gather by now
            if mode == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(600)  # hung: alive, sockets open, never answering
        report({**out, **_wait_for_failure(g, T if mode == "killed" else 2.0)})
        sys.stdout.flush()
        sys.exit(0)  # a normal exit must not wait for the abandoned collective
    else:
        raise SystemExit(f"unknown mode {mode}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
