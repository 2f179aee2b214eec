"""Keras: ckptcore's capture + save and restore against ``tf.train.Checkpoint`` write / read.

A Keras model of three square ``Dense`` layers with ``keras.optimizers.Adam`` after one
step, so its ``momentum``/``velocity`` slots exist: about 200 MiB of variables in all
(``--size-mb`` scales the side).  In one process, in interleaved rounds:

* save: ``ckptcore.save_state(dir, model=model, optimizer=opt)`` (capture included) against
  ``tf.train.Checkpoint(model=model, optimizer=opt).write(prefix)``; every file of both is
  fsynced inside the timing (ckptcore does it itself; for TensorFlow we do);
* restore into a second model and optimizer that have also stepped:
  ``ckptcore.load_state(dir, model=..., optimizer=...)`` (checksums verified) against
  ``tf.train.Checkpoint(model=..., optimizer=...).read(prefix).assert_consumed()``, with the
  files evicted from the page cache first (``posix_fadvise(DONTNEED)`` on these files
  only; ``--warm`` skips it);
* for scale, the disk itself: the same bytes written to one file and fsynced, and read
  back cold with ``readinto`` (one thread, no framework, no checksums); no restore can
  beat that read.

Prints a table and the targets (save and restore >= 1.5x faster), and appends them to
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
    total = state_bytes(model, opt)
    ck = os.path.join(args.dir, "ckptcore")
    tf_dir = os.path.join(args.dir, "tf")
    prefix = os.path.join(tf_dir, "ckpt")
    method = "none" if args.warm else "fadvise"

    def ck_save():
        ckptcore.save_state(ck, model=model, optimizer=opt)
        fsync_paths([ck])

    def tf_save():
        tf.train.Checkpoint(model=model, optimizer=opt).write(prefix)
        fsync_paths([tf_dir])

    def ck_load():
        ckptcore.load_state(ck, model=model2, optimizer=opt2)

    def tf_load():
        tf.train.Checkpoint(model=model2, optimizer=opt2).read(prefix).assert_consumed()

    raw = os.path.join(args.dir, "raw.bin")
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

    times = {k: [] for k in ("ck_save", "tf_save", "ck_load", "tf_load", "raw_save", "raw_load")}
    sizes = {}
    for r in range(args.rounds):
        clean(raw)
        times["raw_save"].append(timed(raw_save))
        evict([raw], method)
        times["raw_load"].append(timed(raw_load))
        order = [("ck", ck_save, ck_load, ck), ("tf", tf_save, tf_load, tf_dir)]
        for name, save, load, path in order if r % 2 == 0 else order[::-1]:
            clean(path)
            times[f"{name}_save"].append(timed(save))
            sizes[name] = sum(os.path.getsize(f) for f in files_under([path]))
            evict([path], method)
            times[f"{name}_load"].append(timed(load))
            assert _same(model, model2), f"{name}: restored variables differ"
            for v in model2.trainable_variables:  # perturb, so the next restore has work to do
                v.assign_add(tf.ones_like(v))
    for p in (ck, tf_dir, raw):
        clean(p)
    return {"bytes": total, "sizes": sizes, "times": {k: summary(v) for k, v in times.items()},
            "method": method, "rounds": args.rounds}


def report(res: dict) -> list[str]:
    t = res["times"]
    gb = res["bytes"] / 1e9
    rows = [("save (capture + write + fsync)", "ck_save", "tf_save", 1.5),
            ("restore (read + verify + assign)", "ck_load", "tf_load", 1.5)]
    lines = [f"## Keras adapter: ckptcore vs tf.train.Checkpoint write / read ({datetime.date.today()})",
             "", f"tensorflow {tf.__version__}, keras {keras.__version__}, numpy {np.__version__}, "
             f"Python {platform.python_version()}, {os.cpu_count()} CPUs; state "
             f"{res['bytes'] / 2**20:.0f} MiB (3 Dense layers + Adam slots, after one step); files "
             f"{res['sizes']['ck'] / 2**20:.0f} / {res['sizes']['tf'] / 2**20:.0f} MiB (ckptcore / "
             f"tf.train.Checkpoint); {res['rounds']} interleaved rounds; restore cache: "
             f"{'warm' if res['method'] == 'none' else 'cold (fadvise DONTNEED on the files)'}.", "",
             "| operation | ckptcore s (median / best) | tf.train.Checkpoint s (median / best) | "
             "ckptcore GB/s | speed-up (median / best) | target | met (median) |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for label, c, o, need in rows:
        ratio = t[o]["median"] / t[c]["median"]
        lines.append(f"| {label} | {t[c]['median']:.3f} / {t[c]['best']:.3f} | {t[o]['median']:.3f} / "
                     f"{t[o]['best']:.3f} | {gb / t[c]['median']:.2f} | {ratio:.2f}x / "
                     f"{t[o]['best'] / t[c]['best']:.2f}x | >= {need:g}x | "
                     f"{'yes' if ratio >= need else 'NO'} |")
    lines.append("")
    lines.append(f"For scale, the same bytes in one file, one thread, no checksums: write + fsync "
                 f"{t['raw_save']['median']:.3f} s, cold read {t['raw_load']['median']:.3f} s "
                 f"(medians); a restore cannot beat the read, so here it can be at most "
                 f"{t['tf_load']['median'] / t['raw_load']['median']:.2f}x faster than "
                 "tf.train.Checkpoint.read.")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=200.0, help="MiB of variables, Adam slots included")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder under /tmp)")
    ap.add_argument("--warm", action="store_true", help="restore from the page cache")
    ap.add_argument("--quick", action="store_true", help="50 MiB, 2 rounds, not recorded")
    ap.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = ap.parse_args()
    if args.quick:
        args.size_mb, args.rounds, args.no_record = 50.0, 2, True
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        args.dir = d
        lines = report(run(args))
    print("\n".join(lines))
    if not args.no_record:
        with open(os.path.join(HERE, "RESULTS.md"), "a") as f:
            f.write("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
