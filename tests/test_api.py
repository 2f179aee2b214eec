"""The public API's contract: existence and overwrite, not-found, inspect/verify, bad input, bad manifests."""

from __future__ import annotations

import os
import pathlib
import threading

import crc32c
import msgpack
import numpy as np
import pytest

import ckptcore
from ckptcore import TrainingState, _knobs
from ckptcore._manifest import FORMAT_VERSION, MANIFEST_NAME
from ckptcore.errors import (CheckpointError, CheckpointExistsError, CheckpointNotFoundError,
                             CorruptCheckpointError, IncompleteCheckpointError, SchemaError,
                             UnsafeCheckpointError)

from _support import assert_state_same, sample_state


def small_state(seed: int = 0) -> TrainingState:
    return TrainingState(model={"w": np.full((4, 4), seed, np.float32), "b": np.arange(seed, seed + 3)},
                         step=seed)


# ------------------------------------------------------------------------ exists / overwrite
def test_save_refuses_to_overwrite(backend):
    url, opts = backend.url("c"), backend.storage_options
    ckptcore.save_state(url, small_state(1), storage_options=opts)
    with pytest.raises(CheckpointExistsError) as e:
        ckptcore.save_state(url, small_state(2), storage_options=opts)
    assert isinstance(e.value, FileExistsError) and isinstance(e.value, CheckpointError)
    assert "overwrite=True" in str(e.value)
    assert_state_same(ckptcore.load_state(url, storage_options=opts), small_state(1))
    assert len([n for n in backend.listdir("c") if n.startswith("shard-")]) == 1  # nothing left behind


def test_overwrite_replaces_and_cleans_up(backend):
    url, opts = backend.url("c"), backend.storage_options
    first = ckptcore.save_state(url, small_state(1), storage_options=opts)
    second = ckptcore.save_state(url, small_state(2), storage_options=opts, overwrite=True)
    assert_state_same(ckptcore.load_state(url, storage_options=opts), small_state(2))
    assert ckptcore.inspect(url, storage_options=opts).writer["id"] == second.writer["id"] != first.writer["id"]
    assert sorted(backend.listdir("c")) == sorted([MANIFEST_NAME, *second.shards])
    if backend.name == "local":  # no temporary siblings left over
        assert backend.listdir() == ["c"]


def test_overwrite_true_on_an_empty_location_just_saves(backend):
    url = backend.url("fresh")
    ckptcore.save_state(url, small_state(3), storage_options=backend.storage_options, overwrite=True)
    assert_state_same(ckptcore.load_state(url, storage_options=backend.storage_options), small_state(3))


def test_two_writers_race_for_one_name(backend):
    """Two simultaneous saves to one new name: exactly one commits, the other gets CheckpointExistsError.

    Usually both are past the existence check before either commits, so this is the commit's own
    arbitration (rename onto a non-empty directory; the create-only PUT); either way one wins.
    """
    url, opts = backend.url("race"), backend.storage_options
    barrier, results = threading.Barrier(2), {}
    # Large enough that both writers are past the existence check before either commits.
    states = {i: TrainingState(model={"w": np.full(1 << 20, i, np.float32)}, step=i) for i in (1, 2)}

    def writer(i):
        barrier.wait()
        try:
            results[i] = ckptcore.save_state(url, states[i], storage_options=opts)
        except CheckpointExistsError as e:
            results[i] = e

    threads = [threading.Thread(target=writer, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, r in results.items() if isinstance(r, ckptcore.CheckpointInfo)]
    assert len(winners) == 1, results
    got = ckptcore.load_state(url, storage_options=opts)
    assert got.step == winners[0]
    assert sorted(backend.listdir("race")) == sorted([MANIFEST_NAME, *results[winners[0]].shards])


def _overwrite_under_a_reader(url: str, opts: dict, rounds: int) -> tuple[int, list]:
    ckptcore.save_state(url, sample_state(0), storage_options=opts)
    stop, seen, errors = threading.Event(), [0], []

    def reader():
        while not stop.is_set():
            try:
                state = ckptcore.load_state(url, storage_options=opts)
                assert_state_same(state, sample_state(state.step))  # old or new, never a mixture
                seen[0] += 1
            except Exception as e:  # noqa: BLE001 - collected and asserted on below
                errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(1, rounds + 1):
            ckptcore.save_state(url, sample_state(i), storage_options=opts, overwrite=True)
    finally:
        stop.set()
        t.join()
    return seen[0], errors


def test_local_overwrite_is_never_unreadable(local_backend):
    """A reader loading in a loop through 20 overwrites always gets one whole checkpoint."""
    seen, errors = _overwrite_under_a_reader(local_backend.url("hot"), {}, 20)
    assert not [e for e in errors if isinstance(e, FileNotFoundError)], errors
    assert errors == []
    assert seen > 0


def test_object_store_overwrite_is_never_unreadable(memory_backend):
    seen, errors = _overwrite_under_a_reader(memory_backend.url("hot"), {}, 20)
    assert errors == [] and seen > 0


# ------------------------------------------------------------------------------- not found
def test_missing_checkpoint(backend):
    url, opts = backend.url("nothing-here"), backend.storage_options
    for fn in (ckptcore.load_state, ckptcore.inspect, ckptcore.verify):
        with pytest.raises(CheckpointNotFoundError, match="does not exist") as e:
            fn(url, storage_options=opts)
        assert isinstance(e.value, FileNotFoundError)


def test_leftovers_without_manifest_are_not_a_checkpoint(backend):
    url, opts = backend.url("c"), backend.storage_options
    info = ckptcore.save_state(url, small_state(), storage_options=opts)
    backend.delete("c", MANIFEST_NAME)
    assert backend.listdir("c") == list(info.shards)
    for fn in (ckptcore.load_state, ckptcore.inspect, ckptcore.verify):
        with pytest.raises(CheckpointNotFoundError, match="no manifest"):
            fn(url, storage_options=opts)
    # ... and a save (with overwrite) over the leftovers gives a clean checkpoint.
    ckptcore.save_state(url, small_state(5), storage_options=opts, overwrite=True)
    assert_state_same(ckptcore.load_state(url, storage_options=opts), small_state(5))


def test_a_file_is_not_a_checkpoint(local_backend):
    path = pathlib.Path(local_backend.url("plain-file"))
    path.write_bytes(b"hello")
    with pytest.raises(CheckpointNotFoundError):
        ckptcore.load_state(path)


def test_path_like_and_file_urls(local_backend):
    path = pathlib.Path(local_backend.url("p"))
    ckptcore.save_state(path, small_state(4))
    assert_state_same(ckptcore.load_state(path), small_state(4))
    assert_state_same(ckptcore.load_state("file://" + str(path)), small_state(4))


# ---------------------------------------------------------------------------- inspect / verify
def test_inspect_reads_only_the_manifest(backend):
    url, opts = backend.url("c"), backend.storage_options
    state = sample_state(9)
    with _knobs.override(shard_size=1024):
        saved = ckptcore.save_state(url, state, storage_options=opts)
    assert len(saved.shards) > 2
    for shard in saved.shards:
        backend.delete("c", shard)
    info = ckptcore.inspect(url, storage_options=opts)
    assert info == saved
    assert (info.step, info.epoch, info.framework, info.format_version) == (9, 0, "numpy", FORMAT_VERSION)
    assert set(info.sections) >= {"model", "optimizer", "schedule", "rng", "data", "accumulation"}
    t = {x.name: x for x in info.tensors}["model/dense/kernel"]
    assert (t.dtype, t.shape, t.nbytes) == ("float32", (32, 64), 32 * 64 * 4)
    assert info.nbytes == sum(x.nbytes for x in info.tensors)
    assert info.data == state.data and info.metadata["note"] == "sample"
    assert info.library["ckptcore"] == ckptcore.__version__
    with pytest.raises(IncompleteCheckpointError, match="missing"):
        ckptcore.load_state(url, storage_options=opts)
    problems = ckptcore.verify(url, storage_options=opts)
    assert problems and all(isinstance(p, IncompleteCheckpointError) for p in problems)
    assert {s for s in saved.shards if any(s in str(p) for p in problems)} == set(saved.shards)


def test_verify_good_checkpoint_is_empty(backend):
    url = backend.url("c")
    with _knobs.override(shard_size=512):
        ckptcore.save_state(url, sample_state(), storage_options=backend.storage_options)
    assert ckptcore.verify(url, storage_options=backend.storage_options) == []


def test_load_without_verify_still_checks_sizes(local_backend):
    url = local_backend.url("c")
    info = ckptcore.save_state(url, small_state(2))
    shard = info.shards[0]
    data = local_backend.read("c", shard)
    local_backend.write(data[:-1], "c", shard)
    with pytest.raises(IncompleteCheckpointError, match="truncated"):
        ckptcore.load_state(url, verify=False)


# ---------------------------------------------------------------------- unstorable values
class Custom:
    pass


BAD_VALUES = [
    (lambda: TrainingState(model={"w": np.array([1, None], dtype=object)}), "model/w"),
    (lambda: TrainingState(model={"w": np.zeros(2, "i4,f4")}), "model/w"),
    (lambda: TrainingState(model={"w": np.zeros(2)}, extra={"big": 2**70}), "big"),
    (lambda: TrainingState(model={"w": np.zeros(2)}, extra={"neg": [-2**63 - 1]}), "neg"),
    (lambda: TrainingState(model={"w": np.zeros(2)}, extra={2**64: 1}), "extra"),
    (lambda: TrainingState(model={"w": np.zeros(2)}, rng={"s": {1, 2}}), "rng['s']"),
    (lambda: TrainingState(model={"w": np.zeros(2)}, data={"obj": [Custom()]}), "data['obj'][0]"),
    (lambda: TrainingState(model={"w": np.zeros(2)}, metadata={"k": {(1, 2): 3}}), "metadata['k']"),
    (lambda: TrainingState(model={"w": np.zeros(2)}, extra={"s": "bad\ud800"}), "extra['s']"),
    (lambda: TrainingState(model={"w": np.zeros(2)}, extra={"o": np.array([object()])}), "extra/o"),
    (lambda: TrainingState(model={1: np.zeros(2)}), "model"),
    (lambda: TrainingState(model={"w": [1.0, 2.0]}), "model['w']"),
    (lambda: {"model": {}}, "TrainingState"),
]


@pytest.mark.parametrize("make, where", BAD_VALUES, ids=[w for _, w in BAD_VALUES])
def test_unstorable_values_are_type_errors_naming_the_path(local_backend, make, where):
    url = local_backend.url("bad")
    with pytest.raises(TypeError) as e:
        ckptcore.save_state(url, make())
    assert where in str(e.value)
    assert not os.path.exists(url)
    assert local_backend.listdir() == []  # no temporary directory left behind


def test_save_needs_a_state_or_objects(memory_backend):
    with pytest.raises(TypeError):
        ckptcore.save_state(memory_backend.url("x"))


# ------------------------------------------------------------------------------ bad manifests
def _write_manifest(backend, name: str, outer: dict | None = None, body: dict | None = None,
                    raw: bytes | None = None) -> None:
    if raw is None:
        body_bytes = msgpack.packb(body, use_bin_type=True)
        for value in _strings(body):
            if value.startswith(DEEP):  # nesting deeper than msgpack.packb will produce
                body_bytes = body_bytes.replace(msgpack.packb(value),
                                                b"\x91" * int(value[len(DEEP):]) + b"\x90")
        envelope = {"format": "ckptcore", "version": 1, "body": body_bytes,
                    "body_crc32c": crc32c.crc32c(body_bytes)}
        envelope.update(outer or {})
        raw = msgpack.packb(envelope, use_bin_type=True)
    backend.write(raw, name, MANIFEST_NAME)


def _strings(tree):
    if isinstance(tree, str):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _strings(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _strings(v)


def _good(backend, name: str = "c") -> tuple[dict, bytes]:
    """Save a small real checkpoint of format version 1 (one map per tensor: these cases edit
    them; version 2's columnar table has its own cases in tests/hostile_manifests.py); return its
    manifest body (ext types kept raw) and raw bytes."""
    with _knobs.override(format_version=1):
        ckptcore.save_state(backend.url(name), small_state(1), storage_options=backend.storage_options)
    raw = backend.read(name, MANIFEST_NAME)
    outer = msgpack.unpackb(raw, raw=False)
    return msgpack.unpackb(outer["body"], raw=False, strict_map_key=False), raw


def _ext(code: int, payload) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(payload))


def _set(path: str, value):
    """A body mutation setting ``path`` ("tensors.0.dtype") to ``value`` (``...`` deletes it)."""
    def mutate(body):
        *parents, last = path.split(".")
        node = body
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        key = int(last) if isinstance(node, list) else last
        if value is ...:
            del node[key]
        else:
            node[key] = value(body) if callable(value) else value
    return mutate


LOAD_ONLY = "load-only"  # the manifest is well-formed; only building the TrainingState fails
DEEP = "@@DEEP@@"  # replaced by raw msgpack nesting too deep for msgpack.packb to produce

BAD_BODIES = [
    # shard paths that would leave the checkpoint directory
    ("shards.0.path", "../x", UnsafeCheckpointError),
    ("shards.0.path", "/etc/passwd", UnsafeCheckpointError),
    ("shards.0.path", "a/b", UnsafeCheckpointError),
    ("shards.0.path", "..", UnsafeCheckpointError),
    ("shards.0.path", ".", UnsafeCheckpointError),
    ("shards.0.path", "", UnsafeCheckpointError),
    ("shards.0.path", "a\\..\\b", UnsafeCheckpointError),
    ("shards.0.path", "x\x00y", UnsafeCheckpointError),
    ("shards.0.path", "s3://other-bucket/x", UnsafeCheckpointError),
    ("shards.0.path", "~root", UnsafeCheckpointError),
    ("shards.0.path", 5, SchemaError),
    # sizes far beyond anything real: rejected before any allocation
    ("tensors.0.shape", [2**40, 2**40], SchemaError),
    ("tensors.0.length", 2**60, SchemaError),
    ("tensors.0.offset", 2**63, SchemaError),
    ("tensors.0.shape", [-1, 4], SchemaError),
    ("tensors.0.shape", [True, 4], SchemaError),
    ("tensors.0.shape", "4x4", SchemaError),
    ("tensors.0.shard", 7, SchemaError),
    ("tensors.0.shard", -1, SchemaError),
    ("tensors.0.checksum", "abc", SchemaError),
    ("shards.0.checksum", -5, SchemaError),
    ("shards.0.size", -5, SchemaError),
    # dtype strings that are not dtypes
    ("tensors.0.dtype", "float99", SchemaError),
    ("tensors.0.dtype", "object", SchemaError),
    ("tensors.0.dtype", "O", SchemaError),
    ("tensors.0.dtype", "<f4", SchemaError),
    ("tensors.0.dtype", "i4,f4", SchemaError),
    ("tensors.0.dtype", "U-1", SchemaError),
    ("tensors.0.dtype", "U01", SchemaError),
    ("tensors.0.dtype", "datetime64[fortnight]", SchemaError),
    ("tensors.0.dtype", "__import__('os')", SchemaError),
    ("tensors.0.dtype", 7, SchemaError),
    ("tensors.0.dtype", "U999999999", SchemaError),  # a real dtype, but the length cannot match
    # missing or mistyped fields
    ("tensors", ..., SchemaError),
    ("shards", ..., SchemaError),
    ("tree", ..., SchemaError),
    ("created", ..., SchemaError),
    ("writer", "me", SchemaError),
    ("checksum", "md5", SchemaError),
    ("tensors.0.name", ..., SchemaError),
    ("tensors.0.name", 5, SchemaError),
    ("tensors", {"a": 1}, SchemaError),
    ("tensors.0", "not a map", SchemaError),
    ("alignment", -64, SchemaError),
    ("tensors.1.name", lambda b: b["tensors"][0]["name"], SchemaError),  # duplicate names
    # the state tree
    ("tree", [1, 2], SchemaError),
    ("tree.model.w", _ext(1, 99), SchemaError),       # reference past the tensor table
    ("tree.model.w", _ext(1, -1), SchemaError),
    ("tree.model.w", _ext(1, "zero"), SchemaError),
    ("tree.model.w", _ext(9, 0), SchemaError),        # unknown extension type
    ("tree.model.w", _ext(2, "not a list"), SchemaError),
    ("tree.model.w", msgpack.ExtType(2, b"\xc1"), SchemaError),  # invalid msgpack inside a tuple
    ("tree.extra", DEEP + "1000", SchemaError),
    ("tree.extra", DEEP + "100000", SchemaError),
    ("tree.model.w", 1.5, LOAD_ONLY),                  # model entries must be tensors
    ("tree.model", [1], LOAD_ONLY),
    ("tree.step", "many", LOAD_ONLY),
    ("tree.step", None, LOAD_ONLY),
    ("tree.epoch", [], LOAD_ONLY),
    ("tree.optimizer", {"step": 1}, LOAD_ONLY),        # no kind
    ("tree.schedule", 3, LOAD_ONLY),
    ("tree.metadata", "x", LOAD_ONLY),
    ("tree.framework", 5, LOAD_ONLY),
    ("tree.params", {"w": {"index": 0}}, LOAD_ONLY),
]


@pytest.mark.parametrize("path, value, error", BAD_BODIES,
                         ids=[f"{p}={'<derived>' if callable(v) else repr(v)}"[:60]
                              for p, v, _ in BAD_BODIES])
def test_bad_manifest_bodies(local_backend, path, value, error):
    body, _ = _good(local_backend)
    _set(path, value)(body)
    _write_manifest(local_backend, "c", body=body)
    url = local_backend.url("c")
    if error == LOAD_ONLY:
        with pytest.raises(SchemaError):
            ckptcore.load_state(url)
        for fn in (ckptcore.inspect, ckptcore.verify):  # may describe it, or refuse it politely
            try:
                fn(url)
            except SchemaError:
                pass
    else:
        _assert_typed(url, {}, error)


def _assert_typed(url: str, opts: dict, error: type, match: str | None = None) -> None:
    """load_state, inspect and verify all refuse the manifest with ``error`` (never a bare one)."""
    for fn in (ckptcore.load_state, ckptcore.inspect, ckptcore.verify):
        try:
            fn(url, storage_options=opts)
        except error as e:
            assert isinstance(e, CheckpointError)
            if match:
                assert match in str(e), str(e)
        except BaseException as e:  # noqa: BLE001
            pytest.fail(f"{fn.__name__} raised {type(e).__name__}: {e}, expected {error.__name__}")
        else:
            pytest.fail(f"{fn.__name__} accepted a bad manifest")


@pytest.mark.parametrize("version", [0, 5, 99, "1", "2", None, 1.5, 2.0, True, 2**64 - 1])
def test_unknown_format_version(backend, version):
    body, _ = _good(backend)
    _write_manifest(backend, "c", outer={"version": version}, body=body)
    _assert_typed(backend.url("c"), backend.storage_options, SchemaError, match=f"version {version!r}")


RAW_MANIFESTS = {
    "empty": b"",
    "garbage": bytes(range(256)) * 4,
    "text": b"hello, I am not msgpack",
    "msgpack-int": msgpack.packb(5),
    "msgpack-list": msgpack.packb([1, 2, 3]),
    "other-format": msgpack.packb({"format": "safetensors", "version": 1}),
    "no-body": msgpack.packb({"format": "ckptcore", "version": 1}),
    "body-not-bin": msgpack.packb({"format": "ckptcore", "version": 1, "body": "x", "body_crc32c": 0}),
    "crc-not-int": msgpack.packb({"format": "ckptcore", "version": 1, "body": b"\x80", "body_crc32c": "0"}),
    "body-not-map": msgpack.packb({"format": "ckptcore", "version": 1, "body": msgpack.packb([1]),
                                   "body_crc32c": crc32c.crc32c(msgpack.packb([1]))}, use_bin_type=True),
    "body-garbage": msgpack.packb({"format": "ckptcore", "version": 1, "body": b"\xc1\xc1",
                                   "body_crc32c": crc32c.crc32c(b"\xc1\xc1")}, use_bin_type=True),
    "huge-declared-bin": b"\x84\xa6format\xa8ckptcore\xa7version\x01\xa4body\xc6\xff\xff\xff\xf0",
    "huge-declared-map": b"\xdf\xff\xff\xff\xff",
    "deep-nesting": b"\x91" * 100_000,
}


@pytest.mark.parametrize("name", list(RAW_MANIFESTS))
def test_garbage_manifests(backend, name):
    _good(backend)
    backend.write(RAW_MANIFESTS[name], "c", MANIFEST_NAME)
    _assert_typed(backend.url("c"), backend.storage_options, SchemaError)


def test_manifest_checksum_mismatch(backend):
    body, _ = _good(backend)
    body_bytes = msgpack.packb(body, use_bin_type=True)
    raw = msgpack.packb({"format": "ckptcore", "version": 1, "body": body_bytes,
                         "body_crc32c": crc32c.crc32c(body_bytes) ^ 1}, use_bin_type=True)
    backend.write(raw, "c", MANIFEST_NAME)
    _assert_typed(backend.url("c"), backend.storage_options, CorruptCheckpointError, match="checksum")


@pytest.mark.slow
def test_truncated_manifest_every_offset(local_backend):
    _, raw = _good(local_backend)
    for n in range(len(raw)):
        local_backend.write(raw[:n], "c", MANIFEST_NAME)
        with pytest.raises((SchemaError, CorruptCheckpointError)):
            ckptcore.load_state(local_backend.url("c"))


def test_declared_sizes_beyond_the_file_are_rejected_before_allocation(backend):
    """A consistent manifest claiming an exabyte tensor: IncompleteCheckpointError, no allocation."""
    body, _ = _good(backend)
    t = body["tensors"][0]
    end = body["shards"][t["shard"]]["size"]  # after every other tensor: no overlap
    t.update(dtype="float64", shape=[2**57], length=2**60, offset=end)
    body["shards"][t["shard"]]["size"] = end + 2**60
    _write_manifest(backend, "c", body=body)
    with pytest.raises(IncompleteCheckpointError, match="truncated"):
        ckptcore.load_state(backend.url("c"), storage_options=backend.storage_options)
    with pytest.raises(IncompleteCheckpointError):
        ckptcore.load_state(backend.url("c"), verify=False, storage_options=backend.storage_options)
    assert ckptcore.inspect(backend.url("c"), storage_options=backend.storage_options).nbytes >= 2**60
    problems = ckptcore.verify(backend.url("c"), storage_options=backend.storage_options)
    assert problems and all(isinstance(p, IncompleteCheckpointError) for p in problems)


def test_optional_tree_keys_take_their_defaults(local_backend):
    """A v1 manifest from before optional keys existed (e.g. schedule.state) still loads."""
    with _knobs.override(format_version=1):
        ckptcore.save_state(local_backend.url("c"), sample_state(4))
    raw = local_backend.read("c", MANIFEST_NAME)
    body = msgpack.unpackb(msgpack.unpackb(raw, raw=False)["body"], raw=False, strict_map_key=False)
    tree = body["tree"]
    for section, key in [("schedule", "state"), ("schedule", "config"), ("schedule", "last_lr"),
                         ("optimizer", "hyperparams"), ("optimizer", "extra"), ("optimizer", "slots")]:
        del tree[section][key]
    for section in ("rng", "data", "metadata", "extra", "params", "framework", "epoch"):
        del tree[section]
    tree["unknown-future-section"] = {"x": 1}
    _write_manifest(local_backend, "c", body=body)
    got = ckptcore.load_state(local_backend.url("c"))
    assert got.schedule.state == {} and got.schedule.config == {} and got.schedule.last_lr is None
    assert got.optimizer.hyperparams == {} and got.optimizer.slots == {} and got.optimizer.extra == {}
    assert (got.rng, got.data, got.metadata, got.extra, got.params, got.framework, got.epoch) == \
           ({}, {}, {}, {}, {}, None, 0)
    assert_state_same(got, sample_state(4), sections=("model", "accumulation", "step"))


# ------------------------------------------------------------------------ unapplied data position
def _numpy_run(tmp_path, with_cursor: bool = True):
    """A NumPy-adapter run saved mid-epoch (the cursor at sample 8 of epoch 1), and fresh targets."""
    import ckptcore_numpy as cn

    def objects():
        return {"model": cn.Model({"w": np.arange(6, dtype=np.float32)}), "optimizer": cn.SGD(0.1)}

    cursor = ckptcore.DataCursor(12, 4, seed=3)
    for _ in range(5):
        cursor.next_batch()
    url = str(tmp_path / "ck")
    ckptcore.save_state(url, **objects(), **({"cursor": cursor} if with_cursor else {}))
    return url, objects, cursor


def _unapplied(caught) -> list:
    return [w for w in caught if issubclass(w.category, ckptcore.errors.UnappliedStateWarning)]


def test_restore_without_cursor_warns_once_naming_the_fix(tmp_path, caplog):
    import warnings
    url, objects, _ = _numpy_run(tmp_path)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("WARNING", "ckptcore"):
        warnings.simplefilter("always")
        ckptcore.load_state(url, **objects())
    hits = _unapplied(caught)
    assert len(hits) == 1, [str(w.message) for w in caught]
    assert "data (pass cursor=" in str(hits[0].message) and "keys=" in str(hits[0].message)
    assert hits[0].filename == __file__  # points at the caller's line
    assert [r for r in caplog.records if "data (pass cursor=" in r.getMessage()]


def test_manager_restore_without_cursor_warns_once(tmp_path):
    import warnings
    import ckptcore_numpy as cn
    cursor = ckptcore.DataCursor(12, 4, seed=3)
    cursor.next_batch()
    with ckptcore.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, model=cn.Model({"w": np.ones(3, np.float32)}), cursor=cursor)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mgr.restore(model=cn.Model({"w": np.zeros(3, np.float32)}))
        assert len(_unapplied(caught)) == 1 and _unapplied(caught)[0].filename == __file__
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # with the cursor: silent
            fresh = ckptcore.DataCursor(12, 4, seed=3)
            mgr.restore(model=cn.Model({"w": np.zeros(3, np.float32)}), cursor=fresh)
        assert fresh.state_dict() == cursor.state_dict()


@pytest.mark.parametrize("case", ["cursor given", "keys without data", "no position saved",
                                  "no framework objects"])
def test_no_warning_when_nothing_is_left_unapplied(tmp_path, case):
    import warnings
    url, objects, cursor = _numpy_run(tmp_path, with_cursor=case != "no position saved")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if case == "cursor given":
            fresh = ckptcore.DataCursor(12, 4, seed=3)
            ckptcore.load_state(url, **objects(), cursor=fresh)
            assert fresh.state_dict() == cursor.state_dict()
        elif case == "keys without data":
            ckptcore.load_state(url, keys=["model", "optimizer"], **objects())
        elif case == "no position saved":
            ckptcore.load_state(url, **objects())
        else:
            assert ckptcore.load_state(url).data == cursor.state_dict()  # a state, no restore


# ------------------------------------------------------------------------ format versions
def _rewrite_body(backend, name: str, edit, version: int) -> None:
    raw = backend.read(name, MANIFEST_NAME)
    body = msgpack.unpackb(msgpack.unpackb(raw, raw=False)["body"], raw=False, strict_map_key=False)
    edit(body)
    body_bytes = msgpack.packb(body, use_bin_type=True)
    backend.write(msgpack.packb({"format": "ckptcore", "version": version, "body": body_bytes,
                                 "body_crc32c": crc32c.crc32c(body_bytes)}, use_bin_type=True),
                  name, MANIFEST_NAME)


def test_writers_write_v2_and_v1_on_request(local_backend):
    """(and version 3, whose table is chunked, for a state of plain arrays too)"""
    state = sample_state(3)
    for version in (1, 2, 3):
        with _knobs.override(format_version=version):
            info = ckptcore.save_state(local_backend.url(f"v{version}"), state)
        assert info.format_version == version
        outer = msgpack.unpackb(local_backend.read(f"v{version}", MANIFEST_NAME), raw=False)
        assert outer["version"] == version
        assert_state_same(ckptcore.load_state(local_backend.url(f"v{version}")), state)
    one, two, three = (ckptcore.inspect(local_backend.url(f"v{v}")) for v in (1, 2, 3))
    assert [(t.name, t.dtype, t.shape, t.nbytes, t.checksum) for t in one.tensors] == \
           [(t.name, t.dtype, t.shape, t.nbytes, t.checksum) for t in two.tensors] == \
           [(t.name, t.dtype, t.shape, t.nbytes, t.checksum) for t in three.tensors]
    with _knobs.override(format_version=4), pytest.raises(ValueError, match="format_version"):
        ckptcore.save_state(local_backend.url("v4"), state)


def test_v2_readers_ignore_unknown_table_columns_and_body_keys(local_backend):
    """A later writer may add optional columns (per-tensor global shapes of sharded tensors, say)
    and body keys; this reader ignores them (docs/FORMAT.md, section 5)."""
    state = sample_state(5)
    ckptcore.save_state(local_backend.url("c"), state)
    n = len(ckptcore.inspect(local_backend.url("c")).tensors)

    def edit(body):
        body["tensors"]["global_shape"] = bytes(8 * n)
        body["tensors"]["future"] = {"anything": [1, 2]}
        body["future-key"] = "x"

    _rewrite_body(local_backend, "c", edit, version=2)
    assert_state_same(ckptcore.load_state(local_backend.url("c")), state)
    assert ckptcore.verify(local_backend.url("c")) == []


def test_checkpoint_info_tensors_behave_as_a_tuple(local_backend):
    info = ckptcore.save_state(local_backend.url("c"), sample_state(2))
    again = ckptcore.inspect(local_backend.url("c"))
    items = tuple(info.tensors)
    assert len(info.tensors) == len(items) > 2 and all(isinstance(t, ckptcore.TensorInfo) for t in items)
    assert info.tensors == items and items == tuple(again.tensors) and info.tensors == again.tensors
    assert info.tensors[0] == items[0] and info.tensors[-1] == items[-1] and info.tensors[1:3] == items[1:3]
    assert list(info.tensors) == list(items) and info.tensors[0] in info.tensors
    assert info.nbytes == sum(t.nbytes for t in items)
    with pytest.raises(IndexError):
        info.tensors[len(items)]


def test_every_error_and_warning_class_is_exported_at_the_top_level():
    # ``except ckptcore.StorageError`` is what a user writes: every class of the hierarchy is
    # reachable there, and listed in __all__.
    import inspect as pyinspect

    from ckptcore import errors

    classes = [n for n, c in vars(errors).items()
               if pyinspect.isclass(c) and issubclass(c, (Exception, Warning))
               and c.__module__ == errors.__name__]
    assert "StorageError" in classes and len(classes) >= 15
    for name in classes:
        assert getattr(ckptcore, name, None) is getattr(errors, name), name
        assert name in ckptcore.__all__, name


@pytest.mark.parametrize("value", [8192, 48, 0, -64])
def test_an_alignment_knob_the_writers_cannot_pad_to_is_refused_before_anything_is_saved(
        tmp_path, monkeypatch, value):
    # The writers pad from a page of zeros: an alignment above 4096 (or not a power of two) would
    # put tensors at offsets other than the manifest's.
    monkeypatch.setenv("CKPTCORE_ALIGNMENT", str(value))
    with pytest.raises(ValueError, match="CKPTCORE_ALIGNMENT.*power of two"):
        ckptcore.save_state(tmp_path / "c", ckptcore.TrainingState(model={"w": np.arange(3.0)}))
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").rglob("manifest*"))
    monkeypatch.setenv("CKPTCORE_ALIGNMENT", "4096")
    ckptcore.save_state(tmp_path / "d", ckptcore.TrainingState(model={"w": np.arange(3.0),
                                                                     "v": np.ones(5)}))
    assert ckptcore.load_state(tmp_path / "d").model["v"].tolist() == [1.0] * 5
