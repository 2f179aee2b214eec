"""Subprocess workers for the benchmarks: TensorFlow, Paddle, and the peak-memory probe.

Each framework lives in its own process (importing TensorFlow before Paddle in
one process segfaults).  A framework worker builds variables of the benchmark's
shapes, prints ``{"ready": ...}``, then answers each ``run`` line on stdin with
one JSON line ``{"save": s, "load": s, "bytes": n}``, so the driver can
interleave its rounds with its own contenders (the disk is noisy; rounds that
alternate see the same weather).  ``peakmem`` prints one JSON line and exits.

The ``tf-sweep`` and ``paddle-sweep`` modes serve bench_scaling.py, whose state changes from
point to point: they print ``{"ready": ...}`` once imported, then answer JSON lines on stdin:
``{"build": {"dist": D, "count": N, "total_mb": M}}`` (rebuild the variables from
``_common.sweep_arrays``, the same arrays the driver builds) with ``{"built": n, "bytes": b}``,
and ``{"run": {"cold": bool, "check": bool}}`` with ``{"save": s, "warm": s, "cold": s|null,
"bytes": n}`` (save with fsync, warm load from the page cache, then evict and load cold).

Usage: python _workers.py {tf|paddle|peakmem} --size-mb N --dir DIR --evict METHOD
       python _workers.py {tf-sweep|paddle-sweep} --dir DIR --evict METHOD
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import numpy as np

from _common import (clean, evict, files_under, fill, fsync_paths, large_shapes, reset_peak_rss,
                     sweep_arrays, sweep_sizes, timed, vm_status)


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _serve(save, load, out: str, method: str) -> None:
    """Answer ``run`` lines: save (durable: fsync included), evict, cold load."""
    for line in sys.stdin:
        if line.strip() != "run":
            break
        clean(out)
        os.makedirs(out)
        t_save = timed(lambda: (save(), fsync_paths([out])))
        nbytes = sum(os.path.getsize(p) for p in files_under([out]))
        evict([out], method)
        t_load = timed(load)
        clean(out)
        _emit({"save": t_save, "load": t_load, "bytes": nbytes})


def run_tf(args) -> None:
    import tensorflow as tf

    variables = {f"v{i}": tf.Variable(fill(shape, seed=i))
                 for i, (_, _, shape) in enumerate(large_shapes(args.size_mb))}
    ckpt = tf.train.Checkpoint(**variables)
    prefix = os.path.join(args.dir, "ckpt")
    _emit({"ready": True, "version": tf.__version__})

    def load():
        # Restores eagerly into the existing variables (TF also checks its own crc32c here).
        ckpt.read(prefix).assert_consumed()

    _serve(lambda: ckpt.write(prefix), load, args.dir, args.evict)


def run_paddle(args) -> None:
    import paddle

    paddle.set_device("cpu")
    tensors = {f"{p}/{s}": paddle.to_tensor(fill(shape, seed=i))
               for i, (p, s, shape) in enumerate(large_shapes(args.size_mb))}
    path = os.path.join(args.dir, "state.pdparams")
    _emit({"ready": True, "version": paddle.__version__})
    _serve(lambda: paddle.save(tensors, path), lambda: paddle.load(path), args.dir, args.evict)


def run_peakmem(args) -> None:
    """Peak RSS a synchronous save adds on top of a built state (VmHWM, reset after building)."""
    import ckptcore
    from _common import large_state

    state = large_state(args.size_mb)
    nbytes = sum(a.nbytes for a in state.model.values())
    nbytes += sum(a.nbytes for slots in state.optimizer.slots.values() for a in slots.values())
    out = {"state_bytes": nbytes}
    for name, save in [("ckptcore", lambda p: ckptcore.save_state(p, state)),
                       ("safetensors", lambda p: _save_safetensors(state, p))]:
        path = os.path.join(args.dir, name)
        clean(path)
        gc.collect()
        if not reset_peak_rss():
            _emit({"error": "cannot reset VmHWM (/proc/self/clear_refs)"})
            return
        base = vm_status("VmRSS")
        save(path)
        out[name] = vm_status("VmHWM") - base
        clean(path)
    _emit(out)


def _save_safetensors(state, path: str) -> None:
    from safetensors.numpy import save_file

    from _common import flat_arrays
    save_file(flat_arrays(state), path)


# -------------------------------------------------------------------------- bench_scaling.py
def _serve_sweep(build, save, load, check, out: str, method: str) -> None:
    """Answer ``build`` and ``run`` lines (see the module docstring) until EOF or ``quit``."""
    arrays: list[np.ndarray] = []
    for line in sys.stdin:
        msg = json.loads(line)
        if "build" in msg:
            arrays = []
            gc.collect()
            arrays = sweep_arrays(sweep_sizes(**msg["build"]))
            build(arrays)
            _emit({"built": len(arrays), "bytes": sum(a.nbytes for a in arrays)})
        elif "run" in msg:
            opts = msg["run"]
            clean(out)
            os.makedirs(out)
            t_save = timed(lambda: (save(), fsync_paths([out])))
            nbytes = sum(os.path.getsize(p) for p in files_under([out]))
            t_warm = timed(load)
            if opts.get("check"):
                check(arrays)
            t_cold = None
            if opts.get("cold"):
                evict([out], method)
                t_cold = timed(load)
            clean(out)
            _emit({"save": t_save, "warm": t_warm, "cold": t_cold, "bytes": nbytes})
        else:
            break


def _same(name: str, got: np.ndarray, want: np.ndarray) -> None:
    if not np.array_equal(got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)):
        raise AssertionError(f"{name} did not round-trip")


def run_tf_sweep(args) -> None:
    import tensorflow as tf

    box: dict = {}
    prefix = os.path.join(args.dir, "ckpt")
    _emit({"ready": True, "version": tf.__version__})

    def build(arrays):
        box.clear()
        box["vars"] = [tf.Variable(a) for a in arrays]
        box["ckpt"] = tf.train.Checkpoint(**{f"v{i}": v for i, v in enumerate(box["vars"])})

    def load():
        box["ckpt"].read(prefix).assert_consumed()  # eagerly into the existing variables

    def check(arrays):
        # The warm read already ran into the live variables: clobber the ends, read again.
        for i in (0, -1):
            box["vars"][i].assign(tf.zeros_like(box["vars"][i]))
        load()
        for i in (0, -1):
            _same(f"tf.Variable {i}", box["vars"][i].numpy(), arrays[i])

    _serve_sweep(build, lambda: box["ckpt"].write(prefix), load, check, args.dir, args.evict)


def run_paddle_sweep(args) -> None:
    import paddle

    paddle.set_device("cpu")
    box: dict = {}
    path = os.path.join(args.dir, "state.pdparams")
    _emit({"ready": True, "version": paddle.__version__})

    def build(arrays):
        box.clear()
        box["tensors"] = {f"t{i}": paddle.to_tensor(a) for i, a in enumerate(arrays)}

    def check(arrays):
        got = paddle.load(path)
        for i in (0, len(arrays) - 1):
            _same(f"paddle tensor {i}", got[f"t{i}"].numpy(), arrays[i])

    _serve_sweep(build, lambda: paddle.save(box["tensors"], path), lambda: paddle.load(path),
                 check, args.dir, args.evict)


def main() -> None:
    ap = argparse.ArgumentParser()
    modes = {"tf": run_tf, "paddle": run_paddle, "peakmem": run_peakmem,
             "tf-sweep": run_tf_sweep, "paddle-sweep": run_paddle_sweep}
    ap.add_argument("mode", choices=list(modes))
    ap.add_argument("--size-mb", type=float, help="state size (tf, paddle, peakmem)")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--evict", default="fadvise")
    args = ap.parse_args()
    if args.size_mb is None and not args.mode.endswith("-sweep"):
        ap.error(f"{args.mode} needs --size-mb")
    os.makedirs(args.dir, exist_ok=True)
    try:
        modes[args.mode](args)
    except ImportError as e:
        _emit({"error": f"not installed ({e})"})


if __name__ == "__main__":
    main()
