"""Run a worker script as the processes of a real ``jax.distributed`` job on 127.0.0.1.

``launch(script, world, *args)`` starts ``world`` processes with ``JAX_RANK``, ``JAX_WORLD``,
``JAX_COORDINATOR=127.0.0.1:<free port>`` (and the same as README's multi-process example reads
them: ``PROCESS_ID``, ``NUM_PROCESSES``, ``JAX_COORDINATOR_ADDRESS``) and ``devices`` CPU
devices each, in ``cwd`` (default: this folder), waits for them
(``timeout``), kills any left in a ``finally`` (a broken test must not hang or leave processes
behind), and returns each one's return code, last stdout line parsed as JSON and stderr tail.
A worker calls :func:`init` first.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def launch(script: str | Path, world: int, *args: Any, devices: int = 4, timeout: float = 120,
           cwd: str | Path = HERE) -> list[dict[str, Any]]:
    sys.path.insert(0, str(HERE.parent))
    from _support import free_port, subprocess_env

    coordinator = f"127.0.0.1:{free_port()}"
    env = {**subprocess_env(HERE), "JAX_COORDINATOR": coordinator, "JAX_COORDINATOR_ADDRESS": coordinator,
           "JAX_WORLD": str(world), "NUM_PROCESSES": str(world), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    procs = []
    try:
        for r in range(world):
            procs.append(subprocess.Popen(
                [sys.executable, str(HERE / script), *map(str, args)], cwd=str(cwd),
                env={**env, "JAX_RANK": str(r), "PROCESS_ID": str(r)}, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, start_new_session=True))
        deadline = time.monotonic() + timeout
        out = []
        for r, p in enumerate(procs):
            try:
                stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"process {r} of {script} {args} did not end within {timeout} s")
            lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
            out.append({"rc": p.returncode, "result": json.loads(lines[-1]) if lines else None,
                        "stderr": stderr[-4000:]})
        for r, o in enumerate(out):
            assert o["rc"] == 0, f"process {r} exited with {o['rc']}:\n{o['stderr']}"
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def init() -> tuple[int, int]:
    """``jax.distributed.initialize`` from the launcher's environment: (rank, world)."""
    import jax

    rank, world = int(os.environ["JAX_RANK"]), int(os.environ["JAX_WORLD"])
    jax.distributed.initialize(coordinator_address=os.environ["JAX_COORDINATOR"],
                               num_processes=world, process_id=rank,
                               initialization_timeout=60)
    return rank, world
