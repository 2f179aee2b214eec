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


# ---------------------------------------------------------------- ranged reads for like= loads
RANKS, ROWS, TENSORS = 4, 2, 40


def _globals() -> dict:
    rng = np.random.default_rng(1)
    return {f"l{i}/w": rng.standard_normal((RANKS * ROWS, 3)).astype(np.float32)
            for i in range(TENSORS)}


def _blocks(ranks: int, r: int, template: bool = False) -> TrainingState:
    """Rank r of ``ranks``: its block (rows along the first dimension) of every tensor."""
    rows = RANKS * ROWS // ranks
    model = {}
    for k, v in _globals().items():
        block = v[r * rows:(r + 1) * rows]
        model[k] = Shard(np.zeros_like(block) if template else np.ascontiguousarray(block),
                         v.shape, (r * rows, 0))
    return TrainingState(model=model)


@pytest.fixture
def grouped(tmp_path, monkeypatch):
    """A format-4 checkpoint saved by 4 ranks (ThreadGroup), one row group per rank."""
    from ckptcore import ThreadGroup, _manifest4
    from _support import run_ranks

    monkeypatch.setattr(_manifest4, "GROUP_MIN", 8)
    url = tmp_path / "c"
    with _knobs.override(manifest_split_rows=10):
        out = run_ranks(ThreadGroup.create(RANKS), lambda g: ckptcore.save_state(
            url, _blocks(RANKS, g.rank), group=g))
    assert all(not isinstance(v, BaseException) for v in out.values()), out
    body = msgpack.unpackb(_outer(url)["body"], raw=False, strict_map_key=False)
    index = {k: np.frombuffer(v, _manifest4.INDEX[k]) for k, v in body["tensors"]["index"].items()}
    assert len(index["rows"]) == RANKS and index["rows"].tolist() == [TENSORS] * RANKS
    return url, index, next(url.glob("shard-rows-*.bin"))


def _rchar() -> int:
    """Bytes this process has read through read(2) and friends (Linux)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _same_blocks(got: TrainingState, ranks: int, r: int) -> None:
    want = _blocks(ranks, r)
    for k, leaf in want.model.items():
        assert got.model[k].offsets == leaf.offsets
        assert got.model[k].data.tobytes() == leaf.data.tobytes(), k


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/io"), reason="Linux /proc")
def test_a_like_load_reads_only_its_row_groups(grouped):
    url, index, rows = grouped
    manifest, size = (url / MANIFEST_NAME).stat().st_size, rows.stat().st_size
    shard = max(p.stat().st_size for p in url.glob("shard-*") if p != rows)
    ckptcore.load_state(url, like=_blocks(RANKS, 0, template=True))  # (imports: not counted)
    for r in range(RANKS):
        before = _rchar()
        got = ckptcore.load_state(url, like=_blocks(RANKS, r, template=True))
        read = _rchar() - before
        _same_blocks(got, RANKS, r)
        # the manifest, this rank's group and at most its shard: not the other groups
        assert read <= manifest + int(index["length"][r]) + shard + 1024, (read, size)
        assert read < manifest + size, (read, size)
    before = _rchar()
    ckptcore.load_state(url)  # a whole load reads the whole rows object
    assert _rchar() - before >= manifest + size


def test_a_like_load_into_another_world_size(grouped):
    from ckptcore import ThreadGroup
    from _support import run_ranks

    url, _, _ = grouped
    out = run_ranks(ThreadGroup.create(2), lambda g: ckptcore.load_state(
        url, like=_blocks(2, g.rank, template=True), group=g))
    for r in range(2):
        _same_blocks(out[r], 2, r)


def test_damage_in_a_group_read_raises_elsewhere_only_verify_sees_it(grouped):
    url, index, rows = grouped
    data = bytearray(rows.read_bytes())
    at = int(index["offset"][2]) + 5  # inside rank 2's group
    data[at] ^= 0x40
    rows.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="rows group 2"):
        ckptcore.load_state(url, like=_blocks(RANKS, 2, template=True))
    _same_blocks(ckptcore.load_state(url, like=_blocks(RANKS, 0, template=True)), RANKS, 0)
    # verify reads every group (the rows object is the manifest's: its damage is raised, as a
    # damaged manifest's is, not returned)
    with pytest.raises(CorruptCheckpointError, match="rows object"):
        ckptcore.verify(url)


def test_rows_read_that_miss_a_block_fall_back_to_all(grouped, caplog):
    url, _, _ = grouped
    like = _blocks(RANKS, 1, template=True)
    del like.model["l0/w"]  # not in the template: loaded whole, from every rank's group
    with caplog.at_level("DEBUG", logger="ckptcore"):
        got = ckptcore.load_state(url, like=like)
    assert got.model["l0/w"].tobytes() == _globals()["l0/w"].tobytes()
    assert got.model["l1/w"].data.tobytes() == _blocks(RANKS, 1).model["l1/w"].data.tobytes()
    assert "reading every row group" in caplog.text


def test_a_manager_restore_like_reads_only_its_groups(tmp_path, monkeypatch):
    from ckptcore import ThreadGroup, _manifest4
    from _support import run_ranks

    monkeypatch.setattr(_manifest4, "GROUP_MIN", 8)
    root = str(tmp_path / "run")

    def save(g):
        with ckptcore.CheckpointManager(root, group=g) as mgr:
            mgr.save(3, _blocks(RANKS, g.rank))

    with _knobs.override(manifest_split_rows=10):
        out = run_ranks(ThreadGroup.create(RANKS), save)
    assert not any(isinstance(v, BaseException) for v in out.values()), out
    with ckptcore.CheckpointManager(root) as mgr:
        folder = tmp_path / "run" / mgr.step_url(3).rsplit("/", 1)[-1]
    rows = next(folder.glob("shard-rows-*.bin"))
    body = msgpack.unpackb(_outer(folder)["body"], raw=False, strict_map_key=False)
    offset = np.frombuffer(body["tensors"]["index"]["offset"], "<u8")
    data = bytearray(rows.read_bytes())
    data[int(offset[3]) + 5] ^= 0x40  # rank 3's group: ranks 0-2 never read it
    rows.write_bytes(bytes(data))
    for r in range(RANKS - 1):
        with ckptcore.CheckpointManager(root) as mgr:
            got = mgr.restore(like=_blocks(RANKS, r, template=True))
        _same_blocks(got, RANKS, r)
