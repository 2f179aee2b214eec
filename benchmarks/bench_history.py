"""What one save costs against the number of steps a run keeps: local disk and an S3 server.

A run that keeps a checkpoint every 1,000 steps for weeks (``KeepEvery(1000)``) reaches
thousands of committed steps; a save must not cost more because of them.  For each history
length N (default 10, 100, 1,000, 5,000) a root is filled with N committed steps (multiples of
1,000: one real save of a small state, then server-side copies of its folder), and one manager
adopts it with two saves (the one time it reads every step's manifest, for the root's writer
record; docs/SCALE.md, "Saves and a run's history").  Then, per N and store:

* **first save**: a new ``CheckpointManager(root, keep=KeepLast(2) | KeepEvery(1000))``
  (construction included) and its first ``save()``: the lock's claim, the step order check,
  the commit, retention over N steps;
* **steady saves**: the next saves of that manager (median), each deleting one step by
  retention (``KeepLast(2)``).

Times are medians over ``--repeats`` new managers (interleaved over N); on S3 the HTTP
requests each save sends are counted on the client (botocore's before-send event).  The state
is small (64 KiB): what is measured is the cost of the history, not of the bytes.

Then, on S3, per N up to ``--list-max`` (1,000): ``list_checkpoints(root)`` (what ``ckpt ls``, ``ckpt log``
and ``ckpt report`` read: every step's manifest) as it runs, against the same reads one after
another (``remote_concurrency=1``: what it did before it read a bucket's manifests in a pool).

Target (issue 25): on the S3 server, the first save over 1,000 committed steps under 2 s, and
no save's requests growing with N.

    python benchmarks/bench_history.py                 # about 3 minutes
    python benchmarks/bench_history.py --quick         # N = 10, 100; not recorded
    python benchmarks/bench_history.py --counts 10,1000 --stores s3
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _report import record  # noqa: E402

EVERY = 1000
TARGET_FIRST_S3 = 2.0  # seconds, first save over 1,000 steps on the S3 server


def _state(step: int):
    import numpy as np

    import ckptcore

    rng = np.random.default_rng(step)
    return ckptcore.TrainingState(model={f"t{i}": rng.standard_normal(2048, np.float32)
                                         for i in range(8)}, step=step)


def _policy():
    import ckptcore

    return ckptcore.KeepLast(2) | ckptcore.KeepEvery(EVERY)


def _counter(opts: dict | None):
    """A count of the HTTP requests s3fs sends (None on local disk)."""
    if opts is None:
        return None
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    fs.connect()
    sent = [0]

    def count(**_):
        sent[0] += 1

    fs.s3.meta.events.register("before-send", count)
    return sent


def fill(root: str, n: int, opts: dict | None) -> None:
    """``root`` with ``n`` committed steps (0, 1000, ...): one real save, copies of its folder,
    then a manager that adopts them (two saves: its record names them and their entries)."""
    import fsspec

    import ckptcore

    with ckptcore.CheckpointManager(root, keep=None, storage_options=opts,
                                    save_on_preemption=False) as mgr:
        mgr.save(0, _state(0))
    fs, path = fsspec.core.url_to_fs(root, **(opts or {}))
    first = f"{path}/step-{0:012d}"
    files = [f for f in fs.find(first) if not f.endswith("/")]

    def copy(k: int) -> None:
        dst = f"{path}/step-{k * EVERY:012d}"
        if opts is None:
            shutil.copytree(first, dst)
            return
        for f in files:
            fs.copy(f, dst + f[len(first):])

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(copy, range(1, n)))
    with ckptcore.CheckpointManager(root, keep=_policy(), storage_options=opts,
                                    save_on_preemption=False) as mgr:
        for step in ((n - 1) * EVERY + 1, (n - 1) * EVERY + 2):  # (KeepLast(2) keeps both)
            mgr.save(step, _state(step))


def measure(root: str, n: int, opts: dict | None, sent, start: int, saves: int) -> dict:
    """One new manager on ``root``: its first save and ``saves`` steady ones."""
    import ckptcore

    def count() -> int:
        return sent[0] if sent is not None else 0

    states = [_state(s) for s in range(2)]
    before, t0 = count(), time.perf_counter()
    mgr = ckptcore.CheckpointManager(root, keep=_policy(), storage_options=opts,
                                     save_on_preemption=False)
    try:
        mgr.save(start, states[0])
        first = (time.perf_counter() - t0, count() - before)
        steady = []
        for i in range(1, saves + 1):
            before, t0 = count(), time.perf_counter()
            mgr.save(start + i, states[i % 2])
            steady.append((time.perf_counter() - t0, count() - before))
        kept = len(mgr.steps())
    finally:
        mgr.close()
    return {"first": first, "steady": steady, "kept": kept}


def run(store: str, counts: list[int], repeats: int, saves: int, opts: dict | None,
        base: str, list_max: int = 0) -> dict:
    sent = _counter(opts)
    roots = {}
    for n in counts:
        roots[n] = f"{base}/history-{n}"
        t0 = time.perf_counter()
        fill(roots[n], n, opts)
        print(f"  {store}: filled {n} steps in {time.perf_counter() - t0:.1f} s", flush=True)
    out: dict[int, dict] = {n: {"first": [], "steady": [], "kept": 0} for n in counts}
    next_step = {n: (n - 1) * EVERY + 3 for n in counts}
    for r in range(repeats):
        for n in (counts if r % 2 == 0 else counts[::-1]):  # interleaved: the machine is noisy
            m = measure(roots[n], n, opts, sent, next_step[n], saves)
            next_step[n] += saves + 1
            out[n]["first"].append(m["first"])
            out[n]["steady"].extend(m["steady"])
            out[n]["kept"] = m["kept"]
            print(f"  {store} N={n} repeat {r}: first {m['first'][0]:.3f} s ({m['first'][1]} "
                  f"requests), steady {statistics.median(t for t, _ in m['steady']):.3f} s",
                  flush=True)
    for n in counts:
        if n <= list_max and opts is not None:  # (local manifests are read in order either way)
            out[n]["listing"] = listing(roots[n], opts, max(2, repeats))
            print(f"  {store} N={n} listing: " + ", ".join(
                f"{k} {statistics.median(v):.3f} s" for k, v in out[n]["listing"].items()), flush=True)
    return out


def listing(root: str, opts: dict | None, repeats: int) -> dict:
    """``list_checkpoints(root)`` as it runs and one manifest at a time: seconds, interleaved."""
    import ckptcore
    from ckptcore import _knobs

    out: dict[str, list[float]] = {"pool": [], "one at a time": []}
    for r in range(repeats):
        for how in (("pool", "one at a time") if r % 2 == 0 else ("one at a time", "pool")):
            t0 = time.perf_counter()
            if how == "pool":
                found = ckptcore.list_checkpoints(root, storage_options=opts)
            else:
                with _knobs.override(remote_concurrency=1):
                    found = ckptcore.list_checkpoints(root, storage_options=opts)
            out[how].append(time.perf_counter() - t0)
            if any(c.info is None for c in found):
                raise AssertionError(f"{root}: an unreadable step in the listing")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--counts", default="10,100,1000,5000",
                   help="committed steps before the measured saves, comma-separated")
    p.add_argument("--stores", default="local,s3")
    p.add_argument("--repeats", type=int, default=3, help="new managers per N")
    p.add_argument("--saves", type=int, default=4, help="steady saves per manager")
    p.add_argument("--list-max", type=int, default=1000,
                   help="time list_checkpoints for N up to this (0: not at all)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    args = p.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    if args.quick:
        counts, args.repeats, args.saves, args.no_record = [10, 100], 1, 2, True
    logging.getLogger("ckptcore").setLevel(logging.WARNING)
    results = {}
    for store in args.stores.split(","):
        if store == "local":
            scratch = tempfile.mkdtemp(prefix="ckpt-history-")
            try:
                results[store] = run(store, counts, args.repeats, args.saves, None, scratch,
                                     args.list_max)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        elif store == "s3":
            import bench_s3
            opts, stop = bench_s3.start_server("process")
            try:
                import s3fs
                s3fs.S3FileSystem(**opts).mkdir("ckptcore-bench")
                results[store] = run(store, counts, args.repeats, args.saves, opts,
                                     f"s3://ckptcore-bench/{uuid.uuid4().hex[:8]}", args.list_max)
            finally:
                stop()
        else:
            p.error(f"unknown store {store!r} (local, s3)")
    text = report(results, args)
    print(text)
    if not args.no_record:
        record(args.results, text)
    return 0


def report(results: dict, args) -> str:
    lines = [f"## bench_history.py, {datetime.datetime.now():%Y-%m-%d %H:%M}", "",
             f"One save against the committed steps a run keeps (KeepLast(2) | KeepEvery({EVERY}), "
             f"64 KiB state); {args.repeats} new managers per N, {args.saves} steady saves each, "
             "interleaved; medians [min-max]; moto S3 server in a child process on 127.0.0.1; "
             "requests counted on the client.", "",
             "| store | committed steps | first save (new manager) | its requests | steady save "
             "| its requests | target |", "|---|---:|---:|---:|---:|---:|---|"]
    verdicts = []
    for store, per_n in results.items():
        for n, r in per_n.items():
            ft = [t for t, _ in r["first"]]
            st = [t for t, _ in r["steady"]]
            fq = statistics.median(q for _, q in r["first"])
            sq = statistics.median(q for _, q in r["steady"])
            target = "-"
            if store == "s3" and n == 1000:
                ok = statistics.median(ft) < TARGET_FIRST_S3
                target = f"first < {TARGET_FIRST_S3:g} s: {'met' if ok else 'NOT met'}"
                verdicts.append(target)
            reqs = (lambda q: f"{q:.0f}") if store == "s3" else (lambda q: "-")
            lines.append(f"| {store} | {n} | {statistics.median(ft):.3f} s [{min(ft):.3f}-"
                         f"{max(ft):.3f}] | {reqs(fq)} | {statistics.median(st) * 1000:.0f} ms "
                         f"[{min(st) * 1000:.0f}-{max(st) * 1000:.0f}] | {reqs(sq)} | {target} |")
        if store == "s3" and len(per_n) > 1:
            qs = [statistics.median(q for _, q in r["steady"]) for r in per_n.values()]
            fs = [statistics.median(q for _, q in r["first"]) for r in per_n.values()]
            flat = max(qs) - min(qs) <= 2 and max(fs) - min(fs) <= 2 + max(per_n) // 1000
            verdicts.append(f"requests flat across N (steady within 2, first within 2 + one "
                            f"listing page per 1,000 steps): {'met' if flat else 'NOT met'}")
    rows = [(store, n, r["listing"]) for store, per_n in results.items() for n, r in per_n.items()
            if "listing" in r]
    if rows:
        lines += ["", "Listing a root (`list_checkpoints`: `ckpt ls`, `ckpt log`, `ckpt report` read "
                  "every step's manifest), medians [min-max] of interleaved repeats:", "",
                  "| store | committed steps | as it runs | one manifest at a time | faster |",
                  "|---|---:|---:|---:|---:|"]
        for store, n, lst in rows:
            a, b = lst["pool"], lst["one at a time"]
            lines.append(f"| {store} | {n} | {statistics.median(a):.3f} s [{min(a):.3f}-{max(a):.3f}] "
                         f"| {statistics.median(b):.3f} s [{min(b):.3f}-{max(b):.3f}] "
                         f"| {statistics.median(b) / statistics.median(a):.1f}x |")
    lines += ["", "Verdicts: " + "; ".join(verdicts), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
