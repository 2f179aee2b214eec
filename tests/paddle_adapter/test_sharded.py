"""Sharded states over real gloo jobs on 127.0.0.1 (ckptcore_paddle.process_group()).

A state whose tensors are cut among the ranks, saved by N processes, loads bit for bit into M
processes (each rank reading its blocks with a template), locally and on the S3 server; a
ZeRO stage-1 run (fleet sharding: each rank holds its parameters' AdamW states) killed with
SIGKILL and resumed equals the uninterrupted run bit for bit, and its checkpoint restores into
a single process with a plain optimizer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ckptcore
from _support import free_ports, subprocess_env

pytest.importorskip("paddle")

HERE = Path(__file__).parent


def _job(out: Path, mode: str, n: int, url: str, arg: str = "", *, opts: dict | None = None,
         killed: int | None = None) -> dict[int, dict]:
    """Run ``n`` ranks of ``_sharded_worker.py``; their reports.  Rank ``killed`` SIGKILLs
    itself: the others are then killed too (a job loses all its processes on preemption)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("rank*.json"):
        f.unlink()
    ports = ",".join(map(str, free_ports(n)))
    env = subprocess_env(HERE)
    if opts:
        env["CKPT_TEST_S3_OPTIONS"] = json.dumps(opts)
    procs = [subprocess.Popen([sys.executable, str(HERE / "_sharded_worker.py"), str(r), ports,
                               str(out), mode, url, arg], env=env, cwd=str(HERE),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True) for r in range(n)]
    logs = {}
    try:
        if killed is not None:
            procs[killed].wait(240)
            assert procs[killed].returncode == -9, procs[killed].stdout.read().decode()[-3000:]
            for p in procs:
                if p.poll() is None:
                    p.kill()
        for r, p in enumerate(procs):
            logs[r] = p.communicate(timeout=240)[0].decode(errors="replace")
    except subprocess.TimeoutExpired:
        pytest.fail(f"a rank hung ({mode})")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    if killed is not None:
        return {}
    reports = {}
    for r in range(n):
        f = out / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote no report:\n" + logs.get(r, "")[-3000:]
        reports[r] = json.loads(f.read_text())
    return reports


def _check_loaded(reports: dict[int, dict], m: int) -> None:
    assert set(reports) == set(range(m))
    for r, rep in reports.items():
        assert all(rep["same"].values()), (r, rep["same"])


@pytest.mark.parametrize("saved,loaded", [(2, 4), (4, 2), (4, 3), (2, 1)])
def test_n_processes_save_m_processes_load(tmp_path, saved, loaded):
    url = str(tmp_path / "ck")
    reports = _job(tmp_path / "save", "save", saved, url)
    assert len({r["writer"] for r in reports.values()}) == 1  # one commit
    ranks = {p.name.split("-")[2] for p in (tmp_path / "ck").glob("shard-*")}
    assert len(ranks) == saved  # every rank wrote its own blocks
    assert not ckptcore.verify(url)
    _check_loaded(_job(tmp_path / "load", "load", loaded, url, str(saved)), loaded)


def test_on_the_s3_server(tmp_path, s3_backend):
    url, opts = s3_backend.url("sharded"), s3_backend.storage_options
    _job(tmp_path / "save", "save", 4, url, opts=opts)
    _check_loaded(_job(tmp_path / "load", "load", 2, url, "4", opts=opts), 2)
    assert not ckptcore.verify(url, storage_options=opts)


def _final(out: Path, ranks: int) -> dict[str, np.ndarray]:
    """The run's final weights and every optimizer slot, from its ranks' dumps."""
    merged: dict[str, np.ndarray] = {}
    for r in range(ranks):
        with np.load(out / f"final{r}.npz") as f:
            for k in f.files:
                if k in merged:  # a replicated weight: the same on every rank
                    assert merged[k].tobytes() == f[k].tobytes(), k
                merged[k] = f[k]
    return merged


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


def test_a_zero_run_killed_and_resumed_equals_the_uninterrupted_run(tmp_path):
    whole = _job(tmp_path / "whole", "zero", 2, str(tmp_path / "run-whole"), "10")
    assert [whole[r]["start"] for r in (0, 1)] == [0, 0]
    expected = _final(tmp_path / "whole", 2)
    assert any(k.startswith("slot/") and k.endswith("/moment1") for k in expected)

    run = str(tmp_path / "run")
    _job(tmp_path / "a", "zero", 2, run, "10:7", killed=1)  # saved 2, 4, 6; killed after 7
    with ckptcore.CheckpointManager(run) as mgr:
        assert mgr.steps() == [4, 6]
    resumed = _job(tmp_path / "b", "zero", 2, run, "10")
    assert [resumed[r]["start"] for r in (0, 1)] == [6, 6]
    assert resumed[0]["lr"] == whole[0]["lr"]
    _same(_final(tmp_path / "b", 2), expected)

    # the sharded checkpoint restores into one process with a plain AdamW: every slot whole
    plain = _job(tmp_path / "plain", "plain", 1, str(tmp_path / "run-whole"))
    assert plain[0]["start"] == 10 and plain[0]["lr"] == whole[0]["lr"]
    _same(_final(tmp_path / "plain", 1), expected)
