"""A save's cost does not grow with the steps a run keeps (docs/SCALE.md, "Saves and a run's
history"): the writer record names the committed steps and what retention knows of them, so
neither a manager's first save nor the later ones ask for a manifest per step.

Requests are counted on a real S3 server (moto on 127.0.0.1) by botocore's before-send event,
per operation; the roots are filled by copying one real step's folder (server-side), then
adopted by a manager, as bench_history.py does."""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil

import numpy as np
import pytest
import s3fs

import ckptcore
from ckptcore import _fence
from ckptcore._manifest import MANIFEST_NAME
from ckptcore._storage import Store

EVERY = 10


def _state(step: int) -> ckptcore.TrainingState:
    rng = np.random.default_rng(step)
    return ckptcore.TrainingState(model={"w": rng.standard_normal(64, np.float32)}, step=step,
                                  metadata={"metrics": {"loss": float(step % 7)}})


def _policy():
    return ckptcore.KeepLast(2) | ckptcore.KeepEvery(EVERY)


def _fill(url: str, n: int, opts: dict | None) -> int:
    """``n`` committed steps (0, EVERY, ...) under ``url``, adopted by a manager; returns the
    next free step."""
    with ckptcore.CheckpointManager(url, keep=None, storage_options=opts) as mgr:
        mgr.save(0, _state(0))
    if opts is None:
        for k in range(1, n):
            shutil.copytree(os.path.join(url, "step-000000000000"),
                            os.path.join(url, f"step-{k * EVERY:012d}"))
    else:
        fs = s3fs.S3FileSystem(**opts)
        path = url.removeprefix("s3://")
        files = [f for f in fs.find(f"{path}/step-000000000000")]
        for k in range(1, n):
            for f in files:
                fs.copy(f, f.replace("step-000000000000", f"step-{k * EVERY:012d}"))
    last = (n - 1) * EVERY
    with ckptcore.CheckpointManager(url, keep=_policy(), storage_options=opts) as mgr:
        mgr.save(last + 1, _state(last + 1))  # reads every manifest once, for the record
        mgr.save(last + 2, _state(last + 2))  # ... which this commit's record carries
    return last + 3


class _Requests:
    """HTTP requests the shared s3fs client sends, by operation."""

    def __init__(self, opts: dict) -> None:
        fs = s3fs.S3FileSystem(**opts)
        fs.connect()
        self.events, self.ops = fs.s3.meta.events, collections.Counter()
        self.events.register("before-send.s3", self._count)

    def _count(self, event_name: str = "", **_) -> None:
        self.ops[event_name.rsplit(".", 1)[-1]] += 1

    def take(self) -> collections.Counter:
        out, self.ops = self.ops, collections.Counter()
        return out

    def close(self) -> None:
        self.events.unregister("before-send.s3", self._count)


def _costs(url: str, opts: dict, start: int, saves: int = 3):
    counter = _Requests(opts)
    try:
        mgr = ckptcore.CheckpointManager(url, keep=_policy(), storage_options=opts)
        try:
            counter.take()
            mgr.save(start, _state(start))
            first = counter.take()
            steady = []
            for i in range(1, saves + 1):
                mgr.save(start + i, _state(start + i))
                steady.append(counter.take())
        finally:
            mgr.close()
    finally:
        counter.close()
    return first, steady


def test_save_requests_do_not_grow_with_the_committed_steps(s3_backend):
    opts = s3_backend.storage_options
    small, large = s3_backend.prefix + "/small", s3_backend.prefix + "/large"
    start_small, start_large = _fill(small, 4, opts), _fill(large, 60, opts)
    f_small, s_small = _costs(small, opts, start_small)
    f_large, s_large = _costs(large, opts, start_large)
    # No manifest asked for per step: HEADs and GETs the same with 4 and 60 steps.
    assert sum(f_large.values()) <= sum(f_small.values()) + 1, (f_small, f_large)
    for a, b in zip(s_small, s_large):
        assert sum(b.values()) <= sum(a.values()) + 1, (a, b)
    # Retention deleted one step per steady save (KeepLast(2)) and kept the KeepEvery ones.
    steps = ckptcore.CheckpointManager(large, lock=False, storage_options=opts).steps()
    assert [s for s in steps if s % EVERY == 0] == [k * EVERY for k in range(60)]


def test_the_writer_record_names_the_steps_and_their_entries(tmp_path):
    root = str(tmp_path / "run")
    start = _fill(root, 5, None)
    view = _fence.view(Store(root))
    assert view is not None and set(range(0, 5 * EVERY, EVERY)) <= view.named
    entries = _fence.read_index(Store(root), view.newest, view.named)
    # (the copies carry step 0's metrics; the adopting manager's two steps their own)
    assert {s: entries[s][1]["loss"] for s in view.named} == \
        {s: float(s % 7) if s >= start - 2 else 0.0 for s in view.named}
    # Retention deletes through the record: a step leaves it before its manifest goes.
    with ckptcore.CheckpointManager(root, keep=_policy()) as mgr:
        for s in range(start, start + 3):
            mgr.save(s, _state(s))
        kept = mgr.steps()
    view = _fence.view(Store(root))
    assert sorted(view.named) == kept
    assert set(_fence.read_index(Store(root), view.newest, view.named)) == set(kept)


def test_a_step_left_out_of_the_record_is_ignored_then_removed(tmp_path, caplog):
    """A crash between the record's rewrite and the manifest's deletion leaves a step the
    record no longer names, committed by an older generation: readers ignore it (as a fenced
    step: logged) and gc() removes it, which is what its deletion was for."""
    root = str(tmp_path / "run")
    start = _fill(root, 3, None)
    with ckptcore.CheckpointManager(root, keep=None) as mgr:
        mgr.save(start, _state(start))
        mgr._lock.forget(EVERY)  # the record no longer names step 10; its files stay
        assert EVERY not in _fence.view(Store(root)).named
    with ckptcore.CheckpointManager(root, keep=None) as mgr:
        with caplog.at_level(logging.WARNING, logger="ckptcore"):
            assert EVERY not in mgr.steps()
        assert any(f"ignoring step {EVERY}" in r.getMessage() for r in caplog.records)
        mgr.gc(grace=0)
    assert not os.path.exists(os.path.join(root, f"step-{EVERY:012d}"))


def test_malformed_record_entries_are_read_from_the_manifests(tmp_path, caplog):
    root = str(tmp_path / "run")
    start = _fill(root, 4, None)
    store = Store(root)
    g = _fence.generations(store)[-1]
    path = os.path.join(root, _fence.index_name(g))
    record = json.loads(open(path).read())
    assert record["entries"]
    record["entries"] = {"0": ["yesterday", None], "10": [1.0, "loss"], "x": [1, None],
                         "20": [float("inf"), None], "31": [1.0, {"loss": "low"}],
                         "32": [1.0, {"loss": [1, 2]}], "99": [1.0, {"loss": 1e9}]}
    with open(path, "w") as f:
        json.dump(record, f)
    # The well-formed shape only (31, 32); 99 is no step of the record.
    assert set(_fence.read_index(store, g, _fence.view(store).named)) == {31, 32}
    best = ckptcore.KeepBest("loss", n=2, mode="max") | ckptcore.KeepLast(1)
    with ckptcore.CheckpointManager(root, keep=best) as mgr:
        mgr.save(start, _state(start))
        kept = mgr.steps()
    # As the manifests say: 31 -> 3.0, 32 -> 4.0, 33 -> 5.0, the copies 0.0.
    assert kept == [32, 33]


def test_a_record_naming_a_step_whose_manifest_was_removed_by_hand(tmp_path):
    """The one case the record cannot know of: a manifest deleted outside ckptcore.  The step
    is listed, and restore() falls back over it with a warning."""
    root = str(tmp_path / "run")
    with ckptcore.CheckpointManager(root, keep=None) as mgr:
        for s in (1, 2):
            mgr.save(s, _state(s))
    os.remove(os.path.join(root, "step-000000000002", MANIFEST_NAME))
    with ckptcore.CheckpointManager(root, keep=None) as mgr:
        with pytest.warns(ckptcore.CheckpointFallbackWarning, match="step 2|000000000002"):
            state = mgr.restore()
    assert state.step == 1


def test_a_sweep_does_not_list_every_blob_again_per_batch(s3_backend):
    """A sweep deleting many unreferenced blobs looks again only at each batch's blobs (a HEAD
    each) after its fence check, not at a listing of every blob per batch of 64: on a store of
    a million blobs that was a million listing pages per 64,000 deletes."""
    import hashlib
    import time

    from ckptcore._cas import sweep

    opts = s3_backend.storage_options
    fs = s3fs.S3FileSystem(**opts)
    root = s3_backend.prefix + "/dedup"
    n = 200  # 4 batches of 64
    for i in range(n):
        digest = hashlib.blake2b(str(i).encode(), digest_size=32).hexdigest()
        fs.pipe(f"{root.removeprefix('s3://')}/chunks/{digest[:2]}/{digest}", b"x" * 8)
    time.sleep(1.1)  # older than the cutoff of a sweep with no grace
    counter = _Requests(opts)
    try:
        removed = sweep(Store(root, opts), 0.0)
        ops = counter.take()
    finally:
        counter.close()
    assert len(removed) == n and all(u.startswith("s3://") for u in removed), removed[:3]
    assert ops["ListObjectsV2"] <= 8, ops  # one blob listing (a page), the steps, intents
    assert ops["HeadObject"] <= n + 8, ops
