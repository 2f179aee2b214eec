"""Rank 0 of a group save of a state with ``Shard`` leaves trusts no chunk reply
(``ckptcore/_replies.py``): a reply carries each chunk's tensor index, shape, start, shard,
offset and checksums without names (rank 0 knows the logical tensors), and a reply of another
version, with columns that do not fit, indices out of range, chunks outside their tensor or
onto another rank's, holes, or bytes outside or shared in a shard is refused on every rank
with a ``CheckpointError``, and nothing is committed.

The ranks are threads (``ckptcore.ThreadGroup``); rank 1's reply is rewritten on its way to
rank 0 (``test_dist_sharded._Tampering``).  Each case names what rank 0 must say, so that a
check that stopped working (the reply committed, or refused by another check by chance) fails.
"""

from __future__ import annotations

import numpy as np
import pytest

import ckptcore
from ckptcore import ThreadGroup, _knobs

from _support import run_ranks
from test_dist_sharded import _rank_leaf, _Tampering
from test_sharded_load import _state

_TYPES = {"tensor": "<u4", "shard": "<u4", "offset": "<u8", "checksum": "<u4", "shape": "<u8",
          "start": "<u8", "block_crc": "<u4"}


def _col(chunks: dict, key: str) -> np.ndarray:
    return np.frombuffer(chunks[key], _TYPES[key]).copy()


def _set(chunks: dict, key: str, values) -> None:
    chunks[key] = np.ascontiguousarray(values, _TYPES[key]).tobytes()


def _logical() -> tuple[list[str], list[int]]:
    """The logical tensors' names and ranks, in the index order every rank encodes them."""
    from ckptcore import _codec
    from ckptcore._dist import _logical as logical

    enc = _codec.encode_state(_state(_rank_leaf(2, 1)))
    names, _, shapes, _ = logical(enc, enc.arrays)
    return names, [len(s) for s in shapes]


def _rows_by_ndim(chunks: dict) -> dict[int, tuple[int, int]]:
    """ndim -> (row, where its dimensions start in the shape/start columns) of rank 1's first
    row of a tensor of that many dimensions (w is 2-d, m 3-d, v 1-d)."""
    _, ndims = _logical()
    out, pos = {}, 0
    for row, t in enumerate(_col(chunks, "tensor").tolist()):
        out.setdefault(ndims[t], (row, pos))
        pos += ndims[t]
    assert pos == len(_col(chunks, "shape")), (pos, len(_col(chunks, "shape")))
    return out


def _w(chunks):  # (row, dims position) of rank 1's block of w: shape (18, 6) at (19, 0)
    return _rows_by_ndim(chunks)[2]


def _shift_start(delta_rows: int):
    def change(c):
        row, pos = _w(c)
        start = _col(c, "start")
        start[pos] = delta_rows
        _set(c, "start", start)
    return change


def _shrink_w(c):  # rank 1's block of w one row shorter: a hole in w
    row, pos = _w(c)
    shape = _col(c, "shape")
    shape[pos] -= 1
    _set(c, "shape", shape)


def _w_as(other_nd: int):
    def change(c):  # rank 1's block of w claims to be another tensor
        rows = _rows_by_ndim(c)
        tensor = _col(c, "tensor")
        tensor[rows[2][0]] = tensor[rows[other_nd][0]]
        _set(c, "tensor", tensor)
    return change


def _v_as_bias(c):  # rank 1's block of v (1-d) claims to be a block of model/bias (1-d)
    names, _ = _logical()
    tensor = _col(c, "tensor")
    tensor[_rows_by_ndim(c)[1][0]] = names.index("model/bias")
    _set(c, "tensor", tensor)


def _w_as_unknown(c):
    tensor = _col(c, "tensor")
    tensor[_w(c)[0]] = 1000
    _set(c, "tensor", tensor)


def _huge(c):
    row, pos = _w(c)
    shape = _col(c, "shape")
    shape[pos] = 2 ** 62
    _set(c, "shape", shape)


def _same_bytes(c):  # two rows of one shard at the same offset
    shard, off = _col(c, "shard"), _col(c, "offset")
    same = np.flatnonzero(shard == shard[0])
    off[same[1]] = off[same[0]]
    _set(c, "offset", off)


def _bad_shard(c):
    shard = _col(c, "shard")
    shard[0] = 7
    _set(c, "shard", shard)


def _past_shard(c):
    off = _col(c, "offset")
    off[-1] += 1 << 20
    _set(c, "offset", off)


def _extra_block_crc(c):
    c["block_crc"] += b"\0\0\0\0"


def _short_shape(c):
    c["shape"] = c["shape"][:-8]


def _short_checksum(c):
    c["checksum"] = c["checksum"][:-4]


def _ragged(c):
    c["offset"] = c["offset"][:-3]


CASES = {  # name: (change of reply["chunks"] or of the reply, what rank 0 says)
    "version-2": (lambda c: c.update(version=2), "reply version 2"),
    "version-missing": (lambda c: c.pop("version"), "reply version None"),
    "version-str": (lambda c: c.update(version="1"), "reply version '1'"),
    "not-a-map": ("reply", lambda r: r.update(chunks=[1, 2]), "not a map"),
    "old-table": ("reply", lambda r: r.update(table=r.pop("chunks")), "as a table"),
    "unknown-tensor": (_w_as_unknown, "chunk of tensor 1000, but the state has"),
    "tensor-of-other-rank": (_w_as(3), "holds"),  # 2 dims read as 3: the columns do not fit
    # (its length is now counted in float32: the shard no longer ends where its rows do)
    "tensor-of-same-rank": (_v_as_bias, "but its chunks end at byte"),
    "start-onto-rank-0": (_shift_start(0), "overlap"),
    "start-outside": (_shift_start(10 ** 6), "outside the global shape"),
    "hole": (_shrink_w, "of its"),
    "huge-chunk": (_huge, "rank 1"),
    "same-bytes": (_same_bytes, "on the same bytes"),
    "shard-index": (_bad_shard, "in its shard 7, but lists"),
    "past-shard": (_past_shard, "beyond the end of its shard"),
    "block-crc-count": (_extra_block_crc, "block checksums"),
    "crc-block": (lambda c: c.update(crc_block=5), "crc_block 5"),
    "shape-short": (_short_shape, "column 'shape' holds"),
    "checksum-short": (_short_checksum, "different lengths"),
    "ragged-column": (_ragged, "whole number"),
    "column-not-bytes": (lambda c: c.update(tensor=[0]), "column 'tensor'"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_chunk_reply_that_does_not_fit_is_refused_on_every_rank(tmp_path, name):
    case = CASES[name]
    change, says = (case[1], case[2]) if case[0] == "reply" else (
        lambda r: case[0](r["chunks"]), case[1])
    url = str(tmp_path / "ck")
    groups = ThreadGroup.create(2)
    groups[1] = _Tampering(groups[1], change)
    with _knobs.override(group_timeout=20):
        out = run_ranks(groups, lambda g: ckptcore.save_state(
            url, _state(_rank_leaf(2, g.rank)), group=g))
    assert all(isinstance(v, ckptcore.CheckpointError) for v in out.values()), out
    assert says in str(out[0]), out[0]
    assert "rank 1" in str(out[0]) or "blocks" in str(out[0]), out[0]
    assert "nothing committed" in str(out[0]), out[0]
    with pytest.raises(ckptcore.CheckpointNotFoundError):
        ckptcore.load_state(url)
    assert not list(tmp_path.glob("ck/shard-*"))


def test_an_honest_reply_is_committed(tmp_path):
    """The cases above start from a reply rank 0 accepts."""
    url = str(tmp_path / "ck")
    groups = ThreadGroup.create(2)
    groups[1] = _Tampering(groups[1], lambda r: None)
    out = run_ranks(groups, lambda g: ckptcore.save_state(
        url, _state(_rank_leaf(2, g.rank)), group=g))
    assert all(isinstance(v, ckptcore.CheckpointInfo) for v in out.values()), out
    assert not ckptcore.verify(url)
