"""Keras: ckptcore's capture + save and restore against ``tf.train.Checkpoint`` write / read.

A Keras model of three square ``Dense`` layers with ``keras.optimizers.Adam`` after one
step, so its ``momentum``/``velocity`` slots exist: about 200 MiB of variables in all
(``--size-mb`` scales the side).  In one process, in interleaved rounds:

* save: ``ckptcore.save_state(dir, model=model, optimizer=opt)`` (capture included) against
  ``tf.train.Checkpoint(model=model, optimizer=opt).write(prefix)``; every file of both is
  fsynced inside the timing (ckptcore does it itself; for TensorFlow we do).  Saves run twice:
  on the disk, and on tmpfs (``--tmpfs``, default /dev/shm), where writing costs memory copies
  only, so the time is the libraries' own work: capture, serialization, checksums, copies;
* restore into a second model and optimizer that have also stepped:
  ``ckptcore.load_state(dir, model=..., optimizer=...)`` (checksums verified) against
  ``tf.train.Checkpoint(model=..., optimizer=...).read(prefix).assert_consumed()``, twice on
  the disk: right after the save, with the files in the page cache (a process restarted on the
  same machine after a crash), and cold, with the files evicted from the page cache first
  (``posix_fadvise(DONTNEED)`` on these files only: a resume on a fresh machine);
* for reference, the disk itself: the same bytes written to one file by one thread and fsynced,
  and read back cold with ``readinto`` (no framework, no checksums).

Where the targets are read: save on tmpfs and the warm restore, the rows where the libraries'
own work sets the time.  On this machine's disk (about 1 GB/s, bursty: it is a shared virtual
disk) TensorFlow's writer and reader spend most of their time waiting on it, so the disk rows
mostly measure the disk; they are printed, with the raw figures for reference, not scored.
(The raw write is not a floor: ckptcore writes with several threads and starts writeback early,
and has been measured faster than it.)

Prints a table and the targets (tmpfs save and warm restore >= 1.5x faster), and appends them to
benchmarks/RESULTS.md unless ``--no-record``.

    python benchmarks/bench_keras.py                # ~200 MiB of variables, 7 rounds
    python benchmarks/bench_keras.py --quick        # 50 MiB, 2 rounds, not recorded
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shutil
import sys
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "adapters"))
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
warnings.filterwarnings("ignore")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import ckptcore  # noqa: E402
from _common import clean, evict, files_under, fsync_paths, summary, timed  # noqa: E402


def build(size_mb: float, seed: int):
    """Three square Dense layers whose weights and Adam slots total ``size_mb`` MiB; one step taken."""
    side = int(math.sqrt(size_mb * 2**20 / 4 / 3 / 3))
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((side,))] + [keras.layers.Dense(side) for _ in range(3)])
    opt = keras.optimizers.Adam(1e-3)
    model.compile(opt, "mse")
    model.train_on_batch(np.random.rand(4, side).astype("float32"), np.zeros((4, side), "float32"))
    return model, opt


def state_bytes(model, opt) -> int:
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
               for v in list(model.variables) + list(opt.variables))


def _same(a, b) -> bool:
    return all(np.array_equal(x.numpy(), y.numpy())
               for x, y in zip(a.variables + a.optimizer.variables, b.variables + b.optimizer.variables))


def run(args) -> dict:
    model, opt = build(args.size_mb, 0)
    model2, opt2 = build(args.size_mb, 1)
    out = {"bytes": state_bytes(model, opt), "rounds": args.rounds, "warmup": args.warmup,
           "tmpfs_dir": args.tmpfs}
    if args.tmpfs and shutil.disk_usage(args.tmpfs).free < 4 * out["bytes"]:
        print(f"skipping the tmpfs pass: {args.tmpfs} has too little room", file=sys.stderr)
        args.tmpfs = out["tmpfs_dir"] = ""
    for where, base in (("disk", args.dir), ("tmpfs", args.tmpfs)):
        if where == "disk" or base:
            with tempfile.TemporaryDirectory(dir=base) as d:
                out[where] = _rounds(args, d, where == "disk", model, opt, model2, opt2)
    return out


def _rounds(args, base: str, disk: bool, model, opt, model2, opt2) -> dict:
    """Interleaved rounds in ``base``; on tmpfs only saves and (warm) restores mean anything."""
    ck = os.path.join(base, "ckptcore")
    tf_dir = os.path.join(base, "tf")
    prefix = os.path.join(tf_dir, "ckpt")

    def ck_save():
        ckptcore.save_state(ck, model=model, optimizer=opt)  # fsyncs everything itself

    def tf_save():
        tf.train.Checkpoint(model=model, optimizer=opt).write(prefix)
        fsync_paths([tf_dir])

    def ck_load():
        ckptcore.load_state(ck, model=model2, optimizer=opt2)

    def tf_load():
        tf.train.Checkpoint(model=model2, optimizer=opt2).read(prefix).assert_consumed()

    raw = os.path.join(base, "raw.bin")
    arrays = [v.numpy() for v in list(model.variables) + list(opt.variables)]
    back = [np.empty_like(a) for a in arrays]

    def raw_save():
        with open(raw, "wb", buffering=0) as f:
            for a in arrays:
                f.write(memoryview(np.ascontiguousarray(a)).cast("B"))
            os.fsync(f.fileno())

    def raw_load():
        with open(raw, "rb", buffering=0) as f:
            for a in back:
                f.readinto(memoryview(a).cast("B"))

    kinds = ("warm", "load") if disk else ("warm",)
    times: dict[str, list[float]] = {}
    sizes = {}
    for r in range(args.warmup + args.rounds):
        got = {}
        clean(raw)
        got["raw_save"] = timed(raw_save)
        if disk:
            evict([raw], "fadvise")
            got["raw_load"] = timed(raw_load)
        order = [("ck", ck_save, ck_load, ck), ("tf", tf_save, tf_load, tf_dir)]
        for name, save, load, path in order if (r - args.warmup) % 2 == 0 else order[::-1]:
            clean(path)
            got[f"{name}_save"] = timed(save)
            sizes[name] = sum(os.path.getsize(f) for f in files_under([path]))
            for kind in kinds:  # right after the save (page cache warm), then cold
                if kind == "load":
                    evict([path], "fadvise")
                got[f"{name}_{kind}"] = timed(load)
                assert _same(model, model2), f"{name}: restored variables differ"
                for v in model2.trainable_variables:  # perturb, so the next restore has work to do
                    v.assign_add(tf.ones_like(v))
        if r >= args.warmup:  # the first rounds fault in memory and warm TensorFlow's kernels
            for k, v in got.items():
                times.setdefault(k, []).append(v)
    for p in (ck, tf_dir, raw):
        clean(p)
    return {"sizes": sizes, "times": {k: summary(v) for k, v in times.items()}}


def report(res: dict) -> list[str]:
    d, m = res["disk"]["times"], res.get("tmpfs", {}).get("times")
    gb = res["bytes"] / 1e9
    rows = [("save to tmpfs (capture + write; the libraries' own cost)", m, "save", 1.5),
            ("restore, page cache warm (read + verify + assign)", d, "warm", 1.5),
            ("save to disk (capture + write + fsync; informative: mostly the disk)", d, "save", None),
            ("restore, cold from disk (informative: mostly the disk)", d, "load", None)]
    sizes = res["disk"]["sizes"]
    lines = [f"## Keras adapter: ckptcore vs tf.train.Checkpoint write / read ({datetime.date.today()})",
             "", f"tensorflow {tf.__version__}, keras {keras.__version__}, numpy {np.__version__}, "
             f"Python {platform.python_version()}, {os.cpu_count()} CPUs; state "
             f"{res['bytes'] / 2**20:.0f} MiB (3 Dense layers + Adam slots, after one step); files "
             f"{sizes['ck'] / 2**20:.0f} / {sizes['tf'] / 2**20:.0f} MiB (ckptcore / "
             f"tf.train.Checkpoint); {res['rounds']} interleaved rounds after {res['warmup']} "
             f"discarded, on the disk and on tmpfs ({res['tmpfs_dir'] or 'skipped'}); cold restores after fadvise "
             "DONTNEED on the files.", "",
             "| operation | ckptcore s (median / best) | tf.train.Checkpoint s (median / best) | "
             "ckptcore GB/s | speed-up (median / best) | target | met (median) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for label, t, op, need in rows:
        if t is None:
            lines.append(f"| {label} | - | - | - | - | >= {need:g}x | not run (no tmpfs) |")
            continue
        c, o = t[f"ck_{op}"], t[f"tf_{op}"]
        ratio = o["median"] / c["median"]
        met = "-" if need is None else ("yes" if ratio >= need else "NO")
        lines.append(f"| {label} | {c['median']:.3f} / {c['best']:.3f} | {o['median']:.3f} / "
                     f"{o['best']:.3f} | {gb / c['median']:.2f} | {ratio:.2f}x / "
                     f"{o['best'] / c['best']:.2f}x | {'-' if need is None else f'>= {need:g}x'} "
                     f"| {met} |")
    lines.append("")
    lines.append(
        f"For reference, the same bytes in one file on the disk, one thread, no checksums: write + "
        f"fsync {d['raw_save']['median']:.3f} s, cold read {d['raw_load']['median']:.3f} s (medians). "
        f"TensorFlow took {d['tf_save']['median'] / d['raw_save']['median']:.2f}x the raw write and "
        f"{d['tf_load']['median'] / d['raw_load']['median']:.2f}x the raw read, ckptcore "
        f"{d['ck_save']['median'] / d['raw_save']['median']:.2f}x and "
        f"{d['ck_load']['median'] / d['raw_load']['median']:.2f}x.")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=200.0, help="MiB of variables, Adam slots included")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default=None, help="where to write on disk (default: a temporary folder under /tmp)")
    ap.add_argument("--tmpfs", default="/dev/shm" if os.path.isdir("/dev/shm") else "",
                    help="a tmpfs folder for the CPU-only pass ('' to skip it)")
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    ap.add_argument("--quick", action="store_true", help="50 MiB, 2 rounds, not recorded")
    ap.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = ap.parse_args()
    if args.quick:
        args.size_mb, args.rounds, args.warmup, args.no_record = 50.0, 2, 0, True
    lines = report(run(args))
    print("\n".join(lines))
    if not args.no_record:
        with open(os.path.join(HERE, "RESULTS.md"), "a") as f:
            f.write("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
