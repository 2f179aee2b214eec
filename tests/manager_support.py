"""Helpers for the manager's reliability tests: checks, and the child processes.

Child processes are started from a ``forkserver`` that has already imported ckptcore, numpy and
s3fs, so each of the many processes these tests kill costs a fork, not an interpreter start-up.
The functions run in the children are plain module-level functions (``crash_child``,
``save_until_killed``, ``race_child``, ``hold_lock``); they talk back through small files that
survive a SIGKILL (one ``os.write`` per line on an ``O_APPEND`` descriptor).
"""

from __future__ import annotations

import itertools
import json
import logging
import multiprocessing
import os
import signal
import threading
import time
import traceback
from typing import Any

import fsspec

import ckptcore
from ckptcore import KeepLast, TrainingState

# The states: the shared helpers' (the children save them too).
from _support import assert_state_of, make_state  # noqa: F401

MANIFEST = "manifest.msgpack"
LOCK = ".ckptcore.lock"
TMP_MARK = ".tmp-"
# Small shards, so one save writes several of them, concurrently (threads=2).
CHILD_ENV = {"CKPTCORE_SHARD_SIZE": "16384", "CKPTCORE_THREADS": "2"}

_ctx = None


def mp() -> Any:
    """The forkserver multiprocessing context, preloaded with everything a child imports."""
    global _ctx
    if _ctx is None:
        import multiprocessing.forkserver as forkserver
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["manager_support", "s3fs"])
        # Python < 3.12 ignores sys.path in the forkserver (and skips a preload it cannot
        # import, silently): start it with this folder on PYTHONPATH.
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [os.path.dirname(os.path.abspath(__file__))] + ([saved] if saved else []))
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
        _ctx = ctx
    return _ctx


# ------------------------------------------------------------------------------------ managers
def root_of(backend, name: str = "run") -> tuple[str, dict | None]:
    """``(url, storage_options)`` of the root ``name`` on a conftest backend."""
    return backend.url(name), backend.storage_options


def open_manager(backend, name: str = "run", **kw: Any) -> ckptcore.CheckpointManager:
    """A manager on the root ``name`` of a conftest backend."""
    root, options = root_of(backend, name)
    return ckptcore.CheckpointManager(root, storage_options=options, **kw)


# ------------------------------------------------------------------------------------ storage
def fs_path(root: str, options: dict | None) -> tuple[Any, str]:
    fs, path = fsspec.core.url_to_fs(root, **(options or {}))
    fs.invalidate_cache()  # other processes changed the store behind this one's back
    return fs, path.rstrip("/")


def names(fs: Any, path: str) -> list[str]:
    try:
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
    except FileNotFoundError:
        return []


def step_url(root: str, step: int) -> str:
    return f"{root.rstrip('/')}/step-{step:012d}"


def leftovers(root: str, options: dict | None = None) -> list[str]:
    """Everything under ``root`` that is neither a committed checkpoint's file nor the lock.

    Temporary directories, step folders without a manifest, and files in a committed step
    folder that its manifest does not name.
    """
    fs, path = fs_path(root, options)
    found = []
    for name in names(fs, path):
        if name in (LOCK, ".ckptcore.gen"):  # the lock and the writer generations
            continue
        if TMP_MARK in name or not name.startswith("step-"):
            found.append(name)
            continue
        inside = names(fs, f"{path}/{name}")
        if MANIFEST not in inside:
            found.append(f"{name}/ (no manifest: {inside})")
            continue
        named = set(ckptcore.inspect(f"{root.rstrip('/')}/{name}", storage_options=options).shards)
        found += [f"{name}/{n}" for n in inside if n != MANIFEST and n not in named]
    return found


def check_listed_steps(root: str, options: dict | None = None) -> list[int]:
    """Every step the manager lists verifies and holds exactly its state; return the steps."""
    mgr = ckptcore.CheckpointManager(root, storage_options=options, lock=False)
    steps = mgr.steps()
    for s in steps:
        url = step_url(root, s)
        assert ckptcore.verify(url, storage_options=options) == [], f"step {s} does not verify"
        # verify() has read and checked every byte; compare the arrays without a second check
        assert_state_of(ckptcore.load_state(url, verify=False, storage_options=options), s)
    mgr.close()
    return steps


def gc_and_check_clean(root: str, options: dict | None = None) -> None:
    """``gc(grace=0)`` removes every leftover and keeps every committed step."""
    mgr = ckptcore.CheckpointManager(root, storage_options=options, lock=False)
    before = mgr.steps()
    mgr.gc(grace=0)
    assert mgr.steps() == before, "gc() touched a committed checkpoint"
    assert leftovers(root, options) == [], leftovers(root, options)
    mgr.close()


# ------------------------------------------------------------------------------------ children
class Reporter:
    """Lines appended to a file with one ``write`` each: what a child said survives its SIGKILL."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def __call__(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())


def read_lines(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


def _child_setup(options: dict | None) -> dict | None:
    os.environ.update(CHILD_ENV)
    return child_options(options)


def _train_while(handle: ckptcore.SaveHandle, state: TrainingState) -> None:
    """Keep "training" (mutating the saved arrays in place) while an async save is in flight."""
    while not handle.done():
        state.model["dense/kernel"] += 1.0
        state.optimizer.slots["dense/kernel"]["m"] *= -1.0
        time.sleep(0.0005)


def crash_child(root: str, options: dict | None, kill_at: int, async_save: bool,
                report_path: str, lock: bool = True) -> None:
    """On a root holding steps 1 and 2 (see :func:`populate`), save step 3 with
    ``keep=KeepLast(2)`` (which deletes step 1), counting storage operations and SIGKILLing this
    process right before operation ``kill_at`` (0: never; the dry run reports every operation)."""
    options = _child_setup(options)
    from ckptcore import _storage
    say = Reporter(report_path)
    mgr = ckptcore.CheckpointManager(root, keep=KeepLast(2), async_save=async_save,
                                     storage_options=options, lock=lock)
    assert mgr.steps() == [1, 2]
    counter = itertools.count(1)

    def hook(op: str, path: str) -> None:
        n = next(counter)  # atomic under the GIL: shards are written from several threads
        if 0 < kill_at < n:
            # Another writer thread, past the kill point while SIGKILL is on its way: it must
            # not report (or perform) an operation the process never reached (S3 saves write
            # remote_concurrency shards at once; under load one could report several).
            time.sleep(3600)
        say(f"op {n} {op} {path}")
        if n == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    _storage._op_hook = hook
    state = make_state(3)
    handle = mgr.save(3, state)
    if async_save:
        _train_while(handle, state)
    handle.result()
    _storage._op_hook = None
    say("committed 3")
    mgr.close()


def populate(template: str, roots: list[str], options: dict | None) -> None:
    """Save steps 1 and 2 at ``template`` and copy them to each of ``roots`` (copies are
    cheaper than saves on the S3 server; a checkpoint folder is relocatable)."""
    with ckptcore.CheckpointManager(template, storage_options=options, lock=False) as mgr:
        for s in (1, 2):
            mgr.save(s, make_state(s))
    fs, src = fs_path(template, options)
    for root in roots:
        dst = fs_path(root, options)[1]
        fs.makedirs(dst, exist_ok=True)
        for name in names(fs, src):
            fs.copy(f"{src}/{name}", f"{dst}/{name}", recursive=True)


def save_until_killed(root: str, options: dict | None, async_save: bool, report_path: str,
                      lock: bool = True) -> None:
    """A resumed run: save steps latest+1, latest+2, ... with ``keep=KeepLast(2)`` until killed,
    reporting each step once it is committed and its retention is done."""
    options = _child_setup(options)
    say = Reporter(report_path)
    mgr = ckptcore.CheckpointManager(root, keep=KeepLast(2), async_save=async_save,
                                     storage_options=options, lock=lock)
    step = (mgr.latest_step() or 0) + 1
    say(f"started {step}")
    while True:
        state = make_state(step)
        handle = mgr.save(step, state)
        if async_save:
            _train_while(handle, state)
        handle.result()
        say(f"committed {step}")
        step += 1


def race_child(mode: str, url: str, options: dict | None, barrier: Any, result_path: str,
               lock: bool = False, commit_barrier: Any = None) -> None:
    """Wait at ``barrier``, then save step 7 (``mode``: "save_state" to ``url`` directly, or
    "manager" on root ``url``); write the outcome (``ok`` or the exception's class) to a file.

    With ``commit_barrier``, also wait there right before the commit (the rename, or the
    manifest's publication), so that both writers have passed every check and written every
    shard before either commits."""
    options = _child_setup(options)
    if commit_barrier is not None:
        from ckptcore import _storage

        def hook(op: str, path: str) -> None:
            if op in ("rename", "publish"):
                commit_barrier.wait(30)

        _storage._op_hook = hook
    state = make_state(7)
    mgr = None
    if mode == "manager":
        mgr = ckptcore.CheckpointManager(url, storage_options=options, lock=lock)
        mgr.steps()  # warm the connection up before the start line
    else:
        ckptcore.CheckpointManager(url.rsplit("/", 1)[0], storage_options=options, lock=False).steps()
    outcome = {"pid": os.getpid()}
    try:
        barrier.wait(timeout=30)
        if mgr is not None:
            mgr.save(7, state).result()
        else:
            ckptcore.save_state(url, state, storage_options=options)
        outcome["result"] = "ok"
    except Exception as e:  # noqa: BLE001 - reported to the parent, which judges it
        outcome.update(result=type(e).__name__, message=str(e), tb=traceback.format_exc())
    finally:
        if mgr is not None:
            try:
                mgr.close()
            except Exception:  # noqa: BLE001
                pass
    with open(result_path, "w") as f:
        json.dump(outcome, f)


def hold_lock(root: str, options: dict | None, report_path: str, release: Any,
              kw: dict | None = None) -> None:
    """Take the writer lock by saving step 1, say so, then hold it until ``release`` is set
    (then close the manager normally), or until killed.  ``kw``: more manager arguments."""
    say = Reporter(report_path)
    mgr = ckptcore.CheckpointManager(root, storage_options=child_options(options), **(kw or {}))
    mgr.save(1, make_state(1)).result()
    say(f"holding {os.getpid()}")
    release.wait(60)
    mgr.close()
    say("released")


def wait_for_line(path: str, prefix: str, timeout: float = 30.0, proc: Any = None) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in read_lines(path):
            if line.startswith(prefix):
                return line
        if proc is not None and not proc.is_alive():
            break
        time.sleep(0.01)
    raise AssertionError(f"no line {prefix!r} in {path}: {read_lines(path)}")


class Gate:
    """An ``_op_hook`` that blocks a background thread before a chosen operation until opened,
    recording every operation (to see when a save is held mid-write)."""

    def __init__(self, block_op: str = "rename|publish"):
        self.block = set(block_op.split("|"))
        self.ops: list[tuple[str, str, str]] = []
        self.reached = threading.Event()
        self.opened = threading.Event()

    def __call__(self, op: str, path: str) -> None:
        thread = threading.current_thread().name
        self.ops.append((op, path, thread))
        if op in self.block and thread != "MainThread" and not self.opened.is_set():
            self.reached.set()
            assert self.opened.wait(30), "gate never opened"

    def open(self) -> None:
        self.opened.set()


# The S3 test server logs every request through werkzeug; pytest would capture each line.
logging.getLogger("werkzeug").setLevel(logging.WARNING)


def _warm_s3_session() -> Any:
    """An aiobotocore session with S3's service model already parsed, made once in the forkserver
    so that each forked child skips the ~0.3 s of loading it (children pass it to s3fs)."""
    try:
        from aiobotocore.session import AioSession
    except ImportError:
        return None
    session = AioSession()
    loader = session.get_component("data_loader")  # caches what it parses
    for kind in ("service-2", "endpoint-rule-set-1"):
        loader.load_service_model("s3", kind)
    return session


_S3_SESSION = _warm_s3_session()


def child_options(options: dict | None) -> dict | None:
    if options is None or _S3_SESSION is None or "client_kwargs" not in options:
        return options
    return dict(options, session=_S3_SESSION)
