"""Subprocess workers for bench_save_load.py: TensorFlow, Paddle, and the peak-memory probe.

Each framework lives in its own process (importing TensorFlow before Paddle in
one process segfaults).  A framework worker builds variables of the benchmark's
shapes, prints ``{"ready": ...}``, then answers each ``run`` line on stdin with
one JSON line ``{"save": s, "load": s, "bytes": n}``, so the driver can
interleave its rounds with its own contenders (the disk is noisy; rounds that
alternate see the same weather).  ``peakmem`` prints one JSON line and exits.

Usage: python _workers.py {tf|paddle|peakmem} --size-mb N --dir DIR --evict METHOD
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

from _common import (clean, evict, files_under, fill, fsync_paths, large_shapes, reset_peak_rss,
                     timed, vm_status)


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["tf", "paddle", "peakmem"])
    ap.add_argument("--size-mb", type=float, required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--evict", default="fadvise")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    try:
        {"tf": run_tf, "paddle": run_paddle, "peakmem": run_peakmem}[args.mode](args)
    except ImportError as e:
        _emit({"error": f"not installed ({e})"})


if __name__ == "__main__":
    main()
