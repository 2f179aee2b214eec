"""Retention policies keep exactly what they promise."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptcore.policies import (CheckpointEntry, KeepAll, KeepAny, KeepBest, KeepEvery,
                               KeepEveryDuration, KeepLast, RetentionPolicy, as_policy)

SETTINGS = settings(max_examples=80, deadline=None)


def _entries(steps, created=None, metrics=None):
    created = created or [float(s) for s in steps]
    metrics = metrics or [None] * len(steps)
    return [CheckpointEntry(s, c, m) for s, c, m in zip(steps, created, metrics)]


entry_lists = st.lists(st.integers(0, 10_000), unique=True, max_size=30).map(sorted).flatmap(
    lambda steps: st.lists(st.floats(0, 1e6), min_size=len(steps), max_size=len(steps)).map(
        lambda created: _entries(steps, sorted(created))))


def test_keep_last():
    entries = _entries([10, 20, 30, 40])
    assert KeepLast(2).keep(entries) == {30, 40}
    assert KeepLast(10).keep(entries) == {10, 20, 30, 40}
    assert KeepLast(1).keep([]) == set()
    assert KeepLast(1).keep(list(reversed(entries))) == {40}  # does not trust the order


@SETTINGS
@given(entries=entry_lists, n=st.integers(1, 40))
@pytest.mark.slow
def test_keep_last_property(entries, n):
    kept = KeepLast(n).keep(entries)
    steps = [e.step for e in entries]
    assert len(kept) == min(n, len(steps))
    assert all(s in kept for s in steps if s > max(set(steps) - kept, default=-1))


def test_keep_every():
    assert KeepEvery(100).keep(_entries([0, 50, 100, 150, 200, 201])) == {0, 100, 200}
    assert KeepEvery(1).keep(_entries([3, 4])) == {3, 4}


def test_keep_best():
    metrics = [{"loss": 0.5}, {"loss": 0.1}, None, {"acc": 0.9}, {"loss": 0.3},
               {"loss": float("nan")}, {"loss": np.float32(0.2)}]
    entries = _entries([1, 2, 3, 4, 5, 6, 7], metrics=metrics)
    assert KeepBest("loss", n=2).keep(entries) == {2, 7}
    assert KeepBest("loss", mode="max", n=2).keep(entries) == {1, 5}
    assert KeepBest("loss", "min", 10).keep(entries) == {1, 2, 5, 7}
    assert KeepBest("acc", mode="max").keep(entries) == {4}
    assert KeepBest("missing").keep(entries) == set()


def test_keep_best_ties_prefer_newer():
    entries = _entries([1, 2, 3], metrics=[{"m": 1.0}, {"m": 1.0}, {"m": 2.0}])
    assert KeepBest("m", n=1).keep(entries) == {2}
    assert KeepBest("m", mode="max", n=2).keep(entries) == {2, 3}


def test_keep_every_duration():
    # created: 0, 10, 30, 59, 61, 100, 125 minutes; one per hour from the first
    minutes = [0, 10, 30, 59, 61, 100, 125]
    entries = _entries(list(range(7)), [60.0 * m for m in minutes])
    assert KeepEveryDuration(hours=1).keep(entries) == {0, 4, 6}
    assert KeepEveryDuration(seconds=3600).keep(entries) == {0, 4, 6}
    assert KeepEveryDuration(seconds=1).keep(entries) == set(range(7))
    assert KeepEveryDuration(hours=1).duration == 3600.0


@SETTINGS
@given(entries=entry_lists, seconds=st.floats(1, 1e5), drop=st.data())
@pytest.mark.slow
def test_keep_every_duration_is_stable(entries, seconds, drop):
    policy = KeepEveryDuration(seconds=seconds)
    kept = policy.keep(entries)
    if entries:
        assert entries[0].step in kept
    kept_entries = [e for e in entries if e.step in kept]
    for a, b in zip(kept_entries, kept_entries[1:]):
        assert b.created - a.created >= seconds
    # Deleting checkpoints it did not keep never changes its choice.
    survivors = [e for e in entries if e.step in kept or drop.draw(st.booleans())]
    assert policy.keep(survivors) == kept


def test_keep_all_and_any():
    entries = _entries([0, 5, 10, 15, 20])
    assert KeepAll().keep(entries) == {0, 5, 10, 15, 20}
    combined = KeepLast(1) | KeepEvery(10)
    assert isinstance(combined, KeepAny)
    assert combined.keep(entries) == {0, 10, 20}
    triple = combined | KeepBest("x")
    assert len(triple.policies) == 3  # flattened
    assert KeepAny(KeepLast(1), KeepEvery(10)) == combined
    assert "KeepLast(n=1)" in repr(combined)


@SETTINGS
@given(entries=entry_lists, n=st.integers(1, 5), every=st.integers(1, 500))
def test_keep_any_is_the_union(entries, n, every):
    a, b = KeepLast(n), KeepEvery(every)
    assert (a | b).keep(entries) == a.keep(entries) | b.keep(entries)


def test_as_policy():
    assert as_policy(None) == KeepAll()
    assert as_policy(3) == KeepLast(3)
    p = KeepEvery(7)
    assert as_policy(p) is p
    assert as_policy([2, KeepEvery(100)]) == KeepAny(KeepLast(2), KeepEvery(100))
    assert as_policy((KeepAll(),)) == KeepAny(KeepAll())
    for bad in ("3", 2.5, True, {"n": 3}, object()):
        with pytest.raises(TypeError):
            as_policy(bad)
    with pytest.raises(ValueError):
        as_policy(0)
    with pytest.raises(ValueError):
        as_policy([])


def test_custom_policy():
    class KeepOdd(RetentionPolicy):
        def keep(self, entries):
            return {e.step for e in entries if e.step % 2}

    assert (KeepOdd() | KeepLast(1)).keep(_entries([1, 2, 3, 4])) == {1, 3, 4}


@pytest.mark.parametrize("make,error", [
    (lambda: KeepLast(0), ValueError), (lambda: KeepLast(1.5), TypeError),
    (lambda: KeepEvery(0), ValueError), (lambda: KeepBest("m", mode="median"), ValueError),
    (lambda: KeepBest("m", n=0), ValueError), (lambda: KeepBest(""), TypeError),
    (lambda: KeepEveryDuration(), TypeError),
    (lambda: KeepEveryDuration(seconds=1, hours=1), TypeError),
    (lambda: KeepEveryDuration(seconds=0), ValueError),
    (lambda: KeepEveryDuration(hours=math.inf), ValueError),
    (lambda: KeepEveryDuration(hours="1"), TypeError),
    (lambda: KeepAny(), ValueError), (lambda: KeepAny(3), TypeError),
])
def test_argument_validation(make, error):
    with pytest.raises(error):
        make()


def test_entries_are_frozen():
    e = CheckpointEntry(1, 2.0)
    with pytest.raises(AttributeError):
        e.step = 3
    assert e.metrics is None
