"""What fencing costs a save on a bucket: ``CheckpointManager.save`` with the writer lock (lease,
generation, fence checks before and after the commit, the writer record) against the same
manager with ``lock=False`` (no lease, no fencing), on an S3 server on loopback (moto, in a child
process).  Rounds are interleaved (the machine is noisy); medians of the save() calls, and the
HTTP requests each save sends, counted on the client.

Target (issue 21): a fenced save within 1.15x of an unfenced one for a 16 MiB state (the fixed
requests weigh most on small states: the 1 MiB figure is reported, not targeted).

    python benchmarks/bench_fence.py [--quick] [--no-record]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _report import record  # noqa: E402

TARGET = 1.15


def _state(mb: float, step: int):
    import numpy as np

    import ckptcore

    n = max(1, int(mb * 2**20 / 4 / 8))
    rng = np.random.default_rng(step)
    return ckptcore.TrainingState(model={f"t{i}": rng.standard_normal(n, np.float32)
                                         for i in range(8)}, step=step)


def _counter(opts: dict):
    """A count of the HTTP requests s3fs sends (botocore's before-send event)."""
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    fs.connect()
    sent = [0]

    def count(**_):
        sent[0] += 1

    fs.s3.meta.events.register("before-send", count)
    return sent


def measure(opts: dict, mb: float, saves: int) -> dict:
    import ckptcore

    sent = _counter(opts)
    base = f"s3://ckptcore-bench/fence-{uuid.uuid4().hex[:8]}"
    times: dict[str, list[float]] = {"fenced": [], "unfenced": []}
    requests: dict[str, list[int]] = {"fenced": [], "unfenced": []}
    managers = {kind: ckptcore.CheckpointManager(f"{base}/{kind}", storage_options=opts, keep=2,
                                                  lock=(kind == "fenced"),
                                                  save_on_preemption=False)
                for kind in times}
    states = [_state(mb, s) for s in range(2)]
    try:
        for step in range(saves + 1):
            for kind in (("fenced", "unfenced") if step % 2 else ("unfenced", "fenced")):
                before, t0 = sent[0], time.perf_counter()
                managers[kind].save(step, states[step % 2])
                if step:  # the first save also takes the lease: not a steady-state save
                    times[kind].append(time.perf_counter() - t0)
                    requests[kind].append(sent[0] - before)
    finally:
        for m in managers.values():
            m.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"mb": mb, "times": med, "range": {k: (min(v), max(v)) for k, v in times.items()},
            "requests": {k: statistics.median(v) for k, v in requests.items()},
            "ratio": med["fenced"] / med["unfenced"]}


def main(argv=None) -> int:
    import bench_s3

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--saves", type=int, default=12)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    args = p.parse_args(argv)
    if args.quick:
        args.saves, args.no_record = 3, True
    opts, stop = bench_s3.start_server("process")
    try:
        import s3fs
        s3fs.S3FileSystem(**opts).mkdir("ckptcore-bench")
        results = [measure(opts, mb, args.saves) for mb in (16, 1)]
    finally:
        stop()
    lines = [f"## bench_fence.py, {datetime.datetime.now():%Y-%m-%d %H:%M}", "",
             f"moto S3 server in a child process on 127.0.0.1; {args.saves} saves each, "
             "interleaved; medians [min-max].", "",
             "| state | unfenced save (lock=False) | fenced save | ratio | requests per save "
             "(unfenced / fenced) | target |", "|---|---:|---:|---:|---:|---|"]
    for r in results:
        t, rng, q = r["times"], r["range"], r["requests"]
        target = (f"<= {TARGET}x: {'met' if r['ratio'] <= TARGET else 'NOT met'}"
                  if r["mb"] >= 16 else "reported")
        lines.append(f"| {r['mb']:g} MiB | {t['unfenced'] * 1000:.0f} ms [{rng['unfenced'][0] * 1000:.0f}-"
                     f"{rng['unfenced'][1] * 1000:.0f}] | {t['fenced'] * 1000:.0f} ms "
                     f"[{rng['fenced'][0] * 1000:.0f}-{rng['fenced'][1] * 1000:.0f}] | "
                     f"**{r['ratio']:.2f}x** | {q['unfenced']:.0f} / {q['fenced']:.0f} | {target} |")
    lines.append("")
    text = "\n".join(lines)
    print(text)
    if not args.no_record:
        record(args.results, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
