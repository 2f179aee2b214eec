"""Hostile torch.save files: no code runs, only typed ckptcore errors, a seeded fuzz of byte flips."""

from __future__ import annotations

import os
import pickle
import random
import struct
import zipfile
import zlib

import numpy as np
import pytest

import ckptcore
import ckptcore_torch
from ckptcore_torch._files import load_torch_file

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


REFUSED = "so this file may try to run code"  # every refusal of a global or a call says why
CASES = {  # name: (pickle bytes from the canary's path, error, what the message must say)
    "os.system": (lambda c: pickle.dumps(_Reduce(os.system, (f"touch {c}",)), 2),
                  "UnsafeCheckpointError", rf"refused global posix\.system; .*{REFUSED}"),
    "eval": (lambda c: pickle.dumps(_Reduce(eval, (f"open({str(c)!r}, 'w')",)), 2),
             "UnsafeCheckpointError", rf"refused global builtins\.eval; .*{REFUSED}"),
    "getattr builtins": (lambda c: b"\x80\x02cbuiltins\ngetattr\n.", "UnsafeCheckpointError",
                         r"refused global builtins\.getattr"),
    "reduce OrderedDict with args": (lambda c: b"\x80\x02ccollections\nOrderedDict\n]\x85R.",
                                     "UnsafeCheckpointError", r"refused collections\.OrderedDict\(\[\],\)"),
    "INST opcode": (lambda c: b"(ios\nsystem\nX\x02\x00\x00\x00ls\x85.", "UnsafeCheckpointError",
                    r"refused the INST opcode"),
    "a set": (lambda c: b"\x80\x04\x8f.", "UnsafeCheckpointError", r"refused a set"),
    "a tensor subclass with hooks": (
        lambda c: _rebuild(_pid()).replace(b"\x89ccollections\nOrderedDict\n)RtR.",
                                           b"\x89}K\x01K\x02stR."),
        "UnsafeCheckpointError", r"refused a tensor with backward hooks"),
    "traversal key": (lambda c: _rebuild(_pid(key=b"../../etc/passwd")), "UnsafeCheckpointError",
                      r"refused storage persistent id .*'\.\./\.\./etc/passwd'.* not a path"),
    "huge numel": (lambda c: _rebuild(_pid(numel=b"\x8a\x08" + (1 << 60).to_bytes(8, "little"))),
                   "CorruptCheckpointError", r"declares 1152921504606846976 float32 values; .* more than"),
    "huge bytes": (lambda c: b"\x80\x04\x8e" + (1 << 40).to_bytes(8, "little"), "CorruptCheckpointError",
                   r"needs 1099511627776 bytes but the file has only"),
    "stride outside": (lambda c: _rebuild(_pid(), stride=b"K\x09\x85"), "CorruptCheckpointError",
                       r"stride \(9,\) at offset 0 reaches element 27 of a storage of 4"),
    "offset outside": (lambda c: _rebuild(_pid(), offset=b"K\x03"), "CorruptCheckpointError",
                       r"offset 3 reaches element 6 of a storage of 4"),
    "expanded view": (lambda c: _rebuild(_pid(), size=b"\x8a\x05\x00\x00\x00\x00\x01\x85",
                                         stride=b"K\x00\x85"),
                      "UnsafeCheckpointError", r"refused a strided view of shape \(4294967296,\)"),
    "missing storage": (lambda c: _rebuild(_pid(key=b"7")), "CorruptCheckpointError",
                        r"names storage '7', but the file has no record archive/data/7"),
    "self-containing list": (lambda c: b"\x80\x02]q\x00h\x00a.", "CorruptCheckpointError",
                             r"a list contains itself"),
    "memo bomb": (lambda c: b"\x80\x02]q\x000" + (b"(" + b"h\x00" * 8 + b"lq\x000") * 12 + b"h\x00.",
                  "UnsafeCheckpointError", r"refused a structure of more than \d+ values"),
}


def test_the_test_pickles_are_valid_when_unmutated(tmp_path):
    """The builders make a readable tensor, so each case above fails for its mutation only."""
    path = _zip(tmp_path, _rebuild(_pid()), {"archive/data/0": np.arange(4, dtype=np.float32).tobytes()})
    assert np.array_equal(load_torch_file(path), np.arange(4, dtype=np.float32))


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_pickles_are_refused_without_running(tmp_path, name):
    canary = tmp_path / "canary"
    make, expected, reason = CASES[name]
    path = _zip(tmp_path, make(canary), {"archive/data/0": np.zeros(4, np.float32).tobytes()})
    with pytest.raises(getattr(ckptcore, expected), match=reason):
        load_torch_file(path)
    assert not canary.exists()


def _patch_sizes(path, name: str, *, declared=None, stored=None) -> None:
    """Rewrite a record's sizes in its local and central zip headers (and its CRC to the bytes
    it would then hold), as a zip bomb would."""
    raw = bytearray(path.read_bytes())
    for sig, fixed, at in ((b"PK\x03\x04", 30, 14), (b"PK\x01\x02", 46, 16)):
        i = raw.find(sig)
        while i >= 0:
            if raw[i + fixed:i + fixed + len(name)] == name.encode():
                if stored is not None:
                    raw[at + i:at + i + 8] = struct.pack("<II", zlib.crc32(b"\0" * stored), stored)
                if declared is not None:
                    raw[at + i + 8:at + i + 12] = struct.pack("<I", declared)
            i = raw.find(sig, i + 4)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("declared, stored, reason", [
    (0xFFFFFFF0, None, r"declaring 4294967280 bytes, 16 stored in a file of"),
    (None, 8, r"declaring 16 bytes, 8 stored"),  # would read 8 bytes for 4 float32 values
    (8, None, r"declaring 8 bytes, 16 stored"),
])
def test_stored_records_declaring_other_sizes_are_refused(tmp_path, declared, stored, reason):
    path = _zip(tmp_path, _rebuild(_pid()), {"archive/data/0": np.zeros(4, np.float32).tobytes()})
    _patch_sizes(path, "archive/data/0", declared=declared, stored=stored)
    with pytest.raises(ckptcore.UnsafeCheckpointError, match=reason):
        load_torch_file(path)


def test_zip_level_attacks(tmp_path):
    good = _rebuild(_pid())
    with pytest.raises(ckptcore.UnsafeCheckpointError, match=r"refused the zip entry '\.\./x' \(a path outside"):
        ckptcore_torch.import_torch_files(_zip(tmp_path, good, {"../x": b""}))
    bomb = tmp_path / "bomb.pt"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("archive/data.pkl", good)
        zf.writestr("archive/data/0", b"\0" * (8 << 20))
    assert bomb.stat().st_size < 1 << 16
    with pytest.raises(ckptcore.UnsafeCheckpointError, match=r"'archive/data.pkl', compressed \(method 8\)"):
        ckptcore_torch.import_torch_files(bomb)
    short = _zip(tmp_path, good, {"archive/data/0": b"\0" * 8})
    with pytest.raises(ckptcore.CorruptCheckpointError, match="holds 8 bytes; its 4 float32 values need 16"):
        ckptcore_torch.import_torch_files(short)
    link = tmp_path / "link.pt"
    link.symlink_to(short)
    with pytest.raises(ckptcore.UnsafeCheckpointError, match="link"):
        ckptcore_torch.import_torch_files(link)
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    with pytest.raises(ckptcore.UnsafeCheckpointError, match="FIFO|fifo|not a regular file"):
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
    print("torch.save fuzz:", "legacy" if legacy else "zip", outcomes)
    assert outcomes["error"] > 30, outcomes
