"""The process-group protocol's own groups (ThreadGroup, SingleProcessGroup) and the Shard leaf."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import ckptcore
from ckptcore import ProcessGroup, Shard, SingleProcessGroup, ThreadGroup


def _run(groups, fn):
    out, errors = {}, {}

    def body(g):
        try:
            out[g.rank] = fn(g)
        except BaseException as e:  # reported below
            errors[g.rank] = e

    threads = [threading.Thread(target=body, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out, errors


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

    out, errors = _run(ThreadGroup.create(size), fn)
    assert not errors
    assert out[0] == [[bytes([r, i]) for r in range(size)] for i in range(30)]
    assert all(out[r] == [None] * 30 for r in range(1, size))
    assert all(isinstance(g, ProcessGroup) for g in ThreadGroup.create(size))


def test_a_missing_rank_times_out_and_breaks_the_group():
    g0, g1, g2 = ThreadGroup.create(3)
    out, errors = _run([g0, g1], lambda g: g.gather(b"x", timeout=0.5))
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
