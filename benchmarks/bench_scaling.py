"""Save and load time against tensor count and against state size: ckptcore and the alternatives.

Two sweeps, each point measured in interleaved rounds (every contender once per round, the order
rotated): the *tensor-count* sweep splits a fixed total (default 16 MiB) into 10 to 30,000
float32 tensors of equal size; the *state-size* sweep keeps a realistic count (200 tensors of
log-uniform sizes) and grows the total from 1 MiB to 1 GiB.  Every contender saves the same
arrays durably (fsync included, for everyone), loads them back warm (page cache full), then cold
(cache emptied as in bench_save_load.py).  Contenders: ckptcore (save_state /
load_state(verify=True)), raw bytes in one file (the floor), safetensors.numpy, numpy.savez, and
tf.train.Checkpoint and paddle.save in their own worker processes (_workers.py), torch.save and
torch.distributed.checkpoint (DCP) in theirs (_torch_sweep.py), Orbax's StandardCheckpointer in its
own (_orbax_sweep.py), under the Python ``--orbax-python`` names (jax and Orbax need not share an
environment with TensorFlow and Paddle; skipped, with the reason, where it cannot import Orbax).

Writes the raw results to benchmarks/scaling.json, the figure to benchmarks/scaling.png
(plot_scaling.py; needs the ``bench`` extra, matplotlib) and appends tables to
benchmarks/RESULTS.md.  See benchmarks/README.md.

    python benchmarks/bench_scaling.py            # default, about 5 minutes
    python benchmarks/bench_scaling.py --quick    # smoke run, outputs in $TMPDIR, not recorded
    python benchmarks/plot_scaling.py             # redraw scaling.png from scaling.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import ckptcore  # noqa: E402
from _common import (cache_method, clean, evict, files_under, fsync_paths, spread,  # noqa: E402
                     sweep_arrays, sweep_sizes, timed, touch_mapped)
from _report import record  # noqa: E402

IOV_MAX = 1024  # buffers per writev call (Linux's limit)
READ_MAX = 1 << 30  # bytes per readinto call (Linux reads at most ~2 GiB at once)
OPS = ("save", "warm", "cold")


# ------------------------------------------------------------------------------------ contenders
def _raw(names, arrays):
    """The floor: every buffer written to one file by writev (no copy, few system calls) and
    fsynced; read back by one sequential readinto into one buffer, split into views."""
    def save(out):
        fd = os.open(os.path.join(out, "all.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            views = [memoryview(a).cast("B") for a in arrays]
            for i in range(0, len(views), IOV_MAX):
                batch = views[i:i + IOV_MAX]
                while batch:
                    n = os.writev(fd, batch)
                    while batch and n >= len(batch[0]):  # drop what a short write finished
                        n -= len(batch[0])
                        batch = batch[1:]
                    if batch and n:
                        batch[0] = batch[0][n:]
            os.fsync(fd)
        finally:
            os.close(fd)

    def load(out):
        buf = np.empty(sum(a.nbytes for a in arrays), np.uint8)
        with open(os.path.join(out, "all.bin"), "rb", buffering=0) as f:
            view = memoryview(buf)
            while view:
                n = f.readinto(view[:READ_MAX])
                if not n:
                    raise EOFError(f.name)
                view = view[n:]
        out_arrays, offset = {}, 0
        for k, a in zip(names, arrays):
            out_arrays[k] = buf[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape)
            offset += a.nbytes
        return out_arrays
    return save, load


def _ckptcore(names, arrays):
    state = ckptcore.TrainingState(model=dict(zip(names, arrays)), step=1)

    def save(out):
        ckptcore.save_state(os.path.join(out, "ckpt"), state)

    def load(out):
        return ckptcore.load_state(os.path.join(out, "ckpt"), verify=True).model
    return save, load


def _safetensors(names, arrays):
    from safetensors.numpy import load_file, save_file

    flat = dict(zip(names, arrays))

    def save(out):
        save_file(flat, os.path.join(out, "state.safetensors"))

    def load(out):
        return load_file(os.path.join(out, "state.safetensors"))
    return save, load


def _savez(names, arrays):
    flat = dict(zip(names, arrays))

    def save(out):
        np.savez(os.path.join(out, "state.npz"), **flat)

    def load(out):
        with np.load(os.path.join(out, "state.npz")) as z:
            return {k: z[k] for k in z.files}
    return save, load


LOCAL = {"ckptcore": _ckptcore, "raw (one file)": _raw, "safetensors.numpy": _safetensors,
         "numpy.savez": _savez}


class Local:
    """A contender in this process, rebuilt for every point."""

    def __init__(self, name: str):
        self.name, self.check = name, False

    def start_build(self, spec: dict) -> None:
        pass

    def finish_build(self, names, arrays) -> None:
        self.names, self.arrays = names, arrays
        self.save, self.load = LOCAL[self.name](names, arrays)

    def _load(self, out: str) -> float:
        got: dict = {}

        def go():
            got.update(self.load(out))
            touch_mapped(got.values())
        t = timed(go)
        if self.check:
            for i in (0, len(self.names) - 1):
                a, b = got[self.names[i]], self.arrays[i]
                if a.shape != b.shape or not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
                    raise AssertionError(f"{self.name}: {self.names[i]} did not round-trip")
        return t

    def run(self, out: str, method: str, cold: bool, check: bool) -> dict:
        self.check = check
        clean(out)
        os.makedirs(out)
        t_save = timed(lambda: (self.save(out), fsync_paths([out])))  # durable, for everyone
        nbytes = sum(os.path.getsize(p) for p in files_under([out]))
        t_warm = self._load(out)
        t_cold = None
        if cold:
            gc.collect()  # the warm result's mappings go before the eviction
            evict([out], method)
            t_cold = self._load(out)
        gc.collect()
        clean(out)
        return {"save": t_save, "warm": t_warm, "cold": t_cold, "bytes": nbytes}


PACKAGES = {"tf": "tensorflow", "torch-save": "torch", "dcp": "torch", "orbax": "orbax-checkpoint"}
SCRIPTS = {"torch-save": ["_torch_sweep.py", "torch-save"], "dcp": ["_torch_sweep.py", "dcp"],
           "orbax": ["_orbax_sweep.py"]}  # the others: _workers.py <mode>-sweep


class Worker:
    """A framework contender in a worker subprocess (``_workers.py <mode>-sweep``,
    ``_torch_sweep.py <mode>`` for PyTorch's savers, ``_orbax_sweep.py`` for Orbax), run by
    ``python`` (default: this interpreter)."""

    def __init__(self, name: str, mode: str, scratch: str, method: str, python: str | None = None):
        self.name, self.package = name, PACKAGES.get(mode, mode)
        script, *arg = SCRIPTS.get(mode, ["_workers.py", f"{mode}-sweep"])
        cmd = [python or sys.executable, os.path.join(HERE, script), *arg,
               "--dir", os.path.join(scratch, mode), "--evict", method]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", GLOG_minloglevel="2")  # quiet logs
        self.info: dict = {}
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True, cwd=HERE, env=env)
        except OSError as e:  # no such interpreter
            self.proc, self.info = None, {"error": f"cannot run {cmd[0]} ({e})"}

    def _ask(self, msg: dict | None = None) -> dict:
        if msg is not None:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker died (its stderr is above)")
        return json.loads(line)

    def wait_ready(self) -> bool:
        if self.proc is None:
            return False
        try:
            self.info = self._ask()
        except RuntimeError as e:
            self.info = {"error": str(e)}
        return bool(self.info.get("ready"))

    def start_build(self, spec: dict) -> None:
        """Sent before the driver builds its own arrays, so both build at once."""
        self.proc.stdin.write(json.dumps({"build": spec}) + "\n")
        self.proc.stdin.flush()

    def finish_build(self, names, arrays) -> None:
        reply = self._ask()
        if reply.get("built") != len(arrays):
            raise RuntimeError(f"the {self.name} worker built {reply}, not {len(arrays)} tensors")

    def run(self, out: str, method: str, cold: bool, check: bool) -> dict:
        return self._ask({"run": {"cold": cold, "check": check}})

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)


# ------------------------------------------------------------------------------------ the sweeps
def run_point(contenders, spec: dict, rounds: int, base: str, method: str, cold: bool) -> dict:
    """One point of a sweep: every contender builds the same arrays, then ``rounds`` interleaved
    rounds; per contender and operation the median, min and max."""
    for c in contenders:
        c.start_build(spec)
    arrays = sweep_arrays(sweep_sizes(**spec))
    names = [f"layer{i // 10}.t{i}" for i in range(len(arrays))]
    for c in contenders:
        c.finish_build(names, arrays)
    runs: dict[str, list[dict]] = {c.name: [] for c in contenders}
    for r in range(rounds):
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            runs[c.name].append(c.run(os.path.join(base, "out"), method, cold, check=r == 0))
    point = {"tensors": len(arrays), "bytes": int(sum(a.nbytes for a in arrays)), "results": {}}
    for name, xs in runs.items():
        res = {op: spread([x[op] for x in xs]) for op in OPS if xs[0][op] is not None}
        res["file_bytes"] = xs[0]["bytes"]
        point["results"][name] = res
    for c in contenders:
        if isinstance(c, Local):
            c.arrays = c.names = c.save = c.load = None
    del arrays
    gc.collect()
    return point


def _show(point: dict, label: str) -> None:
    print(f"  {label}: {point['tensors']} tensors, {point['bytes'] / 2**20:.1f} MiB", flush=True)
    for name, r in point["results"].items():
        cells = "  ".join(f"{op} {r[op]['median']:7.3f}" for op in OPS if op in r)
        print(f"    {name:<20} {cells}  (s, median)", flush=True)


def sweep(kind: str, contenders, args, method: str) -> dict:
    if kind == "count":
        specs = [{"dist": "equal", "count": n, "total_mb": args.count_total_mb}
                 for n in args.counts]
        fixed = f"{args.count_total_mb:g} MiB in equal float32 tensors"
    else:
        specs = [{"dist": "mixed", "count": args.size_count, "total_mb": mb}
                 for mb in args.sizes_mb]
        fixed = f"{args.size_count} float32 tensors of log-uniform sizes"
    points = []
    for spec in specs:
        t0 = time.time()
        point = run_point(contenders, spec, args.rounds, args.dir, method, not args.no_cold)
        point["seconds"] = time.time() - t0
        points.append(point)
        _show(point, kind)
    return {"fixed": fixed, "points": points}


# ------------------------------------------------------------------------------------ the report
def _fmt_sweep(kind: str, sw: dict, names: list[str]) -> list[str]:
    col = "tensors" if kind == "count" else "MiB"
    head = ("Tensor count" if kind == "count" else "State size") + f" ({sw['fixed']})"
    out = [f"### {head}", ""]
    for op, what in (("save", "save with fsync"), ("warm", "warm load (page cache)"),
                     ("cold", "cold load")):
        if op not in sw["points"][0]["results"]["ckptcore"]:
            continue
        out += [f"{what}: median s (contender / ckptcore; > 1: ckptcore faster)", "",
                f"| {col} | " + " | ".join(names) + " |",
                "|---:|" + "---:|" * len(names)]
        for p in sw["points"]:
            ck = p["results"]["ckptcore"][op]["median"]
            x = p["tensors"] if kind == "count" else f"{p['bytes'] / 2**20:g}"
            cells = []
            for n in names:
                r = p["results"].get(n, {}).get(op)
                cells.append("-" if r is None else
                             f"{r['median']:.3f}" if n == "ckptcore" else
                             f"{r['median']:.3f} ({r['median'] / ck:.2f}x)")
            out.append(f"| {x} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def report(data: dict) -> str:
    m = data["meta"]
    names = [n for n in m["contenders"]]
    label = f" ({m['label']})" if m.get("label") else ""
    out = [f"## {m['date']}: scaling sweeps (bench_scaling.py), {m['rounds']} round(s){label}", "",
           f"{m['cpus']} CPUs, {m['platform']}, Python {m['python']}; "
           + ", ".join(f"{k} {v}" for k, v in m["versions"].items())
           + f". Cold cache by {m['cache']}. Every save includes fsync; loads read every page. "
           f"Medians of {m['rounds']} interleaved rounds per point (min and max in "
           f"`scaling.json`); ratio = contender's median / ckptcore's. "
           f"Raw (one file) is the floor for saves and cold loads; a warm load that maps the "
           f"file (ckptcore maps local shards: its arrays are views of the page cache) copies "
           f"nothing into fresh memory and can beat it. "
           f"Run took {m['runtime_s']:.0f} s. Plot: `scaling.png`.", ""]
    for kind in ("count", "size"):
        if kind in data["sweeps"]:
            out += _fmt_sweep(kind, data["sweeps"][kind], names)
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------ main
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--counts", type=ints, default=[10, 100, 1000, 10_000, 30_000],
                    help="tensor counts of the count sweep (comma-separated)")
    ap.add_argument("--count-total-mb", type=float, default=16,
                    help="state size of the count sweep, MiB (default 16)")
    ap.add_argument("--sizes-mb", type=floats, default=[1, 8, 64, 256, 1024],
                    help="state sizes of the size sweep, MiB (comma-separated)")
    ap.add_argument("--size-count", type=int, default=200,
                    help="tensors in the size sweep (default 200)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per point")
    ap.add_argument("--only", choices=["count", "size"], help="run one sweep only")
    ap.add_argument("--no-cold", action="store_true", help="warm loads only (no eviction)")
    ap.add_argument("--evict", choices=["auto", "drop_caches", "fadvise"], default="auto",
                    help="cold-cache method (auto: drop_caches as root, else fadvise; fadvise "
                         "touches only this benchmark's files, kinder to a shared machine)")
    ap.add_argument("--no-frameworks", action="store_true",
                    help="skip TensorFlow, Paddle, PyTorch and Orbax")
    ap.add_argument("--orbax-python", default=os.environ.get("CKPT_ORBAX_PYTHON") or sys.executable,
                    help="the Python that runs the Orbax worker: one with orbax-checkpoint and jax "
                         "(default: $CKPT_ORBAX_PYTHON, else this one; skipped if it has no Orbax)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: small points, outputs in $TMPDIR, not recorded")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a new one in $TMPDIR)")
    ap.add_argument("--json", default=None, help="raw results (default benchmarks/scaling.json)")
    ap.add_argument("--png", default=None, help="figure (default benchmarks/scaling.png)")
    ap.add_argument("--no-plot", action="store_true", help="do not draw the figure")
    ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    ap.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    ap.add_argument("--label", default="", help="note added to the recorded section's title")
    args = ap.parse_args(argv)
    out = HERE
    if args.quick:
        args.counts, args.count_total_mb, args.sizes_mb = [10, 100, 1000, 3000], 4, [1, 8, 32]
        args.no_record, out = True, tempfile.gettempdir()
    stem = "scaling-quick" if args.quick else "scaling"
    args.json = args.json or os.path.join(out, stem + ".json")
    args.png = args.png or os.path.join(out, stem + ".png")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    own_dir = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="ckptbench-scaling-")
    method = cache_method() if args.evict == "auto" else args.evict
    started = time.time()
    print(f"scratch {args.dir}; cold cache by {method}; {args.rounds} round(s) per point",
          flush=True)
    # Started first, so TensorFlow and Paddle import while this process gets going.
    workers = [] if args.no_frameworks else [
        Worker("tf.train.Checkpoint", "tf", args.dir, method),
        Worker("paddle.save", "paddle", args.dir, method),
        Worker("torch.save", "torch-save", args.dir, method),
        Worker("DCP", "dcp", args.dir, method),
        Worker("Orbax", "orbax", args.dir, method, python=args.orbax_python)]
    contenders: list = [Local(n) for n in LOCAL]
    versions = {"ckptcore": ckptcore.__version__, "numpy": np.__version__}
    try:
        import safetensors
        versions["safetensors"] = safetensors.__version__
    except ImportError:
        contenders = [c for c in contenders if c.name != "safetensors.numpy"]
        print("  safetensors.numpy: skipped (not installed)", flush=True)
    try:
        for w in workers:
            if w.wait_ready():
                contenders.append(w)
                versions[w.package] = w.info.get("version")
            else:
                hint = (f"; --orbax-python names a Python with orbax-checkpoint, this run used "
                        f"{args.orbax_python}" if w.package == "orbax-checkpoint" else "")
                print(f"  {w.name}: skipped ({w.info.get('error')}{hint})", flush=True)
        sweeps = {}
        for kind in ("count", "size"):
            if args.only in (None, kind):
                sweeps[kind] = sweep(kind, contenders, args, method)
                print(f"[{time.time() - started:.0f} s]", flush=True)
    finally:
        for w in workers:
            w.close()
        if own_dir:
            clean(args.dir)
    data = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "label": args.label,
                     "rounds": args.rounds, "cache": method if not args.no_cold else "none",
                     "cpus": os.cpu_count(), "platform": platform.platform(),
                     "machine": platform.machine(), "python": platform.python_version(),
                     "versions": versions, "contenders": [c.name for c in contenders],
                     "runtime_s": time.time() - started},
            "sweeps": sweeps}
    with open(args.json, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"raw results: {args.json}")
    text = report(data)
    print("\n" + text)
    if not args.no_record:
        record(args.results, "\n" + text)  # a blank line after whatever section came last
        print(f"appended to {args.results}")
    if not args.no_plot:
        try:
            from plot_scaling import plot
        except ImportError as e:  # matplotlib is the optional ``bench`` extra
            print(f"no plot ({e}); pip install 'ckptcore[bench]', then run plot_scaling.py")
        else:
            plot(data, args.png)
            print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
