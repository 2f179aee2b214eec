"""Paddle: ckptcore's capture + save and restore against ``paddle.save`` / ``paddle.load``.

A model of about 200 MB of float32 parameters (three 4096x4096 ``nn.Linear``; ``--size-mb``
scales the side) with ``paddle.optimizer.Adam`` after one step, so its ``moment1``/``moment2``
slots exist (about 600 MB of state in all).  In one process, in interleaved rounds:

* save, capture included: ``ckptcore.save_state(dir, ckptcore_paddle.capture(net, opt, copy=False))``
  (a synchronous save needs no copy of the tensors: it writes them before training goes on) and
  ``ckptcore.save_state(dir, model=net, optimizer=opt)`` (the keyword path: the adapter's
  ``capture_views`` lets it borrow the tensors too, and it also captures the RNG states), against ``paddle.save(net.state_dict(), .pdparams)`` +
  ``paddle.save(opt.state_dict(), .pdopt)``; every file is fsynced inside the timing (ckptcore does
  it itself; for Paddle we do);
* restore into a second model and optimizer that have also stepped (so Paddle cannot park the
  values for later): ``ckptcore.load_state(dir, model=..., optimizer=...)`` (checksums verified)
  against ``set_state_dict(paddle.load(...))`` for both, twice: right after the save, with the
  files in the page cache (a process restarted on the same machine after a crash: the
  libraries' own cost, and the target), and cold, with the files evicted from the page cache
  first (``posix_fadvise(DONTNEED)`` on these files only: a resume on a fresh machine).

The cold restore is reported but not the target: there both libraries wait mostly on the disk
(about 1 GB/s here, and noisy: the machine is shared), so its ratio measures the disk more than
either library (bench_keras.py also times a raw read of the same bytes, for reference).

Prints a table and the targets (save >= 2x, warm restore >= 1.5x faster), and appends them to
benchmarks/RESULTS.md unless ``--no-record``.

    python benchmarks/bench_paddle.py                # ~200 MB of parameters, 5 rounds
    python benchmarks/bench_paddle.py --quick        # 50 MB, 2 rounds, not recorded
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import sys
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "adapters"))
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import paddle  # noqa: E402

import ckptcore  # noqa: E402
import ckptcore_paddle  # noqa: E402
from _common import clean, evict, fsync_paths, summary, timed  # noqa: E402


def build(size_mb: float, seed: int):
    """Three square Linear layers totalling ``size_mb`` MiB, Adam, one step taken."""
    side = int(math.sqrt(size_mb * 2**20 / 4 / 3))
    paddle.seed(seed)
    with paddle.utils.unique_name.guard():  # the same runtime names, which paddle.load needs
        net = paddle.nn.Sequential(*[paddle.nn.Linear(side, side) for _ in range(3)])
        opt = paddle.optimizer.Adam(1e-3, parameters=net.parameters())
        net(paddle.randn([4, side])).square().mean().backward()
        opt.step()
        opt.clear_grad()
    return net, opt


def state_bytes(net, opt) -> int:
    n = sum(int(np.prod(p.shape)) * 4 for p in net.parameters())
    return n + sum(int(np.prod(v.shape)) * 4 for acc in opt._accumulators.values() for v in acc.values())


def _same(a, b) -> bool:
    return all(np.array_equal(x.numpy(), y.numpy()) for x, y in zip(a.parameters(), b.parameters()))


def run(args) -> dict:
    net, opt = build(args.size_mb, 0)
    net2, opt2 = build(args.size_mb, 1)
    total = state_bytes(net, opt)
    ck = os.path.join(args.dir, "ckptcore")
    pd = os.path.join(args.dir, "paddle")
    pd_files = [pd + ".pdparams", pd + ".pdopt"]

    def ck_save():  # save_state fsyncs every file itself
        ckptcore.save_state(ck, ckptcore_paddle.capture(net, opt, copy=False))

    def kw_save():
        ckptcore.save_state(ck, model=net, optimizer=opt)

    def pd_save():
        paddle.save(net.state_dict(), pd_files[0])
        paddle.save(opt.state_dict(), pd_files[1])
        fsync_paths(pd_files)

    def ck_load():
        ckptcore.load_state(ck, model=net2, optimizer=opt2)

    def pd_load():
        net2.set_state_dict(paddle.load(pd_files[0]))
        opt2.set_state_dict(paddle.load(pd_files[1]))

    times: dict[str, list[float]] = {}
    for r in range(args.warmup + args.rounds):
        got = {}
        clean(ck)
        got["kw_save"] = timed(kw_save)
        order = [("ck", ck_save, ck_load, [ck]), ("pd", pd_save, pd_load, pd_files)]
        for name, save, load, paths in order if (r - args.warmup) % 2 == 0 else order[::-1]:
            for p in paths:
                clean(p)
            got[f"{name}_save"] = timed(save)
            for kind in ("warm", "load"):  # right after the save (page cache warm), then cold
                if kind == "load":
                    evict(paths, "fadvise")
                got[f"{name}_{kind}"] = timed(load)
                assert _same(net, net2), f"{name}: restored parameters differ"
                net2(paddle.ones([1, net2[0].weight.shape[0]])).sum().backward()  # disturb before the next load
                opt2.step()
                opt2.clear_grad()
        if r >= args.warmup:  # the first rounds fault in memory and warm Paddle up
            for k, v in got.items():
                times.setdefault(k, []).append(v)
    sizes = {"ckptcore": sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(ck) for f in fs),
             "paddle": sum(os.path.getsize(p) for p in pd_files)}
    for p in [ck, *pd_files]:
        clean(p)
    return {"bytes": total, "sizes": sizes, "times": {k: summary(v) for k, v in times.items()},
            "rounds": args.rounds, "warmup": args.warmup}


def report(res: dict, args) -> list[str]:
    t = res["times"]
    gb = res["bytes"] / 1e9
    rows = [("save: capture(copy=False) + save_state", "ck_save", "pd_save", 2.0),
            ("save: save_state(model=, optimizer=)", "kw_save", "pd_save", None),
            ("restore, page cache warm: load_state(model=, optimizer=)", "ck_warm", "pd_warm", 1.5),
            ("restore, cold from disk (informative: mostly the disk)", "ck_load", "pd_load", None)]
    lines = [f"## Paddle adapter: ckptcore vs paddle.save / paddle.load ({datetime.date.today()})", "",
             f"paddle {paddle.__version__}, numpy {np.__version__}, Python {platform.python_version()}, "
             f"{os.cpu_count()} CPUs; state {res['bytes'] / 2**20:.0f} MiB (parameters + Adam slots); "
             f"files {res['sizes']['ckptcore'] / 2**20:.0f} / {res['sizes']['paddle'] / 2**20:.0f} MiB "
             f"(ckptcore / paddle); {res['rounds']} interleaved rounds after {res['warmup']} discarded; "
             "cold restores after fadvise DONTNEED on the files.", "",
             "| operation | ckptcore s (median / best) | paddle s (median / best) | ckptcore GB/s | "
             "speed-up (median) | target | met |", "|---|---:|---:|---:|---:|---:|---|"]
    for label, c, p, need in rows:
        ratio = t[p]["median"] / t[c]["median"]
        target, met = ("-", "-") if need is None else (f">= {need:g}x", "yes" if ratio >= need else "NO")
        lines.append(f"| {label} | {t[c]['median']:.3f} / {t[c]['best']:.3f} | {t[p]['median']:.3f} / "
                     f"{t[p]['best']:.3f} | {gb / t[c]['median']:.2f} | {ratio:.2f}x | {target} | {met} |")
    lines += ["", "Both save rows borrow the live tensors (a synchronous save needs no copy); the keyword "
              "path also runs the adapter registry and capture of the scheduler and RNG states."]
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=200.0, help="parameter MiB (Adam adds twice that)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder under /tmp)")
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    ap.add_argument("--quick", action="store_true", help="50 MB, 2 rounds, not recorded")
    ap.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = ap.parse_args()
    if args.quick:
        args.size_mb, args.rounds, args.warmup, args.no_record = 50.0, 2, 0, True
    paddle.set_device("cpu")
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        args.dir = d
        lines = report(run(args), args)
    print("\n".join(lines))
    if not args.no_record:
        with open(os.path.join(HERE, "RESULTS.md"), "a") as f:
            f.write("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
