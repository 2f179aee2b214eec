"""A checkpoint's files are read only from inside it: links, pipes, folders where files belong.

A committed checkpoint has one of its files (the manifest, or a shard) replaced by:

* a symbolic link to a byte-identical copy outside the folder (the content would verify),
* a symbolic link to some other file outside,
* a FIFO (a reader that opens it blocks until a writer appears: forever),
* a directory,
* a dangling symbolic link.

``load_state``, ``inspect`` and ``verify`` must each raise a ``CheckpointError`` naming the file,
without hanging, and no file outside the checkpoint folder may be opened following a link (an
audit hook records every ``open`` of the process).  ``inspect`` reads the manifest alone, so a
damaged shard does not concern it: it must answer and open nothing outside.

Also here: deleting never follows links, ``Store.read(max_bytes=...)`` refuses before reading,
and the writer lock refuses a lock path that is not a regular file.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import threading
import time

import numpy as np
import pytest

import ckptcore
from ckptcore import TrainingState
from ckptcore._manifest import MANIFEST_NAME
from ckptcore._storage import Store
from ckptcore.errors import CheckpointError, SchemaError, UnsafeCheckpointError

pytestmark = pytest.mark.skipif(not hasattr(os, "O_NOFOLLOW") or not hasattr(os, "mkfifo"),
                                reason="needs POSIX links and FIFOs")

CALL_TIMEOUT = 20.0  # seconds; a blocked open of a FIFO would never return

# -------------------------------------------------------------------------- open() audit hook
# Audit hooks cannot be removed, so one is installed per process and switched on while recording.
_RECORD: list | None = None
_HOOKED = False


def _hook(event: str, args: tuple) -> None:
    if _RECORD is not None and event in ("open", "mmap.__new__"):
        _RECORD.append(args if event == "open" else ("<mmap>",) + tuple(args))


def _install_hook() -> None:
    global _HOOKED
    if not _HOOKED:
        sys.addaudithook(_hook)
        _HOOKED = True


def _opens_outside(events: list, folder: str) -> list[str]:
    """Opens of files outside ``folder``: a path there, or a path inside that resolves out of
    it and was opened following links (without ``O_NOFOLLOW``)."""
    folder = os.path.realpath(folder) + os.sep
    bad = []
    for args in events:
        if args[0] == "<mmap>":
            continue
        path, flags = args[0], args[2] if len(args) > 2 else 0
        if isinstance(path, int) or path is None:  # open(fd): no path is looked up
            continue
        path = os.fsdecode(path)
        nofollow = isinstance(flags, int) and bool(flags & os.O_NOFOLLOW)
        parent = os.path.realpath(os.path.dirname(os.path.abspath(path))) + os.sep
        if not parent.startswith(folder) and not path.startswith(folder):
            continue  # not a checkpoint file at all (a module, /proc, ...)
        target = os.path.realpath(path)
        if not nofollow and not (target + os.sep).startswith(folder):
            bad.append(f"{path} -> {target}")
    return bad


# ---------------------------------------------------------------------------------- fixtures
def _state() -> TrainingState:
    return TrainingState(model={"w": np.arange(4096, dtype=np.float32),
                                "b": np.ones(7, dtype=np.int64)}, step=3)


@pytest.fixture
def ckpt(tmp_path):
    """(checkpoint folder, a folder outside it) with a committed checkpoint in the first."""
    url = str(tmp_path / "inside" / "ckpt")
    ckptcore.save_state(url, _state())
    outside = tmp_path / "outside"
    outside.mkdir()
    return url, str(outside)


def _shard_name(url: str) -> str:
    return ckptcore.inspect(url).shards[0]


def _call(fn, *args):
    """Run ``fn(*args)`` in a thread; (returned value, raised exception), or fail if it hangs."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(CALL_TIMEOUT)
    if t.is_alive():
        return None, TimeoutError(f"{fn.__name__} still blocked after {CALL_TIMEOUT} s")
    return out.get("value"), out.get("error")


def _replace(path: str, how: str, outside: str) -> None:
    """Replace the file at ``path`` by ``how``."""
    if how == "link-to-copy":
        copy = os.path.join(outside, "copy-of-" + os.path.basename(path))
        shutil.copyfile(path, copy)
        os.unlink(path)
        os.symlink(copy, path)
    elif how == "link-to-other":
        other = os.path.join(outside, "secret.txt")
        with open(other, "wb") as f:
            f.write(b"not yours\n" * 100)
        os.unlink(path)
        os.symlink(other, path)
    elif how == "fifo":
        os.unlink(path)
        os.mkfifo(path)
    elif how == "directory":
        os.unlink(path)
        os.mkdir(path)
        with open(os.path.join(path, "inner"), "wb") as f:
            f.write(b"x")
    elif how == "dangling-link":
        os.unlink(path)
        os.symlink(os.path.join(outside, "does-not-exist"), path)
    else:  # pragma: no cover
        raise AssertionError(how)


def _unblock(path: str) -> None:
    """Release a reader blocked opening the FIFO at ``path`` (old code), so no thread lingers."""
    try:
        if stat.S_ISFIFO(os.lstat(path).st_mode):
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
    except OSError:
        pass


HOWS = ["link-to-copy", "link-to-other", "fifo", "directory", "dangling-link"]


@pytest.mark.parametrize("which", ["manifest", "shard"])
@pytest.mark.parametrize("how", HOWS)
def test_a_replaced_file_is_refused_and_nothing_outside_is_opened(ckpt, which, how):
    global _RECORD
    url, outside = ckpt
    name = MANIFEST_NAME if which == "manifest" else _shard_name(url)
    path = os.path.join(url, name)
    _replace(path, how, outside)
    _install_hook()
    calls = [("load_state", ckptcore.load_state), ("verify", ckptcore.verify),
             ("inspect", ckptcore.inspect)]
    try:
        for label, fn in calls:
            events: list = []
            _RECORD = events
            try:
                value, error = _call(fn, url)
            finally:
                _RECORD = None
                _unblock(path)
            assert not isinstance(error, TimeoutError), f"{label}: {error} ({how} {which})"
            if label == "inspect" and which == "shard":
                # inspect describes the manifest and reads no shard: it answers.
                assert error is None, f"inspect: {error!r}"
                assert value.shards[0] == name
            else:
                assert isinstance(error, CheckpointError), \
                    f"{label} on a {how} {which}: {type(error).__name__}: {error}"
                assert path in str(error), f"{label}: the error does not name {path}: {error}"
                if how != "directory":
                    assert isinstance(error, UnsafeCheckpointError), f"{label}: {error!r}"
            outside_opens = _opens_outside(events, url)
            assert not outside_opens, f"{label} opened files outside the checkpoint: {outside_opens}"
    finally:
        _unblock(path)


def test_messages_say_what_was_found(ckpt):
    url, outside = ckpt
    shard = os.path.join(url, _shard_name(url))
    _replace(shard, "fifo", outside)
    with pytest.raises(UnsafeCheckpointError, match="named pipe"):
        ckptcore.load_state(url)
    os.unlink(shard)
    _replace_target = os.path.join(outside, "elsewhere.bin")
    with open(_replace_target, "wb") as f:
        f.write(b"\0" * 10)
    os.symlink(_replace_target, shard)
    with pytest.raises(UnsafeCheckpointError, match="symbolic link.*elsewhere.bin"):
        ckptcore.load_state(url)


def test_a_manager_skips_a_step_with_a_linked_shard(tmp_path):
    """restore() falls back past a step whose shard is a link (it is a CheckpointError)."""
    root = str(tmp_path / "run")
    with ckptcore.CheckpointManager(root) as mgr:
        mgr.save(1, _state())
        mgr.save(2, _state())
    step2 = os.path.join(root, "step-000000000002")
    shard = next(n for n in os.listdir(step2) if n.startswith("shard-"))
    _replace(os.path.join(step2, shard), "link-to-copy", str(tmp_path))
    with ckptcore.CheckpointManager(root) as mgr, pytest.warns(Warning, match="step"):
        assert mgr.restore().step == 3  # step 1's state


def test_a_local_shard_costs_one_open_and_one_mmap(tmp_path):
    """Containment adds no per-tensor work: one open and one mmap per shard, one open of the
    manifest, whatever the number of tensors."""
    global _RECORD
    url = str(tmp_path / "many")
    state = TrainingState(model={f"t{i}": np.full(100, i, np.float32) for i in range(3000)})
    with ckptcore._knobs.override(shard_size=400_000):
        ckptcore.save_state(url, state)
    shards = len(ckptcore.inspect(url).shards)
    assert shards >= 3
    _install_hook()
    events: list = []
    _RECORD = events
    try:
        loaded = ckptcore.load_state(url)
    finally:
        _RECORD = None
    assert loaded.model["t2999"][0] == 2999
    opens = [a for a in events if a[0] != "<mmap>" and isinstance(a[0], str) and a[0].startswith(url)]
    mmaps = [a for a in events if a[0] == "<mmap>"]
    assert len(opens) == shards + 1, opens
    assert len(mmaps) == shards
    assert all(a[2] & os.O_NOFOLLOW for a in opens), opens


# ------------------------------------------------------------------- deleting never follows links
@pytest.fixture
def target(tmp_path):
    """A folder outside everything, with files, and a folder holding links to it."""
    t = tmp_path / "target"
    t.mkdir()
    for n in ("manifest.msgpack", "shard-00000-x.bin", "keep.txt"):
        (t / n).write_bytes(b"precious")
    (t / "sub").mkdir()
    (t / "sub" / "deep.bin").write_bytes(b"precious")
    base = tmp_path / "base"
    base.mkdir()
    os.symlink(t, base / "linked-dir")
    os.symlink(t / "keep.txt", base / "linked-file")
    return t, base


def _intact(t) -> None:
    for n in ("manifest.msgpack", "shard-00000-x.bin", "keep.txt", "sub/deep.bin"):
        assert (t / n).read_bytes() == b"precious", n


def test_delete_tree_of_a_linked_folder_removes_the_link_only(target, caplog):
    t, base = target
    with caplog.at_level("WARNING", logger="ckptcore"):
        Store(str(base / "linked-dir")).delete_tree()
    assert not os.path.lexists(base / "linked-dir")
    _intact(t)
    assert any("symbolic link" in r.getMessage() for r in caplog.records)
    Store(str(base)).delete_tree("linked-file")
    assert not os.path.lexists(base / "linked-file")
    _intact(t)


def test_delete_tree_of_a_folder_holding_links_never_follows_them(target):
    t, base = target
    Store(str(base)).delete_tree()
    assert not base.exists()
    _intact(t)


def test_delete_never_deletes_through_a_link(target):
    t, base = target
    store = Store(str(base / "linked-dir"))
    for name in ("manifest.msgpack", "shard-00000-x.bin"):
        with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
            store.delete(name)
    _intact(t)
    Store(str(base)).delete("linked-file")  # the link itself goes
    assert not os.path.lexists(base / "linked-file")
    Store(str(base)).delete("linked-dir")
    assert not os.path.lexists(base / "linked-dir")
    _intact(t)


def test_overwriting_a_linked_checkpoint_path_replaces_the_link_not_its_target(tmp_path):
    real = str(tmp_path / "real")
    ckptcore.save_state(real, _state())
    before = {n: open(os.path.join(real, n), "rb").read() for n in os.listdir(real)}
    link = str(tmp_path / "latest")
    os.symlink(real, link)
    new = TrainingState(model={"w": np.zeros(3, np.float32)}, step=9)
    ckptcore.save_state(link, new, overwrite=True)
    assert not os.path.islink(link) and ckptcore.load_state(link).step == 9
    assert {n: open(os.path.join(real, n), "rb").read() for n in os.listdir(real)} == before
    assert sorted(os.listdir(tmp_path)) == ["latest", "real"]


# ---------------------------------------------------------------------------- read size limits
def test_read_refuses_a_file_over_max_bytes_before_reading_it(tmp_path):
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(8 << 30)  # sparse 8 GiB: reading it would take seconds and the memory
    store = Store(str(tmp_path))
    t0 = time.perf_counter()
    with pytest.raises(SchemaError, match=r"big: 8589934592 bytes.*limit of 1024"):
        store.read("big", max_bytes=1024)
    assert time.perf_counter() - t0 < 5  # reading 8 GiB would take far longer (and the memory)
    (tmp_path / "small").write_bytes(b"12345")
    assert store.read("small", max_bytes=5) == b"12345"
    with pytest.raises(SchemaError):
        store.read("small", max_bytes=4)


def test_read_limit_on_an_object_store(memory_backend):
    store = Store(memory_backend.url())
    memory_backend.write(b"x" * 100, "f")
    with pytest.raises(SchemaError, match="100 bytes.*limit of 10"):
        store.read("f", max_bytes=10)
    assert store.read("f", max_bytes=100) == b"x" * 100


def test_a_huge_manifest_is_refused_unread(ckpt):
    url, _ = ckpt
    with open(os.path.join(url, MANIFEST_NAME), "r+b") as f:
        f.truncate(1 << 20)
    with ckptcore._knobs.override(max_manifest_bytes=1000), \
            pytest.raises(SchemaError, match="limit of 1000"):
        ckptcore.load_state(url)


# ------------------------------------------------------------------------------- the lock file
@pytest.mark.parametrize("how", ["directory", "link", "dangling-link", "fifo"])
def test_a_lock_path_that_is_not_a_file_is_refused_clearly(tmp_path, how):
    root = tmp_path / "run"
    root.mkdir()
    lock = root / ".ckptcore.lock"
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_bytes(b"precious")
    if how == "directory":
        lock.mkdir()
    elif how == "link":
        os.symlink(elsewhere, lock)
    elif how == "dangling-link":
        os.symlink(tmp_path / "nothing", lock)
    else:
        os.mkfifo(lock)
    mgr = ckptcore.CheckpointManager(str(root))
    try:
        value, error = _call(mgr.save, 1, _state())
        assert isinstance(error, UnsafeCheckpointError), repr(error)
        assert str(lock) in str(error) and "not a regular file" in str(error)
        assert "lock=False" in str(error)
    finally:
        _unblock(str(lock))
        mgr.close()
    assert elsewhere.read_bytes() == b"precious"
    assert not (tmp_path / "nothing").exists()
