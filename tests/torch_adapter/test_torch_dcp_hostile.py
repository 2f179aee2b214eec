"""Hostile torch.distributed.checkpoint folders: only typed ckptcore errors with readable reasons,
a seeded byte-flip fuzz of a real ``.metadata``, torch left unloaded, memory bounded."""

from __future__ import annotations

import io
import os
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))
import torch.distributed.checkpoint as dcp  # noqa: E402
from _torch_files_models import build, train  # noqa: E402
from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: E402
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,  # noqa: E402
                                                   MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

import ckptcore  # noqa: E402
import ckptcore_torch  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
W = torch.arange(12, dtype=torch.float32).reshape(4, 3)
HALVES = [((0, 0), (2, 3)), ((2, 0), (2, 3))]


def _folder(path: Path, chunks=HALVES, *, shape=(4, 3), info=None, data: bytes | None = None) -> Path:
    """A DCP folder built by hand as ``dcp.save`` lays one out: tensor ``model.w`` of ``shape`` in
    ``chunks`` (offsets, sizes), each a torch.save zip in ``__0_0.distcp``; ``info(i, storage
    info)`` may change a chunk's storage entry, ``data`` replace the data file's bytes."""
    path.mkdir()
    blob, storage = io.BytesIO(), {}
    for i, (offs, sizes) in enumerate(chunks):
        start = blob.tell()
        part = W[tuple(slice(o, o + s) for o, s in zip(offs, sizes))].clone()
        torch.save(part, blob)
        si = _StorageInfo("__0_0.distcp", start, blob.tell() - start)
        storage[MetadataIndex("model.w", torch.Size(offs), i)] = info(i, si) if info else si
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape),
                               [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
    meta = Metadata({"model.w": md}, planner_data={"model.w": ("model", "w")}, storage_data=storage)
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    (path / "__0_0.distcp").write_bytes(blob.getvalue() if data is None else data)
    return path


def test_the_hand_built_folder_is_what_dcp_writes(tmp_path):
    """The builder's folder reads as the tensor, with dcp.load too: each case below fails only
    for its own change."""
    path = _folder(tmp_path / "ok")
    assert np.array_equal(ckptcore_torch.import_dcp(path).model["w"], W.numpy())
    target = {"model": {"w": torch.zeros(4, 3)}}
    dcp.load(target, checkpoint_id=str(path), no_dist=True)
    assert torch.equal(target["model"]["w"], W)


def _info(**change):
    return lambda i, si: _StorageInfo(**{**vars(si), **change}) if i == 1 else si


HOSTILE = {  # name: (folder builder arguments, error, what the message must say)
    "overlapping chunks": (dict(chunks=[((0, 0), (3, 3)), ((2, 0), (2, 3))]), "SchemaError",
                           r"tensor 'model\.w': chunks overlap at \(2, 0\)"),
    "holed chunks": (dict(chunks=[((0, 0), (2, 3)), ((3, 0), (1, 3))]), "IncompleteCheckpointError",
                     r"tensor 'model\.w': its chunks cover 9 of 12 values"),
    "chunk outside the tensor": (dict(chunks=[((0, 0), (2, 3)), ((2, 0), (3, 3))]), "SchemaError",
                                 r"chunk at \(2, 0\) of size \(3, 3\) lies outside \(4, 3\)"),
    "byte range outside its file": (dict(info=_info(length=10 ** 6)), "CorruptCheckpointError",
                                    r"__0_0\.distcp: bytes \d+\.\.\d+ are listed, the file has \d+"),
    "negative offset": (dict(info=_info(offset=-5)), "SchemaError", r"a file must be a bare \.distcp name"),
    "parent traversal": (dict(info=_info(relative_path="../__0_0.distcp")), "SchemaError",
                         r"'\.\./__0_0\.distcp'.*a file must be a bare \.distcp name"),
    "absolute path": (dict(info=_info(relative_path="/etc/passwd")), "SchemaError",
                      r"'/etc/passwd'.*a file must be a bare \.distcp name"),
    "sub-folder": (dict(info=_info(relative_path="sub/__0_0.distcp")), "SchemaError",
                   r"a file must be a bare \.distcp name"),
    "huge declared shape": (dict(shape=(1 << 40, 1 << 20)), "SchemaError",
                            r"declares \d+ bytes; the data files hold \d+"),
    "data file not a zip": (dict(data=b"not a zip, not a pickle" * 100), "CorruptCheckpointError",
                            r"neither a zip nor a legacy torch\.save file"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_metadata_and_data(tmp_path, name):
    kwargs, error, reason = HOSTILE[name]
    path = _folder(tmp_path / "h", **kwargs)
    with pytest.raises(getattr(ckptcore, error), match=reason):
        ckptcore_torch.import_dcp(path)


def test_linked_and_fifo_metadata_are_refused_without_blocking(tmp_path):
    good = _folder(tmp_path / "ok")
    linked = tmp_path / "linked"
    shutil.copytree(good, linked)
    (linked / ".metadata").unlink()
    (linked / ".metadata").symlink_to(good / ".metadata")
    with pytest.raises(ckptcore.UnsafeCheckpointError, match=r"\.metadata.*link"):
        ckptcore_torch.import_dcp(linked)
    fifo = tmp_path / "fifo"
    shutil.copytree(good, fifo)
    (fifo / ".metadata").unlink()
    os.mkfifo(fifo / ".metadata")
    with pytest.raises(ckptcore.UnsafeCheckpointError, match=r"\.metadata: is a FIFO|not a regular file"):
        ckptcore_torch.import_dcp(fifo)
    data_link = tmp_path / "data_link"
    shutil.copytree(good, data_link)
    (data_link / "__0_0.distcp").unlink()
    (data_link / "__0_0.distcp").symlink_to(good / "__0_0.distcp")
    with pytest.raises(ckptcore.UnsafeCheckpointError, match=r"__0_0\.distcp.*link"):
        ckptcore_torch.import_dcp(data_link)


def test_a_compressed_chunk_is_refused(tmp_path):
    import zipfile
    blob = io.BytesIO()
    with zipfile.ZipFile(blob, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("archive/data.pkl", b"\x80\x02}.")
    raw = blob.getvalue()
    path = _folder(tmp_path / "z", chunks=[((0, 0), (4, 3))], data=raw,
                   info=lambda i, si: _StorageInfo("__0_0.distcp", 0, len(raw)))
    with pytest.raises(ckptcore.UnsafeCheckpointError, match=r"compressed \(method 8\)"):
        ckptcore_torch.import_dcp(path)


def _real_folder(path: Path) -> Path:
    model, opt = build()
    train(model, opt, 2, 1)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path), no_dist=True)
    return path


def test_fuzzed_metadata_gives_typed_errors_or_the_same_tensors(tmp_path):
    src = _real_folder(tmp_path / "src")
    want = ckptcore_torch.import_dcp(src)
    arrays = {(a.dtype.str, a.shape, a.tobytes()) for a in want.model.values()}
    data = (src / ".metadata").read_bytes()
    work = tmp_path / "f"
    shutil.copytree(src, work)
    rng = random.Random(2024)
    outcomes = {"error": 0, "same": 0, "renamed": 0}
    for i in range(400):
        buf = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        (work / ".metadata").write_bytes(bytes(buf))
        try:
            state = ckptcore_torch.import_dcp(work)
        except ckptcore.CheckpointError as e:
            assert str(e), f"flip {i}: an error without a message"
            outcomes["error"] += 1
            continue
        # The metadata holds no tensor bytes: whatever reads must be the saved tensors, maybe
        # under a name a flip changed in both places the pickle's memo shares.
        got = {(a.dtype.str, a.shape, a.tobytes()) for a in state.model.values()}
        assert got <= arrays, f"flip {i}: tensors that were never saved"
        same = state.model.keys() == want.model.keys()
        outcomes["same" if same else "renamed"] += 1
    print("dcp metadata fuzz:", outcomes)
    # Most flips break the pickle; the few that read must have passed every check above.
    assert outcomes["error"] > 300 and outcomes["same"] + outcomes["renamed"] >= 3, outcomes


def test_import_dcp_leaves_torch_unloaded(tmp_path):
    src = _real_folder(tmp_path / "src")
    code = ("import sys, ckptcore_torch; s = ckptcore_torch.import_dcp(sys.argv[1]); "
            "assert 'torch' not in sys.modules, 'torch was imported'; "
            "print(s.optimizer.kind, s.step, sorted(s.model))")
    out = subprocess.run([sys.executable, "-c", code, str(src)], env=ENV, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    model, _ = build()
    assert out.stdout.strip().split(maxsplit=2) == ["adamw", "2", repr(sorted(model.state_dict()))]


_MEASURE = """
import os, re, resource, sys
import ckptcore, ckptcore_torch
from ckptcore_torch import _dcp, _files
# Address space capped at 1 GiB above what is mapped now: a huge allocation fails even when the
# kernel would hand it out lazily, so refusing must come before allocating.
mapped = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), resource.RLIM_INFINITY))

def rss(field):
    return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

for path in sys.argv[1:]:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current size
    before = rss("VmRSS")
    try:
        (ckptcore_torch.import_dcp if os.path.isdir(path) else _files.load_torch_file)(path)
        outcome = "read"
    except ckptcore.CheckpointError as e:
        outcome = type(e).__name__
    print(os.path.basename(path), outcome, rss("VmHWM") - before, "torch" in sys.modules)
"""


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir()) if path.is_dir() else path.stat().st_size


def test_huge_declared_sizes_stay_within_memory_bounds(tmp_path):
    """Each import's peak memory (VmHWM, reset before each) grows by less than twice the files' size plus 100 MB, in one
    subprocess (no torch) whose address space is capped; hostile sizes declared in each place one
    can be, then a real file whose reading must show up in the measure."""
    big = torch.arange(1 << 22, dtype=torch.float32)  # 16 MiB of real data
    torch.save({"w": big[: 1 << 18].as_strided((1 << 28,), (0,))}, tmp_path / "expanded.pt")  # a 1 GiB view
    buf = io.BytesIO()
    torch.save({"w": big[: 1 << 18].clone()}, buf, _use_new_zipfile_serialization=False)
    legacy = bytearray(buf.getvalue())
    at = legacy.rfind((1 << 18).to_bytes(8, "little"))  # the storage's element count
    legacy[at:at + 8] = (1 << 40).to_bytes(8, "little")
    (tmp_path / "legacy.pt").write_bytes(bytes(legacy))
    memo = b"\x80\x02]q\x000" + (b"(" + b"h\x00" * 8 + b"lq\x000") * 12 + b"h\x00."
    import zipfile
    with zipfile.ZipFile(tmp_path / "memo.pt", "w") as zf:
        zf.writestr("archive/data.pkl", memo)
    _folder(tmp_path / "dcp_huge", shape=(1 << 15, 1 << 15), chunks=[((0, 0), (4, 3))],
            data=b"\0" * (1 << 20))
    _folder(tmp_path / "dcp_ok")
    torch.save({"w": big}, tmp_path / "plain.pt")
    expected = {"expanded.pt": "UnsafeCheckpointError", "legacy.pt": "CorruptCheckpointError",
                "memo.pt": "UnsafeCheckpointError", "dcp_huge": "SchemaError", "dcp_ok": "read",
                "plain.pt": "read"}
    out = subprocess.run([sys.executable, "-c", _MEASURE] + [str(tmp_path / n) for n in expected],
                         env=ENV, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rows = {name: (outcome, int(grown)) for name, outcome, grown, torch_loaded in
            map(str.split, out.stdout.splitlines()) if torch_loaded == "False"}
    assert {n: r[0] for n, r in rows.items()} == expected
    for name, (_, grown) in rows.items():
        assert grown < 2 * _size(tmp_path / name) + (100 << 20), (name, grown >> 20, "MiB")
    assert rows["plain.pt"][1] >= 16 << 20, out.stdout  # the measure sees a real file's 16 MiB
