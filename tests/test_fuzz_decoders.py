"""Property-based fuzzing of the manifest and state-tree decoders.

Inputs are a real manifest body with bytes flipped, inserted or cut, or with any field replaced by
an arbitrary msgpack value (extensions of every code with arbitrary payloads, deep nesting,
non-finite and huge numbers), re-wrapped with a valid CRC-32C so the envelope check passes.  The
property: decoding either succeeds, and then loading the checkpoint succeeds or fails typed, or it
raises a ``CheckpointError``; never anything else, never a crash.

CI runs a bounded number of examples; ``CKPTCORE_FUZZ_EXAMPLES=100000 pytest
tests/test_fuzz_decoders.py`` runs longer.
"""

from __future__ import annotations

import os

import crc32c
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptcore
from ckptcore import _codec
from ckptcore._manifest import MANIFEST_NAME, Manifest
from ckptcore.errors import CheckpointError

import hostile_manifests as corpus

EXAMPLES = int(os.environ.get("CKPTCORE_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 300,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A real checkpoint in memory:// (files and manifest body) to mutate."""
    path = tmp_path_factory.mktemp("fuzz") / "ckpt"
    corpus.write_good(path)
    files = {p.name: p.read_bytes() for p in path.iterdir()}
    outer = msgpack.unpackb(files[MANIFEST_NAME], raw=False)
    return files, outer["body"]


def _envelope(body: bytes) -> bytes:
    return msgpack.packb({"format": "ckptcore", "version": 1, "body": body,
                          "body_crc32c": crc32c.crc32c(body)}, use_bin_type=True)


def _check(files: dict, manifest_bytes: bytes) -> None:
    try:
        Manifest.from_bytes(manifest_bytes)
    except CheckpointError:
        return
    # It decoded: the whole checkpoint must then load, or fail typed.
    url = f"memory://fuzz-{os.getpid()}/ckpt"
    fs = ckptcore._storage.Store(url).fs
    for name, data in files.items():
        fs.pipe_file(f"/fuzz-{os.getpid()}/ckpt/{name}", data)
    fs.pipe_file(f"/fuzz-{os.getpid()}/ckpt/{MANIFEST_NAME}", manifest_bytes)
    try:
        ckptcore.load_state(url)
    except CheckpointError:
        pass


# Arbitrary msgpack values, extensions included (any code, any payload, nested payloads).
_atoms = (st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1)
          | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
          | st.binary(max_size=20))


def _ext(children):
    return st.builds(lambda code, v: msgpack.ExtType(code, msgpack.packb(v, use_bin_type=True)),
                     st.integers(0, 5), children)


values = st.recursive(
    _atoms | st.builds(lambda c, d: msgpack.ExtType(c, d), st.integers(0, 127), st.binary(max_size=12)),
    lambda children: (st.lists(children, max_size=4)
                      | st.dictionaries(st.text(max_size=8) | st.integers(-(2 ** 63), 2 ** 64 - 1), children,
                                        max_size=4)
                      | _ext(children)),
    max_leaves=30)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


@FUZZ
@given(data=st.data())
@pytest.mark.slow
def test_bytes_mutated_body(good, data):
    files, body = good
    b = bytearray(body)
    for _ in range(data.draw(st.integers(1, 8))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete"]))
        pos = data.draw(st.integers(0, len(b) - 1))
        if op == "flip":
            b[pos] = data.draw(st.integers(0, 255))
        elif op == "insert":
            b[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            del b[pos:pos + data.draw(st.integers(1, 8))]
    _check(files, _envelope(bytes(b)))


@FUZZ
@given(data=st.data())
@pytest.mark.slow
def test_field_replaced_by_any_value(good, data):
    files, body = good
    tree = msgpack.unpackb(body, raw=False, strict_map_key=False)
    paths = [p for p in _paths(tree) if p]
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        node = tree
        try:
            for p in path[:-1]:
                node = node[p]
            node[path[-1]] = data.draw(values)
        except (KeyError, IndexError, TypeError):
            pass  # an earlier replacement removed this path
    _check(files, _envelope(msgpack.packb(tree, use_bin_type=True)))


@FUZZ
@given(value=values)
@pytest.mark.slow
def test_tree_decoder_is_total(value):
    """``unpack`` + ``decode_state`` on any msgpack value: a state or a ``CheckpointError``."""
    try:
        tree = _codec.unpack(msgpack.packb({"model": {}, "extra": value}, use_bin_type=True))
        _codec.decode_state(_codec.substitute(tree, lambda r: np.zeros(1)))
    except CheckpointError:
        pass


def _plain(value):
    return bytes(value) if isinstance(value, memoryview) else value


_flat_maps = st.dictionaries(st.text(max_size=12) | st.integers(-5, 5),
                             _atoms | st.binary(max_size=300), max_size=6)


@FUZZ
@given(env=_flat_maps | values)
@pytest.mark.slow
def test_envelope_reader_agrees_with_msgpack(env):
    """The envelope's copy-free reader (``_codec.unpack_plain``) returns what msgpack returns, for
    any value: it reads flat maps itself and leaves everything else to msgpack."""
    data = msgpack.packb(env, use_bin_type=True)
    expected = msgpack.unpackb(data, raw=False, strict_map_key=False)
    got = _codec.unpack_plain(data, "m")
    if isinstance(got, dict):
        got = {k: _plain(v) for k, v in got.items()}
    # compared packed: NaN != NaN, and 1 == True, but their packings tell them apart
    assert msgpack.packb(got, use_bin_type=True) == msgpack.packb(expected, use_bin_type=True)


@FUZZ
@given(data=st.data())
@pytest.mark.slow
def test_bytes_mutated_envelope(good, data):
    files, body = good
    b = bytearray(_envelope(body))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, 40))  # the header fields before the body's bytes
        if data.draw(st.booleans()):
            b[pos] = data.draw(st.integers(0, 255))
        else:
            del b[pos:pos + data.draw(st.integers(1, 4))]
    _check(files, bytes(b))


# ------------------------------------------------------------------------------- format 3
@pytest.fixture(scope="module")
def good_v3(tmp_path_factory):
    """A real format-3 checkpoint ("emb" stored as two chunks) to mutate."""
    path = tmp_path_factory.mktemp("fuzz3") / "ckpt"
    corpus.write_good_v3(path)
    files = {p.name: p.read_bytes() for p in path.iterdir()}
    outer = msgpack.unpackb(files[MANIFEST_NAME], raw=False)
    return files, outer["body"]


def _envelope_v3(body: bytes) -> bytes:
    return msgpack.packb({"format": "ckptcore", "version": 3, "body": body,
                          "body_crc32c": crc32c.crc32c(body)}, use_bin_type=True)


def _check_v3(files: dict, manifest_bytes: bytes) -> None:
    """:func:`_check`, then a load through a template asking for a block of "emb" and a verify:
    every outcome a result or a ``CheckpointError``."""
    _check(files, manifest_bytes)
    url = f"memory://fuzz-{os.getpid()}/ckpt"
    like = corpus.good_state()
    like.model["emb"] = ckptcore.Shard(np.zeros((15, 8), np.int16), (40, 8), (5, 0))
    for call in (lambda: ckptcore.load_state(url, like=like), lambda: ckptcore.verify(url)):
        try:
            call()
        except CheckpointError:
            pass


@FUZZ
@given(data=st.data())
@pytest.mark.slow
def test_v3_bytes_mutated_body(good_v3, data):
    files, body = good_v3
    b = bytearray(body)
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, len(b) - 1))
        b[pos] = data.draw(st.integers(0, 255))
    _check_v3(files, _envelope_v3(bytes(b)))


_V3_WIDTH = {"tensor": "<u4", "gshape": "<u8", "start": "<u8", "shape": "<u8", "ndim": "u1",
             "length": "<u8", "offset": "<u8", "dtype": "<u4", "block_crc": "<u4"}
_INTERESTING = st.sampled_from([0, 1, 2, 3, 5, 8, 10, 19, 20, 21, 39, 40, 41, 2 ** 31, 2 ** 32 - 1,
                                2 ** 62, 2 ** 63, 2 ** 64 - 1]) | st.integers(0, 2 ** 64 - 1)


@FUZZ
@given(data=st.data())
@pytest.mark.slow
def test_v3_columns_mutated(good_v3, data):
    """Values changed inside the columns (lengths kept, so the form checks pass and the chunk
    rules, the planner and the reader see the values)."""
    files, body = good_v3
    b = msgpack.unpackb(body, raw=False, strict_map_key=False)
    t = b["tensors"]
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(sorted(_V3_WIDTH)))
        width = np.dtype(_V3_WIDTH[key]).itemsize
        arr = np.frombuffer(t[key][:len(t[key]) // width * width], _V3_WIDTH[key]).copy()
        if not len(arr):
            t[key] = data.draw(st.binary(max_size=8))
            continue
        i = data.draw(st.integers(0, len(arr) - 1))
        arr[i] = data.draw(_INTERESTING) % (1 << (8 * arr.itemsize))
        t[key] = arr.tobytes()
    if data.draw(st.booleans()):
        t["crc_block"] = data.draw(st.sampled_from([4096, 1 << 20, 2 ** 64 - 1, 0, -1]))
    _check_v3(files, _envelope_v3(msgpack.packb(b, use_bin_type=True)))
