"""Object-store failures surface as ckptcore's typed errors, naming the URL (and the bucket).

Against the real moto S3 server (``s3_storage_options``), through s3fs:

* a bucket that does not exist: reads (``load_state``, ``inspect``, ``verify``, listing steps)
  raise ``CheckpointNotFoundError`` (a ``FileNotFoundError``), writes (``save_state``, a
  manager's save) raise ``StorageError``; each message says the bucket does not exist, names it
  and the URL, and chains s3fs's error.
* an endpoint nobody listens on: every one of those raises ``StorageError`` (an ``OSError``)
  naming the URL, with botocore's ``EndpointConnectionError`` chained as ``__cause__`` (s3fs
  lets it escape raw otherwise: neither an ``OSError`` nor a ``CheckpointError``).
"""

from __future__ import annotations

import uuid

import pytest

import ckptcore
from ckptcore import _knobs
from ckptcore._storage import Store
from ckptcore.errors import CheckpointError, CheckpointNotFoundError, StorageError

from _support import dead_s3_options, tiny_state


def _steps(url, opts):
    with ckptcore.CheckpointManager(url, storage_options=opts, lock=False) as reader:
        return reader.steps()


def _manager_save(url, opts):
    with ckptcore.CheckpointManager(url, storage_options=opts) as mgr:
        mgr.save(1, tiny_state(1, n=10))


def _listdir(url, opts):
    return Store(url, opts).listdir()


READS = {
    "load_state": lambda url, opts: ckptcore.load_state(url, storage_options=opts),
    "inspect": lambda url, opts: ckptcore.inspect(url, storage_options=opts),
    "verify": lambda url, opts: ckptcore.verify(url, storage_options=opts),
    "steps": _steps,
    "listdir": _listdir,
}
WRITES = {
    "save_state": lambda url, opts: ckptcore.save_state(url, tiny_state(1, n=10), storage_options=opts),
    "manager.save": _manager_save,
}


@pytest.fixture
def missing_bucket(s3_storage_options):
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:12]}"
    return bucket, f"s3://{bucket}/run/ckpt", dict(s3_storage_options)


@pytest.mark.parametrize("op", list(READS))
@pytest.mark.slow
def test_reading_from_a_missing_bucket(missing_bucket, op):
    bucket, url, opts = missing_bucket
    with pytest.raises(CheckpointNotFoundError) as info:
        READS[op](url, opts)
    e = info.value
    assert isinstance(e, FileNotFoundError) and isinstance(e, CheckpointError)
    msg = str(e)
    assert f"bucket {bucket!r} does not exist" in msg and url in msg, msg


@pytest.mark.parametrize("op", list(WRITES))
def test_writing_to_a_missing_bucket(missing_bucket, op):
    bucket, url, opts = missing_bucket
    with pytest.raises(StorageError) as info:
        WRITES[op](url, opts)
    msg = str(info.value)
    assert f"bucket {bucket!r} does not exist" in msg and f"s3://{bucket}/run/ckpt" in msg, msg
    assert info.value.__cause__ is not None


def test_a_missing_object_in_an_existing_bucket_is_still_plain_not_found(s3_backend):
    url, opts = s3_backend.url("nothing-here"), s3_backend.storage_options
    with pytest.raises(CheckpointNotFoundError, match="does not exist") as info:
        ckptcore.load_state(url, storage_options=opts)
    assert "bucket" not in str(info.value)
    store = Store(url, opts)
    assert store.exists() is False and store.listdir() == []
    with pytest.raises(FileNotFoundError):
        store.read("manifest.msgpack")
    store.delete("manifest.msgpack")  # absent: nothing to do
    store.delete_tree()


@pytest.fixture(scope="module")
def dead_endpoint():
    """Options for an S3 endpoint on a port nobody listens on, failing fast."""
    pytest.importorskip("s3fs")
    return dead_s3_options(read_timeout=1)


@pytest.mark.parametrize("op", list(READS) + list(WRITES))
@pytest.mark.slow
def test_a_dead_endpoint_is_a_storage_error(dead_endpoint, op):
    botocore = pytest.importorskip("botocore.exceptions")
    url = f"s3://some-bucket/run-{uuid.uuid4().hex[:8]}/ckpt"
    fn = READS.get(op) or WRITES[op]
    with pytest.raises(StorageError) as info:
        fn(url, dead_endpoint)
    e = info.value
    assert isinstance(e, OSError) and isinstance(e, CheckpointError)
    assert url in str(e) or url.rsplit("/", 1)[0] in str(e), str(e)
    assert isinstance(e.__cause__, botocore.BotoCoreError), repr(e.__cause__)


@pytest.mark.slow
def test_store_operations_on_a_dead_endpoint_each_raise_storage_error(dead_endpoint):
    botocore = pytest.importorskip("botocore.exceptions")
    store = Store("s3://some-bucket/x", dead_endpoint)
    ops = {
        "exists": lambda: store.exists("m"),
        "size": lambda: store.size("m"),
        "read": lambda: store.read("m"),
        "read max_bytes": lambda: store.read("m", max_bytes=10),
        "read_ranges": lambda: store.read_ranges("m", [(0, 4)]),
        "listdir": lambda: store.listdir(),
        "write_bytes": lambda: store.write_bytes("m", b"abc"),
        "write_bytes create": lambda: store.write_bytes("m", b"abc", create_only=True),
        "open_write": lambda: _write_and_close(store),
        "open_write multipart": lambda: _write_and_close(store, parts=3),
        "read_many": lambda: store.read_many([("m", [(0, 4)]), ("n", [(0, 4)])]),
        "delete": lambda: store.delete("m"),
        "delete_tree": lambda: store.delete_tree(),
    }
    for name, op in ops.items():
        with pytest.raises(StorageError) as info:
            op()
        assert "s3://some-bucket/x" in str(info.value), (name, str(info.value))
        assert isinstance(info.value.__cause__, botocore.BotoCoreError), (name, info.value.__cause__)


def _write_and_close(store: Store, parts: int = 0) -> None:
    """One small object (a single PUT), or ``parts`` parts of a multipart upload."""
    with _knobs.override(remote_part_size=64):
        f = store.open_write("shard")
        f.write(b"x" * (64 * parts or 100))
        f.close()


def test_a_multipart_upload_into_a_missing_bucket(missing_bucket):
    """The first part's CreateMultipartUpload meets NoSuchBucket: StorageError naming bucket
    and object, raised by the write itself, and the writer is closed (nothing to abort)."""
    bucket, url, opts = missing_bucket
    store = Store(url, opts)
    with _knobs.override(remote_part_size=64):
        f = store.open_write("shard")
        with pytest.raises(StorageError) as info:
            f.write(b"y" * 200)
    msg = str(info.value)
    assert f"bucket {bucket!r} does not exist" in msg and url in msg, msg
    assert f.closed
