"""PyTorch's savers as bench_scaling.py contenders, each in a worker process of its own.

``torch-save``: ``torch.save`` of a dict of the sweep's tensors / ``torch.load`` (its default,
``weights_only=True``).  ``dcp``: ``torch.distributed.checkpoint.save`` of the same dict (one
process, no process group; it fsyncs its files itself) / ``dcp.load`` into the live tensors,
the only way DCP loads.  The protocol is ``_workers.py``'s sweep protocol (``{"ready": ...}``,
then ``build`` and ``run`` lines; see its docstring), served by its ``_serve_sweep``, so the
driver interleaves these with its other contenders exactly as it does TensorFlow and Paddle.
In a process of its own because PyTorch in the driver would share its threads and memory with
the contenders measured there.

    python _torch_sweep.py {torch-save|dcp} --dir DIR --evict METHOD
"""

from __future__ import annotations

import argparse
import os
import warnings

from _workers import _emit, _same, _serve_sweep


def run(mode: str, out: str, method: str) -> None:
    warnings.filterwarnings("ignore")  # DCP warns on every single-process call
    import torch
    import torch.distributed.checkpoint as dcp

    box: dict = {}
    path = os.path.join(out, "state.pt" if mode == "torch-save" else "dcp")
    _emit({"ready": True, "version": torch.__version__})

    def build(arrays):
        box.clear()
        box["tensors"] = {f"t{i}": torch.from_numpy(a.copy()) for i, a in enumerate(arrays)}

    if mode == "torch-save":
        def save():
            torch.save(box["tensors"], path)

        def load():
            return torch.load(path)

        def check(arrays):
            got = torch.load(path)
            for i in (0, len(arrays) - 1):
                _same(f"torch tensor {i}", got[f"t{i}"].numpy(), arrays[i])
    else:
        def save():
            dcp.save(box["tensors"], checkpoint_id=path)

        def load():
            dcp.load(box["tensors"], checkpoint_id=path)  # in place, into the live tensors

        def check(arrays):
            # The warm load already ran into the live tensors: clobber the ends, load again.
            for i in (0, len(arrays) - 1):
                box["tensors"][f"t{i}"].zero_()
            load()
            for i in (0, len(arrays) - 1):
                _same(f"DCP tensor {i}", box["tensors"][f"t{i}"].numpy(), arrays[i])

    _serve_sweep(build, save, load, check, out, method)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["torch-save", "dcp"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--evict", default="fadvise")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    try:
        run(args.mode, args.dir, args.evict)
    except ImportError as e:
        _emit({"error": f"not installed ({e})"})


if __name__ == "__main__":
    main()
