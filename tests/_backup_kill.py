"""The kill loop of the backup-tier tests (framework-free): run a training worker with a local
root and a bucket backup, SIGKILL it at random points (often while it replicates), restart it,
and after every kill check what the two tiers hold.

A worker prints ``READY`` once imported and restored, ``REPL-START``/``REPL-END`` around each
replication (from the ``ckptcore`` log) and ``DONE`` at the end, after writing its final state.

After each kill: every step listed in the backup verifies (no half replica is ever listed), and
every step seen committed in either tier so far is still in one of them (local retention deletes
a step only once its replica is committed; the backup keeps every step).  Every few kills the
local root is deleted (a lost machine): the worker then resumes from the bucket.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import ckptcore
from ckptcore import layout
from ckptcore._storage import Store


@dataclass
class KillLog:
    kills: int = 0
    mid_replication: int = 0
    local_lost: int = 0
    runs: int = 0
    notes: list[str] = field(default_factory=list)


def _steps(url: str, opts: dict | None = None) -> set[int]:
    store = Store(url, opts or {})
    return {s for s, _ in layout.committed_steps(store)} if store.exists() else set()


def check_tiers(local: str, backup: str, opts: dict, seen: set[int]) -> set[int]:
    """The invariants after a kill; returns the steps committed now in either tier."""
    in_backup = _steps(backup, opts)
    for step in sorted(in_backup):
        url = f"{backup}/{layout.step_name(step)}"
        problems = ckptcore.verify(url, storage_options=opts)
        assert not problems, f"a listed replica does not verify: {url}: {problems}"
    now = _steps(local) | in_backup
    lost = seen - now
    assert not lost, f"committed steps lost from both tiers: {sorted(lost)}"
    return now


def run_until_done(cmd: list[str], env: dict, cwd: str, local: str, backup: str, opts: dict,
                   log: KillLog, rng: random.Random, *, max_kills: int, window: float,
                   lose_local_every: int = 6, timeout: float = 300, min_mid: int = 0,
                   more: Callable[[], bool] | None = None) -> str:
    """Run ``cmd`` to completion, SIGKILLing it up to ``max_kills`` times; returns its output.

    Half the kills wait for a replication to start; while fewer than ``min_mid`` kills have
    landed mid-replication, most do (whether one lands there depends on the machine's pace).
    ``more()``, when given, says whether another kill is still wanted."""
    seen: set[int] = set()
    kills_here = 0
    while True:
        if kills_here and kills_here % lose_local_every == 0 and Path(local).exists():
            shutil.rmtree(local)  # a lost machine: only the bucket is left
            log.local_lost += 1
            seen = _steps(backup, opts)
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        log.runs += 1
        lines: list[str] = []
        state = {"ready": None, "repl": False}

        def read() -> None:
            for line in proc.stdout:
                lines.append(line)
                if line.startswith("READY") and state["ready"] is None:
                    state["ready"] = time.monotonic()
                elif line.startswith("REPL-START"):
                    state["repl"] = True
                elif line.startswith("REPL-END"):
                    state["repl"] = False

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        start = time.monotonic()
        killed = False
        if kills_here < max_kills and (more is None or more()):
            while state["ready"] is None and proc.poll() is None and time.monotonic() - start < timeout:
                time.sleep(0.01)
            if proc.poll() is None and state["ready"] is not None:
                aim = 0.5 if log.mid_replication >= min_mid else 0.9
                if rng.random() < aim:  # kills aimed at a replication in progress
                    # Up to 30 s: under load a framework's first steps (tracing, compiling) can
                    # take longer than the random window, and a kill aimed at a replication
                    # must not land before the first save every time.
                    until = time.monotonic() + max(window, 30.0)
                    while not state["repl"] and proc.poll() is None and time.monotonic() < until:
                        time.sleep(0.002)
                    time.sleep(rng.uniform(0.0, 0.05))
                else:
                    time.sleep(rng.uniform(0.0, window))
                if proc.poll() is None:
                    mid = state["repl"]
                    proc.kill()
                    killed = True
                    log.kills += 1
                    kills_here += 1
                    log.mid_replication += mid
        try:
            proc.wait(timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
        reader.join(10)
        out = "".join(lines)
        if killed:
            seen |= check_tiers(local, backup, opts, seen)
            continue
        assert proc.returncode == 0 and "DONE" in out, f"the worker failed:\n{out[-4000:]}"
        check_tiers(local, backup, opts, seen)
        return out


def print_events(logger_name: str = "ckptcore") -> None:
    """In a worker: print REPL-START / REPL-END as the backup tier logs them."""
    import logging

    class _Events(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if msg.startswith("backup: replicating step"):
                print("REPL-START", flush=True)
            elif msg.startswith("copy:"):
                print("REPL-END", flush=True)

    log = logging.getLogger(logger_name)
    log.addHandler(_Events())
    log.setLevel(logging.INFO)
    sys.stdout.reconfigure(line_buffering=True)


def campaigns(worker: str, here: Path, tmp_path: Path, s3_backend, kills: int, seed: int,
              min_mid: int = 5) -> KillLog:
    """The whole test of one framework's worker: a reference run, then runs SIGKILLed until
    ``kills`` kills are done, ``min_mid`` of them mid-replication, each run ending bit for bit
    equal to the reference.  A few extra kills (at most ``kills // 2``) are allowed for the
    mid-replication quota."""
    import json

    import numpy as np

    from _support import subprocess_env

    def final(path: Path) -> dict:
        with np.load(path) as f:
            return {k: f[k] for k in f.files}

    opts = s3_backend.storage_options
    env = {**subprocess_env(here), "CKPT_TEST_S3_OPTIONS": json.dumps(opts)}
    log = KillLog()
    ref = tmp_path / "reference.npz"
    run_until_done([sys.executable, worker, str(tmp_path / "ref-local"), s3_backend.url("ref"),
                    str(ref)], env, str(here), str(tmp_path / "ref-local"), s3_backend.url("ref"),
                   opts, log, random.Random(0), max_kills=0, window=0)
    expected = final(ref)
    rng = random.Random(seed)
    campaign = 0
    cap = kills + kills // 2

    def more() -> bool:
        return log.kills < kills or (log.mid_replication < min_mid and log.kills < cap)

    while more():
        campaign += 1
        local, backup = str(tmp_path / f"local{campaign}"), s3_backend.url(f"backup{campaign}")
        out = tmp_path / f"run{campaign}.npz"
        run_until_done([sys.executable, worker, local, backup, str(out)], env, str(here), local,
                       backup, opts, log, rng, max_kills=cap - log.kills, window=1.5,
                       min_mid=min_mid, more=more)
        got = final(out)
        assert got.keys() == expected.keys()
        for k in expected:
            assert got[k].tobytes() == expected[k].tobytes(), k
    return log
