"""The library functions behind ``ckpt gc``, ``ckpt ls`` and ``ckpt diff``, on real checkpoints."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

import ckptcore
from ckptcore import CheckpointManager, LockedError, TrainingState
from ckptcore._manifest import MANIFEST_NAME
from ckptcore._storage import Store
from ckptcore.api import read_manifest
from _support import make_state


def _flip_byte(url: str, tensor: str) -> None:
    """Damage ``tensor``'s data in place (its manifest, checksum included, stays as written)."""
    m = read_manifest(Store(url, {}))
    t = next(t for t in m.tensors if t.name == tensor)
    path = os.path.join(url, m.shards[t.shard].path)
    with open(path, "r+b") as f:
        f.seek(t.offset + 5)
        b = f.read(1)
        f.seek(t.offset + 5)
        f.write(bytes([b[0] ^ 0x10]))


# -- diff -----------------------------------------------------------------------------------------
def test_diff_compares_checksums_and_reads_only_what_changed(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    s = make_state(3)
    ckptcore.save_state(a, s)
    kernel = s.model["dense/kernel"].copy()
    kernel[2, 5] += 2.5
    ckptcore.save_state(b, dataclasses.replace(s, model={**s.model, "dense/kernel": kernel}))
    # The bias is unchanged: damage B's copy of it after writing.  diff trusts the checksums and
    # never reads it; verify reads it and complains.
    _flip_byte(b, "model/dense/bias")
    assert any("model/dense/bias" in str(p) for p in ckptcore.verify(b))

    d = ckptcore.diff(a, b)
    assert isinstance(d, ckptcore.CheckpointDiff) and not d.equal
    assert [x.name for x in d.differences] == ["model/dense/kernel"]
    assert d.differences[0].change == "values" and d.differences[0].max_abs_diff == 2.5
    assert "model/dense/bias" in d.same and d.read == ("model/dense/kernel",)
    assert d.total == len(ckptcore.inspect(a).tensors)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.a = "elsewhere"  # type: ignore[misc]


def test_diff_reads_a_changed_tensor_verified(tmp_path):
    """A tensor diff does read is checked: damage is an error, never a difference."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ckptcore.save_state(a, make_state(3))
    ckptcore.save_state(b, make_state(4))
    _flip_byte(b, "model/dense/kernel")
    with pytest.raises(ckptcore.CorruptCheckpointError, match="dense/kernel"):
        ckptcore.diff(a, b)


def test_diff_names_tensors_on_one_side_and_changed_types(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ckptcore.save_state(a, TrainingState(model={"w": np.zeros(3, np.float32), "old": np.ones(2)}))
    ckptcore.save_state(b, TrainingState(model={"w": np.zeros(3, np.float64), "new": np.ones(2)}))
    d = {x.name: x for x in ckptcore.diff(a, b).differences}
    assert d["model/old"].change == "only_in_a" and d["model/new"].change == "only_in_b"
    assert d["model/w"].change == "type" and d["model/w"].a == "float32[3]" \
        and d["model/w"].b == "float64[3]"
    same = ckptcore.diff(a, a)
    assert same.equal and same.read == () and len(same.same) == 2


def test_diff_of_bool_tensors_counts_in_numbers(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ckptcore.save_state(a, TrainingState(model={"flags": np.array([True, False])}))
    ckptcore.save_state(b, TrainingState(model={"flags": np.array([True, True])}))
    (x,) = ckptcore.diff(a, b).differences
    assert x.change == "values"
    assert x.max_abs_diff == 1.0 and x.describe() == "~ model/flags  max abs diff 1"


# -- list_checkpoints ----------------------------------------------------------------------------
def test_list_checkpoints_is_what_the_manager_sees(tmp_path):
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        for s in (1, 3, 5):
            mgr.save(s, make_state(s))
        steps = mgr.steps()
    (root / "step-000000000009").mkdir()  # a leftover without a manifest: not a checkpoint
    (root / "notes").mkdir()
    found = ckptcore.list_checkpoints(str(root))
    assert [c.step for c in found] == steps == [1, 3, 5]
    assert [c.name for c in found] == [f"step-{s:012d}" for s in steps]
    assert all(c.info is not None and c.info.step == c.step and c.problem is None for c in found)
    with CheckpointManager(root, lock=False) as reader:
        assert found[0].url == reader.step_url(1)
    assert ckptcore.list_checkpoints(str(tmp_path / "nothing-here")) == []


def test_list_checkpoints_reports_an_unreadable_manifest(tmp_path):
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(1, make_state(1))
        mgr.save(2, make_state(2))
    (root / "step-000000000002" / MANIFEST_NAME).write_bytes(b"garbage")
    one, two = ckptcore.list_checkpoints(str(root))
    assert one.info is not None and two.info is None
    assert two.step == 2 and "Error" in two.problem


def test_list_checkpoints_reads_a_buckets_manifests_at_once(s3_backend, monkeypatch):
    """On a bucket each manifest is a GET: they are read several at a time (a listing of 1,000
    steps was 1,000 round trips in a row), and the answer is the same as one by one: ascending,
    each damaged manifest in its place with its problem."""
    import threading

    from ckptcore import layout

    root = s3_backend.url("run")
    opts = s3_backend.storage_options
    with CheckpointManager(root, storage_options=opts, keep=None) as mgr:
        for s in range(1, 13):
            mgr.save(s, make_state(s))
    for bad in (4, 9):
        s3_backend.fs.pipe_file(s3_backend.path("run", f"step-{bad:012d}", MANIFEST_NAME), b"garbage")
    real, lock = layout.inspect, threading.Lock()
    running, most = [0], [0]

    def counted(url, **kw):  # the real read, counting how many are in flight
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            return real(url, **kw)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(layout, "inspect", counted)
    found = ckptcore.list_checkpoints(root, storage_options=opts)
    assert [c.step for c in found] == list(range(1, 13))
    for c in found:
        if c.step in (4, 9):
            assert c.info is None and "Error" in c.problem, c
        else:
            assert c.problem is None and c.info.step == c.step
    assert most[0] > 1, "the manifests were read one after another"


def test_list_checkpoints_skips_a_linked_step(tmp_path, caplog):
    elsewhere = tmp_path / "elsewhere"
    with CheckpointManager(elsewhere) as mgr:
        mgr.save(7, make_state(7))
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(1, make_state(1))
    os.symlink(elsewhere / "step-000000000007", root / "step-000000000007")
    with caplog.at_level("WARNING", logger="ckptcore"):
        assert [c.step for c in ckptcore.list_checkpoints(str(root))] == [1]
    assert "symbolic link" in caplog.text


# -- gc --------------------------------------------------------------------------------------------
def _root_with_leftovers(tmp_path):
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(1, make_state(1))
    leftover = root / "step-000000000002"
    leftover.mkdir()
    (leftover / "shard-00000-dead.bin").write_bytes(b"x" * 100)
    stray = root / "step-000000000001" / "shard-00009-loser.bin"  # a losing writer's shard
    stray.write_bytes(b"y" * 10)
    return root, leftover, stray


def test_gc_removes_leftovers_only(tmp_path, caplog):
    root, leftover, stray = _root_with_leftovers(tmp_path)
    assert ckptcore.gc(str(root), grace=3600) == []  # too young
    assert leftover.exists() and stray.exists()
    with caplog.at_level("INFO", logger="ckptcore"):
        removed = ckptcore.gc(str(root), grace=0)
    assert sorted(os.path.basename(u) for u in removed) == ["shard-00009-loser.bin",
                                                            "step-000000000002"]
    assert not leftover.exists() and not stray.exists()
    assert "gc: removing leftover" in caplog.text  # every deletion is logged
    with CheckpointManager(root, lock=False) as reader:
        assert reader.restore().step == 1


def test_manager_gc_is_the_same_function(tmp_path):
    root, leftover, stray = _root_with_leftovers(tmp_path)
    with CheckpointManager(root) as mgr:
        removed = mgr.gc(grace=0)
    assert len(removed) == 2 and not leftover.exists() and not stray.exists()


def test_gc_refuses_a_locked_root_a_non_root_and_a_negative_grace(tmp_path):
    root, leftover, _ = _root_with_leftovers(tmp_path)
    with CheckpointManager(root) as mgr:
        mgr.save(3, make_state(3))
        with pytest.raises(LockedError):
            ckptcore.gc(str(root), grace=0)
    assert leftover.exists()
    with pytest.raises(FileNotFoundError, match="no checkpoint root"):
        ckptcore.gc(str(tmp_path / "typo"), grace=0)
    assert not (tmp_path / "typo").exists()
    with pytest.raises(FileNotFoundError, match="no checkpoint root"):
        ckptcore.gc(str(root / "step-000000000001"), grace=0)  # one checkpoint, not a root
    for bad in (-1, float("nan")):
        with pytest.raises(ValueError, match="grace must be >= 0"):
            ckptcore.gc(str(root), grace=bad)
