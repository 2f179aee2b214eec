"""import_paddle_dcp on damaged and hostile paddle.distributed checkpoints.

The folders are written with Paddle's own metadata dataclasses and pickle (as
``paddle.distributed.save_state_dict`` writes them), then changed the way an attacker or a
broken copy would; every case ends in a typed ckptcore error naming the file, never in code
run or a crash.  A real two-process save is imported in test_sharded.py.
"""

from __future__ import annotations

import os
import pickle
import random

import numpy as np
import pytest

import ckptcore

pytest.importorskip("paddle")

from paddle.distributed.flex_checkpoint.dcp.metadata import (  # noqa: E402
    LocalTensorIndex, LocalTensorMetadata, Metadata)

import ckptcore_paddle  # noqa: E402

W = np.arange(30, dtype=np.float32).reshape(10, 3)
B = np.ones(3, np.float32)


def _write(folder, *, chunks=None, storage=None, files=None, mapping=None) -> None:
    """A two-rank save of ``{"model": {"w": W cut in two, "b": B}}``, parts replaceable."""
    folder.mkdir(parents=True, exist_ok=True)
    chunks = chunks if chunks is not None else {
        "model.w": [LocalTensorMetadata((0, 0), (5, 3), "float32", (10, 3)),
                    LocalTensorMetadata((5, 0), (5, 3), "float32", (10, 3))],
        "model.b": [LocalTensorMetadata((0,), (3,), "float32", (3,))]}
    storage = storage if storage is not None else {
        LocalTensorIndex("model.w", (0, 0), local_shape=(5, 3)): "0_0.distcp",
        LocalTensorIndex("model.w", (5, 0), local_shape=(5, 3)): "1_0.distcp",
        LocalTensorIndex("model.b", (0,), local_shape=(3,)): "1_0.distcp"}
    mapping = mapping if mapping is not None else {"model.w": ("model", "w"), "model.b": ("model", "b")}
    with open(folder / "0.metadata", "wb") as f:
        pickle.dump(Metadata(chunks, storage, mapping), f)
    files = files if files is not None else {
        "0_0.distcp": {"model.w": W[:5]}, "1_0.distcp": {"model.w": W[5:], "model.b": B}}
    for name, content in files.items():
        with open(folder / name, "wb") as f:
            pickle.dump(content, f, protocol=4)


def test_a_well_formed_folder_imports_whole(tmp_path):
    _write(tmp_path / "ck")
    state = ckptcore_paddle.import_paddle_dcp(tmp_path / "ck")
    assert state.model["w"].tobytes() == W.tobytes() and state.model["b"].tobytes() == B.tobytes()


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_code_in_the_metadata_is_refused(tmp_path):
    _write(tmp_path / "ck", mapping={"model.w": ("model", "w"), "model.b": ("model", "b"),
                                     "x": _Evil()})
    with pytest.raises(ckptcore.UnsafeCheckpointError, match="posix.system|os.system"):
        ckptcore_paddle.import_paddle_dcp(tmp_path / "ck")


def test_code_in_a_data_file_is_refused(tmp_path):
    _write(tmp_path / "ck", files={"0_0.distcp": {"model.w": _Evil()},
                                   "1_0.distcp": {"model.w": W[5:], "model.b": B}})
    with pytest.raises(ckptcore.UnsafeCheckpointError, match="0_0.distcp"):
        ckptcore_paddle.import_paddle_dcp(tmp_path / "ck")


def test_a_file_name_that_leaves_the_folder_is_refused(tmp_path):
    (tmp_path / "outside.distcp").write_bytes(pickle.dumps({"model.b": B}))
    _write(tmp_path / "ck", storage={
        LocalTensorIndex("model.w", (0, 0)): "0_0.distcp",
        LocalTensorIndex("model.w", (5, 0)): "1_0.distcp",
        LocalTensorIndex("model.b", (0,)): "../outside.distcp"})
    with pytest.raises(ckptcore.SchemaError, match="outside.distcp"):
        ckptcore_paddle.import_paddle_dcp(tmp_path / "ck")


def test_a_missing_rank_file_and_a_hole_are_incomplete(tmp_path):
    _write(tmp_path / "a")
    (tmp_path / "a" / "1_0.distcp").unlink()
    with pytest.raises(ckptcore.IncompleteCheckpointError, match="1_0.distcp"):
        ckptcore_paddle.import_paddle_dcp(tmp_path / "a")
    _write(tmp_path / "b", chunks={
        "model.w": [LocalTensorMetadata((0, 0), (5, 3), "float32", (10, 3))],
        "model.b": [LocalTensorMetadata((0,), (3,), "float32", (3,))]})
    with pytest.raises(ckptcore.IncompleteCheckpointError, match="15 of its 30"):
        ckptcore_paddle.import_paddle_dcp(tmp_path / "b")


def test_data_that_disagrees_with_the_metadata_names_the_file(tmp_path):
    _write(tmp_path / "ck", files={"0_0.distcp": {"model.w": W[:4]},
                                   "1_0.distcp": {"model.w": W[5:], "model.b": B}})
    with pytest.raises(ckptcore.SchemaError, match="0_0.distcp.*model.w"):
        ckptcore_paddle.import_paddle_dcp(tmp_path / "ck")
    _write(tmp_path / "out", chunks={
        "model.w": [LocalTensorMetadata((0, 0), (5, 3), "float32", (10, 3)),
                    LocalTensorMetadata((8, 0), (5, 3), "float32", (10, 3))],
        "model.b": [LocalTensorMetadata((0,), (3,), "float32", (3,))]})
    with pytest.raises(ckptcore.SchemaError, match="outside"):
        ckptcore_paddle.import_paddle_dcp(tmp_path / "out")


def test_flattened_chunks_are_unsupported_not_misread(tmp_path):
    _write(tmp_path / "ck", chunks={
        "model.w": [LocalTensorMetadata((0, 0), (5, 3), "float32", (10, 3), True, (0, 15))],
        "model.b": [LocalTensorMetadata((0,), (3,), "float32", (3,))]})
    with pytest.raises(ckptcore.errors.UnsupportedCheckpointError, match="flattened"):
        ckptcore_paddle.import_paddle_dcp(tmp_path / "ck")


def test_no_checkpoint_and_the_newest_of_several_saves(tmp_path):
    with pytest.raises(ckptcore.CheckpointNotFoundError):
        ckptcore_paddle.import_paddle_dcp(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ckptcore.CheckpointNotFoundError, match="metadata"):
        ckptcore_paddle.import_paddle_dcp(tmp_path / "empty")
    _write(tmp_path / "ck")
    for name in ("0.metadata", "0_0.distcp", "1_0.distcp"):  # a second save, id 1, other values
        data = (tmp_path / "ck" / name).read_bytes().replace(b"0_0.distcp", b"0_1.distcp") \
            .replace(b"1_0.distcp", b"1_1.distcp")
        (tmp_path / "ck" / name.replace("0.", "1.").replace("_0.", "_1.")).write_bytes(data)
    np.testing.assert_array_equal(ckptcore_paddle.import_paddle_dcp(tmp_path / "ck").model["w"], W)
    assert "1.metadata" in ckptcore_paddle.import_paddle_dcp(tmp_path / "ck").metadata["files"][0]
    assert "0.metadata" in ckptcore_paddle.import_paddle_dcp(
        tmp_path / "ck", unique_id=0).metadata["files"][0]


def test_flipped_bytes_in_the_metadata_never_crash(tmp_path):
    _write(tmp_path / "ck")
    good = (tmp_path / "ck" / "0.metadata").read_bytes()
    rng = random.Random(7)
    outcomes = set()
    for _ in range(300):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        (tmp_path / "ck" / "0.metadata").write_bytes(bytes(data))
        try:
            ckptcore_paddle.import_paddle_dcp(tmp_path / "ck")
            outcomes.add("ok")
        except ckptcore.CheckpointError as e:
            outcomes.add(type(e).__name__)
    assert outcomes - {"ok"}, outcomes  # damage was seen, and only as ckptcore's own errors
