"""PyTorch real architectures: ckptcore against torch.save / torch.load and torch.distributed.checkpoint.

A ResNet-50 (320 state_dict entries, 100 MB of parameters: per-tensor costs decide it) and a
GPT-2-small-sized Transformer (124M parameters, tied LM head: the bytes decide it), both
defined in ``_torch_models.py`` (torchvision is not installed), each with ``torch.optim.AdamW``
after one step, so every slot (``step``, ``exp_avg``, ``exp_avg_sq``) exists.  One model at a
time, in one process, in interleaved rounds (the order of the contenders rotates each round;
the first ``--warmup`` rounds are not counted):

* save, until durable, each into a fresh path (the previous output deleted and the deletion
  synced first): ``ckptcore.save_state(dir, model=m, optimizer=opt)`` (it fsyncs itself);
  ``torch.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, f)`` + an fsync of the
  file; ``torch.distributed.checkpoint.save`` (DCP, one process, no process group) of the same
  two state dicts, which fsyncs its files itself (``sync_files=True``, its default; the fsync
  we add finds nothing left to do);
* restore into a second model and optimizer that have stepped too (every saved value is
  changed in place between restores, so each restore has everything to put back, and each is
  checked bit for bit against the saved pair): ``ckptcore.load_state(dir, model=, optimizer=)``
  (checksums verified); ``torch.load`` + ``load_state_dict`` of the model and the optimizer;
  ``dcp.load`` into the live objects' state dicts + ``load_state_dict`` of both.  Warm (right
  after the save: the files in the page cache, the target) and cold (after ``fsync`` +
  ``posix_fadvise(DONTNEED)`` on the files; informative: it also measures the disk);
* async: ``CheckpointManager(root, async_save=True, keep=1).save(step, model=, optimizer=)``
  against ``dcp.async_save(state_dicts, checkpoint_id=...)``: the time until the call returns
  (the caller is blocked that long) and until the save is done, one save in flight at a time.

The ckptcore contender uses the adapter (``ckptcore_torch.capture``/``restore`` behind
``save_state(model=...)``) when it is installed.  Until then, and with ``--fallback``, it saves
a ``TrainingState`` of NumPy views of the live tensors (``Tensor.numpy()``, no copy; the tied
head stored once) and restores by ``load_state`` + ``Tensor.copy_`` of each loaded array into
the live tensors; the output says which path ran.

Targets (ratios = the alternative's median time over ckptcore's; > 1: ckptcore faster): save
>= 1.5x ``torch.save`` and >= 1.2x DCP; warm restore >= 1.3x ``torch.load`` +
``load_state_dict`` and >= 1.2x DCP; async blocking time <= DCP's.

``--dist`` adds two ranks (real processes, gloo on 127.0.0.1): DCP save and load across both
against ``save_state(..., group=ckptcore_torch.process_group())`` and ``load_state(..., group=)``
(skipped with the reason printed when ``ckptcore_torch`` has no process group yet).

    python benchmarks/bench_models_torch.py                    # both models, 3 rounds
    python benchmarks/bench_models_torch.py --quick            # small models, 2 rounds, not recorded
    python benchmarks/bench_models_torch.py --models gpt2 --rounds 5 --dist
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import logging
import os
import platform
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "adapters"))
warnings.filterwarnings("ignore")  # DCP warns on every single-process call
logging.getLogger("ckptcore").setLevel(logging.WARNING)  # the manager logs each retention deletion

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import _torch_models as tm  # noqa: E402
import ckptcore  # noqa: E402
from _common import clean, evict, files_under, fsync_paths, summary, timed, cell  # noqa: E402

TARGETS = {  # (operation, alternative): the least ratio ckptcore must reach
    ("save", "ts"): 1.5, ("save", "dcp"): 1.2, ("warm", "ts"): 1.3, ("warm", "dcp"): 1.2}
NAMES = {"ck": "ckptcore", "ts": "torch.save/load", "dcp": "DCP", "raw": "raw one file"}


def adapter_ready() -> bool:
    """Whether ckptcore_torch can capture (its ``_capture`` module exists)."""
    return importlib.util.find_spec("ckptcore_torch._capture") is not None


# ---------------------------------------------------------------------------- the contenders
class Contenders:
    """Each contender's save and restore for one model, writing under ``root``."""

    def __init__(self, root: str, src: tuple, dst: tuple, use_adapter: bool):
        self.src, self.dst, self.adapter = src, dst, use_adapter
        self.paths = {"ck": os.path.join(root, "ckptcore"), "ts": os.path.join(root, "torch.pt"),
                      "dcp": os.path.join(root, "dcp"), "raw": os.path.join(root, "raw.bin")}

    def save(self, name: str) -> None:
        m, opt = self.src
        path = self.paths[name]
        if name == "ck":
            if self.adapter:
                ckptcore.save_state(path, model=m, optimizer=opt)
            else:
                ckptcore.save_state(path, tm.as_state(m, opt))
        elif name == "ts":
            torch.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, path)
            fsync_paths([path])
        elif name == "raw":
            tm.raw_save(path, tm.distinct(m, opt))
        else:
            dcp.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=path)
            fsync_paths([path])

    def load(self, name: str) -> None:
        m, opt = self.dst
        path = self.paths[name]
        if name == "ck":
            if self.adapter:
                ckptcore.load_state(path, model=m, optimizer=opt)
            else:
                tm.put_back(ckptcore.load_state(path), m, opt)
        elif name == "raw":
            tm.raw_load(path, tm.distinct(m, opt))
        elif name == "ts":
            sd = torch.load(path)
            m.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optimizer"])
        else:
            sd = {"model": m.state_dict(), "optimizer": opt.state_dict()}
            dcp.load(sd, checkpoint_id=path)
            m.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optimizer"])



def check(c: Contenders, label: str) -> None:
    bad = tm.same(c.src, c.dst)
    if bad is not None:
        raise AssertionError(f"{label}: the restored state differs from the saved one at {bad}")
    tm.perturb(*c.dst)  # the next restore has every value to put back


def sync_rounds(name: str, args, use_adapter: bool) -> dict:
    src, dst = tm.build(name, 0, args.quick), tm.build(name, 1, args.quick)
    names = ["ck", "ts", "dcp", "raw"]
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        c = Contenders(root, src, dst, use_adapter)
        for r in range(args.warmup + args.rounds):
            got = {}
            k = r % len(names)
            for n in names[k:] + names[:k]:  # rotate who goes first
                clean(c.paths[n])
                got[f"{n}_save"] = timed(lambda: c.save(n))
                got[f"{n}_warm"] = timed(lambda: c.load(n))
                check(c, f"{name}: {NAMES[n]} warm restore")
                evict([c.paths[n]], "fadvise")
                got[f"{n}_cold"] = timed(lambda: c.load(n))
                check(c, f"{name}: {NAMES[n]} cold restore")
            print(f"  {name} round {r}{' (warm-up)' if r < args.warmup else ''}: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)
            if r >= args.warmup:
                for k, v in got.items():
                    times.setdefault(k, []).append(v)
        sizes = {n: sum(os.path.getsize(f) for f in files_under([c.paths[n]])) for n in names}
    return {"times": times, "sizes": sizes, "bytes": tm.state_bytes(*src),
            "entries": len(tm.flat(*src)), "params": sum(p.numel() for p in src[0].parameters())}


def async_rounds(name: str, args, use_adapter: bool) -> dict:
    """Blocking and total time of an async save, ckptcore's manager against dcp.async_save."""
    m, opt = tm.build(name, 0, args.quick)
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        mgr = ckptcore.CheckpointManager(os.path.join(root, "ck"), async_save=True, keep=1)
        dcp_prev = None
        for r in range(args.warmup + args.rounds):
            got = {}
            for n in (["ck", "dcp"] if r % 2 == 0 else ["dcp", "ck"]):
                t0 = time.perf_counter()
                if n == "ck":
                    handle = (mgr.save(r + 1, model=m, optimizer=opt) if use_adapter
                              else mgr.save(r + 1, tm.as_state(m, opt)))
                else:
                    path = os.path.join(root, f"dcp-{r}")
                    handle = dcp.async_save({"model": m.state_dict(), "optimizer": opt.state_dict()},
                                            checkpoint_id=path)
                got[f"{n}_block"] = time.perf_counter() - t0
                handle.result()
                got[f"{n}_total"] = time.perf_counter() - t0
                if n == "dcp":  # retention for DCP too, outside its time
                    if dcp_prev:
                        clean(dcp_prev)
                    dcp_prev = path
            print(f"  {name} async round {r}{' (warm-up)' if r < args.warmup else ''}: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)
            if r >= args.warmup:
                for k, v in got.items():
                    times.setdefault(k, []).append(v)
        mgr.close()
    return {"times": times}


# ------------------------------------------------------------------------------ two ranks (--dist)
def group_ready() -> str | None:
    """None when ckptcore_torch offers a process group, else why the two-rank part is skipped."""
    if importlib.util.find_spec("ckptcore_torch._group") is None:
        return "ckptcore_torch has no _group module yet (ckptcore_torch.process_group())"
    return None


def dist_worker(rank: int, port: int, out: str, name: str, args) -> None:
    """One of two ranks: DCP and ckptcore's group save and load of the same replicated state,
    in alternating order, timed on rank 0 from a barrier until every rank is done."""
    import json

    import torch.distributed as dist

    import ckptcore_torch

    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = ckptcore_torch.process_group()
    use_adapter = adapter_ready() and not args.fallback
    src, dst = tm.build(name, 0, args.quick), tm.build(name, 1, args.quick)
    c = Contenders(out, src, dst, use_adapter)
    times: dict[str, list[float]] = {}

    def save(n: str) -> None:
        m, opt = src
        if n == "dcp":
            dcp.save({"model": m.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=c.paths[n])
        elif use_adapter:
            ckptcore.save_state(c.paths[n], model=m, optimizer=opt, group=group)
        else:
            ckptcore.save_state(c.paths[n], tm.as_state(m, opt), group=group)

    def load(n: str) -> None:
        m, opt = dst
        if n == "dcp":
            c.load("dcp")
        elif use_adapter:
            ckptcore.load_state(c.paths[n], model=m, optimizer=opt, group=group)
        else:
            tm.put_back(ckptcore.load_state(c.paths[n], group=group), m, opt)

    for r in range(args.warmup + args.rounds):
        for n in (["ck", "dcp"] if r % 2 else ["dcp", "ck"]):
            for op, fn in (("save", save), ("warm", load)):
                dist.barrier()
                t0 = time.perf_counter()
                fn(n)
                dist.barrier()
                if r >= args.warmup and rank == 0:
                    times.setdefault(f"{n}_{op}", []).append(time.perf_counter() - t0)
            check(c, f"{name}, rank {rank}: {NAMES[n]} restore across 2 ranks")
            dist.barrier()
            if rank == 0:
                clean(c.paths[n])
    if rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"times": times, "adapter": use_adapter}, f)
    dist.destroy_process_group()


def dist_rounds(name: str, args) -> dict:
    import json
    import subprocess

    from _common import free_ports

    with tempfile.TemporaryDirectory(dir=args.dir) as out:
        port = free_ports(1)[0]
        cmd = [sys.executable, os.path.abspath(__file__), "--rounds", str(args.rounds),
               "--warmup", str(args.warmup)] + (["--quick"] if args.quick else []) \
            + (["--fallback"] if args.fallback else [])
        procs = [subprocess.Popen(cmd + ["--dist-worker", str(r), str(port), out, name])
                 for r in range(2)]
        codes = [p.wait(timeout=3600) for p in procs]
        if any(codes):
            raise RuntimeError(f"{name}: a two-rank worker failed (exit codes {codes})")
        with open(os.path.join(out, "result.json")) as f:
            return json.load(f)


# ------------------------------------------------------------------------------------- report

ROWS = [  # label, operation key, contenders, targets {alternative: least ratio}
    ("save + fsync", "save", ("ck", "ts", "dcp", "raw"),
     {"ts": TARGETS["save", "ts"], "dcp": TARGETS["save", "dcp"]}),
    ("restore into live objects, page cache warm", "warm", ("ck", "ts", "dcp", "raw"),
     {"ts": TARGETS["warm", "ts"], "dcp": TARGETS["warm", "dcp"]}),
    ("restore, cold (informative)", "cold", ("ck", "ts", "dcp", "raw"), {}),
    ("async save: caller blocked", "block", ("ck", "dcp"), {"dcp": 1.0}),
    ("async save: until done (informative)", "total", ("ck", "dcp"), {}),
]


def model_rows(name: str, res: dict, verdicts: list[str]) -> list[str]:
    t = {k: summary(v) for k, v in res["times"].items()}
    lines = []
    for label, op, who, need in ROWS:
        if f"ck_{op}" not in t:
            continue
        ck = t[f"ck_{op}"]["median"]
        cells, ratios, mets = [], [], []
        for n in ("ck", "ts", "dcp", "raw"):
            cells.append(cell(t[f"{n}_{op}"]) if n in who else "-")
        for alt in ("ts", "dcp", "raw"):
            if alt not in who:
                ratios.append("-")
                continue
            ratio = t[f"{alt}_{op}"]["median"] / ck
            ratios.append(f"{ratio:.2f}x")
            if alt in need:
                ok = ratio >= need[alt]
                mets.append(f"vs {NAMES[alt]} >= {need[alt]:g}x: {'PASS' if ok else 'FAIL'}")
                verdicts.append(f"{name} {label} vs {NAMES[alt]}: {ratio:.2f}x (target >= "
                                f"{need[alt]:g}x) {'PASS' if ok else 'FAIL'}")
        lines.append(f"| {name} | {label} | " + " | ".join(cells) + " | " + " | ".join(ratios)
                     + f" | {'; '.join(mets) or '-'} |")
    return lines


def report(results: dict, args, path_note: str) -> list[str]:
    today = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"## PyTorch real architectures: ckptcore vs torch.save / DCP ({today:%Y-%m-%d %H:%M} UTC)"
             + (f" - {args.label}" if args.label else ""), "",
             f"torch {torch.__version__}, numpy {np.__version__}, Python {platform.python_version()}, "
             f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}; AdamW after one step; "
             f"{args.rounds} interleaved rounds after {args.warmup} discarded; times in seconds as "
             "median [best-worst]; ratios are the alternative's median over ckptcore's (> 1: "
             "ckptcore faster); cold restores after fadvise DONTNEED on the files; every restore "
             f"checked bit for bit. ckptcore path: {path_note}. Load average (1 min) at the start "
             f"and end of the run: {args.load_start:.1f}, {os.getloadavg()[0]:.1f} "
             f"({os.cpu_count()} CPUs; other work on the machine shows here).", ""]
    lines += ["| model | operation | ckptcore | torch.save / torch.load | DCP | raw one file (floor) | "
              "vs torch | vs DCP | vs raw | targets |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    verdicts: list[str] = []
    for name, res in results.items():
        lines += model_rows(name, res, verdicts)
    lines.append("")
    for name, res in results.items():
        mib = {n: s / 2**20 for n, s in res["sizes"].items()}
        lines.append(f"{name}: {res['params'] / 1e6:.1f}M parameters, {res['entries']} tensors "
                     f"(model state_dict + optimizer state), {res['bytes'] / 2**20:.0f} MiB of "
                     f"distinct tensors; files {mib['ck']:.0f} / {mib['ts']:.0f} / {mib['dcp']:.0f} / "
                     f"{mib['raw']:.0f} MiB (ckptcore / torch.save / DCP / raw).")
        if res.get("dist"):
            lines.append(f"{name}, two ranks: {res['dist']}")
    lines += ["", "Verdicts: " + "; ".join(verdicts) + ".", ""]
    return lines


def dist_note(d: dict | str) -> str:
    if isinstance(d, str):
        return f"skipped ({d})"
    t = {k: summary(v) for k, v in d["times"].items()}
    parts = []
    for op, label in (("save", "save"), ("warm", "warm restore")):
        ratio = t[f"dcp_{op}"]["median"] / t[f"ck_{op}"]["median"]
        parts.append(f"{label} ckptcore group {cell(t[f'ck_{op}'])} s vs DCP {cell(t[f'dcp_{op}'])} s "
                     f"= {ratio:.2f}x")
    return "; ".join(parts) + " (informative; gloo on 127.0.0.1, both ranks on one disk and 2 cores)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(tm.MODELS), help="comma-separated: resnet50,gpt2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder under $TMPDIR)")
    ap.add_argument("--quick", action="store_true", help="small models, 2 rounds, not recorded")
    ap.add_argument("--fallback", action="store_true",
                    help="ckptcore saves a TrainingState of NumPy views even when the adapter is there")
    ap.add_argument("--no-async", action="store_true", help="skip the async comparison")
    ap.add_argument("--dist", action="store_true", help="also two ranks (gloo): DCP vs ckptcore group save/load")
    ap.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    ap.add_argument("--label", default="", help="added to the recorded section's title")
    ap.add_argument("--dist-worker", nargs=4, metavar=("RANK", "PORT", "DIR", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dist_worker:
        rank, port, out, name = args.dist_worker
        dist_worker(int(rank), int(port), out, name, args)
        return
    if args.quick:
        args.rounds, args.warmup, args.no_record = min(args.rounds, 2), 1, True
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in tm.MODELS:
            ap.error(f"unknown model {m!r} (known: {', '.join(tm.MODELS)})")
    args.load_start = os.getloadavg()[0]
    use_adapter = adapter_ready() and not args.fallback
    path_note = ("the adapter: save_state(dir, model=, optimizer=), load_state(dir, model=, optimizer=), "
                 "CheckpointManager.save(step, model=, optimizer=)" if use_adapter else
                 "FALLBACK (" + ("--fallback" if args.fallback else "ckptcore_torch._capture not present yet")
                 + "): a TrainingState of zero-copy NumPy views of the live tensors saved, restored by "
                 "load_state + Tensor.copy_ into the live tensors")
    print(f"ckptcore path: {path_note}", flush=True)
    results = {}
    for name in models:  # one model at a time: GPT-2 and AdamW are 1.4 GiB a copy
        print(f"== {name}{' (quick: reduced size)' if args.quick else ''}", flush=True)
        res = sync_rounds(name, args, use_adapter)
        if not args.no_async:
            res["times"].update(async_rounds(name, args, use_adapter)["times"])
        if args.dist:
            why = group_ready()
            if why:
                print(f"  two ranks skipped: {why}", flush=True)
            res["dist"] = dist_note(why or dist_rounds(name, args))
        results[name] = res
    lines = report(results, args, path_note)
    print("\n" + "\n".join(lines))
    if not args.no_record:
        from _report import record
        record(args.results, "\n".join(lines))


if __name__ == "__main__":
    main()
