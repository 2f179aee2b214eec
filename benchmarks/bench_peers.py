"""Peers side by side: ckptcore against torch.save, DCP and Orbax on the same bytes, in one run.

Two states of random float32 arrays (``_common.fill``): *large* (768 MiB in 12 tensors of
4096x4096, ``--large-mib``; ``_common.large_shapes``) and *many* (10,000 tensors of log-uniform
sizes, 40 MiB in all, ``--many-count``/``--many-mib``; ``_common.sweep_sizes("mixed", ...)``).
Every contender saves (until durable) and restores the same arrays:

* ckptcore: ``save_state(dir, TrainingState(model=arrays))`` (it fsyncs its files itself) /
  ``load_state(dir, verify=True)`` (checksums checked; local shards are mapped, so every page of
  the result is read: ``_common.touch_mapped``);
* torch.save: ``torch.save`` of a dict of ``torch.from_numpy`` views (no copy) + ``fsync`` of the
  file / ``torch.load`` (``weights_only=True``, its default);
* DCP: ``torch.distributed.checkpoint.save`` of that dict, one process, no process group (it
  fsyncs its files: ``sync_files=True``) / ``dcp.load`` into a second dict of tensors of the same
  shapes (in place, its only way to load; zeroed between restores);
* Orbax: ``ocp.StandardCheckpointer().save`` of the dict of NumPy arrays (its defaults: OCDBT,
  zarr3 chunks compressed with zstd) + ``wait_until_finished()`` + ``fsync`` of its files
  (tensorstore fsyncs the array data and its folders; the metadata files Orbax writes from Python
  it does not: seen with strace) / ``restore(dir, target)``, the target a dict of NumPy arrays of
  the right shapes (NumPy arrays come back);
* raw one file, the floor: every buffer ``writev``-ed into one file, ``fsync`` / one ``readinto``
  of the whole file into one buffer, split into views (``bench_scaling._raw``).

Measured in interleaved rounds (each contender once per round, the order rotated every round,
the first ``--warmup`` rounds discarded; medians [best-worst]):

* **save** until durable, into a fresh folder (the previous output deleted and the deletion
  synced first); **warm restore** right after it (the files in the page cache); **cold restore**
  after ``fsync`` + ``posix_fadvise(DONTNEED)`` of the contender's files (``--evict``).  Every
  restore is checked bit for bit against the saved arrays, outside the timing.
* **async save**: ``CheckpointManager(root, async_save=True, keep=1).save(step, state)``,
  ``dcp.async_save(tensors, checkpoint_id=...)`` and Orbax's ``StandardCheckpointer.save``
  (an ``AsyncCheckpointer``: it returns once it has copied the arrays, then writes in the
  background): the time until the call returns (the caller is blocked) and until the save is
  done (``handle.result()`` / ``wait_until_finished()``, + the fsync of DCP's and Orbax's files,
  as above), one save in flight at a time; the peers' previous step deleted outside their time.
* **peak memory** of each save and each restore above the state, in a child process per
  contender, state and operation (so peaks do not mix): ``VmHWM`` is reset to the current RSS
  (``/proc/self/clear_refs``) once the state (for a save) or the restore target (DCP's tensors)
  is built, and read after the operation; a restore that allocates its result (all but DCP's)
  has the state's size taken off.  RSS counts mapped file pages too (ckptcore's local shards).
  One measurement each (not rounds).

``--dist`` adds two ranks (real processes, gloo on 127.0.0.1) with the large state replicated on
both: ``dcp.save``/``dcp.load`` across both against ``save_state(..., group=
ckptcore_torch.process_group())``/``load_state(..., group=)``, timed on rank 0 from a barrier until
every rank is done, each restore checked bit for bit on each rank.

Ratios are the peer's median over ckptcore's (> 1: ckptcore faster).  Contenders whose library is
not installed are skipped with the reason printed.  The peers come from the ``bench`` extra;
install ``torch==2.13.0`` (a CPU build) first, and keep jax out of an environment holding
TensorFlow and Paddle (see benchmarks/README.md).

    python benchmarks/bench_peers.py                 # both states, 3 rounds, appends to RESULTS.md
    python benchmarks/bench_peers.py --dist          # and two ranks, DCP against a ckptcore group
    python benchmarks/bench_peers.py --quick         # small states, 1 round, not recorded
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "adapters"))
warnings.filterwarnings("ignore")  # DCP warns on every single-process call
logging.getLogger("ckptcore").setLevel(logging.WARNING)  # the manager logs each retention deletion
logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax logs every step of every save

import numpy as np  # noqa: E402

import ckptcore  # noqa: E402
from _common import (clean, evict, files_under, fill, free_ports, fsync_paths,  # noqa: E402
                     large_shapes, reset_peak_rss, summary, sweep_sizes, touch_mapped, vm_status)

ORDER = ("ck", "ts", "dcp", "orbax", "raw")
NAMES = {"ck": "ckptcore", "ts": "torch.save / torch.load", "dcp": "DCP", "orbax": "Orbax",
         "raw": "raw one file (floor)"}
ASYNC = ("ck", "dcp", "orbax")


# ------------------------------------------------------------------------------------ the states
def spec(kind: str, args) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of each array of a state: ``large`` or ``many``."""
    if kind == "large":
        return [(f"{p.replace('/', '_')}_{s}", shape)
                for p, s, shape in large_shapes(args.large_mib)]
    sizes = sweep_sizes("mixed", args.many_count, args.many_mib)
    return [(f"block{i // 100:03d}_t{i:05d}", (n,)) for i, n in enumerate(sizes)]


def build(kind: str, args) -> dict[str, np.ndarray]:
    """The state's arrays, the same in every process for the same arguments."""
    return {name: fill(shape, seed=i) for i, (name, shape) in enumerate(spec(kind, args))}


def describe(kind: str, args) -> str:
    sp = spec(kind, args)
    nbytes = sum(4 * int(np.prod(s)) for _, s in sp)
    return f"{len(sp):,} tensors, {nbytes / 2**20:.1f} MiB"


def same(got: dict, want: dict[str, np.ndarray], label: str) -> None:
    """Every array of ``got`` equal to ``want``'s bit for bit (and no name missing or extra)."""
    if set(got) != set(want):
        raise AssertionError(f"{label}: names differ ({len(set(got) ^ set(want))} not shared)")
    for k, w in want.items():
        g = np.asarray(got[k])
        if g.shape != w.shape or g.dtype != w.dtype or not np.array_equal(
                g.reshape(-1).view(np.uint8), w.reshape(-1).view(np.uint8)):
            raise AssertionError(f"{label}: {k} differs from the saved array")


# ------------------------------------------------------------------------------------ contenders
def available() -> tuple[dict[str, str], dict[str, str]]:
    """``({contender: why skipped}, {library: version})``."""
    skipped, versions = {}, {"ckptcore": ckptcore.__version__, "numpy": np.__version__}
    try:
        import torch
        import torch.distributed.checkpoint  # noqa: F401
        versions["torch"] = torch.__version__
    except ImportError as e:
        skipped["ts"] = skipped["dcp"] = f"torch not installed ({e})"
    try:
        from importlib.metadata import version

        import jax
        import orbax.checkpoint as ocp
        versions.update({"orbax-checkpoint": ocp.__version__, "jax": jax.__version__,
                         "tensorstore": version("tensorstore")})
    except ImportError as e:
        skipped["orbax"] = f"orbax-checkpoint not installed ({e})"
    return skipped, versions


class Contender:
    """One contender's save, restore and async save of one state, each into a folder of its own
    (``path``: created empty before a save).  ``load`` returns ``{name: array}``."""

    in_place = False

    def __init__(self, arrays: dict[str, np.ndarray] | None, shapes: list, restores: bool = True):
        self.arrays, self.shapes, self.restores = arrays, shapes, restores

    def save(self, path: str) -> None:
        raise NotImplementedError

    def load(self, path: str) -> dict:
        raise NotImplementedError

    def reset(self) -> None:
        """Between restores: an in-place restore's target loses what it held."""

    def close(self) -> None:
        pass


class Ckptcore(Contender):
    def __init__(self, arrays, shapes, restores=True):
        super().__init__(arrays, shapes, restores)
        self.state = ckptcore.TrainingState(model=dict(arrays), step=1) if arrays else None
        self.mgr = None

    def save(self, path):
        ckptcore.save_state(os.path.join(path, "ckpt"), self.state)

    def load(self, path):
        got = ckptcore.load_state(os.path.join(path, "ckpt"), verify=True).model
        touch_mapped(got.values())  # mapped shards: every page really read
        return got

    def async_save(self, root: str, step: int):
        if self.mgr is None:
            self.mgr = ckptcore.CheckpointManager(root, async_save=True, keep=1)
        return self.mgr.save(step, self.state).result

    def close(self):
        if self.mgr is not None:
            self.mgr.close()


class TorchSave(Contender):
    def __init__(self, arrays, shapes, restores=True):
        super().__init__(arrays, shapes, restores)
        import torch
        self.torch = torch
        self.tensors = {k: torch.from_numpy(a) for k, a in arrays.items()} if arrays else None

    def save(self, path):
        f = os.path.join(path, "state.pt")
        self.torch.save(self.tensors, f)
        fsync_paths([f])

    def load(self, path):
        got = self.torch.load(os.path.join(path, "state.pt"))
        return {k: t.numpy() for k, t in got.items()}


class DCP(Contender):
    in_place = True

    def __init__(self, arrays, shapes, restores=True):
        super().__init__(arrays, shapes, restores)
        import torch
        import torch.distributed.checkpoint as dcp
        self.dcp = dcp
        self.tensors = {k: torch.from_numpy(a) for k, a in arrays.items()} if arrays else None
        # The live tensors a restore fills (zeros: every page touched, as a live model's are).
        self.target = ({k: torch.zeros(s, dtype=torch.float32) for k, s in shapes}
                       if restores else {})

    def save(self, path):
        p = os.path.join(path, "dcp")
        self.dcp.save(self.tensors, checkpoint_id=p)
        fsync_paths([p])  # finds nothing left to do: DCP fsyncs its files (sync_files=True)

    def load(self, path):
        self.dcp.load(self.target, checkpoint_id=os.path.join(path, "dcp"))
        return {k: t.numpy() for k, t in self.target.items()}

    def reset(self):
        for t in self.target.values():
            t.zero_()

    def async_save(self, root: str, step: int):
        p = os.path.join(root, f"dcp-{step}")
        handle = self.dcp.async_save(self.tensors, checkpoint_id=p)

        def done():
            handle.result()
            fsync_paths([p])
        return done


class Orbax(Contender):
    def __init__(self, arrays, shapes, restores=True):
        super().__init__(arrays, shapes, restores)
        import orbax.checkpoint as ocp
        self.ckptr = ocp.StandardCheckpointer()
        # The target only says what comes back (shapes, dtypes, NumPy): np.zeros allocates lazily.
        self.target = {k: np.zeros(s, np.float32) for k, s in shapes}

    def save(self, path):
        p = os.path.join(path, "orbax")
        self.ckptr.save(p, self.arrays)
        self.ckptr.wait_until_finished()
        fsync_paths([p])  # tensorstore fsynced the array data; Orbax's metadata files it did not

    def load(self, path):
        return self.ckptr.restore(os.path.join(path, "orbax"), self.target)

    def async_save(self, root: str, step: int):
        p = os.path.join(root, f"orbax-{step}")
        self.ckptr.save(p, self.arrays)  # returns once the arrays are copied; writes behind

        def done():
            self.ckptr.wait_until_finished()
            fsync_paths([p])
        return done

    def close(self):
        self.ckptr.close()


class Raw(Contender):
    def __init__(self, arrays, shapes, restores=True):
        super().__init__(arrays, shapes, restores)
        from bench_scaling import _raw
        names = [k for k, _ in shapes]
        proto = list(arrays.values()) if arrays else [np.empty(s, np.float32) for _, s in shapes]
        self._save, self._load = _raw(names, proto)

    def save(self, path):
        self._save(path)

    def load(self, path):
        return self._load(path)


KINDS = {"ck": Ckptcore, "ts": TorchSave, "dcp": DCP, "orbax": Orbax, "raw": Raw}


# ------------------------------------------------------------------------------------ the rounds
def sync_rounds(kind: str, args, names: list[str]) -> dict:
    arrays = build(kind, args)
    shapes = spec(kind, args)
    cs = {n: KINDS[n](arrays, shapes) for n in names}
    times: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="peers-") as root:
        paths = {n: os.path.join(root, n) for n in names}
        for r in range(args.warmup + args.rounds):
            got = {}
            k = r % len(names)
            for n in names[k:] + names[:k]:  # rotate who goes first
                c, path = cs[n], paths[n]
                clean(path)
                os.makedirs(path)
                t0 = time.perf_counter()
                c.save(path)
                got[f"{n}_save"] = time.perf_counter() - t0
                sizes[n] = sum(os.path.getsize(f) for f in files_under([path]))
                for op in ("warm", "cold"):
                    if op == "cold":
                        evict([path], args.evict)
                    t0 = time.perf_counter()
                    res = c.load(path)
                    got[f"{n}_{op}"] = time.perf_counter() - t0
                    same(res, arrays, f"{kind}: {NAMES[n]} {op} restore")
                    del res
                    c.reset()
                    gc.collect()  # the result's mappings go before the eviction
                clean(path)
            print(f"  {kind} round {r}{' (warm-up)' if r < args.warmup else ''}: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)
            if r >= args.warmup:
                for k, v in got.items():
                    times.setdefault(k, []).append(v)
    for c in cs.values():
        c.close()
    return {"times": times, "sizes": sizes, "bytes": sum(a.nbytes for a in arrays.values()),
            "tensors": len(arrays)}


def async_rounds(kind: str, args, names: list[str]) -> dict:
    """Blocking and total time of an async save, one in flight at a time."""
    arrays = build(kind, args)
    shapes = spec(kind, args)
    cs = {n: KINDS[n](arrays, shapes) for n in names}
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="peers-async-") as root:
        roots = {n: os.path.join(root, n) for n in names}
        for p in roots.values():
            os.makedirs(p)
        prev: dict[str, str] = {}
        for r in range(args.warmup + args.rounds):
            got = {}
            k = r % len(names)
            for n in names[k:] + names[:k]:
                step = r + 1
                t0 = time.perf_counter()
                done = cs[n].async_save(roots[n], step)
                got[f"{n}_block"] = time.perf_counter() - t0
                done()
                got[f"{n}_total"] = time.perf_counter() - t0
                if n != "ck":  # the manager keeps 1 itself; the peers' previous step goes here
                    if n in prev:
                        clean(prev[n])
                    prev[n] = os.path.join(roots[n], f"{n}-{step}")
            print(f"  {kind} async round {r}{' (warm-up)' if r < args.warmup else ''}: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)
            if r >= args.warmup:
                for k, v in got.items():
                    times.setdefault(k, []).append(v)
        for c in cs.values():
            c.close()
    return {"times": times}


# ---------------------------------------------------------------------------------- peak memory
def peak_child(kind: str, name: str, op: str, path: str, args) -> None:
    """In a child process: the peak RSS one save or one restore adds above the state; one JSON
    line on stdout."""
    shapes = spec(kind, args)
    state_bytes = sum(4 * int(np.prod(s)) for _, s in shapes)
    arrays = build(kind, args) if op == "save" else None
    c = KINDS[name](arrays, shapes, restores=op == "restore")
    gc.collect()
    if not reset_peak_rss():
        print(json.dumps({"error": "cannot reset VmHWM (/proc/self/clear_refs)"}), flush=True)
        return
    base = vm_status("VmRSS")
    if op == "save":
        os.makedirs(path, exist_ok=True)
        c.save(path)
        extra = vm_status("VmHWM") - base
    else:
        res = c.load(path)  # ckptcore's reads every page of its mapped shards itself
        extra = vm_status("VmHWM") - base - (0 if c.in_place else state_bytes)
        assert len(res) == len(shapes), f"{name} restored {len(res)} of {len(shapes)} arrays"
    c.close()
    print(json.dumps({"extra": extra, "base": base, "state_bytes": state_bytes}), flush=True)


def peak_memory(kind: str, args, names: list[str]) -> dict:
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="peers-mem-") as root:
        for n in names:
            path = os.path.join(root, n)
            for op in ("save", "restore"):
                cmd = [sys.executable, os.path.abspath(__file__), "--peak-child", kind, n, op,
                       path] + sizing(args)
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
                lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
                if p.returncode or not lines:
                    raise RuntimeError(f"peak memory, {kind} {NAMES[n]} {op}: child failed "
                                       f"(exit {p.returncode}):\n{p.stderr[-3000:]}")
                res = json.loads(lines[-1])
                if "error" in res:
                    raise RuntimeError(f"peak memory: {res['error']}")
                out[f"{n}_{op}"] = res["extra"]
                print(f"  {kind} peak memory {NAMES[n]} {op}: {res['extra'] / 2**20:+.0f} MiB "
                      "above the state", flush=True)
            clean(path)
    return out


def sizing(args) -> list[str]:
    return ["--large-mib", str(args.large_mib), "--many-count", str(args.many_count),
            "--many-mib", str(args.many_mib)]


# ------------------------------------------------------------------------------ two ranks (--dist)
def dist_worker(rank: int, port: int, out: str, args) -> None:
    """One of two ranks: DCP and ckptcore's group save and load of the same replicated large
    state, in alternating order, timed on rank 0 from a barrier until every rank is done."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import ckptcore_torch

    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = ckptcore_torch.process_group()
    arrays = build("large", args)
    shapes = spec("large", args)
    state = ckptcore.TrainingState(model=dict(arrays), step=1)
    tensors = {k: torch.from_numpy(a) for k, a in arrays.items()}
    target = {k: torch.zeros(s, dtype=torch.float32) for k, s in shapes}
    paths = {"ck": os.path.join(out, "ckptcore"), "dcp": os.path.join(out, "dcp")}
    times: dict[str, list[float]] = {}

    def save(n: str) -> None:
        if n == "dcp":
            dcp.save(tensors, checkpoint_id=paths[n])
        else:
            ckptcore.save_state(paths[n], state, group=group)

    def load(n: str) -> None:
        if n == "dcp":
            dcp.load(target, checkpoint_id=paths[n])
            box["res"] = {k: t.numpy() for k, t in target.items()}
        else:
            box["res"] = ckptcore.load_state(paths[n], group=group).model
            touch_mapped(box["res"].values())

    box: dict = {}
    for r in range(args.warmup + args.rounds):
        for n in (["ck", "dcp"] if r % 2 else ["dcp", "ck"]):
            for op, fn in (("save", save), ("warm", load)):
                dist.barrier()
                t0 = time.perf_counter()
                fn(n)
                dist.barrier()
                if r >= args.warmup and rank == 0:
                    times.setdefault(f"{n}_{op}", []).append(time.perf_counter() - t0)
            same(box.pop("res"), arrays, f"rank {rank}: {NAMES[n]} restore across 2 ranks")
            for t in target.values():  # DCP's next restore has everything to put back
                t.zero_()
            gc.collect()
            dist.barrier()
            if rank == 0:
                clean(paths[n])
            dist.barrier()
    if rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"times": times}, f)
    dist.destroy_process_group()


def dist_rounds(args) -> dict:
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="peers-dist-") as out:
        port = free_ports(1)[0]
        cmd = [sys.executable, os.path.abspath(__file__), "--rounds", str(args.rounds),
               "--warmup", str(args.warmup)] + sizing(args)
        procs = [subprocess.Popen(cmd + ["--dist-worker", str(r), str(port), out]) for r in range(2)]
        codes = [p.wait(timeout=3600) for p in procs]
        if any(codes):
            raise RuntimeError(f"a two-rank worker failed (exit codes {codes})")
        with open(os.path.join(out, "result.json")) as f:
            return json.load(f)


# ------------------------------------------------------------------------------------- report
def _cell(xs: list[float]) -> str:
    s = summary(xs)
    return f"{s['median']:.3f} [{s['best']:.3f}-{max(xs):.3f}]"


ROWS = [  # label, key, contenders
    ("save + fsync (until durable)", "save", ORDER),
    ("restore, page cache warm", "warm", ORDER),
    ("restore, cold", "cold", ORDER),
    ("async save: caller blocked", "block", ASYNC),
    ("async save: until done", "total", ASYNC),
]


def state_rows(label: str, res: dict) -> list[str]:
    t = res["times"]
    lines = []
    for what, op, who in ROWS:
        if f"ck_{op}" not in t:
            continue
        ck = summary(t[f"ck_{op}"])["median"]
        cells = [_cell(t[f"{n}_{op}"]) if n in who and f"{n}_{op}" in t else "-" for n in ORDER]
        ratios = [f"{summary(t[f'{n}_{op}'])['median'] / ck:.2f}x"
                  if n in who and f"{n}_{op}" in t else "-" for n in ORDER[1:]]
        lines.append(f"| {label} | {what} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    mem = res.get("memory") or {}
    for op in ("save", "restore"):
        if f"ck_{op}" in mem:
            cells = [f"{mem[f'{n}_{op}'] / 2**20:.0f} MiB" if f"{n}_{op}" in mem else "-"
                     for n in ORDER]
            lines.append(f"| {label} | peak memory above the state, {op} | " + " | ".join(cells)
                         + " | - | - | - | - |")
    return lines


def dist_rows(d: dict) -> list[str]:
    t = d["times"]
    lines = []
    for op, what in (("save", "save + fsync (until durable)"), ("warm", "restore, page cache warm")):
        ratio = summary(t[f"dcp_{op}"])["median"] / summary(t[f"ck_{op}"])["median"]
        lines.append(f"| large, 2 ranks | {what} | {_cell(t[f'ck_{op}'])} | - | "
                     f"{_cell(t[f'dcp_{op}'])} | - | - | - | {ratio:.2f}x | - | - |")
    return lines


def report(results: dict, args, skipped: dict, versions: dict) -> list[str]:
    today = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"## Peers side by side: ckptcore vs torch.save, DCP, Orbax (bench_peers.py, "
             f"{today:%Y-%m-%d %H:%M} UTC)" + (f" - {args.label}" if args.label else ""), "",
             ", ".join(f"{k} {v}" for k, v in versions.items())
             + f"; Python {platform.python_version()}, {os.cpu_count()} CPUs. "
             f"{args.rounds} interleaved rounds after {args.warmup} discarded (order rotated each "
             "round); times in seconds as median [best-worst]; ratios are the peer's median over "
             "ckptcore's (> 1: ckptcore faster); every save durable (ckptcore, DCP and the raw "
             "floor fsync themselves, torch.save's file and Orbax's files fsynced after: "
             "tensorstore fsyncs Orbax's array data and folders, not Orbax's metadata files); cold "
             f"restores after {args.evict} eviction of the contender's files; every restore checked "
             "bit for bit. Restores: ckptcore load_state(verify=True) (mapped shards, every page "
             "read), torch.load, dcp.load into preallocated tensors (in place), Orbax "
             "StandardCheckpointer.restore into a NumPy target, raw readinto. Async: "
             "CheckpointManager(async_save=True, keep=1).save, dcp.async_save, "
             "StandardCheckpointer.save (returns after copying the arrays); 'until done' includes "
             "the fsyncs. Peak memory: one child process per contender, state and operation, "
             "VmHWM reset before the operation, the state's size taken off a restore that "
             "allocates its result. Load average (1 min) at the start and end of the run: "
             f"{args.load_start:.1f}, {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs; other work "
             "on the machine shows here).", ""]
    if skipped:
        lines += ["Skipped: " + "; ".join(f"{NAMES[n]} ({why})" for n, why in skipped.items()) + ".", ""]
    lines += ["| state | operation | " + " | ".join(NAMES[n] for n in ORDER)
              + " | vs torch | vs DCP | vs Orbax | vs raw |",
              "|---|---|" + "---:|" * (len(ORDER) + 4)]
    for kind, res in results.items():
        if kind == "dist":
            continue
        lines += state_rows(kind, res)
    if isinstance(results.get("dist"), dict):
        lines += dist_rows(results["dist"])
    lines.append("")
    for kind, res in results.items():
        if kind == "dist":
            continue
        mib = ", ".join(f"{NAMES[n].split(' ')[0]} {s / 2**20:.1f}" for n, s in res["sizes"].items())
        lines.append(f"{kind}: {res['tensors']:,} float32 tensors, {res['bytes'] / 2**20:.1f} MiB; "
                     f"files (MiB): {mib}.")
    if "dist" in results:
        d = results["dist"]
        lines.append("large, 2 ranks: " + (f"skipped ({d})" if isinstance(d, str) else
                     "gloo on 127.0.0.1, the state replicated on both ranks, torch threads 1 per rank; "
                     "dcp.save/dcp.load (into preallocated tensors) against save_state/load_state("
                     "group=ckptcore_torch.process_group()), timed on rank 0 from a barrier until "
                     "both are done; both ranks share one disk and two cores."))
    return lines + [""]


# ------------------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--states", default="large,many", help="comma-separated: large,many")
    ap.add_argument("--large-mib", type=float, default=768, help="the large state, MiB (12 tensors)")
    ap.add_argument("--many-count", type=int, default=10_000, help="tensors of the many state")
    ap.add_argument("--many-mib", type=float, default=40, help="the many state, MiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    ap.add_argument("--only", default=",".join(ORDER),
                    help="contenders, comma-separated (ckptcore always runs): " + ",".join(ORDER))
    ap.add_argument("--evict", choices=["fadvise", "drop_caches"], default="fadvise",
                    help="cold-cache method (fadvise touches only this benchmark's files)")
    ap.add_argument("--no-async", action="store_true", help="skip the async saves")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    ap.add_argument("--dist", action="store_true", help="also two ranks (gloo): DCP vs a ckptcore group")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder under $TMPDIR)")
    ap.add_argument("--quick", action="store_true", help="64 MiB / 1,000 tensors, 1 round, not recorded")
    ap.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    ap.add_argument("--label", default="", help="added to the recorded section's title")
    ap.add_argument("--peak-child", nargs=4, metavar=("STATE", "CONTENDER", "OP", "DIR"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--dist-worker", nargs=3, metavar=("RANK", "PORT", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peak_child:
        peak_child(*args.peak_child, args)
        return
    if args.dist_worker:
        rank, port, out = args.dist_worker
        dist_worker(int(rank), int(port), out, args)
        return
    if args.quick:
        args.large_mib, args.many_count, args.many_mib = 64, 1000, 4
        args.rounds, args.warmup, args.no_record = 1, 1, True
    args.load_start = os.getloadavg()[0]
    started = time.time()
    skipped, versions = available()
    wanted = [n for n in args.only.split(",") if n]
    for n in wanted:
        if n not in ORDER:
            ap.error(f"unknown contender {n!r} (known: {', '.join(ORDER)})")
    names = [n for n in ORDER if (n == "ck" or n in wanted) and n not in skipped]
    for n, why in skipped.items():
        print(f"{NAMES[n]}: skipped ({why})", flush=True)
    print(", ".join(f"{k} {v}" for k, v in versions.items())
          + f"; load average {args.load_start:.1f}", flush=True)
    results: dict = {}
    for kind in [k for k in args.states.split(",") if k]:
        if kind not in ("large", "many"):
            ap.error(f"unknown state {kind!r} (large, many)")
        print(f"== {kind}: {describe(kind, args)}", flush=True)
        res = sync_rounds(kind, args, names)
        gc.collect()
        if not args.no_async:
            res["times"].update(async_rounds(kind, args, [n for n in names if n in ASYNC])["times"])
            gc.collect()
        if not args.no_memory:
            res["memory"] = peak_memory(kind, args, names)
        results[kind] = res
    if args.dist:
        if "dcp" not in names:
            results["dist"] = "DCP not run"
        else:
            print("== large, two ranks (gloo)", flush=True)
            results["dist"] = dist_rounds(args)
    lines = report(results, args, {n: w for n, w in skipped.items()}, versions)
    lines[-1:-1] = [f"Run took {time.time() - started:.0f} s."]
    print("\n" + "\n".join(lines))
    if not args.no_record:
        from _report import record
        record(args.results, "\n".join(lines))
        print(f"appended to {args.results}")


if __name__ == "__main__":
    main()
