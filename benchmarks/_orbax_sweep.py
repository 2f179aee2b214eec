"""Orbax's ``StandardCheckpointer`` as a bench_scaling.py contender, in a worker process of its own.

``ocp.StandardCheckpointer().save`` of a dict of the sweep's NumPy arrays (Orbax's defaults:
OCDBT, zarr3 chunks compressed with zstd; the call returns once it has copied the arrays and
writes in the background, so the save here waits for ``wait_until_finished()``; tensorstore
fsyncs the array data, the driver's protocol fsyncs every file after, Orbax's metadata
included) / ``restore(path, target)`` into a dict of NumPy arrays of the same shapes (NumPy
arrays come back).  The protocol is ``_workers.py``'s sweep protocol (``{"ready": ...}``, then
``build`` and ``run`` lines; see its docstring), served by its ``_serve_sweep``.

It runs under whichever Python has orbax-checkpoint and jax (bench_scaling.py
``--orbax-python``: they need not be installed next to TensorFlow and Paddle, nor ckptcore: this
worker imports only NumPy and ``_common``/``_workers``).  Without them it answers
``{"error": "not installed (...)"}`` and the driver skips it.

    python _orbax_sweep.py --dir DIR --evict METHOD
"""

from __future__ import annotations

import argparse
import logging
import os

import numpy as np

from _workers import _emit, _same, _serve_sweep


def run(out: str, method: str) -> None:
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax logs every step of every save
    import orbax.checkpoint as ocp

    box: dict = {}
    path = os.path.join(out, "orbax")
    ckptr = ocp.StandardCheckpointer()
    _emit({"ready": True, "version": ocp.__version__})

    def build(arrays):
        box.clear()
        box["tree"] = {f"t{i}": a for i, a in enumerate(arrays)}  # the arrays themselves
        # The target only says what comes back (shapes, dtypes, NumPy): np.zeros maps lazily.
        box["target"] = {f"t{i}": np.zeros(a.shape, a.dtype) for i, a in enumerate(arrays)}

    def save():
        ckptr.save(path, box["tree"])
        ckptr.wait_until_finished()

    def load():
        return ckptr.restore(path, box["target"])

    def check(arrays):
        got = load()
        for i in (0, len(arrays) - 1):
            _same(f"Orbax array {i}", np.asarray(got[f"t{i}"]), arrays[i])

    try:
        _serve_sweep(build, save, load, check, out, method)
    finally:
        ckptr.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--evict", default="fadvise")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    try:
        run(args.dir, args.evict)
    except ImportError as e:
        _emit({"error": f"not installed ({e})"})


if __name__ == "__main__":
    main()
