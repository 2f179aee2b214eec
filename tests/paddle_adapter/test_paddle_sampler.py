"""ResumableBatchSampler without Paddle (it never imports it): order, snapshots, advance, sharding.

The DataLoader side (prefetching with a buffer thread and with worker processes) is
``test_paddle_fit.py::test_loader_prefetch_and_workers``.
"""

from __future__ import annotations

import pytest

import ckptcore
from ckptcore_paddle import ResumableBatchSampler


def _cursor(n: int = 23, bs: int = 4, seed: int = 9) -> ckptcore.DataCursor:
    return ckptcore.DataCursor(n, bs, seed=seed)


def _reference(epochs: int, **kw) -> list[list[list[int]]]:
    c = _cursor(**kw)
    return [[b.tolist() for b in c.iter_epoch()] for _ in range(epochs)]


def _train(sampler: ResumableBatchSampler, epochs: int) -> list[list[list[int]]]:
    out = []
    for _ in range(epochs):
        seen = []
        for batch in sampler:
            seen.append(batch)
            sampler.advance()
        out.append(seen)
    return out


def test_one_epoch_per_iter_in_the_cursor_order():
    sampler = ResumableBatchSampler(_cursor())
    assert _train(sampler, 3) == _reference(3)
    assert sampler.cursor.epoch == 3 and sampler.cursor.position == 0
    assert all(isinstance(i, int) for i in next(iter(sampler)))


def test_the_sampler_never_imports_paddle(run_python):
    # In a fresh process: this test process may have imported Paddle for other tests.
    run_python("-c", "import sys, ckptcore, ckptcore_paddle\n"
               "s = ckptcore_paddle.ResumableBatchSampler(ckptcore.DataCursor(10, 3, seed=0))\n"
               "[s.advance() for _ in s]\n"
               "assert s.cursor.epoch == 1 and 'paddle' not in sys.modules, sorted(sys.modules)")


def test_iterating_does_not_move_the_cursor_advance_does():
    c = _cursor()
    sampler = ResumableBatchSampler(c)
    it = iter(sampler)
    fetched = [next(it) for _ in range(4)]  # a loader prefetching ahead of training
    assert (c.epoch, c.position) == (0, 0)
    sampler.advance()
    assert (c.epoch, c.position) == (0, 4)
    saved = c.state_dict()
    sampler.advance(2)
    assert c.position == 12
    # Resuming from the saved position starts at the first batch not trained, not the first not fetched.
    resumed = ResumableBatchSampler(ckptcore.DataCursor.from_state(saved))
    rest = list(resumed)
    assert rest[0] == fetched[1] and [fetched[0], *rest] == _reference(1)[0]


def test_len_is_what_this_pass_yields():
    c = _cursor()  # 23 samples, batches of 4: 6 batches an epoch
    sampler = ResumableBatchSampler(c)
    assert len(sampler) == 6
    it = iter(sampler)
    for _ in range(2):
        next(it)
        sampler.advance()
    assert len(sampler) == 6  # hapi compares its step within this pass with len()
    for _ in it:
        sampler.advance()
    assert len(sampler) == 6 and c.epoch == 1
    c2 = ckptcore.DataCursor.from_state({**c.state_dict(), "position": 8})
    resumed = ResumableBatchSampler(c2)
    assert len(resumed) == 4 and len(list(resumed)) == 4 and len(resumed) == 4


def test_forgetting_advance_refuses_saves_and_never_repeats_an_epoch():
    sampler = ResumableBatchSampler(_cursor())
    first = list(sampler)
    with pytest.raises(ValueError, match="stale"):
        sampler.state_dict()  # what a save asks for: refused rather than position 0
    with pytest.raises(ValueError, match="handed out"):
        sampler.advance(7)  # the pass handed out 6
    second = list(sampler)  # the whole epoch was consumed: the next iter() moves on, no RuntimeError
    assert [first, second] == _reference(2) and sampler.cursor.epoch == 1
    sampler.advance(6)
    assert sampler.cursor.epoch == 2 and sampler.state_dict()["epoch"] == 2  # advanced: trusted again


def test_advance_cannot_outrun_fetching():
    sampler = ResumableBatchSampler(_cursor())
    with pytest.raises(ValueError, match="handed out"):
        sampler.advance()
    it = iter(sampler)
    next(it)
    sampler.advance()
    with pytest.raises(ValueError):
        sampler.advance()
    with pytest.raises(TypeError):
        sampler.advance(True)


def test_sharded_ranks_split_every_global_batch_and_resume_under_another_world_size():
    world = 3
    cursors = [_cursor(n=26, bs=6) for _ in range(world)]
    samplers = [ResumableBatchSampler(c, rank=r, world_size=world) for r, c in enumerate(cursors)]
    assert samplers[0].batch_size == 2 and samplers[0].drop_last is False
    iters = [iter(s) for s in samplers]
    reference = _reference(2, n=26, bs=6)
    for g in range(3):
        parts = [next(it) for it in iters]
        assert sum(parts, []) == reference[0][g]
        for s in samplers:
            s.advance()
    states = {str(c.state_dict()) for c in cursors}
    assert len(states) == 1  # every rank holds the same global position
    # Elastic: the 3-rank state resumes in one process at the same global sample.
    single = ResumableBatchSampler(ckptcore.DataCursor.from_state(cursors[0].state_dict()))
    assert _train(single, 2) == [reference[0][3:], reference[1]]
    # A CursorShard works as well, and must agree with rank/world_size if both are given.
    shard = _cursor(n=26, bs=6).shard(1, 2)
    assert ResumableBatchSampler(shard).rank == 1
    with pytest.raises(ValueError):
        ResumableBatchSampler(shard, rank=0, world_size=2)
    with pytest.raises(TypeError):
        ResumableBatchSampler(_cursor(), rank=0)
    with pytest.raises(ValueError):
        ResumableBatchSampler(_cursor(), rank=2, world_size=2)
    with pytest.raises(TypeError):
        ResumableBatchSampler([1, 2, 3])


def test_state_dict_is_the_cursors_and_load_moves_it():
    c = _cursor()
    sampler = ResumableBatchSampler(c)
    _train(sampler, 1)
    other = ResumableBatchSampler(_cursor())
    other.load_state_dict(sampler.state_dict())
    assert other.state_dict() == c.state_dict() and list(other) == _reference(2)[1]
