"""ckptcore_keras.process_group(): a ckptcore.ProcessGroup over TensorFlow's coordination
service, with two real MultiWorkerMirroredStrategy workers on 127.0.0.1 (separate processes)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _support import free_ports, subprocess_env

pytest.importorskip("tensorflow")

HERE = Path(__file__).parent




def _cluster(tmp_path, mode: str, n: int = 2, env_extra: dict | None = None) -> tuple[dict, float]:
    ports = ",".join(map(str, free_ports(n)))
    env = {**subprocess_env(HERE), **(env_extra or {})}
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


def _shares(root: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in root.iterdir():
        if f.name.startswith("shard-"):
            rank = f.name.split("-")[2]
            out[rank] = out.get(rank, 0) + f.stat().st_size
    return out


def test_every_worker_writes_its_share_of_a_mirrored_model(tmp_path):
    """Chief-free saving under MultiWorkerMirroredStrategy: both workers write, one commit; the
    checkpoint restores bit for bit into a model built without any strategy."""
    report, _ = _cluster(tmp_path, "save")
    shares = _shares(tmp_path / "ck")
    assert set(shares) == {"r00000", "r00001"}, shares
    total = sum(shares.values())
    assert all(0.2 < v / total < 0.8 for v in shares.values()), shares  # a small model: uneven
    state = _load(tmp_path / "ck")
    import numpy as np

    saved = [np.asarray(w, np.float32) for w in report["saved_weights"]]
    assert [a.tobytes() for a in state] == [a.tobytes() for a in saved]


def _load(root: Path) -> list:
    """The model's weights in a fresh process without a strategy, restored from the checkpoint."""
    code = ("import sys, json, numpy as np, keras, ckptcore\n"
            "keras.utils.set_random_seed(1)\n"
            "m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(64), keras.layers.Dense(32),"
            " keras.layers.Dense(4)])\n"
            "ckptcore.load_state(sys.argv[1], model=m)\n"
            "np.savez(sys.argv[2], *m.get_weights())\n")
    out = root.parent / "restored.npz"
    subprocess.run([sys.executable, "-c", code, str(root), str(out)], env=subprocess_env(HERE),
                   check=True, timeout=240, capture_output=True)
    import numpy as np

    with np.load(out) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


def test_a_worker_killed_mid_save_commits_nothing_and_nobody_hangs(tmp_path):
    report, elapsed = _cluster(tmp_path, "savekill")
    assert report["second"] in ("GroupTimeoutError", "GroupError"), report
    assert report["seconds"] < 30, report  # bounded by the 5 s group timeout per wait
    assert report["newest_writer"] == report["writer"]  # the first save is still the newest
    assert elapsed < 200


@pytest.mark.parametrize("store", ["local", "s3"])
def test_two_workers_save_a_sharded_state_that_loads_into_one_and_three_ranks(tmp_path, store,
                                                                               request):
    """Each MultiWorkerMirroredStrategy worker writes its own blocks; one commit; the blocks
    load back bit for bit into 1 rank (whole) and 3 ranks (uneven blocks, with templates)."""
    import ckptcore
    from _sharded_globals import check_rank_state, global_arrays, load_template
    from _support import run_ranks

    if store == "s3":
        backend = request.getfixturevalue("s3_backend")
        url, opts = backend.url("sharded"), backend.storage_options
    else:
        url, opts = str(tmp_path / "sharded"), {}
    report, _ = _cluster(tmp_path, "sharded", env_extra={
        "CKPT_TEST_URL": url, "CKPT_TEST_S3_OPTIONS": json.dumps(opts)})
    info = ckptcore.inspect(url, storage_options=opts)
    assert info.writer["id"] == report["writer"]
    assert {s.split("-")[2] for s in info.shards} == {"r00000", "r00001"}  # both wrote
    whole = ckptcore.load_state(url, storage_options=opts)
    assert whole.model["emb"].tobytes() == global_arrays()["emb"].tobytes()
    out = run_ranks(ckptcore.ThreadGroup.create(3), lambda g: ckptcore.load_state(
        url, like=load_template(g.rank, 3, 2), group=g, storage_options=opts))
    for r in range(3):
        assert all(check_rank_state(out[r], r, 3, 2).values()), (r, check_rank_state(out[r], r, 3, 2))
