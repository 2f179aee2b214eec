"""Sharded saves and loads by the processes of a real ``jax.distributed`` job (2 processes of 4
CPU devices each, one mesh over the 8): every process writes its blocks and the job commits
once; the checkpoint restores bitwise into one process (8 devices, 4, 1), and a checkpoint of
one process restores into the two (each reading its blocks).  README's multi-process example
runs as written as a job of 3 processes."""

from __future__ import annotations

import pytest

pytest.importorskip("jax")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _jax_group_worker import SHAPES, expected  # noqa: E402
from _jax_ranks import launch  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ckptcore  # noqa: E402
import ckptcore_jax  # noqa: E402
from ckptcore.sharding import Chunks, Shard  # noqa: E402

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 CPU devices (XLA_FLAGS)")


def _local(n: int, fill: bool) -> tuple[dict, dict]:
    mesh = Mesh(np.array(jax.devices()[:n]).reshape({8: (4, 2), 4: (2, 2), 1: (1, 1)}[n]), ("a", "b"))
    want = expected()
    params = {k: jax.device_put(want[k] if fill else np.zeros(s, np.float32), NamedSharding(mesh, P(*spec)))
              for k, (s, spec) in SHAPES.items()}
    count = jax.device_put(want["count"] if fill else np.zeros((), np.int32), NamedSharding(mesh, P()))
    return params, {"mu": {"w": params["w"] if fill else jax.device_put(np.zeros((8, 6), np.float32),
                                                                          params["w"].sharding)},
                    "count": count}


def test_two_processes_save_one_commit_restored_in_one(tmp_path):
    url = str(tmp_path / "ckpt")
    out = launch("_jax_group_worker.py", 2, "save", url)
    assert [o["result"]["step"] for o in out] == [7, 7]
    assert ckptcore.list_checkpoints(str(tmp_path)) or (tmp_path / "ckpt").exists()
    want = expected()
    for n in (8, 4, 1):
        params, opt = _local(n, fill=False)
        m, o = ckptcore_jax.Ref(params), ckptcore_jax.Ref(opt)
        ckptcore.load_state(url, model=m, optimizer=o, like=ckptcore_jax.template(m, o))
        for k in SHAPES:
            assert m.value[k].sharding == params[k].sharding
            assert np.asarray(m.value[k]).tobytes() == want[k].tobytes(), (n, k)
        assert np.asarray(o.value["mu"]["w"]).tobytes() == want["w"].tobytes()
        assert int(o.value["count"]) == 5
    whole = ckptcore.load_state(url)  # no like: whole arrays, each block written once covers them
    assert whole.model["w"].tobytes() == want["w"].tobytes() and whole.step == 7


def test_one_process_checkpoint_restored_into_two(tmp_path):
    params, opt = _local(8, fill=True)
    state = ckptcore_jax.capture(ckptcore_jax.Ref(params), ckptcore_jax.Ref(opt), rng=False, step=7)
    assert isinstance(state.model["w"], (Shard, Chunks))
    url = str(tmp_path / "ckpt")
    ckptcore.save_state(url, state)
    out = launch("_jax_group_worker.py", 2, "load", url)
    for o in out:
        assert o["result"]["ok"] and o["result"]["step"] == 7 and o["result"]["checked"] > 0


def test_a_late_process_is_a_timeout_then_the_group_is_broken(tmp_path):
    out = launch("_jax_group_worker.py", 2, "late", str(tmp_path / "unused"))
    first = out[0]["result"]
    assert first["outcome"].startswith("timeout: barrier: a rank did not arrive in time"), first
    assert first["waited"] < 3.5, first
    assert "the group is broken" in first["again"], first


def test_the_readme_job_example_as_a_job_of_three_processes(tmp_path):
    """README's multi-process example, as written, run as the 3 processes of a job (2 CPU devices
    each: a 3 x 2 mesh) on a root where one process of 8 devices (4 x 2) saved step 100 with other
    values: every process restores its blocks (cut across the saved ones) from it, and the job
    saves step 200 with one commit, holding exactly what was restored."""
    world = 3
    from test_readme import BLOCKS

    block = next(b for b in BLOCKS if "jax.distributed.initialize" in b.code)
    (tmp_path / "job.py").write_text(block.code)
    saved = np.random.default_rng(world).standard_normal((768, 256)).astype(np.float32)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    w = jax.device_put(saved, NamedSharding(mesh, P("data", "model")))
    with ckptcore.CheckpointManager(str(tmp_path / "ckpts-jax-job")) as mgr:
        mgr.save(100, model=ckptcore_jax.Ref({"w": w}), rng=False)
    launch(tmp_path / "job.py", world, devices=2, cwd=tmp_path)
    listed = ckptcore.list_checkpoints(str(tmp_path / "ckpts-jax-job"))
    assert [c.step for c in listed] == [100, 200]
    state = ckptcore.load_state(listed[-1].url)
    assert state.step == 200 and state.model["w"].tobytes() == saved.tobytes()
