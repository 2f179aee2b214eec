"""Draw benchmarks/scaling.png from the raw results of bench_scaling.py (benchmarks/scaling.json).

A 2x2 figure, log-log: save time and restore time against tensor count (top), and against
state size (bottom), one colour per contender.  Points are medians; the bars span the min and
max of the rounds.  Restore panels draw the cold load as a solid line and the warm load
(page cache full) as a dashed line of the same colour.  Needs matplotlib (the ``bench`` extra).

    python benchmarks/plot_scaling.py [scaling.json [scaling.png]]
"""

from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

STYLE = {  # contender: (colour, marker); ckptcore drawn thicker and on top
    "ckptcore": ("#d62728", "o"),
    "raw (one file)": ("#222222", "."),
    "safetensors.numpy": ("#1f77b4", "s"),
    "numpy.savez": ("#9467bd", "v"),
    "tf.train.Checkpoint": ("#ff7f0e", "^"),
    "paddle.save": ("#2ca02c", "D"),
    "torch.save": ("#8c564b", "P"),
    "DCP": ("#e377c2", "X"),
    "Orbax": ("#17becf", "h"),
}
LABEL = {"raw (one file)": "raw one file (writev+fsync / readinto): the floor",
         "tf.train.Checkpoint": "tf.train.Checkpoint write / read",
         "paddle.save": "paddle.save / paddle.load",
         "torch.save": "torch.save / torch.load",
         "DCP": "torch.distributed.checkpoint save / load (in place)",
         "Orbax": "Orbax StandardCheckpointer save / restore (NumPy leaves; zstd, its default)",
         "ckptcore": "ckptcore save_state / load_state(verify=True)",
         "numpy.savez": "numpy.savez / np.load (uncompressed)",
         "safetensors.numpy": "safetensors.numpy save_file / load_file"}


def _series(points: list[dict], name: str, op: str, x_of) -> tuple[list, list, list, list]:
    xs, ys, lo, hi = [], [], [], []
    for p in points:
        r = p["results"].get(name, {}).get(op)
        if r is None:
            continue
        xs.append(x_of(p))
        ys.append(r["median"])
        lo.append(r["median"] - r["min"])
        hi.append(r["max"] - r["median"])
    return xs, ys, lo, hi


def _panel(ax, sweep: dict, names: list[str], ops: tuple[str, ...], x_of, xlabel: str,
           title: str) -> None:
    for name in names:
        colour, marker = STYLE.get(name, ("#7f7f7f", "x"))
        main = name == "ckptcore"
        for op in ops:
            xs, ys, lo, hi = _series(sweep["points"], name, op, x_of)
            if not xs:
                continue
            dashed = op == "warm" and len(ops) > 1
            ax.errorbar(xs, ys, yerr=[lo, hi], color=colour, marker=marker,
                        markersize=4 if dashed else 5, linestyle="--" if dashed else "-",
                        linewidth=(1.0 if dashed else 2.6 if main else 1.5),
                        alpha=0.75 if dashed else 1.0, capsize=2, zorder=3 if main else 2)
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}")  # 1,000 not 10^3
    ax.xaxis.set_major_formatter(plain)
    ax.yaxis.set_major_formatter(plain)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("seconds (median; bars: min to max)")
    ax.set_title(title, fontsize=11)
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", alpha=0.12)


def plot(data: dict, path: str) -> None:
    m, sweeps = data["meta"], data["sweeps"]
    names = m["contenders"]
    cold = any("cold" in r for sw in sweeps.values() for p in sw["points"]
               for r in p["results"].values())
    restore_ops = ("cold", "warm") if cold else ("warm",)
    restore = "restore (cold: solid, warm: dashed)" if cold else "restore (warm)"
    fig, axes = plt.subplots(2, 2, figsize=(14, 10.5), squeeze=False, layout="constrained")
    rows = [("count", lambda p: p["tensors"], "tensor count"),
            ("size", lambda p: p["bytes"] / 2**20, "state size (MiB)")]
    for row, (kind, x_of, xlabel) in enumerate(rows):
        if kind not in sweeps:
            for ax in axes[row]:
                ax.set_visible(False)
            continue
        sw = sweeps[kind]
        pts = sw["points"]
        fixed = (f"{pts[0]['bytes'] / 2**20:.0f} MiB total" if kind == "count" else
                 f"{pts[0]['tensors']} tensors")
        _panel(axes[row][0], sw, names, ("save",), x_of, xlabel,
               f"Save (with fsync) vs {xlabel.split(' (')[0]} ({fixed})")
        _panel(axes[row][1], sw, names, restore_ops, x_of, xlabel,
               f"{restore.capitalize()} vs {xlabel.split(' (')[0]} ({fixed})")
    handles = [Line2D([], [], color=STYLE.get(n, ("#7f7f7f", "x"))[0],
                      marker=STYLE.get(n, ("#7f7f7f", "x"))[1],
                      linewidth=2.6 if n == "ckptcore" else 1.5, label=LABEL.get(n, n))
               for n in names]
    if cold:
        handles += [Line2D([], [], color="#555555", linestyle="-", label="cold load"),
                    Line2D([], [], color="#555555", linestyle="--", linewidth=1.0,
                           label="warm load (page cache)")]
    fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=9.5, frameon=False)
    v = m["versions"]
    fig.suptitle(
        f"ckptcore vs alternatives: save and restore time by tensor count and state size\n"
        f"{m['date']} · {m['cpus']} CPUs, {m['machine']}, {m['platform'].split('-with')[0]} · "
        f"Python {m['python']}\n" + ", ".join(f"{k} {x}" for k, x in v.items()) + "\n"
        f"medians of {m['rounds']} interleaved rounds; cold cache by {m['cache']}",
        fontsize=11.5)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    src = argv[0] if argv else os.path.join(HERE, "scaling.json")
    dst = argv[1] if len(argv) > 1 else os.path.splitext(src)[0] + ".png"
    with open(src) as f:
        plot(json.load(f), dst)
    print(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
