"""Format 4: a large chunked table's rows in a separate rows object (``_manifest4``), written
only from ``manifest_split_rows`` rows; read whole, or by range for a load of some blocks."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

import ckptcore
from ckptcore import Chunks, Shard, TrainingState, _knobs
from ckptcore._manifest import MANIFEST_NAME, Manifest
from ckptcore.api import read_manifest
from ckptcore.errors import (CorruptCheckpointError, IncompleteCheckpointError,
                             UnsupportedCheckpointError)

from _support import assert_state_same


def _outer(path) -> dict:
    return msgpack.unpackb((path / MANIFEST_NAME).read_bytes(), raw=False)


def _state(ranks: int = 8, tensors: int = 5, rows: int = 4) -> tuple[TrainingState, dict]:
    """Each tensor cut along its first dimension into ``ranks`` blocks of ``rows`` rows."""
    rng = np.random.default_rng(0)
    whole = {f"layer{i}/w": rng.standard_normal((ranks * rows, 3)).astype(np.float32)
             for i in range(tensors)}
    model = {k: Chunks([Shard(v[r * rows:(r + 1) * rows], v.shape, (r * rows, 0))
                        for r in range(ranks)]) for k, v in whole.items()}
    return TrainingState(model=model, step=7), whole


def test_small_tables_stay_version_3(tmp_path):
    state, _ = _state()
    info = ckptcore.save_state(tmp_path / "c", state)
    assert info.format_version == 3 and _outer(tmp_path / "c")["version"] == 3
    assert not list(tmp_path.joinpath("c").glob("shard-rows-*"))


def test_large_tables_are_version_4_and_load_whole(tmp_path):
    state, whole = _state()
    with _knobs.override(manifest_split_rows=10):
        info = ckptcore.save_state(tmp_path / "c", state)
    assert info.format_version == 4 and _outer(tmp_path / "c")["version"] == 4
    rows = list(tmp_path.joinpath("c").glob("shard-rows-*.bin"))
    assert len(rows) == 1
    body = msgpack.unpackb(_outer(tmp_path / "c")["body"], raw=False, strict_map_key=False)
    assert body["tensors"]["names"] == [f"model/{k}" for k in whole]  # one per logical tensor
    got = ckptcore.load_state(tmp_path / "c")
    assert_state_same(got, TrainingState(model=whole, step=7))
    assert ckptcore.verify(tmp_path / "c") == []
    m = read_manifest(ckptcore._storage.Store(str(tmp_path / "c")))
    assert m.version == 4 and len(m.tensors) == 40 and m.rows.path == rows[0].name


def test_an_older_reader_refuses_version_4(tmp_path, monkeypatch):
    state, _ = _state()
    with _knobs.override(manifest_split_rows=10):
        ckptcore.save_state(tmp_path / "c", state)
    from ckptcore import _manifest
    monkeypatch.setattr(_manifest, "READ_VERSIONS", (1, 2, 3))
    with pytest.raises(UnsupportedCheckpointError, match="unsupported format version 4"):
        Manifest.from_bytes((tmp_path / "c" / MANIFEST_NAME).read_bytes())


def test_rows_object_missing_damaged_or_cut(tmp_path):
    state, _ = _state()
    with _knobs.override(manifest_split_rows=10):
        ckptcore.save_state(tmp_path / "c", state)
    rows = next(tmp_path.joinpath("c").glob("shard-rows-*.bin"))
    data = rows.read_bytes()
    rows.write_bytes(data[:-3])
    with pytest.raises(IncompleteCheckpointError):
        ckptcore.load_state(tmp_path / "c")
    rows.write_bytes(data[:10] + bytes([data[10] ^ 1]) + data[11:])
    with pytest.raises(CorruptCheckpointError):
        ckptcore.load_state(tmp_path / "c")
    rows.unlink()
    with pytest.raises(IncompleteCheckpointError):
        ckptcore.load_state(tmp_path / "c")
