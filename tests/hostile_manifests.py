"""A corpus of crafted checkpoints whose manifests are checksum-valid but hostile or damaged.

Each case starts from a real checkpoint written by ``ckptcore.save_state`` (several shards, every
section of the state filled, a tuple in the RNG state, a numpy scalar), decodes its manifest body
*without* trusting it (extensions stay raw ``msgpack.ExtType``), changes one thing, and writes the
body back with a fresh CRC-32C: the envelope check passes, so only validation stands between the
crafted value and the reader.  ``BODY_CASES`` edit a version-1 manifest (one map per tensor),
``V2_CASES`` a version-2 one (the tensor table as packed columns).  A few cases change the files instead (links, FIFOs, devices,
directories, a sparse 3 GiB manifest).

``build(name, case_dir, outside_dir)`` writes case ``name`` as ``case_dir/ckpt``; link targets go
to ``outside_dir``, which a reader must never open.  ``CASES`` lists every name.  Used by
tests/test_hostile_manifests.py, in the test process and in a child process that measures memory.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

import crc32c
import msgpack
import numpy as np

import ckptcore
from ckptcore import _knobs
from ckptcore._manifest import MANIFEST_NAME

Ext = msgpack.ExtType
TUPLE, TENSOR, SCALAR = 2, 1, 3


def good_state(step: int = 7) -> ckptcore.TrainingState:
    rng = np.random.default_rng(step)
    return ckptcore.TrainingState(
        model={"dense/kernel": rng.standard_normal((4, 3)).astype(np.float32),
               "dense/bias": np.arange(3, dtype=np.float32),
               "emb": rng.integers(0, 9, (40, 8)).astype(np.int16)},
        optimizer=ckptcore.OptimizerState("adam", step=step, hyperparams={"lr": 0.01},
                                          slots={"dense/bias": {"m": np.ones(3, np.float32)}}),
        schedule=ckptcore.ScheduleState("cosine", config={"t": 10}, step=step, last_lr=0.5),
        rng={"python": (3, tuple(range(5)), None), "numpy": np.uint32(9)},
        data={"epoch": 1, "position": 5, "seed": 3},
        accumulation=ckptcore.AccumulationState(every=4, count=1,
                                                buffers={"dense/bias": np.zeros(3, np.float32)}),
        step=step, epoch=1, framework=None, metadata={"note": "x"},
        extra={"hist": [1, 2, 3]},
        params={"dense/bias": ckptcore.ParamInfo(index=0, layer="dense", kind="dense", role="bias")},
    )


def write_good(path: Path, step: int = 7, version: int = 1) -> None:
    """A good checkpoint of format ``version`` (1 for the cases that edit one map per tensor)."""
    with _knobs.override(shard_size=256, format_version=version):  # several shards
        ckptcore.save_state(str(path), good_state(step))


# ------------------------------------------------------------------------------ manifest editing
# ------------------------------------------------------------------------------------ format 4
# The v3 checkpoint above with its rows in a rows object (``manifest_split_rows`` lowered to 1):
# one group of 7 rows.  Cases edit the manifest's table map ``t`` and/or the rows object.
V4_INDEX = {"rows": "<u4", "offset": "<u8", "length": "<u8", "checksum": "<u4", "lo": "<f8",
            "hi": "<f8"}


def write_good_v4(path: Path, step: int = 7) -> None:
    with _knobs.override(manifest_split_rows=1):
        write_good_v3(path, step)


def _rows_file(d: Path, b: dict) -> Path:
    return d / b["tensors"]["object"]["path"]


def _ix(key: str, values: list) -> Callable[[Path, dict], None]:
    """Index column ``key`` becomes ``values``."""
    def edit(d: Path, b: dict) -> None:
        b["tensors"]["index"][key] = np.array(values, V4_INDEX[key]).tobytes()
    return edit


def _ix0(key: str, change: Callable[[int], Any]) -> Callable[[Path, dict], None]:
    def edit(d: Path, b: dict) -> None:
        arr = np.frombuffer(b["tensors"]["index"][key], V4_INDEX[key]).copy()
        arr[0] = change(arr[0].item())
        b["tensors"]["index"][key] = arr.tobytes()
    return edit


def _t4(key: str, value: Any) -> Callable[[Path, dict], None]:
    def edit(d: Path, b: dict) -> None:
        t = b["tensors"]
        t[key] = value(t[key]) if callable(value) else value
    return edit


def _obj(key: str, value: Any) -> Callable[[Path, dict], None]:
    def edit(d: Path, b: dict) -> None:
        o = b["tensors"]["object"]
        o[key] = value(o[key]) if callable(value) else value
    return edit


def _regroup(change: Callable[[dict], Any]) -> Callable[[Path, dict], None]:
    """The one group's columns edited by ``change``, the rows object rewritten and its size and
    checksums (whole and group) made to match: only the rules about rows can refuse it."""
    def edit(d: Path, b: dict) -> None:
        f = _rows_file(d, b)
        cols = msgpack.unpackb(f.read_bytes(), raw=False)
        new = change(cols)
        data = msgpack.packb(cols if new is None else new, use_bin_type=True)
        f.write_bytes(data)
        b["tensors"]["object"].update(size=len(data), checksum=crc32c.crc32c(data))
        _ix("length", [len(data)])(d, b)
        _ix("checksum", [crc32c.crc32c(data)])(d, b)
    return edit


def _g3(key: str, i: int, value: int) -> Callable[[dict], None]:
    def edit(cols: dict) -> None:
        arr = np.frombuffer(cols[key], V3_COLUMNS[key]).copy()
        arr[i] = value
        cols[key] = arr.tobytes()
    return edit


def _v4_file(change: Callable[[Path], None]) -> Callable[[Path, dict], None]:
    return lambda d, b: change(_rows_file(d, b))


V4_CASES: dict[str, Callable[[Path, dict], Any]] = {
    # the index
    "v4-index-range-outside": _ix0("length", lambda n: n + 100),
    "v4-index-offset-outside": _ix0("offset", lambda n: 2 ** 40),
    "v4-index-ranges-overlap": lambda d, b: (
        _ix("rows", [3, 4])(d, b), _ix("lo", [0, 0])(d, b), _ix("hi", [1, 1])(d, b),
        _ix("checksum", [0, 0])(d, b),
        _ix("offset", [0, 10])(d, b),
        _ix("length", [b["tensors"]["object"]["size"] - 10] * 2)(d, b)),
    "v4-index-gap": lambda d, b: (_ix0("offset", lambda n: 5)(d, b)),
    "v4-index-columns-differ": _ix("lo", [0.0, 0.0]),
    "v4-index-huge": lambda d, b: [_ix(k, [0] * 1_000_000)(d, b) for k in V4_INDEX],
    "v4-index-missing": _t4("index", None),
    "v4-index-str-column": lambda d, b: b["tensors"]["index"].update(rows="7"),
    "v4-group-crc-wrong": _ix0("checksum", lambda c: c ^ 1),
    "v4-group-rows-wrong": lambda d, b: (_ix0("rows", lambda n: n - 1)(d, b),
                                         _t4("rows", lambda n: n - 1)(d, b)),
    # the rows object
    "v4-object-crc-wrong": _obj("checksum", lambda c: c ^ 1),
    "v4-object-size-huge": _obj("size", 2 ** 60),
    "v4-object-path-unsafe": _obj("path", "../outside.bin"),
    "v4-object-path-is-a-shard": lambda d, b: _obj("path", b["shards"][0]["path"])(d, b),
    "v4-object-missing": _v4_file(lambda f: f.unlink()),
    "v4-object-truncated": _v4_file(lambda f: f.write_bytes(f.read_bytes()[:-5])),
    "v4-object-longer": _v4_file(lambda f: f.write_bytes(f.read_bytes() + b"x")),
    "v4-object-flipped": _v4_file(lambda f: f.write_bytes(bytes([f.read_bytes()[0] ^ 1])
                                                          + f.read_bytes()[1:])),
    "v4-rows-count-huge": _t4("rows", 2 ** 40),
    "v4-rows-count-negative": _t4("rows", -1),
    # names interned per logical tensor
    "v4-name-index-out-of-range": _t4("names", lambda x: x[:-1]),
    "v4-names-extra": _t4("names", lambda x: x + ["model/ghost"]),
    "v4-names-duplicate": _t4("names", lambda x: [x[1]] + x[1:]),
    "v4-names-not-strings": _t4("names", lambda x: [1] + x[1:]),
    # rows that pass every checksum but break the rules of format 3
    "v4-group-not-a-map": _regroup(lambda c: [1, 2, 3]),
    "v4-group-column-missing": _regroup(lambda c: c.pop("start") and None),
    "v4-group-tensor-out": _regroup(_g3("tensor", 0, 10 ** 6)),
    "v4-group-chunks-overlap": _regroup(lambda c: c.update(start=(lambda a: (
        a.__setitem__(5, 10), a.tobytes())[1])(np.frombuffer(c["start"], "<u8").copy()))),
    "v4-group-length-past-shard": _regroup(_g3("offset", 2, 2 ** 40)),
    "v4-group-dtype-out": _regroup(_g3("dtype", 0, 99)),
}


def read_body(ckpt: Path) -> dict:
    outer = msgpack.unpackb((ckpt / MANIFEST_NAME).read_bytes(), raw=False)
    return msgpack.unpackb(outer["body"], raw=False, strict_map_key=False)


def write_manifest(ckpt: Path, body: Any, *, version: Any = 1, fmt: Any = "ckptcore",
                   raw_body: bytes | None = None, outer: Any = None) -> None:
    data = raw_body if raw_body is not None else _pack_body(body)
    if outer is not None:
        (ckpt / MANIFEST_NAME).write_bytes(outer if isinstance(outer, bytes)
                                           else msgpack.packb(outer, use_bin_type=True))
        return
    # The envelope is written piece by piece (the same msgpack a single packb would give, with a
    # bin32 header), so a 100 MB body is never copied into a second 100 MB envelope: the corpus
    # runs in the process whose peak memory the tests measure.
    with open(ckpt / MANIFEST_NAME, "wb") as f:
        f.write(b"\x84" + msgpack.packb("format") + msgpack.packb(fmt, use_bin_type=True)
                + msgpack.packb("version") + msgpack.packb(version, use_bin_type=True)
                + msgpack.packb("body") + b"\xc6" + len(data).to_bytes(4, "big"))
        f.write(data)
        f.write(msgpack.packb("body_crc32c") + msgpack.packb(crc32c.crc32c(data)))


class Raw:
    """Already-packed msgpack bytes to splice into a body where this object stands (the large
    cases build their tables as bytes: a million Python objects would dwarf what is measured)."""

    def __init__(self, *parts: bytes) -> None:
        self.parts = parts
        self.marker = Ext(99, os.urandom(16))  # packs as 18 unique bytes


def _pack_body(body: Any) -> bytes:
    raws: list[Raw] = []

    def default(obj: Any) -> Any:
        if isinstance(obj, Raw):
            raws.append(obj)
            return obj.marker
        raise TypeError(type(obj).__name__)

    data = msgpack.packb(body, use_bin_type=True, default=default)
    pieces, pos = [], 0
    for raw in raws:  # one join: the result is the only large allocation
        marker = msgpack.packb(raw.marker)
        at = data.index(marker, pos)
        pieces += [data[pos:at], *raw.parts]
        pos = at + len(marker)
    return b"".join(pieces + [data[pos:]]) if raws else data


def nested_tuples(depth: int, leaf: Any = 1) -> Any:
    v = leaf
    for _ in range(depth):
        v = Ext(TUPLE, msgpack.packb([v], use_bin_type=True))
    return v


def nested_lists(depth: int) -> Any:
    v: Any = 1
    for _ in range(depth):
        v = [v]
    return v


def nested_maps(depth: int) -> Any:
    v: Any = 1
    for _ in range(depth):
        v = {"k": v}
    return v


def ref(i: Any, code: int = TENSOR) -> Ext:
    return Ext(code, msgpack.packb(i))


# Cases that edit the body: name -> function(body) (mutates in place, or returns a replacement).
def _t(i: int, **fields: Any) -> Callable[[dict], None]:
    def edit(b: dict) -> None:
        b["tensors"][i].update(fields)
    return edit


def _s(i: int, **fields: Any) -> Callable[[dict], None]:
    def edit(b: dict) -> None:
        b["shards"][i].update(fields)
    return edit


def _tree(path: tuple, value: Any) -> Callable[[dict], None]:
    def edit(b: dict) -> None:
        node = b["tree"]
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value
    return edit


def _set(key: str, value: Any) -> Callable[[dict], None]:
    def edit(b: dict) -> None:
        b[key] = value
    return edit


def _drop(key: str) -> Callable[[dict], None]:
    def edit(b: dict) -> None:
        b.pop(key, None)
    return edit


def _overlap(b: dict) -> None:  # tensor 1 starts inside tensor 0 (same shard)
    t0, t1 = b["tensors"][0], b["tensors"][1]
    t1.update(shard=t0["shard"], offset=t0["offset"] + 4, dtype=t0["dtype"], shape=[1],
              length=np.dtype(t0["dtype"]).itemsize)


def _dup_tensor_name(b: dict) -> None:
    b["tensors"][1]["name"] = b["tensors"][0]["name"]


def _dup_shard(b: dict) -> None:
    b["shards"].append(dict(b["shards"][0]))


def _dup_ref(b: dict) -> None:
    b["tree"]["model"]["dense/bias"] = b["tree"]["model"]["dense/kernel"]


def _many_tensors(b: dict) -> None:  # a large table whose entries all point past the shard
    t = dict(b["tensors"][0])
    b["tensors"] = Raw(b"\xdd" + (100_000).to_bytes(4, "big") + b"".join(
        msgpack.packb(dict(t, name=f"t{i}", offset=10 ** 9 + i * 64)) for i in range(100_000)))


def _huge_map_tree(b: dict) -> None:
    b["tree"]["model"] = Raw(b"\xdf" + (100_000).to_bytes(4, "big") + b"".join(
        msgpack.packb(f"p{i}") + msgpack.packb(ref(10 ** 6 + i)) for i in range(100_000)))


def _huge_str() -> tuple[bytes, bytes]:  # a packed 48 MiB string: header, then the characters
    return b"\xdb" + (48 << 20).to_bytes(4, "big"), b"x" * (48 << 20)


def _huge_string(key: str) -> Callable[[dict], None]:
    return lambda b: b["tensors"][0].update({key: Raw(*_huge_str())})


def _huge_names(b: dict) -> None:  # one 48 MiB string, packed twice
    name = _huge_str()
    b["tensors"][0]["name"], b["tensors"][1]["name"] = Raw(*name), Raw(*name)


def _huge_key_map(b: dict) -> None:  # 13 MB of map keys where a list belongs
    table = bytearray(b"\xdf" + (1_000_000).to_bytes(4, "big"))
    for i in range(1_000_000):
        table += msgpack.packb(f"{i:08d}") + msgpack.packb(i)
    b["shards"] = Raw(bytes(table))


BODY_CASES: dict[str, Callable[[dict], Any]] = {
    # shape bombs
    "shape-dim-2^64-1-empty": _t(0, shape=[0, 2 ** 64 - 1], length=0),
    "shape-65-dims": _t(0, shape=[1] * 65, length=4),
    "shape-v0-2^40x2^40": _t(0, dtype="V0", shape=[2 ** 40, 2 ** 40], length=0),
    "shape-u0-2^62x4": _t(0, dtype="U0", shape=[2 ** 62, 4, 3], length=0),
    "shape-negative-dim": _t(0, shape=[-4, -3], length=48),
    "shape-bool-dims": _t(0, shape=[True, 3], length=12),
    "shape-float-dims": _t(0, shape=[4.0, 3.0], length=48),
    "shape-not-list": _t(0, shape="4x3"),
    "shape-map": _t(0, shape={"a": 1}),
    "shape-length-mismatch": _t(0, shape=[4, 4]),
    "shape-nested-list": _t(0, shape=[[4], [3]]),
    "shape-product-overflow-f4": _t(0, shape=[0, 2 ** 62, 4], length=0),
    # byte ranges
    "range-past-shard-end": _t(0, offset=10 ** 6),
    "range-offset-2^64": _t(0, offset=2 ** 64 - 1),
    "range-length-huge": _t(0, length=2 ** 63),
    "range-negative-offset": _t(0, offset=-8),
    "range-float-offset": _t(0, offset=0.0),
    "range-bool-offset": _t(0, offset=False),
    "range-overlap": _overlap,
    "range-shard-index-out": _t(0, shard=99),
    "range-shard-index-negative": _t(0, shard=-1),
    "range-shard-index-inf": _t(0, shard=float("inf")),
    "shard-size-2^64": _s(0, size=2 ** 64 - 1),
    "shard-size-negative": _s(0, size=-1),
    "shard-size-nan": _s(0, size=float("nan")),
    "shard-size-smaller": _s(0, size=1),
    "shard-checksum-2^40": _s(0, checksum=2 ** 40),
    "shard-checksum-negative": _s(0, checksum=-5),
    "tensor-checksum-float": _t(0, checksum=1.5),
    "tensor-checksum-2^33": _t(0, checksum=2 ** 33),
    # names
    "shard-path-dotdot": _s(0, path="../outside.bin"),
    "shard-path-absolute": _s(0, path="/etc/passwd"),
    "shard-path-slash": _s(0, path="a/b.bin"),
    "shard-path-empty": _s(0, path=""),
    "shard-path-newline": _s(0, path="shard.bin\n"),
    "shard-path-dot": _s(0, path="."),
    "shard-path-hidden": _s(0, path=".shard.bin"),
    "shard-path-manifest": _s(0, path=MANIFEST_NAME),
    "shard-path-too-long": _s(0, path="a" * 5000),
    "shard-path-nul": _s(0, path="shard\x00.bin"),
    "shard-path-unicode-sep": _s(0, path="shard\u2215x.bin"),
    "shard-path-int": _s(0, path=7),
    # a large group's shard folders ("3f/shard-..."): only one folder of two lower-case hex digits
    "shard-path-folder-dotdot": _s(0, path="3f/../../outside.bin"),
    "shard-path-folder-deeper": _s(0, path="3f/00/shard.bin"),
    "shard-path-folder-not-hex": _s(0, path="zz/shard.bin"),
    "shard-path-folder-upper": _s(0, path="3F/shard.bin"),
    "shard-path-folder-one-digit": _s(0, path="3/shard.bin"),
    "shard-path-folder-absolute": _s(0, path="/3f/shard.bin"),
    "shard-path-folder-empty-name": _s(0, path="3f/"),
    "shard-path-folder-double-slash": _s(0, path="3f//shard.bin"),
    "shard-path-folder-hidden": _s(0, path="3f/.shard.bin"),
    "shard-path-folder-manifest": _s(0, path="3f/" + MANIFEST_NAME),
    "shard-path-folder-backslash": _s(0, path="3f\\shard.bin"),
    # a deduplicated replica's chunk names (cas:<64 hex>), crafted
    "shard-path-cas-dotdot": _s(0, path="cas:../../../etc/passwd"),
    "shard-path-cas-short": _s(0, path="cas:" + "ab" * 31),
    "shard-path-cas-upper": _s(0, path="cas:" + "AB" * 32),
    "shard-path-cas-slash": _s(0, path="cas:" + "ab" * 31 + "/x"),
    "shard-path-cas-newline": _s(0, path="cas:" + "ab" * 32 + "\n"),
    "shard-path-cas-missing": _s(0, path="cas:" + "ab" * 32),
    "shard-path-dup": _dup_shard,
    "tensor-name-dup": _dup_tensor_name,
    "tensor-name-int": _t(0, name=5),
    "tensor-name-missing": lambda b: b["tensors"][0].pop("name"),
    # dtypes
    "dtype-object": _t(0, dtype="O"),
    "dtype-object-word": _t(0, dtype="object"),
    "dtype-byteorder": _t(0, dtype="<f4"),
    "dtype-trailing-newline": _t(0, dtype="float32\n"),
    "dtype-sized-newline": _t(0, dtype="V4\n"),
    "dtype-structured": _t(0, dtype="[('a','<f4')]"),
    "dtype-int": _t(0, dtype=4),
    "dtype-unknown": _t(0, dtype="float7"),
    "dtype-huge-unicode": _t(0, dtype="U999999999", shape=[1], length=4 * 999999999),
    "dtype-time-huge-multiplier": _t(0, dtype="datetime64[99999999999999999999999ns]",
                                     shape=[4, 3], length=96),
    "dtype-S-negative": _t(0, dtype="S-1"),
    "dtype-none": _t(0, dtype=None),
    # versions and envelope fields
    "body-not-map": lambda b: [1, 2, 3],
    "body-checksum-sha256": _set("checksum", "sha256"),
    "body-checksum-missing": _drop("checksum"),
    "body-created-inf": _set("created", float("inf")),
    "body-created-nan": _set("created", float("nan")),
    "body-created-str": _set("created", "yesterday"),
    "body-alignment-negative": _set("alignment", -64),
    "body-writer-list": _set("writer", [1]),
    "body-shards-missing": _drop("shards"),
    "body-tensors-map": _set("tensors", {"a": 1}),
    "body-tree-missing": _drop("tree"),
    "body-tree-list": _set("tree", [1, 2]),
    # numbers in the state tree
    "tree-step-inf": _tree(("step",), float("inf")),
    "tree-step-neg-inf": _tree(("step",), float("-inf")),
    "tree-step-nan": _tree(("step",), float("nan")),
    "tree-step-2^70-float": _tree(("step",), 2.0 ** 70),
    "tree-step-str": _tree(("step",), "7"),
    "tree-step-fraction": _tree(("step",), 7.5),
    "tree-epoch-1e300": _tree(("epoch",), 1e300),
    "tree-opt-step-inf": _tree(("optimizer", "step"), float("inf")),
    "tree-opt-step-2^65": _tree(("optimizer", "step"), float(2 ** 65)),
    "tree-opt-kind-int": _tree(("optimizer", "kind"), 3),
    "tree-opt-slots-list": _tree(("optimizer", "slots"), [1, 2]),
    "tree-opt-slot-not-tensor": _tree(("optimizer", "slots", "dense/bias"), {"m": 3}),
    "tree-sched-step-nan": _tree(("schedule", "step"), float("nan")),
    "tree-sched-last-lr-str": _tree(("schedule", "last_lr"), "fast"),
    "tree-accum-every-inf": _tree(("accumulation", "every"), float("-inf")),
    "tree-accum-buffers-str": _tree(("accumulation", "buffers"), "x"),
    "tree-params-index-inf": _tree(("params", "dense/bias", "index"), float("inf")),
    "tree-params-index-neg-inf": _tree(("params", "dense/bias", "index"), float("-inf")),
    "tree-params-layer-missing": lambda b: b["tree"]["params"]["dense/bias"].pop("layer"),
    "tree-params-entry-list": _tree(("params", "dense/bias"), [1]),
    "tree-framework-int": _tree(("framework",), 5),
    "tree-metadata-list": _tree(("metadata",), ["a"]),
    "tree-data-str": _tree(("data",), "cursor"),
    "tree-rng-int": _tree(("rng",), 4),
    "tree-model-not-tensor": _tree(("model", "dense/bias"), [1.0, 2.0]),
    "tree-model-list": _tree(("model",), [1]),
    "tree-optimizer-list": _tree(("optimizer",), [1]),
    # references
    "ref-out-of-range": _tree(("model", "dense/bias"), ref(10 ** 6)),
    "ref-negative": _tree(("model", "dense/bias"), ref(-1)),
    "ref-payload-str": _tree(("model", "dense/bias"), ref("0")),
    "ref-payload-junk": _tree(("model", "dense/bias"), Ext(TENSOR, b"\xc1\xc1")),
    "ref-payload-bool": _tree(("model", "dense/bias"), ref(True)),
    "ref-twice": _dup_ref,
    "ref-scalar-to-matrix": _tree(("rng", "numpy"), ref(0, SCALAR)),
    "ext-unknown-code": _tree(("extra", "x"), Ext(7, b"\x01")),
    "ext-tuple-not-array": _tree(("extra", "x"), Ext(TUPLE, msgpack.packb({"a": 1}))),
    "ext-tuple-junk": _tree(("extra", "x"), Ext(TUPLE, b"\xc1")),
    # nesting
    "nest-tuples-200": _tree(("extra", "x"), nested_tuples(200)),
    "nest-tuples-5000": _tree(("extra", "x"), nested_tuples(5000)),
    "nest-tuples-65": _tree(("extra", "x"), nested_tuples(65)),
    "nest-lists-70": _tree(("extra", "x"), nested_lists(70)),
    "nest-lists-500": _tree(("extra", "x"), nested_lists(500)),  # msgpack packs <= 511
    "nest-maps-100": _tree(("metadata", "x"), nested_maps(100)),
    "nest-mixed-tuple-in-list": _tree(("rng", "x"), [nested_tuples(40, nested_lists(40))]),
    "nest-in-tensor-table": _t(0, shape=nested_lists(500)),
    # map keys
    "key-bin": _tree(("metadata",), {b"k": 1}),
    "key-float": _tree(("metadata",), {1.5: 1}),
    "key-nil": _tree(("metadata",), {None: 1}),
    "key-ext": _tree(("metadata",), {ref(0): 1}),
    # huge strings and maps (each also wrong somewhere)
    "huge-tensor-name-48MiB": _huge_names,
    "huge-dtype-48MiB": _huge_string("dtype"),
    "huge-tensor-table-100k": _many_tensors,
    "huge-model-map-100k": _huge_map_tree,
    "huge-shard-map-1M": _huge_key_map,
}

# Cases that write the manifest's envelope (or bytes) themselves: name -> function(ckpt dir, body).
ENVELOPE_CASES: dict[str, Callable[[Path, dict], None]] = {
    "version-5": lambda d, b: write_manifest(d, b, version=5),
    "version-3-with-v1-table": lambda d, b: write_manifest(d, b, version=3),
    "version-2-with-v1-table": lambda d, b: write_manifest(d, b, version=2),
    "version-str": lambda d, b: write_manifest(d, b, version="1"),
    "version-missing": lambda d, b: write_manifest(d, b, version=None),
    "version-huge": lambda d, b: write_manifest(d, b, version=2 ** 64 - 1),
    "version-true": lambda d, b: write_manifest(d, b, version=True),  # == 1 in Python
    "version-float": lambda d, b: write_manifest(d, b, version=1.0),
    "format-other": lambda d, b: write_manifest(d, b, fmt="safetensors"),
    "envelope-list": lambda d, b: write_manifest(d, b, outer=[1, 2]),
    "envelope-body-str": lambda d, b: write_manifest(d, b, outer={
        "format": "ckptcore", "version": 1, "body": "text", "body_crc32c": 0}),
    "envelope-crc-missing": lambda d, b: write_manifest(d, b, outer={
        "format": "ckptcore", "version": 1, "body": msgpack.packb(b, use_bin_type=True)}),
    "envelope-trailing-bytes": lambda d, b: (write_manifest(d, b), _append(d / MANIFEST_NAME, b"\x00")),
    "envelope-empty-file": lambda d, b: (d / MANIFEST_NAME).write_bytes(b""),
    "envelope-junk": lambda d, b: (d / MANIFEST_NAME).write_bytes(os.urandom(4096)),
    "envelope-nul-bytes": lambda d, b: (d / MANIFEST_NAME).write_bytes(bytes(1000)),
    "envelope-nested-arrays": lambda d, b: (d / MANIFEST_NAME).write_bytes(b"\x91" * 100_000 + b"\xc0"),
    "body-junk-msgpack": lambda d, b: write_manifest(d, b, raw_body=b"\xc1" * 64),
    "body-truncated": lambda d, b: write_manifest(d, b, raw_body=msgpack.packb(b, use_bin_type=True)[:-9]),
    "body-trailing-data": lambda d, b: write_manifest(d, b, raw_body=msgpack.packb(b, use_bin_type=True) + b"\x01"),
    "body-1400B-200-nested-tuples": lambda d, b: write_manifest(d, None, raw_body=msgpack.packb(
        {"checksum": "crc32c", "shards": [], "tensors": [], "tree": {"x": nested_tuples(200)}},
        use_bin_type=True)),
    "body-nested-lists-100k": lambda d, b: write_manifest(d, None, raw_body=b"\x81\xa4tree" + b"\x91" * 100_000 + b"\xc0"),
}


# Version 2: the tensor table as columns (docs/FORMAT.md, section 5).  Tensors 0 and 1
# (dense/kernel, 4x3 float32 at offset 0; dense/bias, 3 float32 at 64) share shard 0, which ends
# at byte 76.
V2_COLUMNS = {"dtype": "<u4", "ndim": "u1", "shape": "<u8", "shard": "<u4", "offset": "<u8",
              "length": "<u8", "checksum": "<u4"}


def _col(key: str, i: int, value: int) -> Callable[[dict], None]:
    """Set element ``i`` of integer column ``key``."""
    def edit(b: dict) -> None:
        arr = np.frombuffer(b["tensors"][key], V2_COLUMNS[key]).copy()
        arr[i] = value
        b["tensors"][key] = arr.tobytes()
    return edit


def _bytes(key: str, change: Callable[[bytes], Any]) -> Callable[[dict], None]:
    """Replace column ``key`` (raw bytes) by ``change(bytes)``, whatever it returns."""
    def edit(b: dict) -> None:
        b["tensors"][key] = change(b["tensors"][key])
    return edit


def _table(key: str, value: Any) -> Callable[[dict], None]:
    def edit(b: dict) -> None:
        if value is ...:
            del b["tensors"][key]
        else:
            b["tensors"][key] = value(b["tensors"][key]) if callable(value) else value
    return edit


def _dims0(*dims: int) -> Callable[[dict], None]:
    """Tensor 0 (two dimensions) gets ``dims`` instead."""
    def edit(b: dict) -> None:
        arr = np.frombuffer(b["tensors"]["shape"], "<u8").copy()
        arr[:2] = dims
        b["tensors"]["shape"] = arr.tobytes()
    return edit


def _v2_scalar_ref_to_vector(b: dict) -> None:
    """The SCALAR reference (rng/numpy, a 0-d uint32) stays; its tensor becomes shape [1] (same
    length), so the only fault is a scalar reference to a tensor that is not 0-d."""
    j = msgpack.unpackb(b["tree"]["rng"]["numpy"].data)
    t = b["tensors"]
    ndim = np.frombuffer(t["ndim"], "u1").copy()
    dims = np.frombuffer(t["shape"], "<u8")
    at = int(ndim[:j].sum())
    ndim[j] = 1
    t["ndim"], t["shape"] = ndim.tobytes(), np.insert(dims, at, 1).astype("<u8").tobytes()


def _v2_many_tensors(b: dict) -> None:  # 100,000 entries, each past the end of shard 0
    n, t = 100_000, b["tensors"]
    t["names"] = [f"t{i}" for i in range(n)]
    t["dtypes"] = ["float32"]
    t["dtype"], t["ndim"] = bytes(4 * n), bytes([1]) * n
    t["shape"] = np.full(n, 1, "<u8").tobytes()
    t["shard"], t["checksum"] = bytes(4 * n), bytes(4 * n)
    t["offset"] = (10 ** 9 + 64 * np.arange(n, dtype="<u8")).tobytes()
    t["length"] = np.full(n, 4, "<u8").tobytes()


def _v2_ndim_bomb(b: dict) -> None:  # ndim claims 64 x 10^6 dimensions; the shape column is tiny
    n, t = 1_000_000, b["tensors"]
    t["names"] = Raw(b"\xdd" + n.to_bytes(4, "big") + b"".join(
        msgpack.packb(f"t{i}") for i in range(n)))
    t["dtype"], t["shard"], t["checksum"] = bytes(4 * n), bytes(4 * n), bytes(4 * n)
    t["ndim"], t["offset"], t["length"] = bytes([64]) * n, bytes(8 * n), bytes(8 * n)


V2_CASES: dict[str, Callable[[dict], Any]] = {
    # the table's form
    "v2-table-list": _set("tensors", [1, 2]),
    "v2-table-str": _set("tensors", "columns"),
    "v2-names-missing": _table("names", ...),
    "v2-dtypes-missing": _table("dtypes", ...),
    "v2-column-missing-length": _table("length", ...),
    "v2-column-missing-shape": _table("shape", ...),
    "v2-names-map": _table("names", {"a": 1}),
    "v2-names-short": _table("names", lambda x: x[:-1]),
    "v2-names-long": _table("names", lambda x: x + ["extra"]),
    "v2-name-int": _table("names", lambda x: [5] + x[1:]),
    "v2-name-none": _table("names", lambda x: [None] + x[1:]),
    "v2-name-dup": _table("names", lambda x: [x[1]] + x[1:]),
    "v2-column-str": _table("offset", "0,64,128"),
    "v2-column-list": _table("shape", [4, 3]),
    "v2-column-int": _table("checksum", 7),
    "v2-column-nil": _table("dtype", None),
    "v2-column-ext": _table("shard", Ext(1, b"\x00")),
    "v2-column-short-dtype": _bytes("dtype", lambda x: x[:-4]),
    "v2-column-short-shard": _bytes("shard", lambda x: x[:-4]),
    "v2-column-short-offset": _bytes("offset", lambda x: x[:-8]),
    "v2-column-short-length": _bytes("length", lambda x: x[:-8]),
    "v2-column-short-checksum": _bytes("checksum", lambda x: x[:-4]),
    "v2-column-short-ndim": _bytes("ndim", lambda x: x[:-1]),
    "v2-column-long-offset": _bytes("offset", lambda x: x + bytes(8)),
    "v2-column-odd-offset": _bytes("offset", lambda x: x + b"\x01"),
    "v2-column-odd-shape": _bytes("shape", lambda x: x[:-3]),
    "v2-column-odd-checksum": _bytes("checksum", lambda x: x[:-1]),
    "v2-column-truncated-shape": _bytes("shape", lambda x: x[:-8]),
    "v2-column-extra-shape": _bytes("shape", lambda x: x + bytes(8)),
    "v2-columns-empty": lambda b: b["tensors"].update(
        {k: b"" for k in V2_COLUMNS}),
    # dtypes
    "v2-dtype-index-out": _col("dtype", 0, 99),
    "v2-dtype-index-2^32-1": _col("dtype", 0, 2 ** 32 - 1),
    "v2-dtypes-empty": _table("dtypes", []),
    "v2-dtypes-object": _table("dtypes", lambda x: ["O"] + x[1:]),
    "v2-dtypes-int": _table("dtypes", lambda x: [4] + x[1:]),
    "v2-dtypes-byteorder": _table("dtypes", lambda x: ["<f4"] + x[1:]),
    "v2-dtypes-huge-unicode": _table("dtypes", lambda x: ["U999999999"] + x[1:]),
    "v2-dtypes-huge-48MiB": _table("dtypes", lambda x: [Raw(*_huge_str())] + x[1:]),
    # shapes and lengths
    "v2-ndim-65": _col("ndim", 0, 65),
    "v2-ndim-255": _col("ndim", 0, 255),
    "v2-ndim-bomb-1M": _v2_ndim_bomb,
    "v2-shape-dim-2^64-1": _dims0(2 ** 64 - 1, 1),
    "v2-shape-2^40x2^40": _dims0(2 ** 40, 2 ** 40),
    "v2-shape-2^32x2^32-wraps-to-0": _dims0(2 ** 32, 2 ** 32),
    "v2-shape-empty-2^64-1": lambda b: (_dims0(0, 2 ** 64 - 1)(b), _col("length", 0, 0)(b)),
    "v2-shape-2^61x4-f4": lambda b: (_dims0(2 ** 61, 4)(b), _col("length", 0, 0)(b)),
    "v2-shape-length-mismatch": _dims0(4, 4),
    "v2-length-plus-4": _col("length", 0, 52),
    "v2-length-2^64-1": _col("length", 0, 2 ** 64 - 1),
    "v2-length-2^63": _col("length", 0, 2 ** 63),
    # byte ranges
    "v2-offset-past-end": _col("offset", 0, 10 ** 6),
    "v2-offset-2^64-1": _col("offset", 0, 2 ** 64 - 1),
    "v2-offset-wraps": _col("offset", 0, 2 ** 64 - 8),
    "v2-shard-index-out": _col("shard", 0, 99),
    "v2-shard-index-2^32-1": _col("shard", 0, 2 ** 32 - 1),
    "v2-overlap": _col("offset", 0, 20),  # kernel [20, 68) overlaps bias [64, 76)
    "v2-shard-size-smaller": _s(0, size=70),
    "v2-shard-size-larger": _s(0, size=77),
    # references against the table
    "v2-ref-out-of-range": _tree(("model", "dense/bias"), ref(10 ** 6)),
    "v2-ref-twice": _dup_ref,
    "v2-ref-scalar-to-vector": _v2_scalar_ref_to_vector,
    # large
    "v2-huge-table-100k": _v2_many_tensors,
}


# Version 3: chunked tensors.  The good checkpoint (write_good_v3) holds good_state with "emb"
# (40x8 int16) saved as two chunks, rows [0, 20) and [20, 40): rows 2 and 3 of the table, logical
# tensor 2.  Every other tensor is one whole chunk.
V3_COLUMNS = {**V2_COLUMNS, "tensor": "<u4", "gshape": "<u8", "start": "<u8", "block_crc": "<u4"}
_EMB = 2  # the first row of "emb"; its dimensions start at position 3 of the dims columns


def write_good_v3(path: Path, step: int = 7) -> None:
    state = good_state(step)
    emb = state.model["emb"]
    state.model["emb"] = ckptcore.Chunks([ckptcore.Shard(emb[:20], emb.shape, (0, 0)),
                                          ckptcore.Shard(emb[20:], emb.shape, (20, 0))])
    with _knobs.override(shard_size=256):
        ckptcore.save_state(str(path), state)


def _c3(key: str, i: int, value: int) -> Callable[[dict], None]:
    """Set element ``i`` of integer column ``key`` of a version-3 table."""
    def edit(b: dict) -> None:
        arr = np.frombuffer(b["tensors"][key], V3_COLUMNS[key]).copy()
        arr[i] = value
        b["tensors"][key] = arr.tobytes()
    return edit


def _emb_dims(key: str, row: int, dims: tuple[int, int]) -> Callable[[dict], None]:
    """Row ``row`` (2 or 3, the chunks of "emb") gets ``dims`` in column ``key`` (shape, gshape
    or start): rows 0 and 1 have 2 and 1 dimensions, so row 2's start at 3, row 3's at 5."""
    at = {2: 3, 3: 5}[row]

    def edit(b: dict) -> None:
        arr = np.frombuffer(b["tensors"][key], "<u8").copy()
        arr[at:at + 2] = dims
        b["tensors"][key] = arr.tobytes()
    return edit


def _both(*edits: Callable[[dict], None]) -> Callable[[dict], None]:
    def edit(b: dict) -> None:
        for e in edits:
            e(b)
    return edit


V3_CASES: dict[str, Callable[[dict], Any]] = {
    # the form of the new columns
    "v3-column-missing-tensor": _table("tensor", ...),
    "v3-column-missing-gshape": _table("gshape", ...),
    "v3-column-missing-start": _table("start", ...),
    "v3-column-missing-block-crc": _table("block_crc", ...),
    "v3-crc-block-missing": _table("crc_block", ...),
    "v3-crc-block-0": _table("crc_block", 0),
    "v3-crc-block-1": _table("crc_block", 1),
    "v3-crc-block-str": _table("crc_block", "1M"),
    "v3-column-str-tensor": _table("tensor", "0,1,2"),
    "v3-column-short-tensor": _bytes("tensor", lambda x: x[:-4]),
    "v3-column-odd-gshape": _bytes("gshape", lambda x: x[:-3]),
    "v3-column-short-gshape": _bytes("gshape", lambda x: x[:-8]),
    "v3-column-long-start": _bytes("start", lambda x: x + bytes(8)),
    "v3-block-crc-unneeded": lambda b: (_table("crc_block", 4096)(b),
                                        _table("block_crc", bytes(4))(b)),
    # logical tensors
    "v3-tensor-index-out": _c3("tensor", 0, 10 ** 6),
    "v3-tensor-index-2^32-1": _c3("tensor", 0, 2 ** 32 - 1),
    "v3-tensor-without-chunks": _c3("tensor", 1, 0),  # tensor 1 loses its only row
    "v3-chunk-name-differs": _table("names", lambda x: x[:3] + ["model/other"] + x[4:]),
    "v3-two-tensors-one-name": _table("names", lambda x: [x[1]] + x[1:]),
    "v3-chunk-dtype-differs": lambda b: (  # float16: the same length, another dtype
        _c3("dtype", 3, len(b["tensors"]["dtypes"]))(b),
        _table("dtypes", lambda x: x + ["float16"])(b)),
    "v3-chunk-ndim-differs": _both(_c3("ndim", 3, 1), _bytes("shape", lambda x: x[:-8]),
                                   _bytes("gshape", lambda x: x[:-8]),
                                   _bytes("start", lambda x: x[:-8])),
    # global shapes and chunk places
    "v3-gshape-inconsistent": _emb_dims("gshape", 3, (41, 8)),
    "v3-gshape-smaller-than-chunk": _both(_emb_dims("gshape", 2, (10, 8)),
                                          _emb_dims("gshape", 3, (10, 8))),
    "v3-gshape-2^40x2^40": _both(_emb_dims("gshape", 2, (2 ** 40, 2 ** 40)),
                                 _emb_dims("gshape", 3, (2 ** 40, 2 ** 40))),
    "v3-gshape-2^64-1": _both(_emb_dims("gshape", 2, (2 ** 64 - 1, 8)),
                              _emb_dims("gshape", 3, (2 ** 64 - 1, 8))),
    "v3-chunks-overlap": _emb_dims("start", 3, (10, 0)),
    "v3-chunks-same-place": _emb_dims("start", 3, (0, 0)),
    "v3-chunk-outside": _emb_dims("start", 3, (30, 0)),
    "v3-chunk-outside-dim1": _emb_dims("start", 3, (20, 1)),
    "v3-start-2^64-1": _emb_dims("start", 3, (2 ** 64 - 1, 0)),
    "v3-start-wraps": _emb_dims("start", 3, (2 ** 64 - 10, 0)),
    "v3-chunk-length-mismatch": _c3("length", _EMB, 322),
    "v3-chunk-shape-vs-length": _emb_dims("shape", 2, (21, 8)),
    "v3-ref-out-of-range": _tree(("model", "dense/bias"), ref(6)),  # 7 rows, 6 tensors
}


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def _first_shard(d: Path) -> Path:
    return d / read_body(d)["shards"][0]["path"]


def _link_shard_to_copy(d: Path, outside: Path) -> None:
    shard = _first_shard(d)
    target = outside / "copy.bin"
    shutil.copyfile(shard, target)  # same bytes: it would verify if followed
    shard.unlink()
    shard.symlink_to(target)


def _link_manifest_to_copy(d: Path, outside: Path) -> None:
    target = outside / "manifest-copy.msgpack"
    shutil.copyfile(d / MANIFEST_NAME, target)
    (d / MANIFEST_NAME).unlink()
    (d / MANIFEST_NAME).symlink_to(target)


def _replace_shard(d: Path, make: Callable[[Path], None]) -> None:
    shard = _first_shard(d)
    shard.unlink()
    make(shard)


def _link_shard_folder(d: Path, outside: Path) -> None:
    """The first shard moved into a shard folder (a valid name, ``3f/...``), and that folder
    replaced by a link to a copy outside the checkpoint: the bytes would verify if followed."""
    body = read_body(d)
    shard = d / body["shards"][0]["path"]
    (outside / "3f").mkdir()
    shutil.copyfile(shard, outside / "3f" / shard.name)
    shard.unlink()
    body["shards"][0]["path"] = f"3f/{shard.name}"
    write_manifest(d, body)
    (d / "3f").symlink_to(outside / "3f", target_is_directory=True)


def _sparse_manifest(d: Path, outside: Path) -> None:
    with open(d / MANIFEST_NAME, "r+b") as f:
        f.truncate(3 << 30)  # 3 GiB, sparse: nothing is allocated on disk


# Cases that change files: name -> function(ckpt dir, outside dir).
FILE_CASES: dict[str, Callable[[Path, Path], None]] = {
    "link-shard-to-outside-copy": _link_shard_to_copy,
    "link-manifest-to-outside-copy": _link_manifest_to_copy,
    "link-shard-to-passwd": lambda d, o: _replace_shard(d, lambda p: p.symlink_to("/etc/passwd")),
    "link-shard-dangling": lambda d, o: _replace_shard(d, lambda p: p.symlink_to(o / "nothing")),
    "link-shard-folder-to-outside-copy": _link_shard_folder,
    "link-shard-to-dev-zero": lambda d, o: _replace_shard(d, lambda p: p.symlink_to("/dev/zero")),
    "shard-is-fifo": lambda d, o: _replace_shard(d, lambda p: os.mkfifo(p)),
    "shard-is-directory": lambda d, o: _replace_shard(d, lambda p: p.mkdir()),
    "manifest-is-fifo": lambda d, o: ((d / MANIFEST_NAME).unlink(), os.mkfifo(d / MANIFEST_NAME)),
    "manifest-is-directory": lambda d, o: ((d / MANIFEST_NAME).unlink(), (d / MANIFEST_NAME).mkdir()),
    "manifest-sparse-3GiB": _sparse_manifest,
}

CASES = sorted([*BODY_CASES, *V2_CASES, *V3_CASES, *V4_CASES, *ENVELOPE_CASES, *FILE_CASES])


def build(name: str, case_dir: Path, outside: Path) -> Path:
    """Write case ``name`` under ``case_dir`` and return the checkpoint folder."""
    ckpt = case_dir / "ckpt"
    if name in V4_CASES:
        write_good_v4(ckpt)
        body = read_body(ckpt)
        V4_CASES[name](ckpt, body)
        write_manifest(ckpt, body, version=4)
        return ckpt
    if name in V3_CASES:
        write_good_v3(ckpt)
        body = read_body(ckpt)
        new = V3_CASES[name](body)
        write_manifest(ckpt, body if new is None or isinstance(new, tuple) else new, version=3)
        return ckpt
    if name in V2_CASES:
        write_good(ckpt, version=2)
        body = read_body(ckpt)
        new = V2_CASES[name](body)
        write_manifest(ckpt, body if new is None or isinstance(new, tuple) else new, version=2)
        return ckpt
    write_good(ckpt)
    body = read_body(ckpt)
    if name in BODY_CASES:
        new = BODY_CASES[name](body)
        write_manifest(ckpt, body if new is None or isinstance(new, tuple) else new)
    elif name in ENVELOPE_CASES:
        ENVELOPE_CASES[name](ckpt, body)
    else:
        FILE_CASES[name](ckpt, outside)
    return ckpt


def peak_rss_mb() -> float:
    """This process's peak resident memory, in MiB.

    ``VmHWM`` belongs to the process's own address space, which exec replaces; ``ru_maxrss`` would
    not do for a child: Linux carries the parent's high-water mark into it across fork and exec,
    so a child of a large pytest process would report the parent's size.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")
