"""DataCursor: a stable order, exact resume, elastic resume across world sizes."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ckptcore.cursor import DataCursor
from ckptcore.errors import SchemaError

SETTINGS = settings(max_examples=60, deadline=None)
M64 = (1 << 64) - 1


# -- a transcription of the algorithm in docs/CURSOR.md, kept independent of the module --

def _ref_mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _ref_index(seed, epoch, n, i):
    g = 0x9E3779B97F4A7C15
    h = _ref_mix64((seed + g) & M64)
    h = _ref_mix64((h + epoch + g) & M64)
    keys = [_ref_mix64((h + (r + 1) * g) & M64) for r in range(6)]
    w = (n - 1).bit_length()

    def f(x):
        for r, key in enumerate(keys):
            b = w // 2 if r % 2 == 0 else w - w // 2
            a = w - b
            left, right = x >> b, x & ((1 << b) - 1)
            x = (right << a) | (left ^ (_ref_mix64(right ^ key) & ((1 << a) - 1)))
        return x

    y = f(i)
    while y >= n:
        y = f(y)
    return y


def test_mix64_is_splitmix64():
    # The first three outputs of the reference splitmix64 seeded with 0.
    g = 0x9E3779B97F4A7C15
    outs = [_ref_mix64((k * g) & M64) for k in (1, 2, 3)]
    assert outs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


# Computed once from the implementation; a change here changes every user's data order.
GOLDEN = {
    (0, 10, 0): [9, 2, 1, 0, 4, 6, 8, 3, 5, 7],
    (0, 10, 1): [9, 6, 4, 8, 7, 1, 5, 2, 0, 3],
    (1, 10, 0): [7, 9, 5, 0, 6, 4, 1, 3, 2, 8],
    (12345, 37, 0): [16, 15, 25, 21, 14, 29, 11, 24, 7, 20, 4, 8, 28, 31, 12, 30, 6, 23, 13,
                     2, 22, 3, 17, 32, 1, 10, 5, 34, 26, 36, 0, 19, 27, 35, 9, 18, 33],
    (2**64 - 1, 1000, 0): [773, 389, 115, 557, 678, 575, 744, 606, 769, 237, 630, 899, 336,
                           574, 942, 239],
    (42, 2**40 + 3, 3): [450800059079, 751010843527, 977442304419, 972031052073,
                         961584954495, 499722272231, 890731905558, 467810669754],
    (3, 2, 0): [0, 1],
    (4, 2, 0): [1, 0],
}


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_golden_orders(key):
    seed, n, epoch = key
    want = GOLDEN[key]
    cursor = DataCursor(n, 4, seed=seed)
    assert cursor.indices(epoch, 0, len(want)).tolist() == want
    assert [cursor.index_at(epoch, i) for i in range(len(want))] == want
    assert [_ref_index(seed, epoch, n, i) for i in range(len(want))] == want


@SETTINGS
@given(seed=st.integers(0, M64), epoch=st.integers(0, 2**40), n=st.integers(1, 2**62),
       data=st.data())
def test_matches_documented_algorithm(seed, epoch, n, data):
    i = data.draw(st.integers(0, n - 1))
    assert DataCursor(n, 1, seed=seed).index_at(epoch, i) == _ref_index(seed, epoch, n, i)


@SETTINGS
@given(seed=st.integers(0, M64), epoch=st.integers(0, 1000), n=st.integers(1, 3000))
def test_each_epoch_is_a_permutation(seed, epoch, n):
    order = DataCursor(n, 7, seed=seed).indices(epoch, 0, n)
    assert order.dtype == np.int64
    assert np.array_equal(np.sort(order), np.arange(n))


@SETTINGS
@given(seed=st.integers(0, M64), epoch=st.integers(0, 2**20), n=st.integers(1, 2**63 - 1),
       data=st.data())
def test_index_at_agrees_with_indices(seed, epoch, n, data):
    start = data.draw(st.integers(0, n - 1))
    stop = data.draw(st.integers(start, min(n, start + 300)))
    cursor = DataCursor(n, 3, seed=seed)
    assert cursor.indices(epoch, start, stop).tolist() == [
        cursor.index_at(epoch, i) for i in range(start, stop)]


def test_order_depends_on_seed_and_epoch():
    c = DataCursor(1000, 10, seed=1)
    e0, e1 = c.indices(0, 0, 1000), c.indices(1, 0, 1000)
    other = DataCursor(1000, 10, seed=2).indices(0, 0, 1000)
    assert not np.array_equal(e0, e1)
    assert not np.array_equal(e0, other)
    assert not np.array_equal(e0, np.arange(1000))


def test_no_shuffle_is_identity():
    c = DataCursor(10, 4, seed=9, shuffle=False)
    assert c.indices(5, 0, 10).tolist() == list(range(10))
    assert [b.tolist() for b in c] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_huge_dataset_is_not_materialised():
    c = DataCursor(2**62 + 1, 1024, seed=5)  # the worst case for cycle walking, too
    c.load_state_dict({**c.state_dict(), "position": 2**61})
    t = time.perf_counter()
    batch = c.next_batch()
    assert time.perf_counter() - t < 5  # materialising 2**62 indices would never end
    assert len(batch) == 1024 and len(set(batch.tolist())) == 1024
    assert batch.min() >= 0 and batch.max() < 2**62 + 1


# -- batches and epochs ---------------------------------------------------------------

def test_batches_and_rollover():
    c = DataCursor(10, 4, seed=3)
    assert (len(c), c.batches_per_epoch, c.steps_remaining_in_epoch) == (3, 3, 3)
    batches = list(c.iter_epoch())
    assert [len(b) for b in batches] == [4, 4, 2]
    assert np.array_equal(np.concatenate(batches), c.indices(0, 0, 10))
    assert (c.epoch, c.position, c.steps_remaining_in_epoch) == (1, 0, 3)
    assert np.array_equal(c.next_batch(), c.indices(1, 0, 4))
    assert (c.epoch, c.position, c.steps_remaining_in_epoch) == (1, 4, 2)


def test_iteration_after_resume_yields_the_rest_of_the_epoch():
    c = DataCursor(10, 4, seed=3)
    c.next_batch()
    assert [len(b) for b in c] == [4, 2]
    assert [len(b) for b in c] == [4, 4, 2]


def test_drop_last():
    c = DataCursor(10, 4, seed=3, drop_last=True)
    assert (len(c), c.samples_per_epoch) == (2, 8)
    batches = [c.next_batch() for _ in range(4)]
    assert [len(b) for b in batches] == [4, 4, 4, 4]
    assert np.array_equal(np.concatenate(batches[:2]), c.indices(0, 0, 8))
    assert np.array_equal(np.concatenate(batches[2:]), c.indices(1, 0, 8))
    assert (c.epoch, c.position) == (2, 0)
    with pytest.raises(ValueError, match="drop_last"):
        DataCursor(3, 4, drop_last=True)


def _uninterrupted(cursor_args, steps):
    c = DataCursor(*cursor_args[:2], **cursor_args[2])
    return [c.next_batch().tolist() for _ in range(steps)]


cursor_configs = st.tuples(st.integers(1, 60), st.integers(1, 16),
                           st.fixed_dictionaries({"seed": st.integers(0, M64),
                                                  "shuffle": st.booleans(),
                                                  "drop_last": st.booleans()})
                           ).filter(lambda a: not (a[2]["drop_last"] and a[1] > a[0]))


@SETTINGS
@given(args=cursor_configs, k=st.integers(0, 40), more=st.integers(1, 40))
@pytest.mark.slow
def test_resume_anywhere_reproduces_the_sequence(args, k, more):
    n, bs, kw = args
    want = _uninterrupted(args, k + more)
    c = DataCursor(n, bs, **kw)
    got = [c.next_batch().tolist() for _ in range(k)]
    saved = msgpack.unpackb(msgpack.packb(c.state_dict()))  # as it comes back from disk
    resumed = DataCursor.from_state(saved)
    assert got + [resumed.next_batch().tolist() for _ in range(more)] == want
    other_seed = DataCursor(n, bs, **{**kw, "seed": kw["seed"] ^ 1})
    other_seed.load_state_dict(saved)  # the saved seed wins over the constructor's
    assert got + [other_seed.next_batch().tolist() for _ in range(more)] == want


@SETTINGS
@given(args=cursor_configs, epochs=st.integers(1, 3))
def test_every_sample_once_per_epoch(args, epochs):
    c = DataCursor(*args[:2], **args[2])
    for e in range(epochs):
        seen = np.concatenate(list(c))
        assert len(seen) == c.samples_per_epoch
        assert len(np.unique(seen)) == len(seen)
        assert c.epoch == e + 1


# -- sharding and elastic resume -----------------------------------------------------

@SETTINGS
@given(n=st.integers(1, 50), bs=st.integers(1, 12), ws=st.integers(1, 6), seed=st.integers(0, 99))
def test_shard_is_array_split(n, bs, ws, seed):
    whole = DataCursor(n, bs, seed=seed).next_batch()
    parts = [DataCursor(n, bs, seed=seed).shard(r, ws).next_batch() for r in range(ws)]
    for part, want in zip(parts, np.array_split(whole, ws)):
        assert part.dtype == np.int64 and np.array_equal(part, want)


def _ranks(state, ws):
    return [DataCursor.from_state(state).shard(r, ws) for r in range(ws)]


def _global_step(views):
    epoch = views[0].cursor.epoch
    parts = [v.next_batch() for v in views]
    assert len({str(v.state_dict()) for v in views}) == 1  # every rank holds the same state
    return epoch, np.concatenate(parts).tolist()


@SETTINGS
@given(n=st.integers(1, 80), bs=st.integers(1, 16), seed=st.integers(0, M64),
       drop_last=st.booleans(), k=st.integers(0, 20), new_ws=st.sampled_from([1, 3, 4]))
@pytest.mark.slow
def test_elastic_resume(n, bs, seed, drop_last, k, new_ws):
    assume(not (drop_last and bs > n))
    base = DataCursor(n, bs, seed=seed, drop_last=drop_last)
    steps = k + 2 * base.batches_per_epoch
    views = _ranks(base.state_dict(), 2)
    got = [_global_step(views) for _ in range(k)]
    saved = msgpack.unpackb(msgpack.packb(views[0].state_dict()))
    views = _ranks(saved, new_ws)
    got += [_global_step(views) for _ in range(steps - k)]
    assert [b for _, b in got] == _uninterrupted((n, bs, {"seed": seed, "drop_last": drop_last}),
                                                steps)
    assert views[0].cursor.epoch >= 2
    for e in range(views[0].cursor.epoch):  # completed epochs, before and across the resume
        seen = sorted(i for epoch, b in got if epoch == e for i in b)
        assert seen == sorted(base.indices(e, 0, base.samples_per_epoch).tolist())


def test_shard_views_cover_an_epoch_exactly_once():
    n, bs = 37, 8
    state = DataCursor(n, bs, seed=11).state_dict()
    views = _ranks(state, 3)
    seen = [np.concatenate(list(v)) for v in views]
    assert sorted(np.concatenate(seen).tolist()) == list(range(n))
    assert all(v.cursor.epoch == 1 for v in views)
    assert len(views[0]) == 5 and views[0].steps_remaining_in_epoch == 5


def test_shard_arguments():
    c = DataCursor(10, 4)
    with pytest.raises(ValueError):
        c.shard(2, 2)
    with pytest.raises(ValueError):
        c.shard(0, 0)
    assert "rank=1" in repr(c.shard(1, 2))


# -- the saved state --------------------------------------------------------------------

def test_state_dict_format():
    c = DataCursor(10, 4, seed=7)
    c.next_batch()
    d = c.state_dict()
    assert d == {"kind": "ckptcore.DataCursor", "version": 1, "seed": 7, "epoch": 0,
                 "position": 4, "num_samples": 10, "batch_size": 4, "shuffle": True,
                 "drop_last": False}
    assert all(type(v) in (int, bool, str) for v in d.values())
    assert repr(c) == ("DataCursor(epoch=0, position=4/10, seed=7, batch_size=4, "
                       "shuffle=True, drop_last=False)")


GOOD = DataCursor(10, 4, seed=7).state_dict()


@pytest.mark.parametrize("field,value", [
    ("kind", "other.Cursor"), ("version", 2), ("version", True), ("seed", -1),
    ("seed", 2**64), ("epoch", -1), ("epoch", 1.0), ("position", 3), ("position", 12),
    ("position", "4"), ("num_samples", 0), ("batch_size", True), ("shuffle", 1),
    ("drop_last", None),
])
def test_bad_state_names_the_field(field, value):
    with pytest.raises(SchemaError, match=field):
        DataCursor.from_state({**GOOD, field: value})
    with pytest.raises(SchemaError, match=field):
        DataCursor(10, 4).load_state_dict({**GOOD, field: value})


def test_missing_and_unknown_fields():
    with pytest.raises(SchemaError, match="position"):
        DataCursor.from_state({k: v for k, v in GOOD.items() if k != "position"})
    with pytest.raises(SchemaError, match="extra"):
        DataCursor.from_state({**GOOD, "extra": 1})
    with pytest.raises(SchemaError, match="mapping"):
        DataCursor.from_state([1, 2])
    with pytest.raises(SchemaError):
        DataCursor.from_state({**GOOD, "batch_size": 11, "drop_last": True})


@pytest.mark.parametrize("field,value", [("num_samples", 11), ("batch_size", 2),
                                         ("shuffle", False), ("drop_last", True)])
def test_resuming_into_another_dataset_is_refused(field, value):
    c = DataCursor(10, 4, seed=1)
    with pytest.raises(ValueError, match=field) as info:
        c.load_state_dict({**GOOD, field: value})
    assert not isinstance(info.value, SchemaError)
    assert (c.seed, c.epoch, c.position) == (1, 0, 0)  # untouched


def test_state_at_the_end_of_an_epoch_means_the_next_one():
    c = DataCursor.from_state({**GOOD, "epoch": 4, "position": 10})
    assert (c.epoch, c.position) == (5, 0)


def test_constructor_validation():
    with pytest.raises(TypeError):
        DataCursor(10.0, 4)
    with pytest.raises(ValueError):
        DataCursor(0, 4)
    with pytest.raises(ValueError):
        DataCursor(10, 0)
    with pytest.raises(ValueError):
        DataCursor(10, 4, seed=-1)
    with pytest.raises(ValueError):
        DataCursor(10, 4).index_at(0, 10)
    with pytest.raises(ValueError):
        DataCursor(10, 4).indices(0, 5, 4)
    assert DataCursor(np.int64(10), np.int32(4)).state_dict()["num_samples"] == 10


def test_indices_of_a_batch_never_build_the_whole_permutation():
    # O(batch), not O(n): a batch of 1,024 of 2**20 + 1 indices (just above a power of two: the
    # slowest n) allocates a few batch-sized arrays, never the 8 MiB permutation.  Measured in
    # bytes, not seconds: a loaded machine cannot make it fail (timings live in benchmarks/).
    import tracemalloc

    c = DataCursor(2**20 + 1, 1024, seed=1)
    c.indices(0, 0, 1024)
    tracemalloc.start()
    try:
        for k in range(20):
            c.indices(k, 0, 1024)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
