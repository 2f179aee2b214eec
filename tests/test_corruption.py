"""Damaged checkpoints: every kind of damage is a typed error naming the part, never a wrong tensor.

Damage is done behind ckptcore's back through the backend's own filesystem (on S3: a plain PUT
of the damaged bytes through s3fs), then ``load_state`` and ``verify`` are asked about it.
"""

from __future__ import annotations

import random

import crc32c
import numpy as np
import pytest

import ckptcore
from ckptcore import TrainingState, _io, _knobs
from ckptcore._manifest import MANIFEST_NAME, Manifest, ShardEntry, TensorEntry
from ckptcore._storage import Store
from ckptcore.errors import (CheckpointError, CorruptCheckpointError, IncompleteCheckpointError,
                             SchemaError)

from _support import assert_state_same, store_params


def damage_state() -> TrainingState:
    """Odd sizes (so shards have padding), a large tensor spanning pages, 0-d and empty tensors."""
    rng = np.random.default_rng(42)
    return TrainingState(
        model={
            "big": rng.standard_normal(3000).astype(np.float32),     # 12000 B: spans pages
            "odd8": rng.integers(1, 100, 33, dtype=np.int8),          # 33 B, then padding
            "f64": rng.standard_normal((3, 5)),                       # 120 B, then padding
            "half": rng.standard_normal(7).astype(np.float16),        # 14 B
            "scalar": np.array(3.25, np.float64),
            "empty": np.zeros((0, 4), np.float32),
            "u": np.array(["ab", "cdef"]),
        },
        optimizer=ckptcore.OptimizerState("sgd", step=3, slots={"big": {"m": np.ones(3000, np.float32)},
                                                                "odd8": {"m": np.arange(1, 34, dtype=np.int16)}}),
        extra={"bytes": rng.integers(1, 255, 500, dtype=np.uint8), "n": np.int64(-5)},
        step=17,
    )


@pytest.fixture(params=store_params("local", "memory", "s3"))
def ckpt(request):
    """A saved multi-shard checkpoint: (backend, url, manifest, {shard path: original bytes})."""
    backend = request.getfixturevalue(f"{request.param}_backend")
    url = backend.url("c")
    with _knobs.override(shard_size=4096):
        ckptcore.save_state(url, damage_state(), storage_options=backend.storage_options)
    manifest = Manifest.from_bytes(backend.read("c", MANIFEST_NAME))
    assert len(manifest.shards) >= 3
    originals = {s.path: backend.read("c", s.path) for s in manifest.shards}
    originals[MANIFEST_NAME] = backend.read("c", MANIFEST_NAME)
    return backend, url, manifest, originals


def _load(backend, url):
    return ckptcore.load_state(url, storage_options=backend.storage_options)


def _verify(backend, url):
    return ckptcore.verify(url, storage_options=backend.storage_options)


def _flip(data: bytes, pos: int, mask: int = 0xFF) -> bytes:
    out = bytearray(data)
    out[pos] ^= mask
    return bytes(out)


def _tensors_in(manifest: Manifest, shard_index: int) -> list[TensorEntry]:
    return sorted((t for t in manifest.tensors if t.shard == shard_index and t.length),
                  key=lambda t: t.offset)


def _padding(manifest: Manifest, shard_index: int) -> list[int]:
    """Offsets in a shard that belong to no tensor."""
    used = np.zeros(manifest.shards[shard_index].size, bool)
    for t in _tensors_in(manifest, shard_index):
        used[t.offset:t.offset + t.length] = True
    return [int(i) for i in np.flatnonzero(~used)]


# ------------------------------------------------------------------------------- flipped bytes
def test_flip_a_byte_in_every_tensor(ckpt):
    backend, url, manifest, originals = ckpt
    rnd = random.Random(0)
    hit = 0
    for s, shard in enumerate(manifest.shards):
        for t in _tensors_in(manifest, s):
            pos = t.offset + rnd.choice([0, t.length - 1, rnd.randrange(t.length)])
            damaged = _flip(originals[shard.path], pos)
            backend.write(damaged, "c", shard.path)
            with pytest.raises(CorruptCheckpointError) as e:
                _load(backend, url)
            err = e.value
            assert err.file.endswith(shard.path) and err.tensor == t.name
            assert err.expected == t.checksum
            assert err.actual == crc32c.crc32c(damaged[t.offset:t.offset + t.length]) != t.checksum
            assert shard.path in str(err) and t.name in str(err)
            assert f"{t.checksum:#010x}" in str(err) and f"{err.actual:#010x}" in str(err)
            problems = _verify(backend, url)
            assert [(p.tensor, type(p)) for p in problems] == [(t.name, CorruptCheckpointError)]
            backend.write(originals[shard.path], "c", shard.path)
            hit += 1
    assert hit == sum(1 for t in manifest.tensors if t.length)
    assert _verify(backend, url) == []


def test_flip_padding_is_found_by_verify_and_harmless_to_load(ckpt):
    """Padding belongs to no tensor: load still returns exact tensors; verify's shard checksum sees it."""
    backend, url, manifest, originals = ckpt
    want = damage_state()
    cases = 0
    for s, shard in enumerate(manifest.shards):
        pad = _padding(manifest, s)
        for pos in pad[:1] + pad[-1:]:
            backend.write(_flip(originals[shard.path], pos), "c", shard.path)
            assert_state_same(_load(backend, url), want)
            problems = _verify(backend, url)
            assert len(problems) == 1 and isinstance(problems[0], CorruptCheckpointError)
            assert problems[0].file.endswith(shard.path) and problems[0].tensor is None
            assert problems[0].expected == shard.checksum
            backend.write(originals[shard.path], "c", shard.path)
            cases += 1
    assert cases >= 2


@pytest.mark.slow
def test_flip_every_manifest_byte(local_backend):
    """No single flipped bit or byte of a manifest is ever accepted."""
    url = local_backend.url("c")
    ckptcore.save_state(url, TrainingState(model={"w": np.arange(4.0)}, step=2))
    raw = local_backend.read("c", MANIFEST_NAME)
    for pos in range(len(raw)):
        for mask in (0x01, 0xFF):
            local_backend.write(_flip(raw, pos, mask), "c", MANIFEST_NAME)
            with pytest.raises((SchemaError, CorruptCheckpointError)):
                ckptcore.load_state(url)


# ---------------------------------------------------------------------------------- truncation
def test_truncate_each_shard(ckpt):
    backend, url, manifest, originals = ckpt
    for s, shard in enumerate(manifest.shards):
        data = originals[shard.path]
        tensors = _tensors_in(manifest, s)
        cuts = sorted({0, len(data) // 2, len(data) - 1} if backend.name == "s3" else
                      {0, 1, len(data) // 2, len(data) - 1, tensors[-1].offset})
        for cut in cuts:
            backend.write(data[:cut], "c", shard.path)
            with pytest.raises(IncompleteCheckpointError, match="truncated") as e:
                _load(backend, url)
            assert shard.path in str(e.value)
            problems = _verify(backend, url)
            assert problems and all(isinstance(p, IncompleteCheckpointError) for p in problems)
            assert any(shard.path in str(p) for p in problems)
        backend.write(data, "c", shard.path)
    assert _verify(backend, url) == []


def test_truncate_manifest(ckpt):
    backend, url, _, originals = ckpt
    raw = originals[MANIFEST_NAME]
    # Every offset of a small manifest is covered in test_api; here a spread over a larger one.
    step = 7 if backend.name != "s3" else len(raw) // 10
    for cut in list(range(0, len(raw), step)) + [len(raw) - 1]:
        backend.write(raw[:cut], "c", MANIFEST_NAME)
        for fn in (ckptcore.load_state, ckptcore.inspect, ckptcore.verify):
            with pytest.raises((SchemaError, CorruptCheckpointError)):
                fn(url, storage_options=backend.storage_options)


# ------------------------------------------------------------------------------------- pages
def test_zero_a_page(ckpt):
    """Zero each 4096-byte page of each shard: exactly the tensors whose bytes changed are reported."""
    backend, url, manifest, originals = ckpt
    cases = 0
    for s, shard in enumerate(manifest.shards):
        data = originals[shard.path]
        for start in range(0, len(data), 4096):
            end = min(start + 4096, len(data))
            damaged = data[:start] + bytes(end - start) + data[end:]
            if damaged == data:
                continue
            changed = {t.name for t in _tensors_in(manifest, s)
                       if damaged[t.offset:t.offset + t.length] != data[t.offset:t.offset + t.length]}
            backend.write(damaged, "c", shard.path)
            if changed:
                with pytest.raises(CorruptCheckpointError) as e:
                    _load(backend, url)
                assert e.value.tensor in changed and e.value.file.endswith(shard.path)
                problems = _verify(backend, url)
                assert {p.tensor for p in problems} == changed
            else:  # only padding was hit
                assert_state_same(_load(backend, url), damage_state())
                assert [p.tensor for p in _verify(backend, url)] == [None]
            backend.write(data, "c", shard.path)
            cases += 1
    assert cases >= len(manifest.shards)


# ------------------------------------------------------------------------ missing and extra
def test_delete_each_shard(ckpt):
    backend, url, manifest, originals = ckpt
    for shard in manifest.shards:
        backend.delete("c", shard.path)
        with pytest.raises(IncompleteCheckpointError, match="missing") as e:
            _load(backend, url)
        assert shard.path in str(e.value)
        problems = _verify(backend, url)
        assert problems and all(isinstance(p, IncompleteCheckpointError) for p in problems)
        assert any(shard.path in str(p) for p in problems)
        backend.write(originals[shard.path], "c", shard.path)
    assert _verify(backend, url) == []


def test_append_garbage_to_each_file(ckpt):
    backend, url, manifest, originals = ckpt
    for shard in manifest.shards:
        backend.write(originals[shard.path] + b"garbage", "c", shard.path)
        with pytest.raises(CorruptCheckpointError) as e:
            _load(backend, url)
        assert e.value.file.endswith(shard.path)
        problems = _verify(backend, url)
        assert problems and all(isinstance(p, CorruptCheckpointError) for p in problems)
        assert any(p.file.endswith(shard.path) for p in problems)
        backend.write(originals[shard.path], "c", shard.path)
    backend.write(originals[MANIFEST_NAME] + b"\x00", "c", MANIFEST_NAME)
    for fn in (ckptcore.load_state, ckptcore.inspect, ckptcore.verify):
        with pytest.raises(SchemaError):
            fn(url, storage_options=backend.storage_options)


def test_swapped_shards_are_detected(ckpt):
    """A shard replaced by another of the same size (a mixed-up copy) is caught by the checksums."""
    backend, url, manifest, originals = ckpt
    a, b = manifest.shards[0], manifest.shards[1]
    other = originals[b.path][: a.size].ljust(a.size, b"\x00")
    backend.write(other, "c", a.path)
    with pytest.raises(CorruptCheckpointError):
        _load(backend, url)
    assert _verify(backend, url)


def test_every_error_is_a_checkpoint_error():
    for cls in (CorruptCheckpointError, IncompleteCheckpointError, SchemaError):
        assert issubclass(cls, CheckpointError)


# ------------------------------------------------------------------------------------ races
def test_remote_shard_vanishing_between_size_check_and_read(memory_backend):
    """A shard deleted after its size was checked (an overwrite's cleanup): typed, not a TypeError."""
    store = Store(memory_backend.url("c"))
    shard = ShardEntry(path="shard-gone.bin", size=4, checksum=0)
    entry = TensorEntry(name="t", dtype="uint8", shape=(4,), shard=0, offset=0, length=4, checksum=0)
    with pytest.raises(IncompleteCheckpointError):
        _io._fetch_remote(store, shard, [entry])
