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


@pytest.mark.parametrize("loaded", [2, 4])
def test_shard_tensor_models_save_their_blocks_and_restore_into_another_mesh(tmp_path, loaded):
    url = str(tmp_path / "ck")
    reports = _job(tmp_path / "out", "dist", 2, url)
    assert reports[0]["leaves"] == {"0.weight": "Shard", "0.bias": "Shard", "2.weight": "ndarray",
                                    "2.bias": "ndarray", "4.weight": "ndarray", "4.bias": "ndarray"}
    with np.load(tmp_path / "out" / "global.npz") as g:
        dense = {k: g[k] for k in g.files}
    whole = ckptcore.load_state(url)  # one process, no Paddle needed: the dense tensors
    _same({k: whole.model[k] for k in dense}, dense)
    info = ckptcore.inspect(url)
    rows = [t for t in info.tensors if t.name == "model/0.weight"]
    assert [(t.global_shape, t.start, t.shape) for t in rows] == [((6, 16), (0, 0), (6, 8)),
                                                                  ((6, 16), (0, 8), (6, 8))]
    _check_loaded(_job(tmp_path / "out", "dist", loaded, url), loaded)


def test_a_paddle_distributed_checkpoint_imports_through_the_safe_reader(tmp_path):
    import ckptcore_paddle

    folder = tmp_path / "pdcp"
    _job(tmp_path / "out", "pdcp", 2, str(folder))
    assert {p.name for p in folder.iterdir()} >= {"0.metadata", "0_0.distcp", "1_0.distcp"}
    state = ckptcore_paddle.import_paddle_dcp(folder)
    with np.load(tmp_path / "out" / "global.npz") as g:
        dense = {k[len("model."):] if k.startswith("model.") else k: g[k] for k in g.files}
    _same(state.model, dense)
    assert set(state.optimizer.slots) == set(dense)  # AdamW's slots, mapped onto the parameters
    assert state.optimizer.slots["0.weight"]["moment1"].shape == (6, 16)
    assert state.step == 1
    # the command line reads it too, into a ckptcore checkpoint
    from ckptcore.cli import main
    assert main(["import", str(folder), str(tmp_path / "ck"), "--from", "paddle-dcp"]) == 0
    _same(ckptcore.load_state(tmp_path / "ck").model, dense)
