"""ckptcore_paddle.process_group(): a ckptcore.ProcessGroup over paddle.distributed's collectives,
and distributed saves through it, with 2 and 4 real gloo processes on 127.0.0.1."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import ckptcore
from _group_checks import check_protocol
from _support import free_ports, run_ranks, subprocess_env

pytest.importorskip("paddle")

HERE = Path(__file__).parent

DEADLINE = 3.0  # the deadline _group_worker.py gives the collective a dead peer never joins
MARGIN = 2.0    # for a loaded machine: thread start, join wake-up


def _job(tmp_path: Path, mode: str, n: int, *,
         stopped: int | None = None) -> tuple[dict[int, dict], dict[int, int]]:
    """Run ``n`` ranks of ``_group_worker.py``; their reports and exit codes.  A rank that stops
    itself (``stopped``) is SIGKILLed once the others are done."""
    ports = ",".join(map(str, free_ports(n)))
    env = subprocess_env(HERE)
    procs = [subprocess.Popen([sys.executable, str(HERE / "_group_worker.py"), str(r), ports,
                               str(tmp_path), mode], env=env, cwd=str(HERE),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True) for r in range(n)]
    outputs, codes = {}, {}
    try:
        for r, p in enumerate(procs):
            if r == stopped:
                continue
            outputs[r] = p.communicate(timeout=240)[0].decode(errors="replace")
            codes[r] = p.returncode
    except subprocess.TimeoutExpired:
        pytest.fail(f"a rank hung ({mode})")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    reports = {}
    for r in range(n):
        f = tmp_path / f"rank{r}.json"
        if f.exists():
            reports[r] = json.loads(f.read_text())
    assert 0 in reports, "rank 0 wrote nothing:\n" + outputs.get(0, "")[-3000:]
    return reports, codes


def test_the_shared_checks_pass_on_the_reference_thread_group():
    # The checks themselves, on ckptcore.ThreadGroup: what the Paddle group must match.
    results = run_ranks(ckptcore.ThreadGroup.create(3), check_protocol)
    assert all(isinstance(v, dict) and all(v.values()) for v in results.values()), results


def test_outside_a_job_the_group_is_this_process_alone(monkeypatch):
    import ckptcore_paddle

    for var in ("PADDLE_TRAINERS_NUM", "PADDLE_TRAINER_ID", "PADDLE_TRAINER_ENDPOINTS"):
        monkeypatch.delenv(var, raising=False)
    group = ckptcore_paddle.process_group()
    assert isinstance(group, ckptcore.SingleProcessGroup)
    assert all(check_protocol(group, rounds=3).values())


@pytest.mark.parametrize("n", [2, 4])
def test_gather_broadcast_barrier_exact(tmp_path, n):
    reports, codes = _job(tmp_path, "protocol", n)
    assert set(reports) == set(range(n)) and codes == dict.fromkeys(range(n), 0)
    for r, rep in reports.items():
        assert rep["size"] == n
        assert rep["checks"] and all(rep["checks"].values()), (r, rep["checks"])
        # the job's environment says n ranks, so asking before init_parallel_env is an error
        assert "init_parallel_env" in rep["before_init"], rep
    if n == 4:
        for r in (2, 3):  # the sub-group of job ranks 2 and 3: its own ranks 0 and 1
            sub = reports[r]["sub"]
            assert (sub["rank"], sub["size"]) == (r - 2, 2) and all(sub["checks"].values()), sub
        for r in (0, 1):
            assert "not a member" in reports[r]["sub"]["refused"]


@pytest.mark.parametrize("n", [2, 4])
def test_a_rank_killed_during_a_collective_fails_every_survivor_in_time(tmp_path, n):
    reports, codes = _job(tmp_path, "kill", n)
    last = n - 1
    assert set(reports) == set(range(last)), reports  # the last rank was SIGKILLed
    assert codes[last] == -signal.SIGKILL and all(codes[r] == 0 for r in range(last)), codes
    for r, rep in reports.items():
        # gloo notices the closed connection within milliseconds: an engine error (GroupError);
        # a GroupTimeoutError at the deadline would also keep the contract.
        assert rep["error"] in ("GroupError", "GroupTimeoutError"), (r, rep)
        assert "gather" in rep["message"] and f"rank {r} " in rep["message"], rep
        assert rep["seconds"] < DEADLINE + MARGIN, (r, rep)
        assert rep["after"] == "GroupError" and "broken" in rep["after_message"], rep
        assert rep["after_seconds"] < 0.5, rep  # a broken group fails at once
        assert any("broken" in m for m in rep["logged"]), rep


def test_a_hung_rank_is_a_timeout_at_the_deadline_on_every_survivor(tmp_path):
    n = 3
    reports, codes = _job(tmp_path, "hang", n, stopped=n - 1)
    assert set(reports) == {0, 1} and codes == {0: 0, 1: 0}, (reports, codes)
    for r, rep in reports.items():
        # a stopped peer keeps its sockets open: gloo would wait 30 s, the deadline is 3 s
        assert rep["error"] == "GroupTimeoutError", (r, rep)
        assert "gather" in rep["message"] and f"rank {r} of 3" in rep["message"], rep
        assert DEADLINE - 0.1 <= rep["seconds"] < DEADLINE + MARGIN, (r, rep)
        assert rep["after"] == "GroupError" and rep["after_seconds"] < 0.5, rep
        assert any("did not arrive" in m for m in rep["logged"]), rep


def _shares(root: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in root.iterdir():
        if f.name.startswith("shard-"):
            out[f.name.split("-")[2]] = out.get(f.name.split("-")[2], 0) + f.stat().st_size
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_every_rank_writes_its_share_of_a_data_parallel_model(tmp_path, n):
    reports, codes = _job(tmp_path, "save", n)
    assert codes == dict.fromkeys(range(n), 0)
    assert len({r["writer"] for r in reports.values()}) == 1  # one commit, seen by every rank
    shares = _shares(tmp_path / "ck")
    assert len(shares) == n, shares
    total = sum(shares.values())
    assert all(abs(v / total - 1 / n) < 0.25 for v in shares.values()), shares
    state = ckptcore.load_state(tmp_path / "ck")
    with np.load(tmp_path / "weights0.npz") as z:
        weights = [z[f"arr_{i}"] for i in range(len(z.files))]
    saved = list(state.model.values())
    assert len(saved) == len(weights)
    assert sorted(a.tobytes() for a in saved) == sorted(w.tobytes() for w in weights)


def test_a_rank_killed_mid_save_commits_nothing_and_nobody_hangs(tmp_path):
    t = time.monotonic()
    reports, codes = _job(tmp_path, "savekill", 2)
    rep = reports[0]
    assert rep["second"] in ("GroupTimeoutError", "GroupError"), rep
    assert rep["seconds"] < 30, rep
    assert rep["newest_writer"] == rep["writer"]  # the first save is still the newest
    assert codes == {0: 0, 1: -signal.SIGKILL}, codes
    assert time.monotonic() - t < 200
