"""Run a worker script as the ranks of a real ``torch.distributed`` job (gloo on 127.0.0.1).

``launch(script, world, *args)`` starts ``world`` processes with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT``, waits for them (``timeout``), kills any that
are left in a ``finally`` (a broken test must not hang or leave ranks behind), and returns each
rank's return code, last stdout line parsed as JSON (None if none) and stderr tail.  A worker
calls :func:`init` first: gloo with a short timeout and one thread.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def launch(script: str, world: int, *args: Any, timeout: float = 120,
           expect_killed: tuple[int, ...] = (), hung: tuple[int, ...] = (),
           any_rc: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """``expect_killed``: ranks that SIGKILL themselves; ``hung``: ranks that never end by
    themselves (SIGKILLed once the others ended); ``any_rc``: ranks whose exit status is not
    checked (the survivors of a killed training job)."""
    sys.path.insert(0, str(HERE.parent))
    from _support import free_port, subprocess_env

    env = {**subprocess_env(HERE), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
    procs = []
    try:
        for r in range(world):
            procs.append(subprocess.Popen(
                [sys.executable, str(HERE / script), *map(str, args)], cwd=str(HERE),
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, start_new_session=True))
        deadline = time.monotonic() + timeout
        out: list[dict[str, Any]] = [{}] * world
        for r in [r for r in range(world) if r not in hung] + list(hung):
            p = procs[r]
            if r in hung:
                os.killpg(p.pid, signal.SIGKILL)
            try:
                stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {r} of {script} {args} did not end within {timeout} s")
            lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
            out[r] = {"rc": p.returncode, "result": json.loads(lines[-1]) if lines else None,
                      "stderr": stderr[-4000:]}
        for r, o in enumerate(out):
            if r in any_rc:
                continue
            want = -signal.SIGKILL if r in expect_killed or r in hung else 0
            assert o["rc"] == want, f"rank {r} exited with {o['rc']}:\n{o['stderr']}"
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                p.wait()


def init() -> tuple[int, int]:
    """In a worker: join the job (gloo, 60 s timeout, one thread); return (rank, world)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    return dist.get_rank(), dist.get_world_size()


def report(result: dict[str, Any]) -> None:
    """In a worker: hand ``result`` back to :func:`launch` (the last JSON line of stdout)."""
    print(json.dumps(result), flush=True)
