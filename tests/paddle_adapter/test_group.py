"""ckptcore_paddle.process_group(): a ckptcore.ProcessGroup over paddle.distributed's own store,
and distributed saves through it, with 2 and 4 real gloo processes on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from _support import free_ports, subprocess_env

pytest.importorskip("paddle")

HERE = Path(__file__).parent




def _job(tmp_path: Path, mode: str, n: int) -> tuple[dict[int, dict], float]:
    ports = ",".join(map(str, free_ports(n)))
    env = subprocess_env(HERE)
    t = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(HERE / "_group_worker.py"), str(r), ports,
                               str(tmp_path), mode], env=env, cwd=str(HERE),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True) for r in range(n)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=240)[0].decode(errors="replace"))
    except subprocess.TimeoutExpired:
        pytest.fail(f"a rank hung ({mode})")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    elapsed = time.monotonic() - t
    reports = {}
    for r in range(n):
        f = tmp_path / f"rank{r}.json"
        if f.exists():
            reports[r] = json.loads(f.read_text())
    assert 0 in reports, "rank 0 wrote nothing:\n" + outputs[0][-3000:]
    return reports, elapsed


@pytest.mark.parametrize("n", [2, 4])
def test_gather_broadcast_barrier(tmp_path, n):
    reports, _ = _job(tmp_path, "protocol", n)
    assert set(reports) == set(range(n))
    assert all(r["is_protocol"] and r["size"] == n and r["broadcast_exact"] for r in reports.values())
    assert reports[0]["gather_exact"] and reports[0]["rounds_exact"]


def test_a_killed_rank_is_a_timeout_on_every_survivor(tmp_path):
    reports, elapsed = _job(tmp_path, "kill", 4)
    assert set(reports) == {0, 1, 2}  # rank 3 was SIGKILLed
    for r, rep in reports.items():
        assert rep["error"] in ("GroupTimeoutError", "GroupError"), (r, rep)
        assert rep["seconds"] < 15, (r, rep)  # 5 s deadlines, not the store's 15 minutes
    # gloo notices the closed connection and fails the collective (GroupError) well before the
    # deadline; a peer that hangs instead would be a GroupTimeoutError at the deadline.
    assert elapsed < 200


def _shares(root: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in root.iterdir():
        if f.name.startswith("shard-"):
            out[f.name.split("-")[2]] = out.get(f.name.split("-")[2], 0) + f.stat().st_size
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_every_rank_writes_its_share_of_a_data_parallel_model(tmp_path, n):
    reports, _ = _job(tmp_path, "save", n)
    assert len({r["writer"] for r in reports.values()}) == 1  # one commit, seen by every rank
    shares = _shares(tmp_path / "ck")
    assert len(shares) == n, shares
    total = sum(shares.values())
    assert all(abs(v / total - 1 / n) < 0.25 for v in shares.values()), shares
    import ckptcore

    state = ckptcore.load_state(tmp_path / "ck")
    with np.load(tmp_path / "weights0.npz") as z:
        weights = [z[f"arr_{i}"] for i in range(len(z.files))]
    saved = list(state.model.values())
    assert len(saved) == len(weights)
    assert sorted(a.tobytes() for a in saved) == sorted(w.tobytes() for w in weights)


def test_a_rank_killed_mid_save_commits_nothing_and_nobody_hangs(tmp_path):
    reports, elapsed = _job(tmp_path, "savekill", 2)
    rep = reports[0]
    assert rep["second"] in ("GroupTimeoutError", "GroupError"), rep
    assert rep["seconds"] < 30, rep
    assert rep["newest_writer"] == rep["writer"]  # the first save is still the newest
    assert elapsed < 200
