"""Generate the golden checkpoints under tests/golden/v1/ .. v4/ (run by hand, results committed).

    python tests/golden/make_golden.py [--force]

The checkpoints pin formats v1 and v2 (the same state in each, written with the
``format_version`` knob) and v3 (the same values, two tensors saved as chunks), and v4 (v3's state with its rows in a rows
object, written by lowering the ``manifest_split_rows`` knob to 1): tests/test_golden.py loads them with the current code and compares
every byte against values it computes itself.  Contents are deterministic (integer
arithmetic only, no RNG); so is everything else in the files: the volatile manifest fields
(creation time, writer id, host, library versions) are pinned and the shards renamed to fixed
names after saving, so rerunning this script reproduces the committed bytes exactly.  Only
regenerate when deliberately changing the format, and then as a new directory (v3/), keeping the
old ones (they are what old checkpoints look like).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import crc32c
import ml_dtypes
import msgpack
import numpy as np

import ckptcore
from ckptcore import (AccumulationState, OptimizerState, ParamInfo, ScheduleState, TrainingState,
                      _knobs)
from ckptcore._manifest import MANIFEST_NAME

HERE = os.path.dirname(os.path.abspath(__file__))
# name -> shard size: one shard, and several shards with padding between tensors.
CHECKPOINTS = {"full": 1 << 20, "sharded": 256}
VERSIONS = (1, 2, 3, 4)
PINNED = {
    "created": 1700000000.0,
    "writer": {"id": "golden", "host": "golden", "pid": 0},
    "library": {"ckptcore": "0.1.0", "numpy": "golden", "python": "golden"},
}


def golden_state() -> TrainingState:
    """The state every golden checkpoint holds (values exact in every dtype used)."""
    ramp = (np.arange(12) % 7 - 3) / 4  # -0.75 .. 0.75 in quarters
    kernel_be = ramp.reshape(4, 3).astype(">f4")  # a big-endian source: stored little-endian
    emb = np.arange(8, dtype=np.int64).reshape(2, 4)[:, ::2] - 2**62  # non-contiguous source
    return TrainingState(
        model={
            "dense/kernel": kernel_be,
            "dense/bias": np.array([0.5, -1.0, 2.0], dtype=ml_dtypes.bfloat16),
            "bn/mean": np.array([1.5, -0.25, 3.0], dtype=np.float16),
            "embed/table": emb,
            "count": np.array(7, dtype=np.int32),
            "empty": np.zeros((0, 4), dtype=np.float32),
            "flags": np.array([True, False, True, True, False]),
            "fp8": np.array([0.5, -2.0, 448.0, 0.0], dtype=ml_dtypes.float8_e4m3fn),
            "cplx": np.array([1 + 2j, -0.5j], dtype=np.complex64),
            "names": np.array(["ab", "xyz"], dtype="<U3"),
            "when": np.array([0, 86400], dtype="datetime64[s]"),
        },
        optimizer=OptimizerState(
            "adam", step=7, hyperparams={"lr": 0.001, "betas": (0.9, 0.999), "amsgrad": False},
            slots={"dense/kernel": {"m": np.full((4, 3), 0.25, np.float32),
                                    "v": np.full((4, 3), 0.0625, np.float32)}},
            extra={"loss_scale": np.float32(1024.0)}),
        schedule=ScheduleState("cosine", config={"warmup": 10, "total": 100}, step=7, last_lr=0.0005,
                               state={"best": 0.5, "bad_epochs": 2}),
        rng={"python": (3, (1, 2, 3), None), "numpy": {"counter": np.array([1, 2], np.uint64)}},
        data={"epoch": 2, "position": 96, "seed": 1234},
        accumulation=AccumulationState(every=4, count=1,
                                       buffers={"dense/kernel": np.full((4, 3), -1.0, np.float32)}),
        step=7, epoch=2, framework="numpy",
        metadata={"note": "golden v1"},
        extra={"list": [1, "two", b"three", None, True, -2**63, 2**64 - 1, 1.5],
               "tuple": (1, (2.5, "x")), 7: "int key", "arr": np.arange(3, dtype=np.uint16)},
        params={"dense/kernel": ParamInfo(index=0, layer="dense", kind="dense", role="kernel", layout="io")},
    )


def golden_state_v3() -> TrainingState:
    """The golden state with two tensors saved as chunks (format 3): ``dense/kernel`` cut along
    its rows (1 + 3), its Adam slot ``m`` along its columns (2 + 1)."""
    state = golden_state()
    kernel, m = state.model["dense/kernel"], state.optimizer.slots["dense/kernel"]["m"]
    state.model["dense/kernel"] = ckptcore.Chunks([ckptcore.Shard(kernel[:1], (4, 3), (0, 0)),
                                                   ckptcore.Shard(kernel[1:], (4, 3), (1, 0))])
    state.optimizer.slots["dense/kernel"]["m"] = ckptcore.Chunks(
        [ckptcore.Shard(m[:, :2], (4, 3), (0, 0)), ckptcore.Shard(m[:, 2:], (4, 3), (0, 2))])
    return state


def _pin(path: str) -> None:
    """Rewrite the manifest with pinned volatile fields and fixed shard names.

    Works on the msgpack level (extension objects kept as they are), like a foreign reader would.
    """
    with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
        outer = msgpack.unpackb(f.read(), raw=False)
    body = msgpack.unpackb(outer["body"], raw=False, strict_map_key=False)
    body.update(PINNED)
    body.pop("stats", None)  # the save's own timings: volatile, and optional for readers
    # The golden files predate the optional lineage map (run id, host, git...: volatile): old
    # checkpoints have none, and readers must load them as they are.
    body.pop("lineage", None)
    for i, s in enumerate(body["shards"]):
        name = f"shard-{i:05d}-golden.bin"
        os.rename(os.path.join(path, s["path"]), os.path.join(path, name))
        s["path"] = name
    rows = body["tensors"].get("object") if isinstance(body["tensors"], dict) else None
    if rows is not None:  # format 4: the rows object, named by the save's token
        os.rename(os.path.join(path, rows["path"]), os.path.join(path, "shard-rows-golden.bin"))
        rows["path"] = "shard-rows-golden.bin"
    outer["body"] = msgpack.packb(body, use_bin_type=True)
    outer["body_crc32c"] = crc32c.crc32c(outer["body"])
    with open(os.path.join(path, MANIFEST_NAME), "wb") as f:
        f.write(msgpack.packb(outer, use_bin_type=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="replace existing golden checkpoints")
    ap.add_argument("--out", default=HERE, help="the golden root: writes <out>/v<version>/<name>")
    ap.add_argument("--version", type=int, choices=VERSIONS, action="append",
                    help="format version(s) to write (default: all)")
    args = ap.parse_args(argv)
    for version in args.version or VERSIONS:
        for name, shard_size in CHECKPOINTS.items():
            target = os.path.join(args.out, f"v{version}", name)
            if os.path.exists(target) and not args.force:
                print(f"{target} exists; pass --force to regenerate", file=sys.stderr)
                return 1
            with tempfile.TemporaryDirectory() as tmp:
                work = os.path.join(tmp, name)
                with _knobs.override(shard_size=shard_size, alignment=64,
                                     format_version=min(version, 3),
                                     manifest_split_rows=1 if version == 4 else 1 << 40):
                    ckptcore.save_state(work, golden_state_v3() if version >= 3 else golden_state())
                _pin(work)
                shutil.rmtree(target, ignore_errors=True)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copytree(work, target)
            print(f"wrote {target}: {sorted(os.listdir(target))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
