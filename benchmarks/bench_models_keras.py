"""Keras on real architectures: ckptcore against ``tf.train.Checkpoint`` and safetensors.

``keras.applications`` ResNet50, MobileNetV2 and EfficientNetB0 (``weights=None``, 96x96x3
inputs, 10 classes), each with ``keras.optimizers.Adam`` after one training step, so that its
``momentum``/``velocity`` slots exist: hundreds of small and medium variables (batch-norm
vectors, depthwise kernels) beside a few large ones, which is where per-tensor costs show.
Each model is built twice (a source and a restore target that has also stepped), once per
architecture; building is kept out of every timing.  In one process, in interleaved rounds
(the contenders' order rotates from round to round):

* save, every file fsynced inside the timing: ``ckptcore.save_state(dir, model=, optimizer=)``
  (what users call; capture included; ckptcore fsyncs itself) against
  ``tf.train.Checkpoint(model=, optimizer=).write(prefix)`` + fsync of its files, and against
  ``safetensors.numpy.save_file`` of the same variables (read with ``.numpy()`` inside the
  timing) + fsync;
* restore into the second model and optimizer, with the files in the page cache (warm: a
  process restarted on the same machine) and evicted first (cold: ``posix_fadvise(DONTNEED)``
  on those files): ``ckptcore.load_state(dir, model=, optimizer=)`` (checksums verified)
  against ``tf.train.Checkpoint(model=, optimizer=).read(prefix).assert_consumed()`` and
  ``safetensors.numpy.load_file`` + ``variable.assign`` of every variable.  Every restore is
  checked bit for bit, then the target is perturbed so the next one has work to do;
* peak memory added by one save of each (``VmHWM`` over the RSS before it; files in the page
  cache do not count).

Targets (ckptcore against the framework's own saver, medians): save >= 1.5x, warm restore >=
1.3x.  Cold restores and safetensors are printed for reference.  Prints a table and appends it
to benchmarks/RESULTS.md unless ``--no-record``.

    python benchmarks/bench_models_keras.py                   # 3 architectures, 7 rounds
    python benchmarks/bench_models_keras.py --quick           # 2 rounds, not recorded
    python benchmarks/bench_models_keras.py --arch MobileNetV2 --rounds 5
"""

from __future__ import annotations

import argparse
import datetime
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
from safetensors.numpy import load_file, save_file  # noqa: E402

import ckptcore  # noqa: E402
from _common import (clean, evict, files_under, fsync_paths, reset_peak_rss, summary, timed,  # noqa: E402
                     vm_status, cell)

ARCHS = ("ResNet50", "MobileNetV2", "EfficientNetB0")
CONTENDERS = ("ck", "tf", "st")
LABELS = {"ck": "ckptcore", "tf": "tf.train.Checkpoint", "st": "safetensors"}
TARGETS = {"save": 1.5, "warm": 1.3}


def build(arch: str, size: int, classes: int, seed: int):
    """``arch`` with Adam after one eager training step (no tf.function tracing: builds fast)."""
    keras.utils.set_random_seed(seed)
    model = getattr(keras.applications, arch)(weights=None, input_shape=(size, size, 3),
                                              classes=classes)
    opt = keras.optimizers.Adam(1e-3)
    x = np.random.rand(2, size, size, 3).astype("float32")
    y = keras.utils.to_categorical(np.arange(2) % classes, classes)
    with tf.GradientTape() as tape:
        loss = keras.losses.categorical_crossentropy(y, model(x, training=True))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return model, opt


def all_variables(model, opt) -> list:
    return list(model.variables) + list(opt.variables)


def _same(a: list, b: list) -> bool:
    return all(np.array_equal(x.numpy(), y.numpy()) for x, y in zip(a, b))


def _perturb(variables: list) -> None:
    for v in variables:
        if np.dtype(v.dtype).kind == "f":
            v.assign(v + 1)


def run_arch(args, arch: str, base: str) -> dict:
    model, opt = build(arch, args.size, args.classes, 0)
    model2, opt2 = build(arch, args.size, args.classes, 1)
    src, dst = all_variables(model, opt), all_variables(model2, opt2)
    # safetensors needs unique flat names; an index prefix keeps them unique and in order.
    st_names = [f"{i:05d}.{v.path}" for i, v in enumerate(src)]
    ck = os.path.join(base, "ckptcore")
    tf_dir = os.path.join(base, "tf")
    prefix = os.path.join(tf_dir, "ckpt")
    st = os.path.join(base, "model.safetensors")

    def ck_save():
        ckptcore.save_state(ck, model=model, optimizer=opt)

    def tf_save():
        tf.train.Checkpoint(model=model, optimizer=opt).write(prefix)
        fsync_paths([tf_dir])

    def st_save():
        save_file({n: np.asarray(v.numpy()) for n, v in zip(st_names, src)}, st)
        fsync_paths([st])

    def ck_load():
        ckptcore.load_state(ck, model=model2, optimizer=opt2)

    def tf_load():
        tf.train.Checkpoint(model=model2, optimizer=opt2).read(prefix).assert_consumed()

    def st_load():
        arrays = load_file(st)
        for n, v in zip(st_names, dst):
            v.assign(arrays[n])

    ops = {"ck": (ck_save, ck_load, ck), "tf": (tf_save, tf_load, tf_dir), "st": (st_save, st_load, st)}
    times: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}
    for r in range(args.warmup + args.rounds):
        got = {}
        k = r % len(CONTENDERS)
        for name in CONTENDERS[k:] + CONTENDERS[:k]:
            save, load, path = ops[name]
            clean(path)
            got[f"{name}_save"] = timed(save)
            sizes[name] = sum(os.path.getsize(f) for f in files_under([path]))
            for kind in ("warm", "cold"):
                _perturb(dst)
                if kind == "cold":
                    evict([path], "fadvise")
                got[f"{name}_{kind}"] = timed(load)
                if not _same(src, dst):
                    raise AssertionError(f"{arch}: {LABELS[name]} {kind} restore differs")
        if r >= args.warmup:  # the first round faults memory in and warms TensorFlow's kernels
            for key, v in got.items():
                times.setdefault(key, []).append(v)
    peak = {}
    for name in CONTENDERS:
        save, _, path = ops[name]
        clean(path)
        if reset_peak_rss():
            before = vm_status("VmRSS")
            save()
            peak[name] = max(0, vm_status("VmHWM") - before)
        clean(path)
    nbytes = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in src)
    return {"arch": arch, "bytes": nbytes, "tensors": len(src), "model_vars": len(model.variables),
            "sizes": sizes, "peak": peak, "times": {k: summary(v) for k, v in times.items()}}



def report(results: list[dict], args) -> list[str]:
    lines = [f"## Keras real architectures: ckptcore vs tf.train.Checkpoint and safetensors "
             f"({datetime.date.today()})", "",
             f"tensorflow {tf.__version__}, keras {keras.__version__}, numpy {np.__version__}, "
             f"Python {platform.python_version()}, {os.cpu_count()} CPUs; "
             f"keras.applications models, weights=None, {args.size}x{args.size}x3 inputs, "
             f"{args.classes} classes, Adam after one step; {args.rounds} interleaved rounds after "
             f"{args.warmup} discarded; seconds as median [min-max]; saves include fsync; cold "
             "restores after fadvise DONTNEED on the files; ratio = other's median / ckptcore's.",
             "",
             "| model | tensors / MiB | operation | ckptcore | tf.train.Checkpoint | safetensors | "
             "vs tf | vs safetensors | target (vs tf) | met |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    verdicts = []
    for res in results:
        t = res["times"]
        for op, label in (("save", "save + fsync"), ("warm", "restore, warm"), ("cold", "restore, cold")):
            c, o, s = t[f"ck_{op}"], t[f"tf_{op}"], t[f"st_{op}"]
            r_tf, r_st = o["median"] / c["median"], s["median"] / c["median"]
            need = TARGETS.get(op)
            met = "-" if need is None else ("yes" if r_tf >= need else "NO")
            if need is not None:
                verdicts.append(r_tf >= need)
            lines.append(f"| {res['arch']} | {res['tensors']} / {res['bytes'] / 2**20:.0f} | {label} | "
                         f"{cell(c)} | {cell(o)} | {cell(s)} | {r_tf:.2f}x | {r_st:.2f}x | "
                         f"{'-' if need is None else f'>= {need:g}x'} | {met} |")
    lines += ["", "Peak memory added by one save (MiB; VmHWM over the RSS before it) and file sizes (MiB):", "",
              "| model | ckptcore | tf.train.Checkpoint | safetensors | files ck / tf / st |",
              "|---|---:|---:|---:|---|"]
    for res in results:
        p, z = res["peak"], res["sizes"]
        cells = " | ".join(f"{p[n] / 2**20:.1f}" if n in p else "n/a" for n in CONTENDERS)
        lines.append(f"| {res['arch']} | {cells} | "
                     f"{' / '.join(f'{z[n] / 2**20:.1f}' for n in CONTENDERS)} |")
    lines += ["", f"Targets met: {sum(verdicts)} of {len(verdicts)}.", ""]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", choices=ARCHS,
                    help="an architecture (repeatable; default: all three)")
    ap.add_argument("--size", type=int, default=96, help="input side (default 96)")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder under /tmp)")
    ap.add_argument("--quick", action="store_true", help="2 rounds, no warm-up, not recorded")
    ap.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.warmup, args.no_record = 2, 0, True
    results = []
    for arch in args.arch or ARCHS:
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            results.append(run_arch(args, arch, d))
        print(f"{arch}: done", file=sys.stderr, flush=True)
    lines = report(results, args)
    print("\n".join(lines))
    if not args.no_record:
        with open(os.path.join(HERE, "RESULTS.md"), "a") as f:
            f.write("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
