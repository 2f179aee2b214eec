"""ckptcore_keras.process_group(): a ckptcore.ProcessGroup over TensorFlow's coordination
service, with two real MultiWorkerMirroredStrategy workers on 127.0.0.1 (separate processes)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _support import subprocess_env

pytest.importorskip("tensorflow")

HERE = Path(__file__).parent


def _ports(n: int) -> str:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = ",".join(str(s.getsockname()[1]) for s in socks)
    for s in socks:
        s.close()
    return ports


def _cluster(tmp_path, mode: str, n: int = 2) -> tuple[dict, float]:
    ports = _ports(n)
    env = subprocess_env(HERE)
    t = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(HERE / "_keras_group_worker.py"), str(r), ports,
                               str(tmp_path), mode], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(n)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=240)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a worker hung ({mode})")
    elapsed = time.monotonic() - t
    result = tmp_path / "rank0.json"
    assert result.exists(), "rank 0 wrote nothing:\n" + outputs[0][-3000:]
    return json.loads(result.read_text()), elapsed


def test_gather_broadcast_barrier_across_two_workers(tmp_path):
    report, _ = _cluster(tmp_path, "protocol")
    assert (report["rank"], report["size"], report["is_protocol"]) == (0, 2, True)
    assert report["gather_exact"] and report["broadcast_exact"] and report["rounds_exact"]
    assert report["single_group"] == "SingleProcessGroup"


def test_a_killed_worker_is_a_timeout_not_a_hang(tmp_path):
    report, elapsed = _cluster(tmp_path, "kill")
    assert report["error"] == "GroupTimeoutError" and report["timeout_error"], report
    assert "rank 1" in report["message"]
    assert 4.0 <= report["seconds"] < 15, report  # the 5 s deadline, not a hang
    assert report["after"] == "GroupError"  # a broken group fails at once from then on
    assert elapsed < 200
