"""Save and cold-load throughput of ckptcore against raw I/O and other checkpoint formats.

Builds one training state in memory (default 768 MiB: four 4096x4096 float32
weights with Adam m and v slots) and a second of 10,000 small tensors, then, in
one run and in interleaved rounds, times every contender's durable save
(fsync included, for everyone) and cold-cache load (page cache dropped, every
page of the result touched); the small case also times a warm load.  The
baseline of the large load is a raw sequential ``readinto`` of the same bytes
into preallocated arrays.  Also measures a cold restore into live objects (the
NumPy reference adapter, 1 MiB tensors) streamed against load-then-assign, the cost of
checksums and the peak memory a synchronous save adds.  Prints a table and the
targets, and appends a dated section to benchmarks/RESULTS.md.  See
benchmarks/README.md.

    python benchmarks/bench_save_load.py            # default, a few minutes
    python benchmarks/bench_save_load.py --quick    # smoke run, not recorded
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

sys.path.append(os.path.join(os.path.dirname(HERE), "adapters"))  # the NumPy adapter, if not installed

import ckptcore  # noqa: E402
import ckptcore._io  # noqa: E402
import ckptcore.api  # noqa: E402
from _common import (cache_method, clean, evict, files_under, flat_arrays,  # noqa: E402
                     fsync_paths, large_state, small_state, summary, timed, touch)
from _report import print_report, record  # noqa: E402


# ------------------------------------------------------------------------------------ contenders
def _no_crc(data, value=0) -> int:
    """Stands in for crc32c: reads one byte per page (so a load still faults every page in, on the
    same threads) and returns 0, which is what a save under this switch recorded."""
    flat = np.frombuffer(data, np.uint8)
    if flat.size:
        flat[::4096].sum()
    return 0


@contextlib.contextmanager
def no_checksums():
    """Benchmark-only switch: ckptcore's own save and verified load, minus the checksum work."""
    saved = ckptcore._io.crc32c
    ckptcore._io.crc32c = types.SimpleNamespace(crc32c=_no_crc)
    try:
        yield
    finally:
        ckptcore._io.crc32c = saved


def _write_all(f, buf: memoryview) -> None:
    while buf:
        buf = buf[f.write(buf):]


def _read_all(f, buf: memoryview) -> None:
    while buf:
        n = f.readinto(buf)
        if not n:
            raise EOFError(f.name)
        buf = buf[n:]


def _raw_one_file(flat: dict[str, np.ndarray]):
    def save(out):
        with open(os.path.join(out, "all.bin"), "wb", buffering=0) as f:
            for a in flat.values():
                _write_all(f, memoryview(a).cast("B"))
            os.fsync(f.fileno())

    def load(out):
        bufs = {k: np.empty_like(a) for k, a in flat.items()}
        with open(os.path.join(out, "all.bin"), "rb", buffering=0) as f:
            for b in bufs.values():
                _read_all(f, memoryview(b).cast("B"))
        return bufs
    return save, load


def _raw_per_tensor(flat: dict[str, np.ndarray]):
    def save(out):
        for k, a in flat.items():
            with open(os.path.join(out, k), "wb", buffering=0) as f:
                _write_all(f, memoryview(a).cast("B"))
                os.fsync(f.fileno())

    def load(out):
        bufs = {k: np.empty_like(a) for k, a in flat.items()}
        for k, b in bufs.items():
            with open(os.path.join(out, k), "rb", buffering=0) as f:
                _read_all(f, memoryview(b).cast("B"))
        return bufs
    return save, load


def _ckptcore(state, checksums: bool):
    guard = contextlib.nullcontext if checksums else no_checksums

    def save(out):
        with guard():
            ckptcore.save_state(os.path.join(out, "ckpt"), state)

    def load(out):
        with guard():
            return flat_arrays(ckptcore.load_state(os.path.join(out, "ckpt"), verify=True))
    return save, load


def _savez(flat):
    def save(out):
        np.savez(os.path.join(out, "state.npz"), **flat)

    def load(out):
        with np.load(os.path.join(out, "state.npz")) as z:
            return {k: z[k] for k in z.files}
    return save, load


def _safetensors(flat):
    from safetensors.numpy import load_file, save_file

    def save(out):
        save_file(flat, os.path.join(out, "state.safetensors"))

    def load(out):
        return load_file(os.path.join(out, "state.safetensors"))
    return save, load


class Local:
    """A contender run in this process: ``save(dir)``, then ``load(dir) -> {name: array}``."""

    def __init__(self, name: str, fns, reference: dict[str, np.ndarray], warm: bool = False):
        self.name, (self.save, self.load), self.reference = name, fns, reference
        self.warm = warm

    def run(self, out: str, method: str, check: bool) -> dict:
        clean(out)
        os.makedirs(out)
        t_save = timed(lambda: self.save(out))
        t_save += timed(lambda: fsync_paths([out]))  # durable, like ckptcore and raw
        nbytes = sum(os.path.getsize(p) for p in files_under([out]))
        evict([out], method)
        got = {}
        t_load = timed(lambda: got.update(self._load_and_touch(out)))
        if check:
            self._check(got)
        res = {"save": t_save, "load": t_load, "bytes": nbytes}
        if self.warm:  # the files are in the page cache now
            got.clear()
            res["load_warm"] = timed(lambda: got.update(self._load_and_touch(out)))
        clean(out)
        return res

    def _load_and_touch(self, out):
        arrays = self.load(out)
        for a in arrays.values():
            touch(a)
        return arrays

    def _check(self, got):
        for k in (next(iter(self.reference)), next(reversed(self.reference))):
            if not np.array_equal(got[k], self.reference[k]):
                raise AssertionError(f"{self.name}: {k} did not round-trip")


class Remote:
    """A framework contender in a worker subprocess (see _workers.py)."""

    def __init__(self, name: str, mode: str, args, method: str):
        self.name, self.package = name, {"tf": "tensorflow"}.get(mode, mode)
        cmd = [sys.executable, os.path.join(HERE, "_workers.py"), mode, "--size-mb",
               str(args.size_mb), "--dir", os.path.join(args.dir, mode), "--evict", method]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", GLOG_minloglevel="2")  # quiet logs
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=HERE, env=env)
        self.info: dict = {}

    def wait_ready(self) -> bool:
        line = self.proc.stdout.readline()
        self.info = json.loads(line) if line.strip() else {"error": "worker died"}
        return bool(self.info.get("ready"))

    def run(self, out: str, method: str, check: bool) -> dict:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker died (its stderr is above)")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)


# ------------------------------------------------------------------------------------ the rounds
def run_rounds(contenders, rounds: int, base: str, method: str) -> dict[str, dict]:
    """Each round runs every contender once, in rotated order; per-contender median and best."""
    raw: dict[str, list[dict]] = {c.name: [] for c in contenders}
    for r in range(rounds):
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            res = c.run(os.path.join(base, "out"), method, check=r == 0)
            raw[c.name].append(res)
            print(f"  round {r + 1}/{rounds}  {c.name:<22} save {res['save']:6.3f} s  "
                  f"load {res['load']:6.3f} s", flush=True)
    return {name: {**{op: summary([x[op] for x in xs]) for op in ("save", "load", "load_warm")
                      if op in xs[0]}, "bytes": xs[0]["bytes"]}
            for name, xs in raw.items()}


def checksum_cost(state, flat, pairs: int, base: str, method: str) -> dict:
    """ckptcore with and without checksums, run back to back in pairs (order alternating).

    The cost is the median over pairs of (with / without): pairing cancels the slow drift of a
    shared disk that makes two separate medians disagree by more than the 10% being measured.
    """
    on = Local("with checksums", _ckptcore(state, True), flat)
    off = Local("without checksums", _ckptcore(state, False), flat)
    runs: dict[str, list[dict]] = {on.name: [], off.name: []}
    for p in range(pairs):
        for c in ((on, off) if p % 2 == 0 else (off, on)):
            runs[c.name].append(c.run(os.path.join(base, "crc"), method, check=p == 0))
    out = {name: {op: summary([x[op] for x in xs]) for op in ("save", "load")}
           for name, xs in runs.items()}
    for op in ("save", "load"):
        both = zip(runs[on.name], runs[off.name])
        out["cost_" + op] = summary([a[op] / b[op] - 1 for a, b in both])
    print(f"  checksum cost ({base}): save {out['cost_save']['median']:+.1%}, "
          f"load {out['cost_load']['median']:+.1%}", flush=True)
    return out


def peak_memory(args, method: str) -> dict:
    cmd = [sys.executable, os.path.join(HERE, "_workers.py"), "peakmem", "--size-mb",
           str(args.size_mb), "--dir", os.path.join(args.dir, "peakmem"), "--evict", method]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE)
    lines = res.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else {"error": res.stderr.strip()[-300:]}


# ------------------------------------------------------------------------------------------ main
CASES = ("large", "small", "restore", "checksums", "memory")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=float, default=768,
                    help="size of the large state in MiB (default 768: 4 x 3 x 4096^2 float32)")
    ap.add_argument("--small-count", type=int, default=10_000, help="tensors in the small case")
    ap.add_argument("--repeat", type=int, default=5, help="interleaved rounds per contender")
    ap.add_argument("--pairs", type=int, default=6,
                    help="back-to-back pairs for the checksum cost (with / without)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 48 MiB state, 2 rounds, not recorded in RESULTS.md")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a new one in $TMPDIR)")
    ap.add_argument("--no-frameworks", action="store_true", help="skip TensorFlow and Paddle")
    ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    ap.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    ap.add_argument("--label", default="", help="note added to the recorded section's title")
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated subset of {','.join(CASES)} (default: all)")
    args = ap.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    if set(args.cases) != set(CASES):
        args.no_record = True  # RESULTS.md keeps whole runs only
    if args.quick:
        args.size_mb, args.repeat, args.pairs, args.no_record = 48, 2, 2, True
    return args


def large_case(state, args, method: str, workers: list[Remote]) -> tuple[dict, dict]:
    flat = flat_arrays(state)
    contenders = [Local("raw (one file)", _raw_one_file(flat), flat),
                  Local("raw (file per tensor)", _raw_per_tensor(flat), flat),
                  Local("ckptcore", _ckptcore(state, True), flat),
                  Local("numpy.savez", _savez(flat), flat),
                  Local("safetensors.numpy", _safetensors(flat), flat)]
    versions = {"ckptcore": ckptcore.__version__, "numpy": np.__version__}
    for w in workers:
        if w.wait_ready():
            contenders.append(w)
            versions[w.package] = w.info.get("version")
        else:
            print(f"  {w.name}: skipped ({w.info.get('error')})", flush=True)
    print(f"large state: {sum(a.nbytes for a in flat.values()) / 2**20:.0f} MiB "
          f"in {len(flat)} tensors", flush=True)
    try:
        return run_rounds(contenders, args.repeat, args.dir, method), versions
    finally:
        for w in workers:
            w.close()


def small_case(args, method: str) -> dict:
    small = small_state(args.small_count)
    flat = flat_arrays(small)
    mib = sum(a.nbytes for a in flat.values()) / 2**20
    print(f"small state: {len(flat)} tensors, {mib:.1f} MiB", flush=True)
    return run_rounds([Local("raw (one file)", _raw_one_file(flat), flat, warm=True),
                       Local("ckptcore", _ckptcore(small, True), flat, warm=True),
                       Local("numpy.savez", _savez(flat), flat, warm=True),
                       Local("safetensors.numpy", _safetensors(flat), flat, warm=True)],
                      args.repeat, args.dir, method)


class Restore:
    """A cold restore into live objects of the NumPy reference adapter: ``load_state(url, model=...)``, which streams (each tensor assigned once its
    own batch is verified), against ``load_state(url)`` then ``restore_objects`` (everything
    verified, then everything assigned: what a restore did before streaming)."""

    def __init__(self, name: str, model_arrays: dict[str, np.ndarray], streamed: bool):
        import ckptcore_numpy as cn

        self.name, self.streamed, self.cn = name, streamed, cn
        self.source = cn.Model(model_arrays)
        self.target = cn.Model({k: np.zeros_like(v) for k, v in model_arrays.items()})

    def run(self, out: str, method: str, check: bool) -> dict:
        clean(out)
        os.makedirs(out)
        url = os.path.join(out, "ckpt")
        t_save = timed(lambda: ckptcore.save_state(url, model=self.source, rng=False))
        evict([out], method)
        if self.streamed:
            t_load = timed(lambda: ckptcore.load_state(url, model=self.target, rng=False))
        else:
            t_load = timed(lambda: ckptcore.api.restore_objects(
                ckptcore.load_state(url), {"model": self.target, "rng": False}))
        if check:
            for k, v in self.source.params.items():
                if not np.array_equal(self.target.params[k], v):
                    raise AssertionError(f"{self.name}: {k} did not round-trip")
        for v in self.target.params.values():
            v[...] = 0
        clean(out)
        return {"save": t_save, "load": t_load, "bytes": sum(a.nbytes for a in self.source.params.values())}


def restore_case(args, method: str) -> dict:
    """A model of 1 MiB float32 tensors, a third of the large state's size (256 by default)."""
    from _common import fill

    count = max(8, int(args.size_mb / 3))
    model = {f"layer{i}/kernel": fill((512, 512), seed=i) for i in range(count)}
    print(f"restore into a NumPy model: {sum(a.nbytes for a in model.values()) / 2**20:.0f} MiB "
          f"in {len(model)} tensors", flush=True)
    return run_rounds([Restore("load + restore_objects", model, streamed=False),
                       Restore("load_state(model=) streamed", model, streamed=True)],
                      args.repeat, args.dir, method)


def crc_alone(flat: dict[str, np.ndarray], reps: int = 3) -> float:
    """Seconds for crc32c over the whole state on one thread (best of ``reps``): the most the
    checksums can add to a save or a verified load, were nothing to overlap them."""
    import crc32c

    views = [memoryview(a).cast("B") for a in flat.values()]
    return min(timed(lambda: [crc32c.crc32c(v) for v in views]) for _ in range(reps))


def checksum_case(state, args, method: str) -> dict:
    flat = flat_arrays(state)
    out = {"crc_alone": crc_alone(flat)}
    out["disk"] = checksum_cost(state, flat, args.pairs, args.dir, method)
    if os.path.isdir("/dev/shm"):  # no disk at all: the CPU cost shows in full
        shm = tempfile.mkdtemp(prefix="ckptbench-", dir="/dev/shm")
        try:
            out["tmpfs"] = checksum_cost(state, flat, args.pairs, shm, "none")
        finally:
            clean(shm)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    own_dir = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="ckptbench-")
    method = cache_method()
    started = time.time()
    print(f"scratch {args.dir}; cold cache by {method}; {args.repeat} round(s)", flush=True)
    # Started first, so TensorFlow and Paddle import while this process builds its state.
    workers = [] if args.no_frameworks or "large" not in args.cases else [
        Remote("tf.train.Checkpoint", "tf", args, method), Remote("paddle.save", "paddle", args, method)]
    versions = {"ckptcore": ckptcore.__version__, "numpy": np.__version__}
    try:
        needs_large = {"large", "checksums"} & set(args.cases)
        state = large_state(args.size_mb) if needs_large else None
        results = {}
        if "large" in args.cases:
            results["large"], versions = large_case(state, args, method, workers)
            print(f"[{time.time() - started:.0f} s]", flush=True)
        if "small" in args.cases:
            results["small"] = small_case(args, method)
            print(f"[{time.time() - started:.0f} s]", flush=True)
        if "restore" in args.cases:
            results["restore"] = restore_case(args, method)
            print(f"[{time.time() - started:.0f} s]", flush=True)
        if "checksums" in args.cases:
            results["checksums"] = checksum_case(state, args, method)
            print(f"[{time.time() - started:.0f} s]", flush=True)
        del state
        if "memory" in args.cases:
            results["peak_memory"] = peak_memory(args, method)
    finally:
        for w in workers:
            w.close()
        if own_dir:
            clean(args.dir)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "label": args.label,
            "size_mb": args.size_mb, "small_count": args.small_count, "rounds": args.repeat,
            "pairs": args.pairs, "cache": method, "cpus": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(),
            "versions": versions,
            "threads": int(ckptcore._knobs.get("threads")),
            "shard_mb": int(ckptcore._knobs.get("shard_size")) / 2**20,
            "runtime_s": time.time() - started}
    text = print_report(results, meta)
    if not args.no_record:
        record(args.results, text)
        print(f"appended to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
