"""The process-group protocol's own groups (ThreadGroup, SingleProcessGroup) and the Shard leaf."""

from __future__ import annotations

import numpy as np
import pytest

import ckptcore
from ckptcore import ProcessGroup, Shard, SingleProcessGroup, ThreadGroup

from _support import run_ranks




@pytest.mark.parametrize("size", [1, 2, 4])
def test_thread_group_collectives_in_order(size):
    def fn(g):
        seen = []
        for i in range(30):
            got = g.gather(bytes([g.rank, i]), timeout=10)
            seen.append(got)
            b = g.broadcast(b"round %d" % i if g.rank == 0 else None, timeout=10)
            assert b == b"round %d" % i
            g.barrier(timeout=10)
        return seen

    out = run_ranks(ThreadGroup.create(size), fn)
    errors = {r: v for r, v in out.items() if isinstance(v, BaseException)}
    assert not errors
    assert out[0] == [[bytes([r, i]) for r in range(size)] for i in range(30)]
    assert all(out[r] == [None] * 30 for r in range(1, size))
    assert all(isinstance(g, ProcessGroup) for g in ThreadGroup.create(size))


def test_a_missing_rank_times_out_and_breaks_the_group():
    g0, g1, g2 = ThreadGroup.create(3)
    errors = run_ranks([g0, g1], lambda g: g.gather(b"x", timeout=0.5))
    assert set(errors) == {0, 1}
    assert all(isinstance(e, ckptcore.GroupTimeoutError) for e in errors.values())
    assert all(isinstance(e, TimeoutError) for e in errors.values())
    assert "[2]" in str(errors[0])
    with pytest.raises(ckptcore.GroupError, match="broken"):
        g2.barrier(timeout=1)


def test_single_process_group():
    g = SingleProcessGroup()
    assert (g.rank, g.size) == (0, 1) and isinstance(g, ProcessGroup)
    assert g.gather(b"a", timeout=1) == [b"a"]
    assert g.broadcast(b"b", timeout=1) == b"b"
    with pytest.raises(ckptcore.GroupError):
        g.broadcast(None, timeout=1)
    g.barrier(timeout=1)


def test_shard_validates_its_place():
    s = Shard(np.arange(6.0).reshape(2, 3), [4, 3], (2, 0))
    assert (s.global_shape, s.offsets, s.shape) == ((4, 3), (2, 0), (2, 3))
    whole = np.zeros((4, 3))
    whole[s.index()] = s.data
    assert whole[2:].tolist() == s.data.tolist()
    with pytest.raises(ValueError, match="outside"):
        Shard(np.zeros((2, 3)), (3, 3), (2, 0))
    with pytest.raises(ValueError, match="dimensions"):
        Shard(np.zeros((2, 3)), (4,), (0,))
    with pytest.raises(ValueError, match="non-negative"):
        Shard(np.zeros(2), (4,), (-1,))
    with pytest.raises(TypeError, match="ndarray"):
        Shard([1, 2], (4,), (0,))
    with pytest.raises(Exception):
        s.offsets = (0, 0)  # frozen
