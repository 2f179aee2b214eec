"""Distributed saves of real gloo jobs on 127.0.0.1 (ckptcore_torch.process_group()).

DDP: the replicated arrays are written with each rank writing its share.  FSDP2
(``fully_shard``, on a 1-D mesh and HSDP's 2-D ``(Replicate, Shard(0))``): parameters and Adam's
states saved as ``Shard``s by every rank with one commit, restored into other world sizes and
meshes (2->4, 4->3, 4->2, 2->1) bit for bit, comparing the global tensors; a rank SIGKILLed in
the middle of a save commits nothing and the others get a GroupError; a 2-rank run SIGKILLed and
resumed ends bit for bit equal to the uninterrupted run.

A job costs seconds to start on a busy machine, so each job does several steps (see
_torch_sharded_worker.py) and the module-scoped fixtures share them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import ckptcore  # noqa: E402
from _torch_ranks import launch  # noqa: E402
from ckptcore.errors import CheckpointNotFoundError  # noqa: E402

WORKER = "_torch_sharded_worker.py"


def _job(d: Path, name: str, world: int, *steps: str, **kw) -> list[dict | None]:
    """Run one job; each rank's report (None for a rank that was killed before writing it)."""
    out = d / f"job-{name}"
    out.mkdir()
    launch(WORKER, world, out, *steps, timeout=180, **kw)
    return [json.loads(f.read_text()) if (f := out / f"rank{r}.json").exists() else None
            for r in range(world)]


def _same_npz(a: Path, b: Path) -> None:
    with np.load(a) as x, np.load(b) as y:
        assert sorted(x.files) == sorted(y.files) and len(x.files) == 16
        for k in x.files:
            assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, k
            assert x[k].tobytes() == y[k].tobytes(), f"{k} differs"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The jobs in order: 2 ranks save (and train the uninterrupted run), 4 ranks on a 2-D mesh
    load that and save their own, 3 ranks load the 4-rank save then die mid-save, 2 ranks load it
    and run the training that is killed, 2 ranks resume it."""
    d = tmp_path_factory.mktemp("sharded")
    reports = {
        "w2": _job(d, "w2", 2, f"ddp:{d}/ddp", f"save:{d}/w2:1d", f"train:{d}/ref:6:0", "refusals"),
        "w4": _job(d, "w4", 4, f"load:{d}/w2:2d", f"save:{d}/w4:2d"),
        "w3": _job(d, "w3", 3, f"load:{d}/w4:1d", f"killsave:{d}/dead", expect_killed=(2,)),
        "kill": _job(d, "kill", 2, f"load:{d}/w4:1d", f"train:{d}/run:6:5", expect_killed=(1,), any_rc=(0,)),
    }
    reports["resumed"] = _job(d, "resumed", 2, f"train:{d}/run:6:0")
    return d, reports


def test_ddp_writes_the_replicated_arrays_with_every_rank_writing_its_share(jobs):
    d, reports = jobs
    first = reports["w2"]
    assert all(r["ddp_same"] for r in first)
    assert first[0]["ddp_keys"] == ["0.bias", "0.weight", "1.bias", "1.weight"]  # no "module."
    written = first[0]["ddp_bytes"]
    total = 3 * 4 * (64 * 256 + 256 + 256 * 8 + 8)  # weights, biases and Adam's two slots
    assert sorted(written) == ["r00000", "r00001"] and total <= sum(written.values()) < total + 16384
    assert min(written.values()) > total / 3, written  # each rank about half, none nothing


def test_fsdp2_blocks_are_shards_with_torchs_own_offsets(jobs):
    d, reports = jobs
    w2, w4 = reports["w2"], reports["w4"]
    assert [r["save_leaves"]["0.weight"] for r in w2] == [
        "Shard(float32[4, 5] at [0, 0] of [7, 5])", "Shard(float32[3, 5] at [4, 0] of [7, 5])"]
    # HSDP on a (2, 2) mesh: ranks 2 and 3 replicate ranks 0 and 1, and write nothing of it
    assert [r["save_leaves"]["0.weight"] for r in w4] == [
        "Shard(float32[4, 5] at [0, 0] of [7, 5])", "Shard(float32[3, 5] at [4, 0] of [7, 5])",
        "Shard(float32[0, 5] at [0, 0] of [7, 5])", "Shard(float32[0, 5] at [0, 0] of [7, 5])"]
    # loading into three ranks asks for torch.chunk's blocks of 3, 3 and 1 rows, wherever they were cut
    assert [r["load_leaves_3"]["0.weight"] for r in reports["w3"]] == [
        "Shard(float32[3, 5] at [0, 0] of [7, 5])", "Shard(float32[3, 5] at [3, 0] of [7, 5])",
        "Shard(float32[1, 5] at [6, 0] of [7, 5])"]


@pytest.mark.parametrize("saved, loaded", [("w2", 4), ("w4", 3), ("w4", 2)])
def test_a_sharded_save_restores_bitwise_into_another_world_and_mesh(jobs, saved, loaded):
    d, reports = jobs
    _same_npz(d / f"{saved}.npz", d / f"{saved}.loaded-{loaded}.npz")
    job = {4: "w4", 3: "w3", 2: "kill"}[loaded]
    # Adam's moments are DTensors again (placed like their parameters), its step a plain tensor
    assert all(r["slot_types"] == ["DTensor", "Tensor"] for r in reports[job])


def test_a_two_rank_save_loads_whole_into_one_process(jobs):
    d, _ = jobs
    state = ckptcore.load_state(str(d / "w2"))
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    with torch.no_grad():
        for k, p in net.state_dict().items():
            p.copy_(torch.from_numpy(state.model[k]))
    with np.load(d / "w2.npz") as want:
        for k, p in net.state_dict().items():
            assert p.numpy().tobytes() == want[f"model/{k}"].tobytes(), k
        for n, slots in state.optimizer.slots.items():
            for k, v in slots.items():
                assert isinstance(v, np.ndarray) and v.tobytes() == want[f"optimizer/{n}/{k}"].tobytes()


def test_a_rank_killed_mid_save_commits_nothing_and_no_rank_hangs(jobs):
    d, reports = jobs
    for r in reports["w3"][:2]:
        assert r["killsave"].startswith("GroupError"), r["killsave"]
        assert r["killsave_took"] < 30, r
    with pytest.raises(CheckpointNotFoundError):
        ckptcore.load_state(str(d / "dead"))


def test_a_sharded_run_killed_and_resumed_equals_the_uninterrupted_run(jobs):
    d, reports = jobs
    assert [r["start"] for r in reports["resumed"]] == [4, 4]  # saved at 2 and 4, killed after 5
    assert ckptcore.CheckpointManager(str(d / "run"), lock=False).steps()[-1] == 6
    _same_npz(d / "ref.final.npz", d / "run.final.npz")


def test_a_partial_dtensor_and_another_ranks_block_are_refused(jobs):
    d, reports = jobs
    for r in reports["w2"]:
        assert "a Partial DTensor holds a summand, not a block" in r["partial"]
        assert r["partial"].startswith("a DTensor of shape [4, 3]")
        mine = "[0, 0]" if r["rank"] == 0 else "[2, 0]"
        assert f"weight: loaded Shard(float32[2, 3] at" in r["wrong_block"]
        assert f"this rank holds the block of shape [2, 3] at {mine} of [4, 3]" in r["wrong_block"]
