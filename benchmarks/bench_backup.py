"""The backup tier against its baselines, on an S3 server on loopback (moto, in a child process).

Targets (issue 15):

1. **Replication throughput** >= 0.9x s3fs's own concurrent PUTs of the same bytes: a committed
   local step (``--size-mb`` in ``--tensors`` float32 tensors, every byte new to the bucket)
   replicated by ``_replica.copy_checkpoint`` (read back from local disk and verified, hashed,
   uploaded as content-addressed chunks, manifest committed), against ``fs.pipe({path: bytes})``
   of one object per tensor (bytes made beforehand, untimed; no checksums, no hashing, no
   manifest).
2. **save() with a local tier** within 10% of a local save with no backup: ``--saves`` saves of a
   ``--state-mb`` state, each after ``--gap`` seconds of "training" (a sleep: replication runs
   then, as it would during real steps), with ``backup=`` the S3 server throttled to
   ``--bucket-mbps`` MB/s (a slow bucket) against the same manager without a backup; medians of
   the save() calls.
3. **Bytes uploaded per step** when 90% of the parameter bytes are frozen (measured by listing
   the bucket): the target is at most 15% of the state after the first step.

    python benchmarks/bench_backup.py [--quick] [--no-record]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _report import record  # noqa: E402

TARGET_THROUGHPUT = 0.9
TARGET_SAVE = 1.10
TARGET_DEDUP = 0.15


def _state(mb: float, tensors: int, seed: int):
    import numpy as np

    import ckptcore

    per = max(1, int(mb * 2**20 / 4 / tensors))
    rng = np.random.default_rng(seed)
    return ckptcore.TrainingState(model={f"layer{i}/w": rng.standard_normal(per).astype(np.float32)
                                         for i in range(tensors)}, step=seed)


def throughput(opts: dict, size_mb: float, tensors: int, rounds: int) -> dict:
    import s3fs

    import ckptcore
    from ckptcore._replica import copy_checkpoint
    from ckptcore._storage import Store

    fs = s3fs.S3FileSystem(**opts)
    raw_t, ours_t = [], []
    tmp = tempfile.mkdtemp()
    try:
        for r in range(rounds):
            state = _state(size_mb, tensors, seed=100 + r)  # new bytes every round: no dedup hits
            local = os.path.join(tmp, f"step-{r:012d}")
            ckptcore.save_state(local, state)
            blobs = {f"ckptcore-bench/raw-{uuid.uuid4().hex}/{k}": v.tobytes()
                     for k, v in state.model.items()}
            order = [0, 1] if r % 2 == 0 else [1, 0]
            for which in order:
                if which == 0:
                    t = time.perf_counter()
                    fs.pipe(blobs)
                    raw_t.append(time.perf_counter() - t)
                else:
                    dst = Store(f"s3://ckptcore-bench/backup-{uuid.uuid4().hex}/step-{r:012d}", opts)
                    t = time.perf_counter()
                    copy_checkpoint(Store(local), dst, dedup=True, known={})
                    ours_t.append(time.perf_counter() - t)
            shutil.rmtree(local)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    raw, ours = statistics.median(raw_t), statistics.median(ours_t)
    return {"raw": raw, "ours": ours, "ratio": raw / ours, "mb": size_mb,
            "raw_range": (min(raw_t), max(raw_t)), "ours_range": (min(ours_t), max(ours_t))}


def save_latency(opts: dict, state_mb: float, saves: int, gap: float) -> dict:
    import ckptcore

    out = {}
    tmp = tempfile.mkdtemp()
    try:
        for label, backup in (("local only", None),
                              ("local + S3 backup", f"s3://ckptcore-bench/tier-{uuid.uuid4().hex}")):
            times = []
            kw = {} if backup is None else {"backup": ckptcore.Backup(backup, storage_options=opts)}
            with ckptcore.CheckpointManager(os.path.join(tmp, label.replace(" ", "_")), keep=2,
                                            **kw) as mgr:
                for step in range(1, saves + 1):
                    state = _state(state_mb, 16, seed=step)  # all new: the bucket gets it all
                    time.sleep(gap)  # training
                    t = time.perf_counter()
                    mgr.save(step, state)
                    times.append(time.perf_counter() - t)
            out[label] = statistics.median(times[1:])  # the first save warms the page cache
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out["ratio"] = out["local + S3 backup"] / out["local only"]
    return out


def dedup(opts: dict) -> dict:
    import numpy as np

    import ckptcore
    from ckptcore._storage import Store

    frozen = np.random.default_rng(0).standard_normal(9 * 2**20 // 4).astype(np.float32)
    tmp = tempfile.mkdtemp()
    backup = f"s3://ckptcore-bench/dedup-{uuid.uuid4().hex}"
    grown = []
    try:
        with ckptcore.CheckpointManager(tmp, backup=ckptcore.Backup(backup, storage_options=opts)) as mgr:
            for step in range(1, 6):
                head = np.random.default_rng(step).standard_normal(2**20 // 4).astype(np.float32)
                before = sum(e.size or 0 for e in Store(backup, opts).find()) if step > 1 else 0
                mgr.save(step, ckptcore.TrainingState(model={"backbone": frozen, "head": head},
                                                      step=step))
                mgr.wait()
                grown.append(sum(e.size or 0 for e in Store(backup, opts).find()) - before)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    state = frozen.nbytes + 2**20
    return {"state": state, "grown": grown, "worst": max(grown[1:]) / state}


def main(argv=None) -> int:
    import bench_s3

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=256)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--state-mb", type=float, default=64)
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--gap", type=float, default=1.0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    args = p.parse_args(argv)
    if args.quick:
        args.size_mb, args.rounds, args.state_mb, args.saves, args.gap = 32, 1, 16, 3, 0.3
        args.no_record = True
    opts, stop = bench_s3.start_server("process")
    try:
        import s3fs
        s3fs.S3FileSystem(**opts).mkdir("ckptcore-bench")
        tp = throughput(opts, args.size_mb, args.tensors, args.rounds)
        lat = save_latency(opts, args.state_mb, args.saves, args.gap)
        dd = dedup(opts)
    finally:
        stop()
    lines = [
        f"## bench_backup.py, {datetime.datetime.now():%Y-%m-%d %H:%M}", "",
        "moto S3 server in a child process on 127.0.0.1; medians [min-max].", "",
        "| quantity | value | target |", "|---|---:|---|",
        f"| replicate {tp['mb']:.0f} MB ({args.tensors} tensors, all new): s3fs raw concurrent "
        f"PUTs / ckptcore replication | {tp['raw']:.2f} s [{tp['raw_range'][0]:.2f}-"
        f"{tp['raw_range'][1]:.2f}] / {tp['ours']:.2f} s [{tp['ours_range'][0]:.2f}-"
        f"{tp['ours_range'][1]:.2f}] = **{tp['ratio']:.2f}x** | >= {TARGET_THROUGHPUT}x: "
        f"{'met' if tp['ratio'] >= TARGET_THROUGHPUT else 'NOT met'} |",
        f"| save() of {args.state_mb:.0f} MB every {args.gap:g} s: local only / with an S3 "
        f"backup | {lat['local only'] * 1000:.0f} ms / {lat['local + S3 backup'] * 1000:.0f} ms "
        f"= **{lat['ratio']:.2f}x** | <= {TARGET_SAVE}x: "
        f"{'met' if lat['ratio'] <= TARGET_SAVE else 'NOT met'} |",
        f"| 90% frozen: bytes added to the bucket per step after the first (worst of 4) | "
        f"{max(dd['grown'][1:]) / 2**20:.2f} MiB of a {dd['state'] / 2**20:.0f} MiB state = "
        f"**{dd['worst']:.1%}** | <= {TARGET_DEDUP:.0%}: "
        f"{'met' if dd['worst'] <= TARGET_DEDUP else 'NOT met'} |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_record:
        record(args.results, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
