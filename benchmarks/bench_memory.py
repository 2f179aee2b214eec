"""Peak memory of saves and restores, above the state (issue 25, point 3: bounded memory).

Each measurement runs in a fresh child process, so the process's peak is its own: the child
builds the state (``--gib`` GiB, default 1, in 16 float32 arrays), warms up the code path on a
tiny state (imports, the S3 client and its service model), resets its peak RSS
(``/proc/self/clear_refs``), reads ``VmRSS``, runs the operation and reads ``VmHWM``.  The figure
is the peak above the RSS before the call; for a restore, above the restored state (the RSS
before the call holds no state, so the restored bytes are subtracted).

Cases and their targets (knobs read from ``ckptcore._knobs`` in the child):

* S3 save, ``save_state("s3://...")`` on moto's server in another process: peak above the state
  <= ``remote_concurrency x remote_part_size`` + 64 MiB;
* async save, ``CheckpointManager(local, async_save=True).save(...)`` and ``wait()``: <= one
  staging copy (the state, or ``staging_bytes`` when set) + 64 MiB; also with a staging budget of
  a quarter of the state;
* restore, ``load_state`` from local disk and from S3: <= the restored state + 64 MiB.

    python benchmarks/bench_memory.py [--gib 1] [--quick] [--no-record]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from _common import reset_peak_rss, vm_status  # noqa: E402
from _report import record  # noqa: E402

MIB = 2**20
SLACK = 64 * MIB  # what every target allows on top (interpreter, client, buffers in passing)
ARRAYS = 16
BUCKET = "ckptcore-bench"


# ------------------------------------------------------------------------------ in the child
def make_state(total: int, seed: int = 0):
    """``ARRAYS`` float32 arrays of ``total`` bytes in all, each a cheap deterministic pattern
    (the figures are about bytes held, not their entropy; a pattern is quick to check)."""
    import ckptcore

    n = max(1, total // 4 // ARRAYS)
    return ckptcore.TrainingState(
        model={f"t{i:02d}": _pattern(n, seed + i) for i in range(ARRAYS)}, step=1)


def _pattern(n: int, salt: int):
    import numpy as np

    a = np.arange(n, dtype=np.uint32)
    a *= 2654435761 + 2 * salt  # every byte differs from its neighbours; bit-exact to rebuild
    return a.view(np.float32)


def _check(state, total: int, seed: int = 0) -> None:
    """The restored arrays are the saved ones, bit for bit (one array rebuilt at a time)."""
    import numpy as np

    n = max(1, total // 4 // ARRAYS)
    for i in range(ARRAYS):
        got = state.model[f"t{i:02d}"]
        if not np.array_equal(got.view(np.uint32), _pattern(n, seed + i).view(np.uint32)):
            raise SystemExit(f"t{i:02d}: restored bytes differ from the saved ones")


def _peak(fn) -> tuple[int, float]:
    """Run ``fn``; (peak RSS above the RSS before it, seconds)."""
    import gc

    gc.collect()
    if not reset_peak_rss():
        raise SystemExit("this kernel refuses /proc/self/clear_refs: no clean peak to measure")
    before = vm_status("VmRSS")
    t0 = time.perf_counter()
    fn()
    return vm_status("VmHWM") - before, time.perf_counter() - t0


def child(args: argparse.Namespace) -> dict:
    import ckptcore
    from ckptcore import _knobs

    opts = json.loads(args.opts) if args.opts else {}
    total = int(args.gib * 2**30)
    knobs = {"remote_part_size": _knobs.remote_part_size(),
             "remote_concurrency": _knobs.remote_concurrency(),
             "staging_bytes": _knobs.staging_bytes()}
    out: dict = {"case": args.child, "state": total, "knobs": knobs}
    tiny = make_state(ARRAYS * 4096)
    if args.child == "s3_save":
        state = make_state(total)
        ckptcore.save_state(f"s3://{BUCKET}/warmup-{uuid.uuid4().hex}", tiny, storage_options=opts)
        out["peak"], out["seconds"] = _peak(
            lambda: ckptcore.save_state(args.url, state, storage_options=opts))
        out["bound"] = knobs["remote_concurrency"] * knobs["remote_part_size"] + SLACK
    elif args.child in ("async_save", "async_save_budget"):
        state = make_state(total)
        with ckptcore.CheckpointManager(os.path.join(args.url, "warmup"), async_save=True,
                                        save_on_preemption=False) as warm:
            warm.save(0, tiny).result()
        mgr = ckptcore.CheckpointManager(args.url, async_save=True, save_on_preemption=False)
        blocked: list[float] = []

        def save() -> None:
            t0 = time.perf_counter()
            handle = mgr.save(1, state)
            blocked.append(time.perf_counter() - t0)
            handle.result()

        out["peak"], out["seconds"] = _peak(save)
        mgr.close()
        out["blocked"] = blocked[0]
        staged = knobs["staging_bytes"] or total
        out["bound"] = min(staged, total) + SLACK
    elif args.child in ("restore_local", "restore_s3"):
        ckptcore.load_state(args.warmup, storage_options=opts)
        got = []
        out["peak"], out["seconds"] = _peak(
            lambda: got.append(ckptcore.load_state(args.url, storage_options=opts)))
        out["peak"] -= total  # above the restored state
        _check(got[0], total)
        out["bound"] = SLACK
    else:
        raise SystemExit(f"unknown case {args.child!r}")
    return out


# ------------------------------------------------------------------------------ the driver
def run_child(case: str, gib: float, url: str, opts: dict, env: dict,
              warmup: str = "") -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--gib", str(gib),
           "--url", url, "--opts", json.dumps(opts), "--warmup", warmup]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{case} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_all(gib: float, opts: dict, workdir: str) -> list[dict]:
    import ckptcore

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    s3_url = f"s3://{BUCKET}/mem-{uuid.uuid4().hex[:8]}"
    local = os.path.join(workdir, "run")
    small = os.path.join(workdir, "small")
    ckptcore.save_state(small, make_state(ARRAYS * 4096))  # what restores warm up on
    ckptcore.save_state(f"{s3_url}-small", make_state(ARRAYS * 4096), storage_options=opts)
    quarter = dict(env, CKPTCORE_STAGING_BYTES=str(int(gib * 2**30) // 4))
    rows = [
        ("S3 save", run_child("s3_save", gib, s3_url, opts, env)),
        ("async save (local)", run_child("async_save", gib, local, {}, env)),
        ("async save, staging_bytes = state / 4",
         run_child("async_save_budget", gib, os.path.join(workdir, "budget"), {}, quarter)),
        ("restore from local disk",
         run_child("restore_local", gib, os.path.join(local, _step_dir(local)), {}, env, small)),
        ("restore from S3", run_child("restore_s3", gib, s3_url, opts, env, f"{s3_url}-small")),
    ]
    return [dict(r, label=label) for label, r in rows]


def _step_dir(root: str) -> str:
    steps = sorted(e for e in os.listdir(root) if e.startswith("step-"))
    return steps[-1]


def table(rows: list[dict], gib: float, quick: bool) -> str:
    k = rows[0]["knobs"]
    lines = [f"## bench_memory.py, {datetime.datetime.now():%Y-%m-%d %H:%M}"
             + (" (--quick)" if quick else ""), "",
             f"{gib:g} GiB state in {ARRAYS} float32 arrays; each case in a fresh child process, "
             f"peak RSS (VmHWM after clear_refs) above the RSS before the call, minus the restored "
             f"state for restores. Knobs: remote_part_size={k['remote_part_size'] // MIB} MiB, "
             f"remote_concurrency={k['remote_concurrency']}. moto S3 server in another process "
             "on 127.0.0.1.", "",
             "| case | peak above the state (MiB) | target (MiB) | met | time s "
             "| caller blocked s |",
             "|---|---:|---|---|---:|---:|"]
    for r in rows:
        blocked = f"{r['blocked']:.3f}" if "blocked" in r else "-"
        lines.append(f"| {r['label']} | {r['peak'] / MIB:.0f} | <= {_target(r)} | "
                     f"{'yes' if r['peak'] <= r['bound'] else 'NO'} | {r['seconds']:.2f} | "
                     f"{blocked} |")
    return "\n".join(lines) + "\n"


def _target(r: dict) -> str:
    k, bound = r["knobs"], r["bound"] // MIB
    if r["case"] == "s3_save":
        return (f"{bound} ({k['remote_concurrency']} x {k['remote_part_size'] // MIB} MiB parts "
                "+ 64)")
    if r["case"].startswith("async"):
        return f"{bound} (one staging copy, {(r['bound'] - SLACK) // MIB} MiB, + 64)"
    return f"{bound} (64 above the restored state)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--quick", action="store_true", help="a 0.25 GiB state; records nothing")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--opts", help=argparse.SUPPRESS)
    p.add_argument("--warmup", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if args.quick:
        args.gib, args.no_record = 0.25, True
    import bench_s3

    opts, stop = bench_s3.start_server("process")
    try:
        import s3fs

        s3fs.S3FileSystem(**opts).mkdir(BUCKET)
        with tempfile.TemporaryDirectory(prefix="ckptcore-mem-") as workdir:
            rows = measure_all(args.gib, opts, workdir)
    finally:
        stop()
    text = table(rows, args.gib, args.quick)
    print(text)
    if not args.no_record:
        record(args.results, text)
    return 0 if all(r["peak"] <= r["bound"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
