"""Hostile torch.save files: no code runs, only typed ckptcore errors, a seeded fuzz of byte flips."""

from __future__ import annotations

import io
import os
import pickle
import random
import zipfile

import numpy as np
import pytest

import ckptcore
import ckptcore_torch

torch = pytest.importorskip("torch")


class _Reduce:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _zip(tmp_path, pkl: bytes, records: dict | None = None, name="archive/data.pkl"):
    path = tmp_path / "h.pt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(name, pkl)
        for k, v in (records or {}).items():
            zf.writestr(k, v)
    return path


def _rebuild(pid: bytes, size=b"K\x04\x85", stride=b"K\x01\x85", offset=b"K\x00") -> bytes:
    return (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(" + pid + b"Q" + offset + size + stride
            + b"\x89ccollections\nOrderedDict\n)RtR.")


def _pid(key=b"0", numel=b"K\x04", kind=b"ctorch\nFloatStorage\n") -> bytes:
    return b"(X\x07\x00\x00\x00storage" + kind + b"X" + len(key).to_bytes(4, "little") + key + b"X\x03\x00\x00\x00cpu" + numel + b"t"


CASES = {
    "os.system": (lambda c: pickle.dumps(_Reduce(os.system, (f"touch {c}",)), 2), "UnsafeCheckpointError"),
    "eval": (lambda c: pickle.dumps(_Reduce(eval, (f"open({str(c)!r}, 'w')",)), 2), "UnsafeCheckpointError"),
    "getattr builtins": (lambda c: b"\x80\x02cbuiltins\ngetattr\n.", "UnsafeCheckpointError"),
    "reduce OrderedDict with args": (lambda c: b"\x80\x02ccollections\nOrderedDict\n]\x85R.", "UnsafeCheckpointError"),
    "traversal key": (lambda c: _rebuild(_pid(key=b"../../etc/passwd")), "UnsafeCheckpointError"),
    "huge numel": (lambda c: _rebuild(_pid(numel=b"\x8a\x08" + (1 << 60).to_bytes(8, "little"))), "CorruptCheckpointError"),
    "stride outside": (lambda c: _rebuild(_pid(), stride=b"K\x09\x85"), "CorruptCheckpointError"),
    "offset outside": (lambda c: _rebuild(_pid(), offset=b"K\x03"), "CorruptCheckpointError"),
    "missing storage": (lambda c: _rebuild(_pid(key=b"7")), "CorruptCheckpointError"),
    "self-containing list": (lambda c: b"\x80\x02]q\x00h\x00a.", "CorruptCheckpointError"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_pickles_are_refused_without_running(tmp_path, name):
    canary = tmp_path / "canary"
    make, expected = CASES[name]
    path = _zip(tmp_path, make(canary), {"archive/data/0": np.zeros(4, np.float32).tobytes()})
    with pytest.raises(getattr(ckptcore, expected)):
        ckptcore_torch.import_torch_files(path)
    assert not canary.exists()


def test_zip_level_attacks(tmp_path):
    good = _rebuild(_pid())
    with pytest.raises(ckptcore.UnsafeCheckpointError, match="outside"):
        ckptcore_torch.import_torch_files(_zip(tmp_path, good, {"../x": b""}))
    bomb = tmp_path / "bomb.pt"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("archive/data.pkl", good)
        zf.writestr("archive/data/0", b"\0" * (50 << 20))
    with pytest.raises(ckptcore.UnsafeCheckpointError, match="compressed"):
        ckptcore_torch.import_torch_files(bomb)
    short = _zip(tmp_path, good, {"archive/data/0": b"\0" * 8})
    with pytest.raises(ckptcore.CorruptCheckpointError, match="holds 8 bytes"):
        ckptcore_torch.import_torch_files(short)
    link = tmp_path / "link.pt"
    link.symlink_to(short)
    with pytest.raises(ckptcore.CheckpointError):
        ckptcore_torch.import_torch_files(link)
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    with pytest.raises(ckptcore.CheckpointError):
        ckptcore_torch.import_torch_files(fifo)


@pytest.mark.parametrize("legacy", [False, True])
def test_fuzzed_byte_flips_give_typed_errors_or_the_right_values(tmp_path, legacy):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    src = tmp_path / "src.pt"
    torch.save(model.state_dict(), src, _use_new_zipfile_serialization=not legacy)
    data = src.read_bytes()
    want = {k: v.numpy() for k, v in model.state_dict().items()}
    rng = random.Random(1234 + legacy)
    outcomes = {"error": 0, "same": 0, "other values": 0}
    for i in range(150):
        buf = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        path = tmp_path / f"f{i}.pt"
        path.write_bytes(bytes(buf))
        try:
            state = ckptcore_torch.import_torch_files(path)
        except ckptcore.CheckpointError:
            outcomes["error"] += 1
            continue
        same = state.model.keys() == want.keys() and all(np.array_equal(state.model[k], want[k]) for k in want)
        outcomes["same" if same else "other values"] += 1
        # A flip inside legacy raw storage bytes (no checksum there) changes values, never shapes.
        assert same or legacy, f"flip {i}: zip records are CRC-checked, yet other values came back"
    assert outcomes["error"] > 30, outcomes
