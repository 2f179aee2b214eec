"""save_state(url, state, group=...): every rank writes its share, rank 0 commits once.

The ranks are threads of this process (ckptcore.ThreadGroup): the protocol and the storage are
the real ones, on local disk and on the moto S3 server (tests/conftest.py).  Real multi-process
groups over the frameworks' engines are tested with their adapters.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import ckptcore
from ckptcore import ThreadGroup, TrainingState, _knobs
from ckptcore._dist import assign

from _support import run_ranks


def _state(seed: int = 0, count: int = 60) -> TrainingState:
    rng = np.random.default_rng(seed)
    model = {f"layer{i // 6}/t{i}": rng.standard_normal(int(rng.integers(1, 60_000))).astype(np.float32)
             for i in range(count)}
    opt = ckptcore.OptimizerState(kind="adam", step=3, hyperparams={"lr": 0.1},
                                  slots={k: {"m": v * 2} for k, v in list(model.items())[:10]})
    return TrainingState(model=model, optimizer=opt, step=11, epoch=2,
                         data={"cursor": {"epoch": 2, "position": 5}})




def _same(a: TrainingState, b: TrainingState) -> bool:
    return (a.model.keys() == b.model.keys()
            and all(a.model[k].tobytes() == b.model[k].tobytes() and a.model[k].dtype == b.model[k].dtype
                    for k in a.model)
            and all(a.optimizer.slots[k]["m"].tobytes() == b.optimizer.slots[k]["m"].tobytes()
                    for k in a.optimizer.slots)
            and (a.step, a.epoch, a.data) == (b.step, b.epoch, b.data))


def _bytes_per_rank(backend, *parts) -> dict[str, int]:
    out: dict[str, int] = {}
    for name in backend.listdir(*parts):
        if name.startswith("shard-"):
            rank = name.split("-")[2]
            out[rank] = out.get(rank, 0) + len(backend.read(*parts, name))
    return out


def test_assignment_is_balanced_and_deterministic():
    sizes = [int(x) for x in np.random.default_rng(1).integers(1, 10**6, 500)]
    for n in (1, 2, 3, 4, 7):
        owner = assign(sizes, n)
        assert owner == assign(list(sizes), n)
        load = [sum(s for s, r in zip(sizes, owner) if r == k) for k in range(n)]
        assert max(load) - min(load) <= max(sizes)
    assert assign([], 3) == []
    from ckptcore import _dist

    many = [int(x) for x in np.random.default_rng(2).integers(1, 10**6, _dist._GREEDY_MAX + 1)]
    for n in (2, 7, 1000):
        owner = assign(many, n)  # the vectorised plan for many tensors
        assert owner == assign(list(many), n) and set(owner) == set(range(n))
        load = np.bincount(owner, weights=many, minlength=n)
        assert load.max() - load.min() <= max(many)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_every_rank_writes_its_share_and_one_commit_loads_bit_for_bit(backend, ranks):
    state = _state()
    url, opts = backend.url("ck"), backend.storage_options
    out = run_ranks(ThreadGroup.create(ranks),
               lambda g: ckptcore.save_state(url, state, group=g, storage_options=opts))
    assert all(isinstance(v, ckptcore.CheckpointInfo) for v in out.values()), out
    assert len({v.writer["id"] for v in out.values()}) == 1  # one commit, seen by every rank
    assert _same(ckptcore.load_state(url, storage_options=opts), state)
    assert not ckptcore.verify(url, storage_options=opts)
    shares = _bytes_per_rank(backend, "ck")
    assert len(shares) == ranks
    total = sum(shares.values())
    for share in shares.values():
        assert abs(share / total - 1 / ranks) <= 0.05, shares


def test_an_existing_checkpoint_fails_every_rank_unless_overwritten(backend):
    url, opts = backend.url("ck"), backend.storage_options
    ckptcore.save_state(url, _state(1), storage_options=opts)
    out = run_ranks(ThreadGroup.create(3),
               lambda g: ckptcore.save_state(url, _state(2), group=g, storage_options=opts))
    assert all(isinstance(v, ckptcore.CheckpointExistsError) for v in out.values()), out
    assert _same(ckptcore.load_state(url, storage_options=opts), _state(1))
    out = run_ranks(ThreadGroup.create(3), lambda g: ckptcore.save_state(
        url, _state(2), group=g, storage_options=opts, overwrite=True))
    assert all(isinstance(v, ckptcore.CheckpointInfo) for v in out.values()), out
    assert _same(ckptcore.load_state(url, storage_options=opts), _state(2))


def test_a_rank_that_fails_leaves_no_commit_and_every_rank_raises(backend):
    url, opts = backend.url("ck"), backend.storage_options
    ckptcore.save_state(url, _state(1), storage_options=opts)

    def save(g):
        state = _state(2)
        if g.rank == 1:
            state.extra = {"bad": object()}  # cannot be encoded: this rank fails
        return ckptcore.save_state(url, state, group=g, storage_options=opts, overwrite=True)

    t = time.monotonic()
    out = run_ranks(ThreadGroup.create(3), save)
    assert time.monotonic() - t < 30  # at once, not after the group timeout
    assert isinstance(out[1], TypeError)
    assert all(isinstance(out[r], ckptcore.CheckpointError) for r in (0, 2)), out
    assert "rank 1" in str(out[0])
    assert _same(ckptcore.load_state(url, storage_options=opts), _state(1))
    assert not [n for n in backend.listdir("ck") if n.startswith("shard-") and "-r0000" in n]


@pytest.mark.slow
def test_a_rank_that_never_comes_times_out_on_the_others(backend):
    url, opts = backend.url("ck"), backend.storage_options
    ckptcore.save_state(url, _state(1), storage_options=opts)
    groups = ThreadGroup.create(3)
    with _knobs.override(group_timeout=1.0):
        t = time.monotonic()
        out = run_ranks(groups[:2], lambda g: ckptcore.save_state(url, _state(2), group=g,
                                                            storage_options=opts, overwrite=True))
        elapsed = time.monotonic() - t
    assert all(isinstance(v, ckptcore.GroupError) for v in out.values()), out
    assert any(isinstance(v, ckptcore.GroupTimeoutError) for v in out.values())
    assert elapsed < 10
    assert _same(ckptcore.load_state(url, storage_options=opts), _state(1))


def test_ranks_with_different_states_are_refused_naming_the_tensor(backend):
    url, opts = backend.url("ck"), backend.storage_options

    def save(g):
        state = _state(3)
        if g.rank == 2:
            state.model["layer0/t1"] = state.model["layer0/t1"][:-1]  # not replicated
        return ckptcore.save_state(url, state, group=g, storage_options=opts)

    out = run_ranks(ThreadGroup.create(3), save)
    assert isinstance(out[0], ckptcore.SchemaError) and "layer0/t1" in str(out[0]), out
    assert all(isinstance(v, ckptcore.CheckpointError) for v in out.values())
    with pytest.raises(ckptcore.CheckpointNotFoundError):
        ckptcore.load_state(url, storage_options=opts)


def test_a_group_save_of_an_incomplete_shard_is_refused(tmp_path):
    """Without a group, a Shard is one process's own block (saved as it is: a partial
    checkpoint); a whole group's save must cover every tensor (tests/test_dist_sharded.py)."""
    state = TrainingState(model={"w": ckptcore.Shard(np.zeros(2), (4,), (0,))})
    with pytest.raises(ValueError, match="16 of its 32 bytes"):
        ckptcore.save_state(tmp_path / "ck", state, group=ckptcore.SingleProcessGroup())
    with pytest.raises(ckptcore.CheckpointNotFoundError):
        ckptcore.load_state(tmp_path / "ck")
    ckptcore.save_state(tmp_path / "ck", state)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_manager_with_a_group_saves_every_step_once_and_keeps_its_retention(backend, async_save):
    root, opts = backend.url("run"), backend.storage_options
    states = {step: _state(step, count=12) for step in (10, 20, 30, 40)}

    def run(g):
        mgr = ckptcore.CheckpointManager(root, keep=2, storage_options=opts, group=g,
                                         async_save=async_save, save_on_preemption=False)
        try:
            for step, state in states.items():
                mgr.save(step, state)
            mgr.wait()
            return mgr.steps(), mgr._lock is not None
        finally:
            mgr.close()

    out = run_ranks(ThreadGroup.create(3), run)
    assert all(not isinstance(v, BaseException) for v in out.values()), out
    assert out[0] == ([30, 40], True)  # rank 0 applied retention and held the lock
    assert all(out[r][1] is False for r in (1, 2))
    mgr = ckptcore.CheckpointManager(root, storage_options=opts, lock=False,
                                     save_on_preemption=False)
    assert _same(mgr.restore(), states[40])
    assert len(_bytes_per_rank(backend, "run", ckptcore.layout.step_name(40))) == 3


def test_a_refusal_only_rank_0_can_make_reaches_every_rank_at_once(tmp_path):
    """The writer lock is rank 0's: when another manager holds it, every rank of the group
    raises LockedError at once (not GroupTimeoutError after the group timeout); a step below
    the newest is refused on every rank alike."""
    root = str(tmp_path / "run")
    holder = ckptcore.CheckpointManager(root, save_on_preemption=False)
    holder.save(5, _state(5, count=4))

    def run(g):
        mgr = ckptcore.CheckpointManager(root, group=g, save_on_preemption=False)
        try:
            return mgr.save(10, _state(10, count=4))
        finally:
            mgr.close()

    with _knobs.override(group_timeout=30.0):
        t = time.monotonic()
        out = run_ranks(ThreadGroup.create(3), run)
        assert time.monotonic() - t < 10
    assert all(isinstance(v, ckptcore.LockedError) for v in out.values()), out
    holder.close()

    def below(g):
        mgr = ckptcore.CheckpointManager(root, group=g, save_on_preemption=False)
        try:
            return mgr.save(3, _state(3, count=4))
        finally:
            mgr.close()

    out = run_ranks(ThreadGroup.create(3), below)
    assert all(isinstance(v, ValueError) for v in out.values()), out


def test_a_rank_whose_snapshot_fails_fails_every_rank_at_once(tmp_path):
    root = str(tmp_path / "run")

    def run(g):
        state = _state(1, count=4)
        if g.rank == 2:
            state.extra = {"bad": object()}
        mgr = ckptcore.CheckpointManager(root, group=g, async_save=True, save_on_preemption=False)
        try:
            mgr.save(1, state)
            mgr.wait()
            return mgr.steps()
        finally:
            mgr.close()

    t = time.monotonic()
    out = run_ranks(ThreadGroup.create(3), run)
    assert time.monotonic() - t < 30
    assert all(isinstance(v, Exception) for v in out.values()), out
    with ckptcore.CheckpointManager(root, lock=False, save_on_preemption=False) as reader:
        assert not reader.steps()
