"""ckptcore_torch.process_group(): torch.distributed (gloo) as a ckptcore.ProcessGroup, in real
processes on 127.0.0.1 (2, 3 and 4 ranks): bytes of any length in rank order, a sub-group, a killed peer (GroupError
within a second, then the group stays broken) and a hung one (GroupTimeoutError at the deadline,
and the process still exits)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import ckptcore_torch  # noqa: E402
from _torch_ranks import launch  # noqa: E402
from ckptcore.errors import CheckpointError  # noqa: E402
from ckptcore.group import ProcessGroup, SingleProcessGroup  # noqa: E402


def test_outside_a_job_the_group_is_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    g = ckptcore_torch.process_group()
    assert isinstance(g, SingleProcessGroup) and isinstance(g, ProcessGroup)
    assert (g.rank, g.size) == (0, 1) and g.gather(b"x", timeout=1) == [b"x"]
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(CheckpointError, match="4 ranks .*init_process_group"):
        ckptcore_torch.process_group()
    with pytest.raises(CheckpointError, match="not initialised"):
        ckptcore_torch.process_group(object())


def _worked(out: list[dict], world: int) -> None:
    """Every rank's checks passed (gathers in rank order, broadcasts, barriers: the worker asserts)."""
    assert [(o["rank"], o["size"], o["type"]) for o in out] == \
        [(r, world, "CollectiveGroup") for r in range(len(out))]
    print({o["rank"]: (o["gather_ms"], o["broadcast_ms"], o["barrier_ms"]) for o in out})
    assert all(o["barrier_ms"] < 1000 for o in out)


def test_bytes_travel_in_rank_order_through_gloo_and_a_sub_group():
    out = [o["result"] for o in launch("_torch_group_worker.py", 4, "basic")]
    _worked(out, 4)
    # the sub-group of job ranks 1 and 3: its own ranks 0 and 1; the others are refused
    assert [(o["sub"]["rank"], o["sub"]["size"]) for o in out if "sub" in o] == [(0, 2), (1, 2)]
    assert [o["rank"] for o in out if "sub" in o] == [1, 3]
    for r in (0, 2):
        assert f"rank {r} of the job) is not a member of the torch group of ranks [1, 3]" in out[r]["refused"]


def test_a_killed_peer_is_a_group_error_within_a_second_and_the_group_stays_broken():
    out = [o["result"] for o in launch("_torch_group_worker.py", 3, "killed", expect_killed=(2,))[:2]]
    _worked(out, 3)
    print([round(o["took"] - 0.5, 3) for o in out])  # after the kill (the victim slept 0.5 s)
    for o in out:
        assert o["error"] == "GroupError" and not o["timeout"], o
        assert "torch.distributed failed" in o["message"] and o["took"] < 5, o
        assert o["again"].startswith("GroupError: barrier: the group is broken") and o["again_took"] < 0.1


def test_a_hung_peer_is_a_timeout_at_the_deadline_and_the_survivors_still_exit():
    out = [o["result"] for o in launch("_torch_group_worker.py", 2, "hung", hung=(1,), timeout=60)[:1]]
    _worked(out, 2)  # two ranks: the job works until its peer stops answering
    for o in out:
        assert o["error"] == "GroupTimeoutError" and o["timeout"], o
        assert 2.0 <= o["took"] < 4, o
        assert "the group is broken" in o["again"]
