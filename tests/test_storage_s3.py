"""The S3 test backend is real enough to trust: moto honours create-only PUTs, as S3 does.

ckptcore's object-store commit rests on one primitive: a PUT that succeeds only if the key is
absent (``If-None-Match: *``, sent by s3fs ``pipe_file(..., mode="create")``).  These tests pin
that the server started by conftest.py implements it, and that ckptcore's storage layer exposes
it on every backend.
"""

from __future__ import annotations

import threading

import pytest

from ckptcore._storage import Store


def test_moto_honours_create_only_put(s3_backend):
    fs, path = s3_backend.fs, s3_backend.path("once")
    fs.pipe_file(path, b"first", mode="create")
    with pytest.raises(FileExistsError):
        fs.pipe_file(path, b"second", mode="create")
    assert fs.cat_file(path) == b"first"
    fs.pipe_file(path, b"third")  # a plain PUT still overwrites
    assert fs.cat_file(path) == b"third"


def test_racing_create_only_puts_have_one_winner(s3_backend):
    fs, path = s3_backend.fs, s3_backend.path("contested")
    barrier, outcomes = threading.Barrier(6), []

    def put(i):
        barrier.wait()
        try:
            fs.pipe_file(path, b"%d" % i, mode="create")
            outcomes.append(("won", i))
        except FileExistsError:
            outcomes.append(("lost", i))

    threads = [threading.Thread(target=put, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for kind, i in outcomes if kind == "won"]
    assert len(outcomes) == 6 and len(winners) == 1, outcomes
    assert fs.cat_file(path) == b"%d" % winners[0]


def test_store_create_only_on_every_backend(backend):
    store = Store(backend.url("d"), backend.storage_options)
    store.makedirs()
    store.write_bytes("m", b"one", create_only=True)
    with pytest.raises(FileExistsError):
        store.write_bytes("m", b"two", create_only=True)
    assert store.read("m") == b"one"
    store.write_bytes("m", b"three")
    assert store.read("m") == b"three" and store.size("m") == 5


def test_store_capabilities(backend):
    store = Store(backend.url("d"), backend.storage_options)
    assert store.atomic_rename is (backend.name == "local")
    assert store.atomic_create  # all three test backends have a real create-only primitive


def test_store_range_reads(backend):
    store = Store(backend.url("d"), backend.storage_options)
    store.makedirs()
    store.write_bytes("f", bytes(range(200)))
    assert store.read_ranges("f", [(0, 3), (100, 104), (199, 200)]) == [
        b"\x00\x01\x02", bytes(range(100, 104)), b"\xc7"]
    assert [e.name for e in store.listdir()] == ["f"]
    store.delete("f")
    assert not store.exists("f")
    store.delete("f")  # deleting what is gone is not an error
