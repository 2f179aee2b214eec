"""Paddle real architectures: ckptcore against paddle.save / paddle.load and safetensors.

``paddle.vision.models.resnet50`` and ``mobilenet_v2`` (``pretrained=False``) with
``paddle.optimizer.Adam`` after one training step (so every ``moment1``/``moment2``/``beta*_pow_acc``
slot exists): about 900 tensors each, most of them small (BatchNorm means and variances, biases,
one-element beta powers), 40 MB and 300 MB of state.  That is the point: per-tensor costs, not the
disk, decide these.  In one process, in interleaved rounds (the order rotates each round):

* save, until durable: ``ckptcore.save_state(dir, model=net, optimizer=opt)`` (what users call; it
  fsyncs itself) and ``CheckpointManager.save(step, model=net, optimizer=opt)`` (a synchronous
  manager: also its lock, retention and step folder), against ``paddle.save(net.state_dict())`` +
  ``paddle.save(opt.state_dict())`` + an fsync of both files, and against safetensors:
  ``save_file`` of the same arrays (``.numpy()`` of every model and optimizer tensor, included in
  the time: a Paddle user has to make them) + fsync;
* restore into a second model and optimizer that have also stepped (and step again between
  loads, so every load has values to change): ``ckptcore.load_state(dir, model=, optimizer=)``
  (checksums verified) against ``set_state_dict(paddle.load(...))`` for the model and the
  optimizer, and ``set_state_dict(load_file(...))`` for safetensors; warm (right after the save:
  the files in the page cache, the target) and cold (after ``posix_fadvise(DONTNEED)`` on the
  files; informative: it also measures the disk).  Every restore is checked bit for bit.
* peak memory a save adds: in a fresh subprocess per contender, the model is built, the peak RSS
  (``VmHWM``) reset, one save run, and the rise of ``VmHWM`` over the RSS before it reported (a
  fresh process, so no earlier round's freed-but-kept heap hides a copy).

Prints a table with ratios (median over median) and verdicts against the targets (save >= 1.7x
``paddle.save``, warm restore >= 1.5x ``paddle.load`` + ``set_state_dict``; issue 25 raised them
from 1.5x and 1.3x), and appends it to benchmarks/RESULTS.md unless ``--no-record``.

    python benchmarks/bench_models_paddle.py            # both architectures, 5 rounds (~3 minutes)
    python benchmarks/bench_models_paddle.py --quick    # mobilenet_v2, 2 rounds, no peak memory, not recorded
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "adapters"))
warnings.filterwarnings("ignore")
logging.getLogger("ckptcore").setLevel(logging.WARNING)  # the manager logs each retention deletion

import numpy as np  # noqa: E402
import paddle  # noqa: E402

import ckptcore  # noqa: E402
from _common import clean, evict, files_under, fsync_paths, reset_peak_rss, summary, timed, vm_status, cell  # noqa: E402

ARCHS = ("mobilenet_v2", "resnet50")
SAVE_TARGET, RESTORE_TARGET = 1.7, 1.5


def build(arch: str, seed: int):
    """``arch`` with Adam after one step on a small random batch."""
    paddle.seed(seed)
    with paddle.utils.unique_name.guard():  # the same runtime names in both copies, which paddle.load needs
        net = getattr(paddle.vision.models, arch)(pretrained=False)
        opt = paddle.optimizer.Adam(1e-3, parameters=net.parameters())
        disturb(net, opt)
    return net, opt


def disturb(net, opt) -> None:
    net.train()
    net(paddle.randn([2, 3, 64, 64])).mean().backward()
    opt.step()
    opt.clear_grad()


def tensors(net, opt) -> dict[str, object]:
    """Every tensor of the two state dicts, by a key safetensors accepts."""
    out = {f"model.{k}": v for k, v in net.state_dict().items()}
    out.update({f"opt.{k}": v for k, v in opt.state_dict().items() if hasattr(v, "numpy")})
    return out


def state_bytes(net, opt) -> int:
    return sum(int(np.prod(v.shape)) * v.element_size() for v in tensors(net, opt).values())


def same(net, opt, net2, opt2) -> bool:
    a, b = tensors(net, opt), tensors(net2, opt2)
    return a.keys() == b.keys() and all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)


class Contenders:
    """The save and load of each contender for one architecture, writing under ``root``."""

    def __init__(self, root: str, net, opt, net2, opt2):
        self.net, self.opt, self.net2, self.opt2 = net, opt, net2, opt2
        self.ck = os.path.join(root, "ckptcore")
        self.mgr_root = os.path.join(root, "manager")
        self.pd = [os.path.join(root, "paddle.pdparams"), os.path.join(root, "paddle.pdopt")]
        self.st = [os.path.join(root, "model.safetensors"), os.path.join(root, "opt.safetensors")]
        self.step, self.mgr = 0, None

    def paths(self, name: str) -> list[str]:
        return {"ck": [self.ck], "mgr": [self.mgr_root], "pd": self.pd, "st": self.st}[name]

    def save(self, name: str) -> None:
        getattr(self, f"save_{name}")()

    def load(self, name: str) -> None:
        getattr(self, f"load_{name}")()

    def save_ck(self) -> None:
        ckptcore.save_state(self.ck, model=self.net, optimizer=self.opt)

    def save_mgr(self) -> None:
        # One manager for the run, as a training loop has; keep=1 deletes the previous step (in the time).
        if self.mgr is None:
            self.mgr = ckptcore.CheckpointManager(self.mgr_root, keep=1)
        self.step += 1
        self.mgr.save(self.step, model=self.net, optimizer=self.opt)

    def save_pd(self) -> None:
        paddle.save(self.net.state_dict(), self.pd[0])
        paddle.save(self.opt.state_dict(), self.pd[1])
        fsync_paths(self.pd)

    def save_st(self) -> None:
        from safetensors.numpy import save_file
        save_file({k: v.numpy() for k, v in self.net.state_dict().items()}, self.st[0])
        save_file({k: v.numpy() for k, v in self.opt.state_dict().items() if hasattr(v, "numpy")}, self.st[1])
        fsync_paths(self.st)

    def load_ck(self) -> None:
        ckptcore.load_state(self.ck, model=self.net2, optimizer=self.opt2)

    def load_pd(self) -> None:
        self.net2.set_state_dict(paddle.load(self.pd[0]))
        self.opt2.set_state_dict(paddle.load(self.pd[1]))

    def load_st(self) -> None:
        from safetensors.numpy import load_file
        self.net2.set_state_dict(load_file(self.st[0]))
        self.opt2.set_state_dict(load_file(self.st[1]))


def run_arch(arch: str, args) -> dict:
    net, opt = build(arch, 0)
    net2, opt2 = build(arch, 1)
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        c = Contenders(root, net, opt, net2, opt2)
        names = ["ck", "pd", "st"]
        times: dict[str, list[float]] = {}
        for r in range(args.warmup + args.rounds):
            got: dict[str, float] = {}
            got["mgr_save"] = timed(c.save_mgr)
            order = names[r % len(names):] + names[:r % len(names)]  # rotate who goes first
            for name in order:
                for p in c.paths(name):
                    clean(p)
                got[f"{name}_save"] = timed(lambda: c.save(name))
                for kind in ("warm", "cold"):
                    if kind == "cold":
                        evict(c.paths(name), "fadvise")
                    got[f"{name}_{kind}"] = timed(lambda: c.load(name))
                    if not same(net, opt, net2, opt2):
                        raise AssertionError(f"{arch}: {name} {kind} restore differs from the saved state")
                    disturb(net2, opt2)  # the next load has values to change
            if r >= args.warmup:  # the first rounds fault memory in and warm Paddle up
                for k, v in got.items():
                    times.setdefault(k, []).append(v)
        sizes = {n: sum(os.path.getsize(f) for f in files_under(c.paths(n))) for n in names}
        c.mgr.close()
    return {"arch": arch, "tensors": len(tensors(net, opt)), "bytes": state_bytes(net, opt), "sizes": sizes,
            "times": {k: summary(v) for k, v in times.items()}}


# ---------------------------------------------------------------------------------------- peak memory
def peak_worker(arch: str, name: str, root: str) -> None:
    """Build, reset VmHWM, save once with ``name``, print the rise as JSON (runs in a subprocess)."""
    paddle.set_device("cpu")
    net, opt = build(arch, 0)
    c = Contenders(root, net, opt, None, None)
    if not reset_peak_rss():
        print(json.dumps({"error": "cannot reset VmHWM (/proc/self/clear_refs)"}))
        return
    base = vm_status("VmRSS")
    c.save(name)
    print(json.dumps({"added": vm_status("VmHWM") - base}))


def peak_memory(arch: str, args) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name in ("ck", "pd", "st"):
        with tempfile.TemporaryDirectory(dir=args.dir) as root:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--peak-worker", arch, name, root],
                                  capture_output=True, text=True, env=os.environ.copy())
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        res = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"error": proc.stderr[-300:]}
        out[name] = res.get("added")
    return out


# ---------------------------------------------------------------------------------------- report

def report(results: list[dict], args) -> list[str]:
    lines = [f"## Paddle real architectures: ckptcore vs paddle.save / paddle.load / safetensors "
             f"({datetime.date.today()}){' - ' + args.label if args.label else ''}", "",
             f"paddle {paddle.__version__}, numpy {np.__version__}, Python {platform.python_version()}, "
             f"{os.cpu_count()} CPUs; Adam after one step; {args.rounds} interleaved rounds after {args.warmup} "
             "discarded; times in seconds as median [best-worst]; ratios are median over median "
             "(> 1: ckptcore faster); cold restores after fadvise DONTNEED on the files; every restore "
             "checked bit for bit.", ""]
    lines += ["| model | tensors | state MiB | operation | ckptcore | paddle | safetensors | vs paddle | "
              "vs safetensors | target | met |", "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    verdicts = []
    for res in results:
        t = res["times"]
        rows = [("save + fsync: save_state(model=, optimizer=)", "ck_save", "pd_save", "st_save", SAVE_TARGET),
                ("save + fsync: CheckpointManager.save", "mgr_save", "pd_save", "st_save", None),
                ("restore, page cache warm", "ck_warm", "pd_warm", "st_warm", RESTORE_TARGET),
                ("restore, cold (informative)", "ck_cold", "pd_cold", "st_cold", None)]
        for label, c, p, s, need in rows:
            ratio, vs_st = t[p]["median"] / t[c]["median"], t[s]["median"] / t[c]["median"]
            target, met = ("-", "-") if need is None else (f">= {need:g}x", "yes" if ratio >= need else "NO")
            if need is not None:
                verdicts.append(f"{res['arch']} {label.split(':')[0].split(',')[0]}: {ratio:.2f}x "
                                f"(target {need:g}x) {'met' if ratio >= need else 'NOT met'}")
            lines.append(f"| {res['arch']} | {res['tensors']} | {res['bytes'] / 2**20:.0f} | {label} | "
                         f"{cell(t[c])} | {cell(t[p])} | {cell(t[s])} | {ratio:.2f}x | {vs_st:.2f}x | "
                         f"{target} | {met} |")
    lines.append("")
    if any(r.get("peak") for r in results):
        lines += ["Peak memory a save adds (VmHWM rise in a fresh process, MiB; share of the state):", "",
                  "| model | ckptcore | paddle.save | safetensors |", "|---|---:|---:|---:|"]
        for res in results:
            cells = []
            for n in ("ck", "pd", "st"):
                v = res["peak"].get(n)
                cells.append("n/a" if v is None else f"{v / 2**20:.0f} ({v / res['bytes']:.0%})")
            lines.append(f"| {res['arch']} | {' | '.join(cells)} |")
        lines.append("")
    lines += ["Files (MiB): " + "; ".join(
        f"{r['arch']} " + " / ".join(f"{r['sizes'][n] / 2**20:.1f}" for n in ("ck", "pd", "st")) for r in results)
        + " (ckptcore / paddle / safetensors).", "", "Verdicts: " + "; ".join(verdicts) + ".", ""]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", choices=ARCHS, help="architecture (repeatable; default both)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder under $TMPDIR)")
    ap.add_argument("--no-peak", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--quick", action="store_true", help="mobilenet_v2, 2 rounds, no peak memory, not recorded")
    ap.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    ap.add_argument("--label", default="", help="added to the recorded section's title")
    ap.add_argument("--peak-worker", nargs=3, metavar=("ARCH", "CONTENDER", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peak_worker:
        peak_worker(*args.peak_worker)
        return
    if args.quick:
        args.arch, args.rounds, args.warmup, args.no_peak, args.no_record = ["mobilenet_v2"], 2, 1, True, True
    paddle.set_device("cpu")
    results = []
    for arch in args.arch or ARCHS:
        res = run_arch(arch, args)
        res["peak"] = {} if args.no_peak else peak_memory(arch, args)
        results.append(res)
    lines = report(results, args)
    print("\n".join(lines))
    if not args.no_record:
        with open(args.results, "a") as f:
            f.write("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
