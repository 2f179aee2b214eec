"""Rank 0 of a group save trusts no reply: a plain (format-2) state's replies are checked as
strictly as a chunked state's (tests/test_dist_sharded.py), and a save has one outcome on every
rank: committed (success everywhere; a peer lost after its reply is only logged) or not (a
typed error everywhere, nothing committed, nothing outside the checkpoint touched).

The ranks are threads (``ckptcore.ThreadGroup``); a wrapper alters one rank's reply on its way
to rank 0 (a buggy or hostile peer) or makes a rank stop right after it replied.
"""

from __future__ import annotations

import logging
import time

import msgpack
import numpy as np
import pytest

import ckptcore
from ckptcore import ThreadGroup, TrainingState, _knobs

from _support import assert_state_same, run_ranks


def _state(seed: int = 0) -> TrainingState:
    rng = np.random.default_rng(seed)
    model = {f"t{i}": rng.standard_normal(int(rng.integers(10, 3000))).astype(np.float32)
             for i in range(12)}
    return TrainingState(model=model, step=seed, data={"position": seed * 3})


class _Tampering:
    """A rank whose plain-state save reply is rewritten by ``change(reply)`` on its way to rank 0,
    while ``armed``."""

    def __init__(self, inner, change, *, armed: bool = True, kind: str = "rows") -> None:
        self._inner, self._change, self.armed, self._kind = inner, change, armed, kind
        self.rank, self.size = inner.rank, inner.size

    def gather(self, data, *, timeout):
        reply = msgpack.unpackb(data, raw=False)
        if self.armed and isinstance(reply, dict) and self._kind in reply:
            self._change(reply)
            data = msgpack.packb(reply, use_bin_type=True)
        return self._inner.gather(data, timeout=timeout)

    def broadcast(self, data, *, timeout):
        return self._inner.broadcast(data, timeout=timeout)

    def barrier(self, *, timeout):
        return self._inner.barrier(timeout=timeout)


def _rows(reply, key: str) -> np.ndarray:
    from ckptcore._dist import _ROW_DTYPES
    return np.frombuffer(reply["rows"][key], _ROW_DTYPES[key]).copy()


def _set_rows(reply, key: str, values: np.ndarray) -> None:
    from ckptcore._dist import _ROW_DTYPES
    reply["rows"][key] = np.ascontiguousarray(values, _ROW_DTYPES[key]).tobytes()


def _offset_past_shard(reply):
    off = _rows(reply, "offset")
    off[0] = reply["shards"][int(_rows(reply, "shard")[0])][1] + 64
    _set_rows(reply, "offset", off)


def _escape(reply):
    reply["shards"][0][0] = "../evil.bin"


def _rank_0_name(reply):
    reply["shards"][0][0] = reply["shards"][0][0].replace("-r00001-", "-r00000-")


def _no_marker(reply):  # a safe name, but not one this rank wrote (another save's)
    reply["shards"][0][0] = "shard-00000-r00001-0123456789abcdef.bin"


def _size_lie(reply):  # declared larger than the file and than its tensors
    reply["shards"][0][1] += 4096


def _twice(reply):
    reply["shards"].append(list(reply["shards"][0]))


def _overlap(reply):
    shard, off = _rows(reply, "shard"), _rows(reply, "offset")
    same = np.flatnonzero(shard == shard[0])
    assert len(same) >= 2, "the test needs two tensors of rank 1 in one shard"
    off[same[1]] = off[same[0]]
    _set_rows(reply, "offset", off)


def _bad_shard_index(reply):
    shard = _rows(reply, "shard")
    shard[0] = len(reply["shards"])
    _set_rows(reply, "shard", shard)


def _short_column(reply):
    _set_rows(reply, "crc", _rows(reply, "crc")[:-1])


CHANGES = {
    "offset-past-shard": _offset_past_shard,
    "escape": _escape,
    "rank-0-name": _rank_0_name,
    "other-token": _no_marker,
    "size-lie": _size_lie,
    "listed-twice": _twice,
    "overlap": _overlap,
    "shard-index": _bad_shard_index,
    "short-column": _short_column,
}


@pytest.fixture(params=["local", "memory"])
def store(request):
    return request.getfixturevalue(f"{request.param}_backend")


def _assert_refused(out: dict, *, naming_rank_1: bool = True) -> None:
    assert all(isinstance(v, ckptcore.CheckpointError) for v in out.values()), out
    if naming_rank_1:
        assert isinstance(out[0], ckptcore.GroupError), out
        assert "rank 1" in str(out[0]), out[0]
        assert all(isinstance(v, ckptcore.GroupError) for v in out.values()), out


@pytest.mark.parametrize("change", list(CHANGES.values()), ids=list(CHANGES))
def test_a_plain_state_reply_that_does_not_fit_is_refused_on_every_rank(store, change):
    url, opts = store.url("ck"), store.storage_options
    store.write(b"sentinel", "evil.bin")  # beside the checkpoint folder: "../evil.bin" from it
    groups = ThreadGroup.create(3)
    groups[1] = _Tampering(groups[1], change)
    out = run_ranks(groups, lambda g: ckptcore.save_state(url, _state(), group=g,
                                                          storage_options=opts))
    _assert_refused(out)
    with pytest.raises(ckptcore.CheckpointNotFoundError):
        ckptcore.load_state(url, storage_options=opts)
    assert store.read("evil.bin") == b"sentinel"
    # nothing left behind: no shard of the refused save, no temporary folder
    assert store.listdir() in (["evil.bin"], ["ck", "evil.bin"]), store.listdir()
    assert not [n for n in store.listdir("ck") if n.startswith("shard-")]


def _truncate_own_shard(store):
    """Rank 1's reply is honest, but its first shard file holds fewer bytes than it says (a
    short write nobody noticed): only the listing before the commit can tell."""
    def change(reply):
        folder = [n for n in store.listdir() if n.startswith(".ck.tmp-")] or ["ck"]
        name = reply["shards"][0][0]
        store.write(store.read(folder[0], name)[:-1], folder[0], name)
    return change


def test_a_shard_smaller_than_its_reply_says_fails_every_rank(store):
    url, opts = store.url("ck"), store.storage_options
    groups = ThreadGroup.create(3)
    groups[1] = _Tampering(groups[1], _truncate_own_shard(store))
    out = run_ranks(groups, lambda g: ckptcore.save_state(url, _state(), group=g,
                                                          storage_options=opts))
    _assert_refused(out, naming_rank_1=False)
    assert all(isinstance(v, ckptcore.IncompleteCheckpointError) for v in out.values()), out
    assert all("r00001" in str(v) for v in out.values()), out
    with pytest.raises(ckptcore.CheckpointNotFoundError):
        ckptcore.load_state(url, storage_options=opts)


@pytest.mark.parametrize("change", [_escape, _rank_0_name, _size_lie, _offset_past_shard],
                         ids=["escape", "rank-0-name", "size-lie", "offset-past-shard"])
def test_a_refused_step_leaves_the_previous_step_of_a_manager(store, change):
    root, opts = store.url("run"), store.storage_options
    store.write(b"sentinel", "evil.bin")
    groups = ThreadGroup.create(2)
    groups[1] = _Tampering(groups[1], change, armed=False)

    def run(g):
        mgr = ckptcore.CheckpointManager(root, keep=1, group=g, storage_options=opts,
                                         save_on_preemption=False)
        try:
            mgr.save(1, _state(1))
            g.armed = True
            try:
                mgr.save(2, _state(2))
                refused = None
            except ckptcore.CheckpointError as e:
                refused = e
            finally:
                g.armed = False
            return refused, mgr.steps(), mgr.restore()
        finally:
            mgr.close()

    for g in groups:
        g.armed = False
    out = run_ranks(groups, run)
    assert all(not isinstance(v, BaseException) for v in out.values()), out
    for r, (refused, steps, restored) in out.items():
        assert isinstance(refused, ckptcore.GroupError), (r, refused)
        assert steps == [1], (r, steps)
        assert_state_same(restored, _state(1), sections=("model", "data"))
        assert restored.step == 1
    assert store.read("evil.bin") == b"sentinel"
    mgr = ckptcore.CheckpointManager(root, lock=False, storage_options=opts,
                                     save_on_preemption=False)
    assert mgr.steps() == [1]
    assert_state_same(mgr.restore(), _state(1), sections=("model", "data"))


def _table_overlap(reply):
    table = reply["chunks"]
    shard = np.frombuffer(table["shard"], "<u4")
    off = np.frombuffer(table["offset"], "<u8").copy()
    same = np.flatnonzero(shard == shard[0])
    assert len(same) >= 2, "the test needs two chunks of rank 1 in one shard"
    off[same[1]] = off[same[0]]
    table["offset"] = off.tobytes()


@pytest.mark.parametrize("change", [_escape, _rank_0_name, _no_marker, _size_lie, _twice,
                                    _table_overlap],
                         ids=["escape", "rank-0-name", "other-token", "size-lie", "listed-twice",
                              "overlap"])
def test_a_chunked_state_reply_is_checked_alike(store, change):
    """The same checks for a state of Shard leaves (format 3), whose replies carry chunk
    columns (``_replies``)."""
    from test_dist_sharded import _rank_leaf
    from test_sharded_load import _state as sharded_state

    url, opts = store.url("ck"), store.storage_options
    store.write(b"sentinel", "evil.bin")
    groups = ThreadGroup.create(2)
    groups[1] = _Tampering(groups[1], change, kind="chunks")
    out = run_ranks(groups, lambda g: ckptcore.save_state(
        url, sharded_state(_rank_leaf(2, g.rank)), group=g, storage_options=opts))
    _assert_refused(out)
    with pytest.raises(ckptcore.CheckpointNotFoundError):
        ckptcore.load_state(url, storage_options=opts)
    assert store.read("evil.bin") == b"sentinel"
    assert not [n for n in store.listdir("ck") if n.startswith("shard-")]


class _Gone(Exception):
    """A rank that stopped taking part (its process died) right after its reply."""


class _StopsAfterReplying:
    def __init__(self, inner) -> None:
        self._inner, self._replied = inner, False
        self.rank, self.size = inner.rank, inner.size

    def gather(self, data, *, timeout):
        if self._replied:
            raise _Gone()
        out = self._inner.gather(data, timeout=timeout)
        self._replied = True
        return out

    def broadcast(self, data, *, timeout):
        if self._replied:
            raise _Gone()
        return self._inner.broadcast(data, timeout=timeout)

    def barrier(self, *, timeout):
        raise _Gone()


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.slow
def test_a_rank_lost_after_its_reply_does_not_undo_the_commit(store, ranks, caplog):
    url, opts = store.url("ck"), store.storage_options
    state = _state(5)
    groups = ThreadGroup.create(ranks)
    groups[1] = _StopsAfterReplying(groups[1])
    with _knobs.override(group_timeout=1.0), caplog.at_level(logging.WARNING, logger="ckptcore"):
        t = time.monotonic()
        out = run_ranks(groups, lambda g: ckptcore.save_state(url, state, group=g,
                                                              storage_options=opts))
        elapsed = time.monotonic() - t
    assert isinstance(out[1], _Gone), out
    survivors = [r for r in range(ranks) if r != 1]
    assert all(isinstance(out[r], ckptcore.CheckpointInfo) for r in survivors), out
    assert len({out[r].writer["id"] for r in survivors}) == 1
    assert elapsed < 20
    got = ckptcore.load_state(url, storage_options=opts)
    assert_state_same(got, state, sections=("model", "data"))
    assert got.step == state.step
    assert not ckptcore.verify(url, storage_options=opts)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(url in m and "committed" in m and "outcome" in m and "GroupTimeoutError" in m
               for m in warned), warned
