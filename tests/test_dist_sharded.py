"""A sharded state saved by N ranks of a group, loaded into M ranks (N -> M) bit for bit.

Every rank holds its own blocks (``Shard``/``Chunks`` leaves) of the sharded tensors and the
same replicated arrays; each writes its blocks and its share of the replicated arrays, rank 0
commits once.  The ranks are threads (``ckptcore.ThreadGroup``) on local disk and on the moto
S3 server; the same saves over real gloo processes are in tests/paddle_adapter/test_sharded.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import ckptcore
from ckptcore import Chunks, Shard, ThreadGroup, TrainingState

from _support import run_ranks
from test_sharded_load import GLOBALS, _blocks, _check_rank, _split, _state, _template


def _rank_leaf(ranks: int, r: int, *, template: bool = False, axis: int = 0):
    """Rank r of ``ranks``: its block of each sharded tensor (cut unevenly along ``axis``)."""
    def leaf(name, g):
        ax = axis if g.ndim > axis else 0
        block = _blocks(g, _split(g.shape[ax], ranks), ax)[r]
        return _template(block) if template else block
    return leaf


def _save(url, ranks: int, opts=None, **kw) -> dict:
    return run_ranks(ThreadGroup.create(ranks), lambda g: ckptcore.save_state(
        url, _state(_rank_leaf(ranks, g.rank, **kw)), group=g, storage_options=opts))


def _load(url, ranks: int, opts=None, **kw) -> dict:
    return run_ranks(ThreadGroup.create(ranks), lambda g: ckptcore.load_state(
        url, like=_state(_rank_leaf(ranks, g.rank, template=True, **kw)), group=g,
        storage_options=opts))


def _whole(state: TrainingState) -> None:
    assert state.model["w"].tobytes() == GLOBALS["w"].tobytes()
    assert state.optimizer.slots["w"]["m"].tobytes() == GLOBALS["m"].tobytes()
    assert state.accumulation.buffers["w"].tobytes() == GLOBALS["v"].tobytes()
    assert state.model["bias"].tobytes() == np.arange(6, dtype=np.float32).tobytes()
    assert (state.step, state.data["position"], state.schedule.last_lr) == (11, 123, 0.01)


CASES = [(2, 1), (1, 4), (4, 2), (3, 2), (2, 3)]


@pytest.mark.parametrize("saved,loaded", CASES)
def test_n_ranks_save_m_ranks_load(tmp_path, saved, loaded):
    url = str(tmp_path / "ck")
    out = _save(url, saved)
    assert all(isinstance(v, ckptcore.CheckpointInfo) for v in out.values()), out
    assert len({v.writer["id"] for v in out.values()}) == 1
    assert not ckptcore.verify(url)
    # every rank wrote its own blocks: one rank's shard files per rank
    ranks = {n.split("-")[2] for n in (tmp_path / "ck").iterdir() for n in [n.name]
             if n.startswith("shard-")}
    assert len(ranks) == saved
    got = _load(url, loaded)
    for r in range(loaded):
        assert isinstance(got[r], TrainingState), got
        _check_rank(got[r], loaded, r)
    _whole(ckptcore.load_state(url))  # no template: whole arrays


@pytest.mark.slow
def test_on_s3(s3_backend):
    url, opts = s3_backend.url("ck"), s3_backend.storage_options
    out = _save(url, 3, opts)
    assert all(isinstance(v, ckptcore.CheckpointInfo) for v in out.values()), out
    got = _load(url, 2, opts)
    for r in range(2):
        _check_rank(got[r], 2, r)
    assert not ckptcore.verify(url, storage_options=opts)


def test_replicated_to_sharded_and_back(tmp_path):
    plain = str(tmp_path / "plain")
    ckptcore.save_state(plain, _state(lambda name, g: g))  # one process, plain arrays
    got = _load(plain, 3)
    for r in range(3):
        _check_rank(got[r], 3, r)
    sharded = str(tmp_path / "sharded")
    _save(sharded, 2)
    out = run_ranks(ThreadGroup.create(2), lambda g: ckptcore.load_state(sharded, group=g))
    for r in range(2):
        _whole(out[r])  # every rank the whole (replicated) arrays


def test_per_rank_rng_as_a_sharded_leaf(tmp_path):
    """Each rank's own RNG state, saved as its row of a (world, n) tensor, comes back to the
    same rank; a replicated array saved by every rank is written once."""
    url = str(tmp_path / "ck")

    def save(g):
        mine = np.random.default_rng(100 + g.rank).integers(0, 2**32, (1, 8), dtype=np.uint32)
        state = TrainingState(model={"w": np.arange(10.0)},
                              rng={"numpy": Shard(mine, (3, 8), (g.rank, 0))}, step=1)
        return ckptcore.save_state(url, state, group=g)

    run_ranks(ThreadGroup.create(3), save)

    def load(g):
        like = TrainingState(rng={"numpy": Shard(np.zeros((1, 8), np.uint32), (3, 8), (g.rank, 0))})
        return ckptcore.load_state(url, like=like, group=g)

    out = run_ranks(ThreadGroup.create(3), load)
    for r in range(3):
        want = np.random.default_rng(100 + r).integers(0, 2**32, (1, 8), dtype=np.uint32)
        assert out[r].rng["numpy"].data.tobytes() == want.tobytes()
        assert out[r].model["w"].tobytes() == np.arange(10.0).tobytes()


def test_blocks_that_leave_a_hole_are_refused_naming_the_tensor(tmp_path):
    url = str(tmp_path / "ck")

    def save(g):
        leaf = _rank_leaf(3, g.rank)
        if g.rank == 2:  # forgets its block of "w": the ranks' blocks do not cover it
            return ckptcore.save_state(url, _state(lambda n, a: (leaf(n, a) if n != "w" else
                                       Shard(a[:0], a.shape, (0, 0)))), group=g)
        return ckptcore.save_state(url, _state(leaf), group=g)

    out = run_ranks(ThreadGroup.create(3), save)
    assert all(isinstance(v, ValueError) for v in out.values()), out
    assert "'model/w'" in str(out[1]) and "cover" in str(out[1])
    with pytest.raises(ckptcore.CheckpointNotFoundError):
        ckptcore.load_state(url)
    assert not [p for p in (tmp_path / "ck").glob("shard-*")] if (tmp_path / "ck").exists() else True


def test_overlapping_blocks_are_refused(tmp_path):
    url = str(tmp_path / "ck")

    def save(g):
        w = GLOBALS["w"]
        block = Shard(np.ascontiguousarray(w[:20]), w.shape, (0, 0)) if g.rank == 0 else \
            Shard(np.ascontiguousarray(w[10:]), w.shape, (10, 0))
        return ckptcore.save_state(url, TrainingState(model={"w": block}), group=g)

    out = run_ranks(ThreadGroup.create(2), save)
    assert all(isinstance(v, ValueError) for v in out.values()), out
    assert "model/w" in str(out[0]) and "disjoint" in str(out[0])
    with pytest.raises(ckptcore.CheckpointNotFoundError):
        ckptcore.load_state(url)


def test_a_leaf_sharded_on_one_rank_and_plain_on_another_is_refused(tmp_path):
    url = str(tmp_path / "ck")

    def save(g):
        w = GLOBALS["w"]
        leaf = Shard(w, w.shape, (0, 0)) if g.rank == 0 else w
        return ckptcore.save_state(url, TrainingState(model={"w": leaf}), group=g)

    out = run_ranks(ThreadGroup.create(2), save)
    assert isinstance(out[0], ckptcore.SchemaError) and "a Shard" in str(out[0]), out
    assert isinstance(out[1], ckptcore.CheckpointError)


def _only_w(ranks: int, r: int, *, template: bool = False, step: int = 1) -> TrainingState:
    """A state of one sharded tensor: rank r's block is all it reads with a template."""
    block = _blocks(GLOBALS["w"], _split(GLOBALS["w"].shape[0], ranks))[r]
    return TrainingState(model={"w": _template(block) if template else block}, step=step)


def _damage_rank_1(folder) -> None:
    shard = sorted(folder.glob("shard-*-r00001-*"))[0]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF  # in rank 1's block of w, which only rank 1 reads back
    shard.write_bytes(bytes(data))


def test_a_rank_whose_load_fails_fails_every_rank(tmp_path):
    url = str(tmp_path / "ck")
    run_ranks(ThreadGroup.create(2), lambda g: ckptcore.save_state(url, _only_w(2, g.rank), group=g))
    _damage_rank_1(tmp_path / "ck")
    assert isinstance(ckptcore.load_state(url, like=_only_w(2, 0, template=True)), TrainingState)
    out = run_ranks(ThreadGroup.create(2), lambda g: ckptcore.load_state(
        url, like=_only_w(2, g.rank, template=True), group=g))
    assert all(isinstance(v, ckptcore.CorruptCheckpointError) for v in out.values()), out
    assert "rank 1" in str(out[0])


@pytest.mark.filterwarnings("ignore::ckptcore.CheckpointFallbackWarning")
def test_a_manager_with_a_group_restores_sharded_states_and_falls_back_together(tmp_path, caplog):
    root = str(tmp_path / "run")

    def save(g):
        with ckptcore.CheckpointManager(root, keep=5, group=g) as mgr:
            for step in (1, 2):
                mgr.save(step, _only_w(2, g.rank, step=step))

    out = run_ranks(ThreadGroup.create(2), save)
    assert not any(isinstance(v, BaseException) for v in out.values()), out
    with ckptcore.CheckpointManager(root) as mgr:
        folder = tmp_path / "run" / mgr.step_url(2).rsplit("/", 1)[-1]
    _damage_rank_1(folder)  # only rank 1 of a 2-rank restore reads it: both fall back to 1

    def restore(g):
        with ckptcore.CheckpointManager(root, group=g) as mgr:
            return mgr.restore(like=_only_w(2, g.rank, template=True))

    out = run_ranks(ThreadGroup.create(2), restore)
    falls = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(falls) == 2 and any("rank 1" in m for m in falls), falls  # one per rank
    for r in range(2):
        assert isinstance(out[r], TrainingState), out
        assert out[r].step == 1
        assert out[r].model["w"].data.tobytes() == _only_w(2, r).model["w"].data.tobytes()


def test_chunks_leaves_several_blocks_per_rank(tmp_path):
    url = str(tmp_path / "ck")

    def save(g):  # rank r holds blocks r and r+2 of 4
        def leaf(name, a):
            blocks = _blocks(a, _split(a.shape[0], 4))
            return Chunks((blocks[g.rank], blocks[g.rank + 2]))
        return ckptcore.save_state(url, _state(leaf), group=g)

    out = run_ranks(ThreadGroup.create(2), save)
    assert all(isinstance(v, ckptcore.CheckpointInfo) for v in out.values()), out
    _whole(ckptcore.load_state(url))


class _Tampering:
    """Rank 1 of a ThreadGroup whose save reply is rewritten by ``change`` on its way to rank 0
    (a buggy or hostile peer): rank 0 must refuse it and commit nothing."""

    def __init__(self, inner, change) -> None:
        self._inner, self._change = inner, change
        self.rank, self.size = inner.rank, inner.size

    def gather(self, data, *, timeout):
        import msgpack

        reply = msgpack.unpackb(data, raw=False)
        if "chunks" in reply:
            self._change(reply)
            data = msgpack.packb(reply, use_bin_type=True)
        return self._inner.gather(data, timeout=timeout)

    def broadcast(self, data, *, timeout):
        return self._inner.broadcast(data, timeout=timeout)

    def barrier(self, *, timeout):
        return self._inner.barrier(timeout=timeout)


def _tensor_column(value: int):
    def change(reply):
        col = np.frombuffer(reply["chunks"]["tensor"], np.uint32).copy()
        col[0] = value
        reply["chunks"]["tensor"] = col.tobytes()
    return change


@pytest.mark.parametrize("change", [
    _tensor_column(40),  # a tensor the state does not have
    lambda r: r["chunks"].update(offset=b"\xff" * len(r["chunks"]["offset"])),  # beyond its shard
    lambda r: r["chunks"].update(tensor=[0]),  # not a column
    lambda r: r.update(shards=[]),
], ids=["unknown-tensor", "offsets", "not-bytes", "no-shards"])
def test_a_rank_reply_that_does_not_fit_is_refused(tmp_path, change):
    url = str(tmp_path / "ck")
    groups = ThreadGroup.create(2)
    groups[1] = _Tampering(groups[1], change)
    out = run_ranks(groups, lambda g: ckptcore.save_state(url, _only_w(2, g.rank), group=g))
    assert all(isinstance(v, (ckptcore.CheckpointError, ValueError)) for v in out.values()), out
    assert "rank 1" in str(out[0]) or "blocks" in str(out[0]), out[0]
    with pytest.raises(ckptcore.CheckpointNotFoundError):
        ckptcore.load_state(url)


def test_delete_rewind_and_gc_with_a_group_are_done_once_by_rank_0(tmp_path, caplog):
    root = str(tmp_path / "run")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "step-000000000099.tmp-deadbeef").mkdir()  # a leftover for gc

    def run(g):
        with ckptcore.CheckpointManager(root, keep=10, group=g) as mgr:
            for step in (1, 2, 3, 4):
                mgr.save(step, _only_w(3, g.rank, step=step))
            gone = mgr.rewind(3)
            mgr.delete(1)
            removed = mgr.gc(grace=0)
            return gone, removed, mgr.steps(), mgr.latest_step()

    with caplog.at_level("INFO", logger="ckptcore"):
        out = run_ranks(ThreadGroup.create(3), run)
    assert all(not isinstance(v, BaseException) for v in out.values()), out
    assert len({repr(v) for v in out.values()}) == 1, out  # every rank saw the same
    gone, removed, steps, latest = out[0]
    assert gone == [4, 3] and steps == [2] and latest == 2
    assert any("step-000000000099" in r for r in removed)
    deletions = [r.getMessage() for r in caplog.records if "deleting checkpoint" in r.getMessage()]
    assert len(deletions) == 3, deletions  # 4, 3 and 1, each deleted once (by rank 0)
    with ckptcore.CheckpointManager(root) as mgr:
        assert mgr.steps() == [2]
