"""ckptcore against raw concurrent s3fs transfers of the same bytes, on an S3 server on loopback.

Target (issue 13): ``save_state`` and ``load_state(verify=True)`` to ``s3://`` each run at
>= 0.9x the speed of s3fs moving the same bytes as one object per tensor, all at once
(``fs.pipe({...})`` and ``fs.cat([...])``).  The raw transfer does no checksums, no manifest and
no commit: it is the store's own speed through the same client, the bound to get close to.

The server is moto's ``ThreadedMotoServer`` on 127.0.0.1, the one tests/conftest.py uses; by
default it runs in a child process (``--server process``), so the client's CPU and memory are
measured alone, as against a real store; ``--server thread`` runs it inside this process as the
tests do (then server and client share the GIL and the peak-memory figure is not meaningful).

States: *large*, ``--size-mb`` (256) in ``--tensors`` (8) float32 tensors; *many*,
``--many-count`` (2,000) tensors totalling ``--many-mb`` (64).  Contenders, interleaved in
``--rounds`` (5) rounds, order rotated per round, each writing to a fresh prefix:

* ``s3fs raw``: save = ``fs.pipe({path: bytes})`` (the bytes made beforehand, untimed), load =
  ``fs.cat([paths])``;
* ``ckptcore``: ``save_state`` / ``load_state(verify=True)`` with default knobs;
  (S3 shards are bounded to one upload part, ``Store.shard_size``, and written
  ``remote_concurrency`` at once).

Times are medians with [min-max]; ratios are raw time / ckptcore time from the medians (>= 1:
ckptcore faster).  Peak memory added: VmHWM above the RSS before each call, largest over rounds.

    python benchmarks/bench_s3.py [--quick] [--server process|thread] [--no-record]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import fill, free_ports, reset_peak_rss, vm_status  # noqa: E402
from _report import record  # noqa: E402

_AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SECURITY_TOKEN": "testing", "AWS_SESSION_TOKEN": "testing",
            "AWS_DEFAULT_REGION": "us-east-1"}
BUCKET = "ckptcore-bench"
TARGET = 0.9




def start_server(kind: str):
    """Start moto on 127.0.0.1; return (storage options, stop function)."""
    os.environ.update(_AWS_ENV)
    os.environ.pop("AWS_PROFILE", None)
    port = free_ports(1)[0]
    if kind == "thread":
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        stop = server.stop
    else:
        code = ("import time\nfrom moto.server import ThreadedMotoServer\n"
                f"ThreadedMotoServer(ip_address='127.0.0.1', port={port}, verbose=False).start()\n"
                "while True:\n    time.sleep(3600)\n")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    proc.kill()
                    raise RuntimeError("the moto server did not start")
                time.sleep(0.1)

        def stop() -> None:
            proc.kill()
            proc.wait()
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    return {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"},
            "key": "testing", "secret": "testing"}, stop


def make_state(count: int, total_mb: float, seed: int):
    import ckptcore

    n = max(1, int(total_mb * 2**20 / 4 / count))
    return ckptcore.TrainingState(model={f"layer{i // 10}/t{i}": fill((n,), seed + i)
                                         for i in range(count)}, step=1)


class Contenders:
    def __init__(self, opts, state):
        import s3fs

        from ckptcore import _knobs

        self.opts, self.state, self._knobs = opts, state, _knobs
        self.fs = s3fs.S3FileSystem(**opts)
        self.raw = {name.replace("/", "."): a.tobytes() for name, a in state.model.items()}
        self.nbytes = sum(len(b) for b in self.raw.values())

    names = ["s3fs raw", "ckptcore"]

    def save(self, name: str, prefix: str) -> None:
        import ckptcore

        if name == "s3fs raw":
            self.fs.pipe({f"{prefix}/{k}": v for k, v in self.raw.items()})
            return
        ckptcore.save_state(f"s3://{prefix}", self.state, storage_options=self.opts)

    def load(self, name: str, prefix: str) -> None:
        import ckptcore

        if name == "s3fs raw":
            out = self.fs.cat([f"{prefix}/{k}" for k in self.raw])
            assert sum(len(v) for v in out.values()) == self.nbytes
            return
        got = ckptcore.load_state(f"s3://{prefix}", storage_options=self.opts, verify=True)
        assert len(got.model) == len(self.state.model)

    def clean(self, prefix: str) -> None:
        self.fs.rm(prefix, recursive=True)
        self.fs.invalidate_cache()


def measured(fn, peaks: list[int]) -> float:
    reset_peak_rss()
    before = vm_status("VmRSS")
    t0 = time.perf_counter()
    fn()
    t = time.perf_counter() - t0
    peaks.append(vm_status("VmHWM") - before)
    return t


def run_case(c: Contenders, rounds: int) -> dict:
    names = c.names
    res = {n: {"save": [], "load": [], "peak_save": [], "peak_load": []} for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            prefix = f"{BUCKET}/{uuid.uuid4().hex}"
            res[n]["save"].append(measured(lambda: c.save(n, prefix), res[n]["peak_save"]))
            res[n]["load"].append(measured(lambda: c.load(n, prefix), res[n]["peak_load"]))
            c.clean(prefix)
    return res


def _fmt(ts: list[float]) -> str:
    return f"{statistics.median(ts):.3f} [{min(ts):.3f}-{max(ts):.3f}]"


def report(title: str, c: Contenders, res: dict, server: str) -> tuple[list[str], list[tuple]]:
    mib = c.nbytes / 2**20
    lines = [f"### {title}: {len(c.state.model):,} tensors, {mib:.0f} MiB", "",
             "| contender | save s, median [min-max] | save MB/s | load s, median [min-max] "
             "| load MB/s | peak memory added, save / load (MiB) |", "|---|---:|---:|---:|---:|---:|"]
    for n, r in res.items():
        peaks = (f"{max(r['peak_save']) / 2**20:.0f} / {max(r['peak_load']) / 2**20:.0f}"
                 if server == "process" else "n/a (server in process)")
        lines.append(f"| {n} | {_fmt(r['save'])} | {c.nbytes / statistics.median(r['save']) / 1e6:.0f} "
                     f"| {_fmt(r['load'])} | {c.nbytes / statistics.median(r['load']) / 1e6:.0f} | {peaks} |")
    lines.append("")
    verdicts = []
    raw = res["s3fs raw"]
    for n in res:
        if n == "s3fs raw":
            continue
        for op in ("save", "load"):
            ratio = statistics.median(raw[op]) / statistics.median(res[n][op])
            best = min(raw[op]) / min(res[n][op])
            verdicts.append((f"{title}, {op}: {n} vs s3fs raw", ratio, best))
    return lines, verdicts


def _knob_text(knobs) -> str:
    out = []
    for name in ("remote_part_size", "remote_concurrency", "threads"):
        try:
            v = int(knobs.get(name))
        except KeyError:  # a ckptcore from before the knob
            continue
        out.append(f"{name}={v // 2**20} MiB" if v >= 2**20 else f"{name}={v}")
    return ", ".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=256)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--many-count", type=int, default=2000)
    p.add_argument("--many-mb", type=float, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--server", choices=("process", "thread"), default="process")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 32 MiB in 8 tensors, 200 tensors of 4 MiB, 2 rounds, not recorded")
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                     "RESULTS.md"))
    p.add_argument("--label", default="")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mb, args.many_count, args.many_mb, args.rounds = 32, 200, 4, 2
        args.no_record = True

    opts, stop = start_server(args.server)
    try:
        import s3fs

        from ckptcore import _knobs
        s3fs.S3FileSystem(**opts).mkdir(BUCKET)
        lines, verdicts = [], []
        for title, count, mb, seed in (("large", args.tensors, args.size_mb, 0),
                                       ("many", args.many_count, args.many_mb, 10_000)):
            c = Contenders(opts, make_state(count, mb, seed))
            res = run_case(c, args.rounds)
            case_lines, case_verdicts = report(title, c, res, args.server)
            lines += case_lines
            verdicts += case_verdicts
            print("\n".join(case_lines), flush=True)
    finally:
        stop()

    head = [f"## bench_s3.py, {datetime.datetime.now():%Y-%m-%d %H:%M}"
            f"{' (' + args.label + ')' if args.label else ''}", "",
            f"moto ThreadedMotoServer on 127.0.0.1 ({'child process' if args.server == 'process' else 'in this process'}), "
            f"{args.rounds} interleaved rounds; knobs {_knob_text(_knobs)}.", ""]
    table = ["| target (speed vs s3fs raw, >= 0.9x) | ratio of medians | ratio of best rounds | verdict |",
             "|---|---:|---:|---|"]
    for label, ratio, best in verdicts:
        table.append(f"| {label} | {ratio:.2f}x | {best:.2f}x | {'met' if ratio >= TARGET else 'MISSED'} |")
    text = "\n".join(head + lines + table + [""])
    print("\n".join(table))
    if not args.no_record:
        record(args.results, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
