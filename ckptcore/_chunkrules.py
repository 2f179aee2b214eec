"""The rules tying the rows (chunks) of a version-3 tensor table into logical tensors
(docs/FORMAT.md, sections 5 and 10), checked with NumPy on the table's columns: for a manifest
read from disk (``_manifest``), a table joined from several ranks' (``_replies.join``)
and a table about to be written (``save_state``).  Also the exact element counts every
version's table check uses."""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _codec
from .errors import SchemaError

_SIZE_MAX = 2 ** 63 - 1  # numpy's limit on an array's size in bytes


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


# table: a _manifest.TensorTable, not imported here (_manifest imports this module)
def check_chunks(table: Any, source: str, *, starts: np.ndarray | None = None,
                 itemsize: np.ndarray | None = None, parsed: list[np.dtype] | None = None,
                 interned: list[str] | None = None) -> None:
    """The rules tying a chunked table's rows into logical tensors: every logical tensor
    0..L-1 has a row; its rows share name, dtype, rank and global shape, and distinct tensors
    have distinct names; the global shape is a possible array; every chunk lies inside it; and
    no two non-empty chunks of a tensor overlap.  Each failure is a ``SchemaError`` naming
    ``source`` and the tensor.  ``interned``: the table's names are ``interned[tensor]`` by
    construction (``_replies.join``), so only those need to differ."""
    n = len(table)
    tensor, ndim, dims, gdims, start, code = (table.tensor, table.ndim, table.dims, table.gdims,
                                              table.start, table.dtype)
    assert tensor is not None and gdims is not None and start is not None
    names = table.names
    if starts is None:
        starts = np.cumsum(ndim, dtype=np.int64) - ndim
    if parsed is None:
        parsed = [_codec.parse_dtype(d) for d in table.dtypes]
    if itemsize is None:
        itemsize = np.array([d.itemsize for d in parsed] or [0], np.uint64)[code if n else []]

    def fail(mask: np.ndarray, what: Any) -> None:
        if mask.any():
            i = _first(mask)
            raise SchemaError(f"{source}: tensor {_codec.short_repr(names[i])}: {what(i)}")

    def dims_of(col: np.ndarray, i: int) -> list[int]:
        return col[starts[i]:starts[i] + ndim[i]].tolist()

    fail(tensor >= n, lambda i: f"a chunk of logical tensor {int(tensor[i])}, but the table has "
         f"only {n} rows")
    order, heads, firsts = _logical_tensors(tensor, n, source)
    f = firsts[tensor] if n else np.zeros(0, np.intp)
    if interned is None:
        _check_names(names, firsts, f, source)
    elif len(set(interned)) != len(interned):
        raise SchemaError(f"{source}: tensor names are not unique")
    fail(code != code[f], lambda i: f"chunks of dtypes {parsed[code[f[i]]]} and {parsed[code[i]]}")
    fail(ndim != ndim[f], lambda i: f"chunks of {int(ndim[f[i]])} and {int(ndim[i])} dimensions")
    differ, outside = _global_bounds(table, starts, f)
    fail(differ, lambda i: f"global shape {dims_of(gdims, i)} of one chunk, "
         f"{dims_of(gdims, int(f[i]))} of another")
    # (the global shapes agree within a tensor, checked above: counted once per tensor)
    _, _, over = element_counts(ndim[firsts], gdims, starts[firsts], itemsize[firsts])
    fail(over[tensor] if n else over, lambda i: f"global shape {dims_of(gdims, i)} of {parsed[code[i]]} is too large "
         "for any array")
    fail(outside, lambda i: f"chunk of shape {dims_of(dims, i)} at {dims_of(start, i)} lies "
         f"outside the global shape {dims_of(gdims, i)}")
    _check_overlaps(table, source, order, heads, starts, dims_of)
    table.firsts_cache = firsts


def _logical_tensors(tensor: np.ndarray, n: int, source: str
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ``n`` rows grouped by logical tensor (``tensor`` below ``n``, checked before):
    ``order`` sorts the rows by it, ``heads`` are where each tensor's run starts in that order,
    ``firsts`` each tensor's first row.  A logical tensor without a row is a ``SchemaError``."""
    order = np.argsort(tensor, kind="stable")
    sorted_t = tensor[order]
    heads = np.flatnonzero(np.r_[True, sorted_t[1:] != sorted_t[:-1]]) if n else np.zeros(0, int)
    count = int(sorted_t[-1]) + 1 if n else 0
    if len(heads) != count:  # some index below the largest has no row
        present = np.zeros(count, bool)
        present[sorted_t] = True
        raise SchemaError(f"{source}: tensor table: logical tensor {_first(~present)} has no "
                          "chunks")
    return order, heads, order[heads]


def _check_names(names: list[str], firsts: np.ndarray, f: np.ndarray, source: str) -> None:
    """Every row is named as its tensor's first row ``f``, and the tensors' names differ."""
    n = len(names)
    # (an object array compares the strings in one C loop: a Python loop over two million rows
    # was a third of a 1,000-rank merge, bench_scale_sim.py)
    named = np.empty(n, object)
    named[:] = names
    bad = np.flatnonzero(named != named[f]) if n else []
    if len(bad):
        i = int(bad[0])
        raise SchemaError(f"{source}: tensor {_codec.short_repr(names[int(f[i])])}: a chunk is named "
                          f"{_codec.short_repr(names[i])}; the chunks of a tensor share its name")
    if len({names[k] for k in firsts.tolist()}) != len(firsts):
        raise SchemaError(f"{source}: tensor names are not unique")


def _global_bounds(table: Any, starts: np.ndarray, f: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Per row: whether its global shape differs from its tensor's first row ``f``, and whether
    the chunk reaches outside its global shape (one pass per dimension, over the rows that
    have it)."""
    n, ndim, dims, gdims, start = len(table), table.ndim, table.dims, table.gdims, table.start
    gstart = starts[f]
    differ = np.zeros(n, bool)
    outside = np.zeros(n, bool)
    d = _uniform(ndim, dims, starts)
    for k in range(int(ndim.max()) if n else 0):
        rows, at = _column(ndim, starts, k, d)
        g = gdims[at]
        differ[rows] |= g != gdims[gstart[rows] + k]
        st, sh = start[at], dims[at]
        outside[rows] |= (st > g) | (sh > g - np.minimum(st, g))
    return differ, outside


def _check_overlaps(table: Any, source: str, order: np.ndarray, heads: np.ndarray,
                    starts: np.ndarray, dims_of: Any) -> None:
    """No two non-empty chunks of one logical tensor overlap (tensors of one chunk are skipped;
    ``order``/``heads`` from ``_logical_tensors``)."""
    n, ndim, dims, start, names = len(table), table.ndim, table.dims, table.start, table.names
    many = np.flatnonzero(np.diff(np.r_[heads, n]) > 1) if n else np.zeros(0, np.intp)
    many = many[~_separated(table, order, starts, len(heads))[many]]
    for h in many:
        rows = order[heads[h]:(heads[h + 1] if h + 1 < len(heads) else n)]
        nd = int(ndim[rows[0]])
        pos = starts[rows][:, None] + np.arange(nd)
        lo = start[pos].astype(np.int64) if nd else np.zeros((len(rows), 0), np.int64)
        hi = lo + (dims[pos].astype(np.int64) if nd else 0)
        try:
            pair = _overlap(lo, hi)
        except _TooIrregular as e:
            raise SchemaError(f"{source}: tensor {_codec.short_repr(names[int(rows[0])])}: its "
                              f"{len(rows)} chunks are cut too irregularly to be checked for "
                              f"overlaps ({e} candidate pairs, at most {_MAX_PAIRS}); writers "
                              "cut along one dimension or in a grid") from None
        if pair is not None:
            a, b = (int(rows[j]) for j in pair)
            raise SchemaError(f"{source}: tensor {_codec.short_repr(names[a])}: chunks at "
                              f"{dims_of(start, a)} (shape {dims_of(dims, a)}) and "
                              f"{dims_of(start, b)} (shape {dims_of(dims, b)}) overlap")


def _separated(table: Any, order: np.ndarray, starts: np.ndarray, count: int) -> np.ndarray:
    """Per logical tensor: whether, taken in table order, each of its non-empty chunks ends
    along some one dimension where or before the next one starts (the same dimension for all):
    then their spans along it ascend without meeting, and no two chunks overlap.  Chunks cut
    along one dimension and listed in order (what writers do) pass for every tensor in a few
    vectorised passes; a tensor that does not is checked exactly by :func:`_overlap`."""
    ndim, dims, start, tensor = table.ndim, table.dims, table.start, table.tensor
    top = int(ndim.max()) if len(ndim) else 0
    u = _uniform(ndim, dims, starts)
    live = np.ones(len(ndim), bool)
    for k in range(top):
        at, pos = _column(ndim, starts, k, u)
        live[at] &= dims[pos] > 0
    rows = order[live[order]]
    t, nd = tensor[rows], ndim[rows]
    same = t[1:] == t[:-1]
    ok = np.zeros(count, bool)
    for k in range(top):
        if u is not None:  # every row has dimension k
            has, lo, span = True, start[k::u][rows], dims[k::u][rows]
        else:
            has = nd > k
            pos = np.where(has, starts[rows] + k, 0)
            lo, span = np.where(has, start[pos], 0), np.where(has, dims[pos], 0)
        apart = (lo[:-1] + span[:-1] <= lo[1:]) & (has if u is not None else has[1:] & has[:-1])
        stuck = np.zeros(count, bool)
        stuck[t[1:][same & ~apart]] = True
        ok |= ~stuck
    return ok


_PAIRS = 1 << 22  # candidate pairs checked at once by _overlap
# Candidate pairs _overlap checks at most (a few seconds): chunks cut along one dimension give
# about one per chunk, a grid of r x c chunks about r*c*c/2; a hostile table could ask for
# billions, and is refused instead of checked for minutes.
_MAX_PAIRS = 1 << 27


class _TooIrregular(Exception):
    pass


def _overlap(lo: np.ndarray, hi: np.ndarray) -> tuple[int, int] | None:
    """Two boxes ``[lo, hi)`` (rows of ``lo``, ``hi``) that share a point, or None.  A sweep
    along the dimension where the fewest pairs of boxes have overlapping spans: only those pairs
    are compared, which for chunks cut along any one dimension is about one pair per chunk.
    More than ``_MAX_PAIRS`` candidates raise ``_TooIrregular`` (their number)."""
    live = np.flatnonzero((hi > lo).all(axis=1))
    if len(live) < 2:
        return None
    if lo.shape[1] == 0:  # two chunks of a 0-d tensor: both hold its one element
        return int(live[0]), int(live[1])
    lo, hi = lo[live], hi[live]
    m = len(lo)
    best = None
    for k in range(lo.shape[1]):
        order = np.argsort(lo[:, k], kind="stable")
        # boxes i+1 .. reach[i]-1 start (along k) before box i ends
        reach = np.searchsorted(lo[order, k], hi[order, k], "left")
        counts = np.maximum(reach - np.arange(m) - 1, 0)
        total = int(counts.sum())
        if best is None or total < best[0]:
            best = (total, order, counts)
    total, order, counts = best
    if total > _MAX_PAIRS:
        raise _TooIrregular(total)
    lo, hi, live = lo[order], hi[order], live[order]
    i0 = 0
    while i0 < m:
        cum = np.cumsum(counts[i0:])
        i1 = i0 + max(1, int(np.searchsorted(cum, _PAIRS, "right")))
        c = counts[i0:i1]
        if c.sum():
            ii = np.repeat(np.arange(i0, i1), c)
            jj = ii + 1 + (np.arange(len(ii)) - np.repeat(np.cumsum(c) - c, c))
            hit = ((lo[ii] < hi[jj]) & (lo[jj] < hi[ii])).all(axis=1)
            if hit.any():
                k = _first(hit)
                return int(live[ii[k]]), int(live[jj[k]])
        i0 = i1
    return None


def _uniform(ndim: np.ndarray, flat: np.ndarray, starts: np.ndarray) -> int | None:
    """``d`` when every row has ``d`` dimensions laid out one row after the other in ``flat``
    (``starts[i] == d * i``): then dimension k of every row is the view ``flat[k::d]``."""
    n = len(ndim)
    if not n or len(starts) != n:
        return None
    d = int(ndim[0])
    if not d or len(flat) != n * d or not (ndim == d).all() \
            or not np.array_equal(starts, np.arange(0, n * d, d)):
        return None
    return d


def _column(ndim: np.ndarray, starts: np.ndarray, k: int, d: int | None) -> tuple[Any, Any]:
    """The rows having a dimension ``k`` and where it is in the flat column (see
    :func:`_uniform`: ``d`` is not None: every row, a strided slice)."""
    if d is not None:
        return slice(None), slice(k, None, d)
    rows = np.flatnonzero(ndim > k)
    return rows, starts[rows] + k


def element_counts(ndim: np.ndarray, dims: np.ndarray, starts: np.ndarray, itemsize: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of ``dims`` (``ndim[i]`` values from ``starts[i]``): the product of the non-zero
    dimensions, whether any dimension is 0, and whether that product times the itemsize
    reaches 2^63 (numpy's limit), computed exactly in uint64 with every step checked."""
    n = len(ndim)
    nonzero = np.ones(n, np.uint64)
    empty = np.zeros(n, bool)
    over = np.zeros(n, bool)
    limit = np.uint64(_SIZE_MAX)
    u = _uniform(ndim, dims, starts)
    for k in range(int(ndim.max()) if n else 0):
        rows, at = _column(ndim, starts, k, u)
        d = dims[at]
        empty[rows] |= d == 0
        d = np.maximum(d, np.uint64(1))
        cur = nonzero[rows]
        big = cur > limit // d
        over[rows] |= big
        nonzero[rows] = np.where(big, cur, cur * d)
    over |= nonzero > limit // np.maximum(itemsize, np.uint64(1))
    return nonzero, empty, over


