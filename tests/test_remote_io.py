"""Concurrent object-store transfers, against the real moto S3 server of conftest.py, through s3fs.

Uploads: an object larger than ``remote_part_size`` goes up as a multipart upload whose parts
travel concurrently; a smaller one is a single PUT; any failure aborts the multipart upload, so
no part is left behind (listed through the S3 API), and nothing is committed.  Reads: ranges are
fetched in part-sized pieces, concurrently, into one writable buffer per range, exactly.

S3 (and moto) refuse parts under 5 MiB except the last; tests that want many tiny parts lower
moto's own minimum (``S3_UPLOAD_PART_MIN_SIZE``, a setting of the fake server, not of ckptcore),
and one test keeps it to make a real completion fail.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

import ckptcore
from ckptcore import TrainingState, _knobs
from ckptcore._storage import Store
from _proxy import CuttingProxy

BUCKET = "ckptcore-test"


@pytest.fixture
def tiny_parts(monkeypatch, s3_storage_options):
    """Let the moto server accept parts of any size (real S3: 5 MiB at least)."""
    import moto.s3.models

    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 1)


def _uploads(backend) -> list[dict]:
    """Multipart uploads in progress under this test's prefix, as the S3 API lists them."""
    fs = backend.fs
    prefix = backend.path().split("/", 1)[1]
    out = fs.call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix=prefix)
    return out.get("Uploads", [])


def _etag(backend, *parts: str) -> str:
    return backend.fs.info(backend.path(*parts), refresh=True)["ETag"].strip('"')


def _rng_array(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


PART = 4096


def _state() -> TrainingState:
    return TrainingState(model={
        "empty": np.zeros((0, 3), np.float32),
        "one_part": _rng_array(PART, 1),               # exactly one part
        "two_parts": _rng_array(2 * PART, 2),          # exactly two parts
        "uneven": _rng_array(5 * PART + 123, 3),       # an uneven last part
        "many": np.random.default_rng(4).standard_normal(40 * PART // 4).astype(np.float32),
        "small": np.arange(7, dtype=np.int64),
    }, step=3)


@pytest.mark.parametrize("concurrency", [1, 3, 8])
@pytest.mark.slow
def test_multipart_round_trip_bit_for_bit(s3_backend, tiny_parts, concurrency):
    state = _state()
    url, opts = s3_backend.url("ck"), s3_backend.storage_options
    with _knobs.override(remote_part_size=PART, remote_concurrency=concurrency,
                         shard_size=64 * PART):
        ckptcore.save_state(url, state, storage_options=opts)
        loaded = ckptcore.load_state(url, storage_options=opts, verify=True)
    for name, arr in state.model.items():
        got = loaded.model[name]
        assert got.dtype == arr.dtype and got.shape == arr.shape, name
        assert got.tobytes() == arr.tobytes(), name
        assert got.size == 0 or got.flags.writeable, name
    # The large shards went up in parts (a multipart ETag ends in -<part count>), the manifest
    # and small shards as single PUTs.
    shards = [n for n in s3_backend.listdir("ck") if n.startswith("shard-")]
    etags = {n: _etag(s3_backend, "ck", n) for n in shards}
    assert any("-" in e for e in etags.values()), etags
    assert "-" not in _etag(s3_backend, "ck", "manifest.msgpack")
    assert _uploads(s3_backend) == []
    assert ckptcore.verify(url, storage_options=opts) == []  # shard checksums too


@pytest.mark.parametrize("size", [0, 1, PART - 1, PART, PART + 1, 3 * PART, 7 * PART + 5])
def test_store_writer_sizes_and_request_shapes(s3_backend, tiny_parts, size):
    """Single PUT up to one part (no multipart), parts above; the bytes land exactly."""
    store = Store(s3_backend.url("w"), s3_backend.storage_options)
    data = _rng_array(size, size).tobytes()
    with _knobs.override(remote_part_size=PART, remote_concurrency=2):
        f = store.open_write("obj")
        for start in range(0, size, 1000):  # writes that straddle part boundaries
            f.write(memoryview(data)[start:start + 1000])
        f.close()
        f.close()  # closing twice is harmless
    assert s3_backend.read("w", "obj") == data
    parts = -(-size // PART)
    etag = _etag(s3_backend, "w", "obj")
    assert (etag.endswith(f"-{parts}") if parts > 1 else "-" not in etag), (size, etag)
    assert _uploads(s3_backend) == []


@pytest.mark.slow
def test_concurrency_one_and_many_writers_share_the_buffers(s3_backend, tiny_parts):
    """Eight shards, each several parts, through one part buffer: no deadlock, exact bytes."""
    state = TrainingState(model={f"t{i}": _rng_array(3 * PART + i, 10 + i) for i in range(8)},
                          step=1)
    url, opts = s3_backend.url("ck"), s3_backend.storage_options
    with _knobs.override(remote_part_size=PART, remote_concurrency=1, threads=4,
                         shard_size=PART):
        ckptcore.save_state(url, state, storage_options=opts)
        loaded = ckptcore.load_state(url, storage_options=opts)
    for name, arr in state.model.items():
        assert loaded.model[name].tobytes() == arr.tobytes()


def test_failed_completion_aborts_and_commits_nothing(s3_backend, caplog):
    """A real refusal by the server: parts under S3's 5 MiB minimum fail at completion
    (EntityTooSmall).  The save fails naming the shard, the multipart upload is aborted (and
    logged), and no checkpoint exists."""
    url, opts = s3_backend.url("ck"), s3_backend.storage_options
    state = TrainingState(model={"w": _rng_array(10 * PART, 7)}, step=1)
    caplog.set_level(logging.WARNING, logger="ckptcore")
    with _knobs.override(remote_part_size=PART), pytest.raises(OSError) as info:
        ckptcore.save_state(url, state, storage_options=opts)
    assert url in str(info.value), str(info.value)
    assert _uploads(s3_backend) == []
    assert "multipart upload was aborted" in caplog.text
    with pytest.raises(ckptcore.errors.CheckpointNotFoundError):
        ckptcore.load_state(url, storage_options=opts)
    assert not [n for n in s3_backend.listdir("ck") if n.startswith("shard-")]


@pytest.mark.slow
def test_a_part_failing_mid_upload_aborts_the_upload(s3_backend, tiny_parts, caplog):
    """The multipart upload vanishes under the writer (aborted through the S3 API, as a bucket
    lifecycle rule would): the next part or the completion fails, naming the object; nothing is
    published and no upload is left."""
    store = Store(s3_backend.url("w"), s3_backend.storage_options)
    caplog.set_level(logging.WARNING, logger="ckptcore")
    data = _rng_array(12 * PART, 9).tobytes()
    with _knobs.override(remote_part_size=PART, remote_concurrency=2):
        f = store.open_write("obj")
        f.write(data[:4 * PART])  # three parts shipped, the fourth buffered
        [upload] = _uploads(s3_backend)
        s3_backend.fs.call_s3("abort_multipart_upload", Bucket=BUCKET, Key=upload["Key"],
                              UploadId=upload["UploadId"])
        with pytest.raises(OSError) as info:
            f.write(data[4 * PART:])
            f.close()
    assert store.join("obj").split("/", 1)[1] in str(info.value) or \
        s3_backend.url("w", "obj") in str(info.value), str(info.value)
    assert f.closed
    assert _uploads(s3_backend) == []
    assert not s3_backend.fs.exists(s3_backend.path("w", "obj"))
    assert "upload failed" in caplog.text


def test_abandoned_writer_can_abort(s3_backend, tiny_parts):
    store = Store(s3_backend.url("w"), s3_backend.storage_options)
    with _knobs.override(remote_part_size=PART):
        with pytest.raises(KeyboardInterrupt):
            with store.open_write("obj") as f:
                f.write(bytes(5 * PART))
                raise KeyboardInterrupt
    assert _uploads(s3_backend) == []
    assert not s3_backend.fs.exists(s3_backend.path("w", "obj"))


@pytest.mark.parametrize("piece", [1, 777, 4096, 1 << 20])
@pytest.mark.slow
def test_concurrent_ranged_reads_are_exact(s3_backend, piece):
    store = Store(s3_backend.url("r"), s3_backend.storage_options)
    data = _rng_array(300_000, 5).tobytes()
    s3_backend.write(data, "r", "a")
    s3_backend.write(data[::-1], "r", "b")
    ranges = [(0, 1), (0, 300_000), (5, 70_001), (299_999, 300_000), (123, 45_678),
              (100_000, 100_000 + 3 * 777)]
    if piece == 1:
        ranges = [(10, 50), (299_990, 300_000)]  # a piece per byte: keep it short
    elif piece == 777:  # dozens of pieces per range, not hundreds (each is a request)
        ranges = [(0, 1), (0, 9_000), (5, 7_001), (299_999, 300_000), (123, 4_678),
                  (100_000, 100_000 + 3 * 777)]
    with _knobs.override(remote_part_size=piece, remote_concurrency=3):
        blobs = store.read_ranges("a", ranges)
        both = store.read_many([("a", ranges[:2]), ("b", ranges), ("a", [])])
    assert all(isinstance(b, memoryview) and not b.readonly for b in blobs)
    assert [bytes(b) for b in blobs] == [data[s:e] for s, e in ranges]
    assert [bytes(b) for b in both[0]] == [data[s:e] for s, e in ranges[:2]]
    assert [bytes(b) for b in both[1]] == [data[::-1][s:e] for s, e in ranges]
    assert both[2] == []


def test_ranged_reads_past_the_end_come_back_short(s3_backend):
    """The object is shorter than asked (it shrank since its size was checked): the range is
    cut at the first missing byte, never padded; the caller sees the short length."""
    store = Store(s3_backend.url("r"), s3_backend.storage_options)
    s3_backend.write(bytes(range(100)), "r", "a")
    with _knobs.override(remote_part_size=16, remote_concurrency=4):
        blobs = store.read_ranges("a", [(90, 140), (100, 164), (0, 10)])
    assert [bytes(b) for b in blobs] == [bytes(range(90, 100)), b"", bytes(range(10))]


def test_missing_object_read_is_file_not_found(s3_backend):
    store = Store(s3_backend.url("r"), s3_backend.storage_options)
    with pytest.raises(FileNotFoundError):
        store.read_ranges("nothing", [(0, 10)])


def test_truncated_remote_shard_is_incomplete(s3_backend):
    url, opts = s3_backend.url("ck"), s3_backend.storage_options
    ckptcore.save_state(url, TrainingState(model={"w": _rng_array(50_000, 1)}, step=1),
                        storage_options=opts)
    [shard] = [n for n in s3_backend.listdir("ck") if n.startswith("shard-")]
    s3_backend.write(s3_backend.read("ck", shard)[:1000], "ck", shard)
    with pytest.raises(ckptcore.errors.IncompleteCheckpointError, match="truncated"):
        ckptcore.load_state(url, storage_options=opts)


def test_shard_size_and_writers_per_store(backend):
    store = Store(backend.url("d"), backend.storage_options)
    with _knobs.override(shard_size=1000, remote_part_size=300, threads=2,
                         remote_concurrency=6):
        if backend.name == "s3":
            assert (store.shard_size, store.writers) == (300, 6)
        elif backend.name in ("memory", "gcs", "azure"):  # no S3 multipart: the knob; network-bound writers
            assert (store.shard_size, store.writers) == (1000, 6)
        else:
            assert (store.shard_size, store.writers) == (1000, 2)


def test_concurrent_saves_share_nothing(s3_backend, tiny_parts):
    """Two saves at once in one process (an async save and another), each with its own buffers."""
    opts = s3_backend.storage_options
    states = [TrainingState(model={"w": _rng_array(9 * PART + k, k)}, step=k) for k in range(2)]
    errors = []

    def save(k):
        try:
            ckptcore.save_state(s3_backend.url(f"c{k}"), states[k], storage_options=opts)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    with _knobs.override(remote_part_size=PART, remote_concurrency=2):
        threads = [threading.Thread(target=save, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    for k in range(2):
        got = ckptcore.load_state(s3_backend.url(f"c{k}"), storage_options=opts)
        assert got.model["w"].tobytes() == states[k].model["w"].tobytes()


@pytest.mark.slow
def test_a_save_spreads_over_part_sized_shards_read_back_together(s3_backend, tiny_parts):
    """On S3 a shard is at most one part (a single PUT each); a save of many tensors has many
    shards written at once, and a load fetches all of them in one concurrent read, exactly."""
    opts = s3_backend.storage_options
    state = TrainingState(model={f"t{k}": _rng_array(PART // 3 + 17 * k, k) for k in range(40)},
                          step=5)
    with _knobs.override(remote_part_size=PART, remote_concurrency=3):
        ckptcore.save_state(s3_backend.url("m"), state, storage_options=opts)
        shards = [n for n in s3_backend.listdir("m") if n.startswith("shard-")]
        assert len(shards) >= 10
        assert all(len(s3_backend.read("m", s)) <= PART for s in shards)
        assert not _uploads(s3_backend)  # single PUTs: no multipart upload was ever needed
        got = ckptcore.load_state(s3_backend.url("m"), storage_options=opts)
    for k, arr in state.model.items():
        assert got.model[k].tobytes() == arr.tobytes(), k


@pytest.mark.slow
def test_damage_in_one_of_many_remote_shards_is_named(s3_backend, tiny_parts):
    """A truncated shard and a flipped byte in another: load names the first; verify reports
    both and nothing about the intact shards."""
    opts = s3_backend.storage_options
    state = TrainingState(model={f"t{k}": _rng_array(PART // 2, k) for k in range(12)}, step=1)
    with _knobs.override(remote_part_size=PART, remote_concurrency=4):
        ckptcore.save_state(s3_backend.url("d"), state, storage_options=opts)
        shards = sorted(n for n in s3_backend.listdir("d") if n.startswith("shard-"))
        assert len(shards) >= 3
        s3_backend.write(s3_backend.read("d", shards[0])[:100], "d", shards[0])
        blob = bytearray(s3_backend.read("d", shards[-1]))
        blob[10] ^= 0xFF
        s3_backend.write(bytes(blob), "d", shards[-1])
        with pytest.raises(ckptcore.errors.IncompleteCheckpointError, match=shards[0]):
            ckptcore.load_state(s3_backend.url("d"), storage_options=opts)
        problems = ckptcore.verify(s3_backend.url("d"), storage_options=opts)
    text = "\n".join(str(p) for p in problems)
    assert shards[0] in text and shards[-1] in text
    assert not any(s in text for s in shards[1:-1])


def _body_bytes(body) -> bytes:
    """A request body's bytes: a buffer as it is, a file-like one (the writer's part bodies,
    which stream to the socket) read and put back where it was."""
    if not hasattr(body, "read"):
        return bytes(body)
    pos = body.tell()
    body.seek(0)
    data = body.read()
    body.seek(pos)
    return data


def _captured_uploads(store: Store) -> list[tuple[str, dict, bytes]]:
    """Every PutObject/UploadPart request this store's client sends: (operation, headers, body),
    recorded by a botocore event handler (the requests still go to the server)."""
    from fsspec.asyn import sync

    seen: list[tuple[str, dict, bytes]] = []

    def record(request, **kwargs):
        op = kwargs.get("event_name", "").rsplit(".", 1)[-1]
        headers = {k.lower(): v.decode() if isinstance(v, bytes) else v
                   for k, v in request.headers.items()}
        seen.append((op, headers, _body_bytes(request.body)))

    client = sync(store.fs.loop, store.fs.set_session)
    for op in ("PutObject", "UploadPart"):
        client.meta.events.register(f"before-send.s3.{op}", record)
    return seen


@pytest.mark.parametrize("size", [3 * PART // 2, 5 * PART])  # a single PUT, a multipart upload
@pytest.mark.slow
def test_uploads_carry_the_crc32c_of_their_bytes(s3_backend, tiny_parts, size):
    """S3 checks each upload against a CRC32C computed by the writer (botocore then computes no
    CRC32 of its own on the shared event loop); a client configured to send checksums only when
    required gets none."""
    import base64

    import crc32c

    data = _rng_array(size, 7).tobytes()
    for config, expect in (({}, True), ({"request_checksum_calculation": "when_required"}, False)):
        opts = dict(s3_backend.storage_options, config_kwargs=config)
        store = Store(s3_backend.url(f"crc{int(expect)}"), opts)
        seen = _captured_uploads(store)
        with _knobs.override(remote_part_size=2 * PART, remote_concurrency=2):
            with store.open_write("obj") as f:
                f.write(data)
        assert seen and all(op in ("PutObject", "UploadPart") for op, _, _ in seen)
        for _, headers, body in seen:
            assert "x-amz-checksum-crc32" not in headers
            got = headers.get("x-amz-checksum-crc32c")
            if expect:
                want = base64.b64encode(crc32c.crc32c(body).to_bytes(4, "big")).decode()
                assert got == want
            else:
                assert got is None
        assert store.read("obj") == data


@pytest.fixture
def cutting_proxy(s3_storage_options):
    port = int(s3_storage_options["client_kwargs"]["endpoint_url"].rsplit(":", 1)[1])
    proxy = CuttingProxy(port)
    yield proxy
    proxy.close()


@pytest.mark.slow
def test_a_body_broken_off_is_fetched_again_and_logged(s3_backend, cutting_proxy, caplog):
    """A ranged read whose body breaks off mid-transfer is fetched again (logged) and the load is
    bit for bit; one that keeps breaking fails as a StorageError naming the shard."""
    import s3fs

    state = TrainingState(model={"w": _rng_array(300_000, 9)}, step=2)
    ckptcore.save_state(s3_backend.url("b"), state, storage_options=s3_backend.storage_options)
    opts = dict(s3_backend.storage_options,
                client_kwargs={"endpoint_url": f"http://127.0.0.1:{cutting_proxy.port}"},
                skip_instance_cache=True)
    s3fs.S3FileSystem.clear_instance_cache()
    cutting_proxy.cuts = 1
    with caplog.at_level(logging.WARNING, logger="ckptcore"):
        got = ckptcore.load_state(s3_backend.url("b"), storage_options=opts)
    assert got.model["w"].tobytes() == state.model["w"].tobytes()
    assert cutting_proxy.cut_done == 1
    assert any("broke off" in r.getMessage() for r in caplog.records)
    cutting_proxy.cuts = 100
    with pytest.raises(ckptcore.errors.StorageError, match="shard-"):
        ckptcore.load_state(s3_backend.url("b"), storage_options=opts)
