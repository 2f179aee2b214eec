"""Saves by large groups (issue 25, "1,000-rank commits"): shard folders and the commit summary.

* A group of at least ``prefix_ranks`` ranks (lowered to 2 here) puts each rank's shards in a
  folder of two hex digits hashed from the rank (``3f/shard-...``), so an object store's
  per-prefix request rate does not cap the save.  Every path that handles shard names must take
  them: the manifest validator (that exact shape only), rank 0's check of the replies, cleanup
  of failed and overwritten saves, gc, readers (no link followed, not even the folder), verify,
  backup copies and ``ckpt sync``.
* Rank 0 sends the other ranks a summary of the commit with its outcome: they build their
  ``CheckpointInfo`` from it and read nothing from the store; its tensor and shard lists are
  read on first use, once, and raise ``CheckpointNotFoundError`` once the step is gone.

The ranks are threads (``ckptcore.ThreadGroup``) on real stores (local disk, ``memory://``);
reads are counted with Python's audit hook (every file the process opens), not by wrapping
ckptcore.  Interrupted saves are made with the library's fault-injection hook.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import threading

import msgpack
import numpy as np
import pytest

import ckptcore
from ckptcore import ThreadGroup, TrainingState, _knobs, _storage, cli
from ckptcore._dist import rank_folder
from ckptcore._manifest import MANIFEST_NAME, safe_shard_name
from ckptcore._read import read_manifest, summary_of

import hostile_manifests as corpus
from _support import assert_state_same, run_ranks
from test_dist_replies import _Tampering, _assert_refused

NAME = re.compile(r"([0-9a-f]{2})/shard-[0-9]{5}-r([0-9]{5})-([0-9a-f]{16})\.bin")
COPY_NAME = re.compile(r"[0-9a-f]{2}/shard-[0-9]{5}-[0-9a-f]{16}\.bin")  # a plain copy's


def _state(seed: int = 0, metadata: dict | None = None) -> TrainingState:
    rng = np.random.default_rng(seed)
    model = {f"layer{i // 4}/t{i}": rng.standard_normal(int(rng.integers(10, 4000))).astype(np.float32)
             for i in range(24)}
    opt = ckptcore.OptimizerState(kind="adam", step=seed, hyperparams={"lr": 0.1},
                                  slots={k: {"m": v * 2} for k, v in list(model.items())[:6]})
    return TrainingState(model=model, optimizer=opt, step=seed, epoch=1,
                         data={"epoch": 1, "position": 5 + seed},
                         metadata={"note": "large group"} if metadata is None else metadata)


@pytest.fixture(params=["local", "memory"])
def store(request):
    return request.getfixturevalue(f"{request.param}_backend")


def _save(url: str, ranks: int, state: TrainingState, opts=None, **kw) -> dict:
    with _knobs.override(prefix_ranks=2):
        return run_ranks(ThreadGroup.create(ranks), lambda g: ckptcore.save_state(
            url, state, group=g, storage_options=opts, **kw))


def _files(store, *parts) -> list[str]:
    """Every file under ``parts`` of the backend, relative to it (through fsspec, not ckptcore)."""
    base = store.path(*parts).rstrip("/")
    return sorted(p[len(base):].lstrip("/") for p in store.fs.find(base))


# -- shard folders --------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [4, 6])
def test_a_large_group_puts_each_ranks_shards_in_its_folder_and_loads_bit_for_bit(store, ranks):
    url, opts = store.url("ck"), store.storage_options
    state = _state(3)
    out = _save(url, ranks, state, opts)
    assert all(isinstance(v, ckptcore.CheckpointInfo) for v in out.values()), out
    shards = list(out[0].shards)
    assert {int(NAME.fullmatch(p).group(2)) for p in shards} == set(range(ranks)), shards
    for p in shards:
        folder, rank, token = NAME.fullmatch(p).groups()
        assert folder == rank_folder(int(rank)) and token == out[0].writer["id"], p
    assert _files(store, "ck") == sorted(shards + [MANIFEST_NAME])
    assert_state_same(ckptcore.load_state(url, storage_options=opts), state)
    assert ckptcore.verify(url, storage_options=opts) == []
    assert all(out[r] == out[0] for r in range(ranks))  # every rank's info: the same commit
    assert cli.main(["verify", url]) == 0


def test_the_folders_spread_ranks_over_256_prefixes():
    folders = [rank_folder(r) for r in range(1000)]
    assert all(re.fullmatch(r"[0-9a-f]{2}", f) for f in folders)
    counts = np.bincount([int(f, 16) for f in folders], minlength=256)
    assert counts.min() == 3 and counts.max() == 4, counts  # 1,000 / 256: evenly
    assert len({rank_folder(r) for r in range(256)}) == 256
    assert all(abs(int(rank_folder(r), 16) - int(rank_folder(r + 1), 16)) >= 16 for r in range(999))


@pytest.mark.parametrize("ranks,knob,nested", [(3, 256, False), (3, 4, False), (3, 3, True)])
def test_the_knob_decides_from_the_group_size(memory_backend, ranks, knob, nested):
    url = memory_backend.url("ck")
    with _knobs.override(prefix_ranks=knob):
        out = run_ranks(ThreadGroup.create(ranks),
                        lambda g: ckptcore.save_state(url, _state(), group=g))
    assert all("/" in p for p in out[0].shards) is nested
    assert all("/" not in p for p in out[0].shards) is not nested
    assert_state_same(ckptcore.load_state(url), _state())


def test_a_sharded_state_of_a_large_group_uses_folders_too(store):
    from test_dist_sharded import _rank_leaf
    from test_sharded_load import _check_rank, _state as sharded_state

    url, opts = store.url("ck"), store.storage_options
    with _knobs.override(prefix_ranks=2):
        out = run_ranks(ThreadGroup.create(4), lambda g: ckptcore.save_state(
            url, sharded_state(_rank_leaf(4, g.rank)), group=g, storage_options=opts))
    assert all(isinstance(v, ckptcore.CheckpointInfo) for v in out.values()), out
    assert out[0].format_version == 3 and all(NAME.fullmatch(p) for p in out[0].shards)
    assert ckptcore.verify(url, storage_options=opts) == []
    got = run_ranks(ThreadGroup.create(3), lambda g: ckptcore.load_state(
        url, like=sharded_state(_rank_leaf(3, g.rank, template=True)), group=g,
        storage_options=opts))
    for r, state in got.items():
        _check_rank(state, 3, r)


def test_an_overwrite_removes_the_old_nested_shards(store):
    url, opts = store.url("ck"), store.storage_options
    first = _save(url, 4, _state(1), opts)[0]
    second = _save(url, 4, _state(2), opts, overwrite=True)[0]
    assert first.writer["id"] != second.writer["id"]
    assert _files(store, "ck") == sorted(list(second.shards) + [MANIFEST_NAME])
    assert_state_same(ckptcore.load_state(url, storage_options=opts), _state(2))


# -- replies naming another folder -----------------------------------------------------------------
def _other_ranks_folder(reply):
    path = reply["shards"][0][0]
    reply["shards"][0][0] = f"{rank_folder(2)}/{path.split('/', 1)[1]}"


def _flat(reply):  # its own name, but outside its folder
    reply["shards"][0][0] = reply["shards"][0][0].split("/", 1)[1]


def _traversal(reply):
    reply["shards"][0][0] = f"{rank_folder(1)}/../../evil.bin"


def _deeper(reply):
    folder, name = reply["shards"][0][0].split("/", 1)
    reply["shards"][0][0] = f"{folder}/{folder}/{name}"


def _absolute(reply):
    reply["shards"][0][0] = "/" + reply["shards"][0][0]


@pytest.mark.parametrize("change", [_other_ranks_folder, _flat, _traversal, _deeper, _absolute],
                         ids=["other-rank's-folder", "flat", "traversal", "deeper", "absolute"])
def test_a_reply_naming_a_shard_outside_its_folder_is_refused_on_every_rank(store, change):
    assert rank_folder(1) != rank_folder(2)
    url, opts = store.url("ck"), store.storage_options
    store.write(b"sentinel", "evil.bin")
    groups = ThreadGroup.create(3)
    groups[1] = _Tampering(groups[1], change)
    with _knobs.override(prefix_ranks=2):
        out = run_ranks(groups, lambda g: ckptcore.save_state(url, _state(), group=g,
                                                              storage_options=opts))
    _assert_refused(out)
    assert "not a shard it wrote in this save" in str(out[0]), out[0]
    with pytest.raises(ckptcore.CheckpointNotFoundError):
        ckptcore.load_state(url, storage_options=opts)
    assert store.read("evil.bin") == b"sentinel"
    # every rank's nested shards were removed with the refused save
    assert not [f for f in _files(store, "ck") if "shard-" in f], _files(store, "ck")
    assert not [n for n in store.listdir() if ".tmp-" in n]


# -- the validator ---------------------------------------------------------------------------------
GOOD = ["shard-00000-0123456789abcdef.bin", "3f/shard-00000-r00001-0123456789abcdef.bin",
        "00/x.bin", "ff/shard_1", "cas:" + "ab" * 32]
BAD = ["../x", "a/b/c", "zz/shard-0.bin", "/abs", "/ab/shard.bin", "ab//shard.bin", "ab/",
       "AB/shard.bin", "a/shard.bin", "abc/shard.bin", "ab/../x", "ab/./x", "ab/.hidden",
       "ab/manifest.msgpack", "ab/cd/shard.bin", "ab\\shard.bin", "ab/shard.bin\n", "\u0661\u0662/x",
       "ab/" + "a" * 201, ""]


def test_the_validator_takes_one_folder_of_two_hex_digits_and_nothing_else():
    assert all(safe_shard_name(p) for p in GOOD), [p for p in GOOD if not safe_shard_name(p)]
    assert not any(safe_shard_name(p) for p in BAD), [p for p in BAD if safe_shard_name(p)]


@pytest.fixture
def nested_ckpt(tmp_path):
    """A committed local checkpoint of a 4-rank group with shard folders."""
    url = str(tmp_path / "ck")
    out = _save(url, 4, _state(4))
    assert all("/" in p for p in out[0].shards)
    return tmp_path / "ck"


def test_the_reader_printed_in_format_md_reads_shard_folders(nested_ckpt):
    from test_golden import _format_md_reader

    tree = _format_md_reader()(str(nested_ckpt))
    for name, want in _state(4).model.items():
        assert tree["model"][name].tobytes() == want.tobytes(), name


@pytest.mark.parametrize("path", ["../x", "a/b/c", "zz/shard", "/abs", "ab/../../x",
                                  "00/11/shard.bin"])
def test_a_hostile_manifest_naming_shards_outside_is_refused(nested_ckpt, path):
    body = corpus.read_body(nested_ckpt)
    body["shards"][1]["path"] = path
    corpus.write_manifest(nested_ckpt, body, version=2)
    for call in (ckptcore.load_state, ckptcore.inspect, ckptcore.verify):
        with pytest.raises(ckptcore.UnsafeCheckpointError, match="shard path"):
            call(str(nested_ckpt))
    assert cli.main(["verify", str(nested_ckpt)]) != 0


def test_a_shard_folder_that_is_a_link_is_never_followed(nested_ckpt, tmp_path):
    outside = tmp_path / "outside"
    folder = nested_ckpt / read_manifest(_storage.Store(str(nested_ckpt))).shards[1].path.split("/")[0]
    shutil.copytree(folder, outside)  # the same bytes: they would verify if followed
    shutil.rmtree(folder)
    folder.symlink_to(outside, target_is_directory=True)
    with pytest.raises(ckptcore.UnsafeCheckpointError, match="symbolic link"):
        ckptcore.load_state(str(nested_ckpt))
    try:
        problems = ckptcore.verify(str(nested_ckpt))
    except ckptcore.UnsafeCheckpointError:
        pass
    else:
        assert any(isinstance(p, ckptcore.UnsafeCheckpointError) for p in problems), problems
    folder.unlink()
    folder.write_bytes(b"not a folder")
    with pytest.raises(ckptcore.UnsafeCheckpointError, match="not a folder"):
        ckptcore.load_state(str(nested_ckpt))


# -- gc, backups and sync ----------------------------------------------------------------------------
def _fail(ops: set[str]):
    def hook(op, path):
        if op in ops:
            raise OSError(f"injected failure of {op} {path}")
    return hook


@pytest.mark.parametrize("where", ["local", "memory"])
def test_gc_removes_the_leftovers_of_an_interrupted_nested_save(request, monkeypatch, where):
    """The commit fails and so does its cleanup (a host losing the store mid-save): the nested
    shards stay behind; gc keeps them while young (an object store gives folders no time: the
    files' own times must count) and removes them once past the grace."""
    store = request.getfixturevalue(f"{where}_backend")
    root = store.url("run")
    step = f"{root}/{ckptcore.layout.step_name(1)}"
    ops = {"rename", "delete_tree", "delete"} if where == "local" else {"publish", "delete"}
    monkeypatch.setattr(_storage, "_op_hook", _fail(ops))
    out = _save(step, 4, _state())
    monkeypatch.setattr(_storage, "_op_hook", None)
    assert all(isinstance(v, Exception) for v in out.values()), out
    left = [f for f in _files(store, "run") if "shard-" in f]
    assert left and all(re.search(r"/[0-9a-f]{2}/shard-", "/" + f) for f in left), left
    assert ckptcore.gc(root) == []  # young: kept
    assert [f for f in _files(store, "run") if "shard-" in f] == left
    removed = ckptcore.gc(root, grace=0)
    assert removed and not [f for f in _files(store, "run") if "shard-" in f], removed


def test_gc_removes_a_nested_shard_no_manifest_names(memory_backend, capsys):
    root = memory_backend.url("run")
    name = ckptcore.layout.step_name(1)
    info = _save(f"{root}/{name}", 4, _state())[0]
    stray = f"{rank_folder(9)}/shard-00000-r00009-0123456789abcdef.bin"
    memory_backend.write(b"x" * 64, "run", name, *stray.split("/"))
    assert cli.main(["gc", root]) == 0
    assert "1 kept, younger than the grace" in capsys.readouterr().out
    removed = ckptcore.gc(root, grace=0)
    assert len(removed) == 1 and removed[0].endswith(f"/{name}/{stray}"), removed
    assert _files(memory_backend, "run", name) == sorted(list(info.shards) + [MANIFEST_NAME])
    assert ckptcore.verify(f"{root}/{name}") == []


@pytest.mark.parametrize("dedup", [False, True], ids=["plain", "dedup"])
def test_a_backup_of_a_nested_step_restores_bit_for_bit(tmp_path, memory_backend, dedup):
    root, backup = str(tmp_path / "local"), memory_backend.url("backup")
    states = {r: _state(7) for r in range(4)}

    def save(g):
        with ckptcore.CheckpointManager(root, group=g, save_on_preemption=False,
                                        backup=ckptcore.Backup(backup, dedup=dedup)) as mgr:
            mgr.save(7, states[g.rank])
            mgr.wait()
            return mgr.backup.pending()

    with _knobs.override(prefix_ranks=2):
        out = run_ranks(ThreadGroup.create(4), save)
    assert out == {r: [] for r in range(4)}, out
    replica = f"{backup}/{ckptcore.layout.step_name(7)}"
    assert ckptcore.verify(replica) == []
    if not dedup:  # a plain copy keeps the folders, its names carry its own token (FORMAT.md)
        copied = ckptcore.inspect(replica).shards
        assert all(COPY_NAME.fullmatch(p) for p in copied), copied
        assert len({p.rsplit("-", 1)[1] for p in copied}) == 1
        source = ckptcore.inspect(f"{root}/{ckptcore.layout.step_name(7)}").shards
        assert sorted(p.split("/")[0] for p in copied) == sorted(p.split("/")[0] for p in source)
    shutil.rmtree(root)  # the machine is lost: only the backup is left
    with ckptcore.CheckpointManager(root, backup=ckptcore.Backup(backup, dedup=dedup),
                                    save_on_preemption=False) as mgr:
        assert_state_same(mgr.restore(), _state(7))


def test_ckpt_sync_copies_nested_shards(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    name = ckptcore.layout.step_name(3)
    info = _save(f"{src}/{name}", 5, _state(3))[0]
    assert cli.main(["sync", src, dst, "--plain", "-q"]) == 0
    copy = tmp_path / "dst" / name
    copied = ckptcore.inspect(str(copy)).shards  # named by the copy's token, in the same folders
    assert all(COPY_NAME.fullmatch(p) for p in copied), copied
    assert sorted(p.split("/")[0] for p in copied) == sorted(p.split("/")[0] for p in info.shards)
    assert sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file()) == \
        sorted(list(copied) + [MANIFEST_NAME])
    assert ckptcore.verify(str(copy)) == []
    assert_state_same(ckptcore.load_state(str(copy)), _state(3))


# -- the summary: the other ranks read nothing -------------------------------------------------------
_opened: list | None = None


def _audit(event: str, args: tuple) -> None:
    if _opened is not None and event == "open":
        _opened.append((threading.current_thread().name, args))


sys.addaudithook(_audit)  # records only while _opened is a list


def _reads(events: list, under: str) -> list[tuple[str, str]]:
    """The files opened for reading among ``events`` (builtin ``open`` and ``os.open``): under
    ``under``, or relative (``os.open`` beside a folder descriptor); folders left out."""
    out = []
    for thread, (path, mode, flags) in events:
        if not isinstance(path, (str, bytes, os.PathLike)):
            continue  # open(fd): the descriptor's own open was counted
        path = os.fsdecode(path)
        if os.path.isabs(path) and not path.startswith(under):
            continue
        if isinstance(mode, str):
            reading = "r" in mode and "+" not in mode
        else:
            reading = (flags & os.O_ACCMODE) == os.O_RDONLY and not flags & os.O_DIRECTORY
        if reading:
            out.append((thread, path))
    return out


def test_no_rank_reads_the_store_after_the_commit_and_lists_are_read_once(tmp_path):
    global _opened
    url = str(tmp_path / "ck")
    _opened = []
    try:
        out = _save(url, 4, _state(5))
        saving = list(_opened)
        _opened.clear()
        shown = [(i.step, i.epoch, i.created, i.sections, i.nbytes, i.writer, i.library,
                  dict(i.data), dict(i.metadata), len(i.tensors), len(i.shards), repr(i))
                 for _, i in sorted(out.items())]
        before = list(_opened)
        _opened.clear()
        assert out[1].tensors == out[0].tensors and out[2].shards == out[0].shards
        listing = list(_opened)
    finally:
        _opened = None
    assert _reads(saving, str(tmp_path)) == []  # no rank read anything, the manifest included
    assert _reads(before, str(tmp_path)) == []  # nor to show what was committed
    assert all(s[:-1] == shown[0][:-1] for s in shown), shown  # counts included
    assert "read from the manifest on first use" in shown[1][-1]
    read = _reads(listing, str(tmp_path))
    assert [os.path.basename(p) for _, p in read] == [MANIFEST_NAME] * 2, read  # once per rank
    os.remove(os.path.join(url, MANIFEST_NAME))
    assert len(out[1].tensors[0].name) and out[1].tensors == out[0].tensors  # read once, kept
    assert out[1] == out[0] and repr(out[1].tensors) == repr(out[0].tensors)


def test_a_step_gone_or_replaced_before_the_first_use_is_not_found(store):
    url, opts = store.url("ck"), store.storage_options
    out = _save(url, 4, _state(6), opts)
    assert_state_same(ckptcore.load_state(url, storage_options=opts), _state(6))
    ckptcore.save_state(url, _state(8), storage_options=opts, overwrite=True)  # replaced
    with pytest.raises(ckptcore.CheckpointNotFoundError, match="replaced by another"):
        out[1].tensors[0]
    fs, path = store.fs, store.path("ck")
    fs.rm(path, recursive=True)  # a rewind deleted it
    info = out[2]
    assert (info.step, info.epoch, info.data, info.metadata) == (6, 1, out[0].data, out[0].metadata)
    assert info.created == out[0].created and len(info.tensors) == len(out[0].tensors)
    for use in (lambda: info.tensors[0], lambda: list(info.shards), lambda: info == out[0]):
        with pytest.raises(ckptcore.CheckpointNotFoundError, match="is gone"):
            use()
    with pytest.raises(FileNotFoundError):  # a builtin the caller may catch instead
        out[3].shards[0]


def test_the_summary_is_a_few_hundred_bytes_and_large_sections_stay_lazy(memory_backend, caplog):
    url = memory_backend.url("ck")
    _save(url, 4, _state())
    small = summary_of(read_manifest(_storage.Store(url)))
    assert 200 < len(small) < 600, len(small)
    big = {"note": "x" * 10_000, "runs": list(range(50))}
    caplog.set_level(logging.INFO, logger="ckptcore")
    out = _save(url, 4, _state(metadata=big), overwrite=True)
    assert len(summary_of(read_manifest(_storage.Store(url)))) <= 4096
    assert "metadata left out" in caplog.text
    info = out[1]
    assert info.data == {"epoch": 1, "position": 5}  # small: in the summary
    assert "read from the manifest on first use" in repr(info.metadata)
    assert info.metadata == big and dict(info.metadata) == out[0].metadata
    assert out[1] == out[0]


class _GarbledSummary:
    """Rank ``inner``'s view of rank 0's outcome, with the summary replaced by junk."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.rank, self.size = inner.rank, inner.size

    def broadcast(self, data, *, timeout):
        got = self._inner.broadcast(data, timeout=timeout)
        msg = msgpack.unpackb(got, raw=False)
        if isinstance(msg, dict) and msg.get("kind") == "ok" and "summary" in msg:
            got = msgpack.packb({**msg, "summary": b"\xc1 not msgpack"}, use_bin_type=True)
        return got

    def gather(self, data, *, timeout):
        return self._inner.gather(data, timeout=timeout)

    def barrier(self, *, timeout):
        return self._inner.barrier(timeout=timeout)


def test_a_rank_with_an_unusable_summary_reads_the_manifest(memory_backend, caplog):
    url = memory_backend.url("ck")
    groups = ThreadGroup.create(3)
    groups[2] = _GarbledSummary(groups[2])
    caplog.set_level(logging.INFO, logger="ckptcore")
    with _knobs.override(prefix_ranks=2):
        out = run_ranks(groups, lambda g: ckptcore.save_state(url, _state(), group=g))
    assert all(isinstance(v, ckptcore.CheckpointInfo) for v in out.values()), out
    assert "summary of the commit cannot be used" in caplog.text
    assert "read from the manifest on first use" not in repr(out[2])  # read during the save
    assert out[2] == out[0] == out[1]
