"""How long ``CheckpointManager.save()`` blocks the caller with ``async_save=True``.

Target (issue 3): the blocking time of an async save is at most 15% of a synchronous save of the
same state, both measured in this run (the machine is shared and noisy, so only ratios count).

    python benchmarks/bench_async.py [--size-mb 768] [--rounds 3] [--root DIR]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import clean, large_state  # noqa: E402
from _report import record  # noqa: E402

import ckptcore  # noqa: E402


def measure(state, base: str, rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"sync": [], "async_block": [], "async_total": []}
    for r in range(rounds):
        root = os.path.join(base, f"sync-{r}")
        with ckptcore.CheckpointManager(root) as mgr:
            t0 = time.perf_counter()
            mgr.save(1, state)
            out["sync"].append(time.perf_counter() - t0)
        clean(root)
    # Async saves in steady state: one manager saving periodically, as in training (its staging
    # buffers are warm after the first save, which is measured separately).
    root = os.path.join(base, "async")
    with ckptcore.CheckpointManager(root, async_save=True, keep=1) as mgr:
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            handle = mgr.save(r + 1, state)
            blocked = time.perf_counter() - t0
            handle.result()
            total = time.perf_counter() - t0
            if r == 0:
                out["first_block"] = [blocked]
            else:
                out["async_block"].append(blocked)
                out["async_total"].append(total)
    clean(root)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=768)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--root", default=None, help="scratch folder (default: a temp folder)")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    state = large_state(args.size_mb)
    nbytes = sum(a.nbytes for a in state.model.values()) + sum(
        a.nbytes for s in state.optimizer.slots.values() for a in s.values())
    base = tempfile.mkdtemp(prefix="ckpt-bench-async-", dir=args.root)
    try:
        t = measure(state, base, args.rounds)
    finally:
        clean(base)
    med = {k: statistics.median(v) for k, v in t.items()}
    ratio = med["async_block"] / med["sync"]
    lines = [f"## bench_async.py, {datetime.datetime.now():%Y-%m-%d %H:%M} ({nbytes / 2**20:.0f} MiB, "
             f"median of {args.rounds})", "",
             "| measure | seconds |", "|---|---|",
             f"| synchronous save | {med['sync']:.3f} |",
             f"| async save(): time the caller is blocked | {med['async_block']:.3f} |",
             f"| async save(): until committed | {med['async_total']:.3f} |",
             f"| first async save of a manager (allocates its staging buffers) | {med['first_block']:.3f} |", "",
             f"Blocking time / synchronous save = **{ratio:.1%}** (target <= 15%: "
             f"{'met' if ratio <= 0.15 else 'MISSED'}).", ""]
    text = "\n".join(lines)
    print(text)
    if not args.no_record:
        record(os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md"), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
