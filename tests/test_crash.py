"""SIGKILL a process that is saving checkpoints, many times; what reads as committed must be whole.

A saver process (forked from a small fork server, so it starts in milliseconds) saves a few-MB
state over and over: to fresh names (``overwrite=False``) and to one name it overwrites
(``overwrite=True``), logging ``begin NAME I`` before and ``committed NAME I`` after each save.
The test kills it with SIGKILL, either after a seeded random delay or, for a few runs, the saver
kills itself from the storage layer's fault-injection hook at a chosen operation (before a save
starts, between shards, before the manifest, before the rename, after the commit).  After every
kill:

* every checkpoint the child reported committed still loads, verifies, and holds its values;
* the overwritten checkpoint is the last committed version or the one being saved, never
  unreadable, never a mixture;
* every directory holding a manifest, including temporary leftovers, loads and verifies or is
  refused with a typed error; directories without one are not checkpoints.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

import ckptcore
from ckptcore._commit import TMP_MARK
from ckptcore.errors import CheckpointError, CheckpointNotFoundError

from _support import assert_state_same

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")

ELEMS = 1 << 18  # 1 MiB per float32 tensor, 4 tensors, shards of 1 MiB: several files per save
RANDOM_KILLS = 25
HOOK_KILLS = [  # (operation, n-th occurrence) at which the saver kills itself
    ("begin", 2),         # about to start a save, nothing written yet
    ("open_write", 1),    # the first save's temporary directory exists, no shard yet
    ("open_write", 3),    # between shards
    ("write_bytes", 1),   # shards done, manifest not yet written
    ("rename", 1),        # manifest written in the temporary directory, not yet renamed
    ("rename", 2),        # the overwrite's exchange
    ("delete", 1),        # after the overwrite's commit, removing the old checkpoint
    ("delete_tree", 1),   # ditto, a little later
]


# Shared verbatim by the child (which must start fast: no pytest import) and by the checks here.
STATE_SRC = f"""
import numpy as np
from ckptcore import TrainingState

def make_state(i, elems={ELEMS}):
    base = np.arange(elems, dtype=np.float32)
    return TrainingState(model={{f"w{{k}}": base + (i * 10 + k) for k in range(4)}},
                         extra={{"i": i}}, step=i)
"""
exec(STATE_SRC)  # defines make_state here

# A fork server: imports once, then forks one saver per request, so each of the many killed
# savers starts in milliseconds.  Requests on stdin: "LOG START OP NTH"; answers on stdout:
# "pid PID" once the saver runs, "warm" (from the saver) once its storage client is ready, and
# "exit STATUS" once it is dead.  Savers log their saves to LOG.
SERVER = STATE_SRC + r"""
import json, os, signal, sys
import ckptcore
from ckptcore import _storage

root, options, elems = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
if root.startswith("s3://"):
    import s3fs  # imported here, instantiated in each saver (no event loop crosses a fork)

def say(line):  # one write(2) per line: the saver and the server share this pipe
    os.write(1, (line + "\n").encode())

def saver(log, i, kill_op, kill_nth):
    if kill_op != "-":
        seen = [0]
        def hook(op, path):
            if op == kill_op:
                seen[0] += 1
                if seen[0] == kill_nth:
                    os.kill(os.getpid(), signal.SIGKILL)
        _storage._op_hook = hook
    out = open(log, "w", buffering=1)
    import fsspec
    fsspec.core.url_to_fs(root, **options)[0].exists(root)  # a warm client before the clock starts
    say("warm")
    begun = 0
    while True:
        for name, overwrite in ((f"fresh-{i:04d}", False), ("hot", True)):
            out.write(f"begin {name} {i}\n")
            begun += 1
            if kill_op == "begin" and begun == kill_nth:
                os.kill(os.getpid(), signal.SIGKILL)
            ckptcore.save_state(root + "/" + name, make_state(i, elems), overwrite=overwrite,
                                storage_options=options)
            out.write(f"committed {name} {i}\n")
        i += 1

say("ready")
for line in sys.stdin:
    log, i, kill_op, kill_nth = line.split()
    pid = os.fork()
    if pid == 0:
        try:
            saver(log, int(i), kill_op, int(kill_nth))
        finally:
            os._exit(1)
    say(f"pid {pid}")
    say(f"exit {os.waitpid(pid, 0)[1]}")
"""


@pytest.fixture
def fork_server():
    procs = []

    def start(backend, elems):
        env = dict(os.environ, CKPTCORE_SHARD_SIZE=str(elems * 4), PYTHONDONTWRITEBYTECODE="1")
        p = subprocess.Popen([sys.executable, "-c", SERVER, backend.prefix,
                              json.dumps(backend.storage_options), str(elems)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        procs.append(p)
        assert p.stdout.readline().strip() == "ready"
        return p

    yield start
    for p in procs:
        p.stdin.close()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _run_saver(server, backend, log, start: int, delay: float | None, hook=("-", 0)) -> list[str]:
    """Start one saver, SIGKILL it after ``delay`` (or let its hook do it); its log lines."""
    server.stdin.write(f"{log} {start} {hook[0]} {hook[1]}\n")
    server.stdin.flush()
    got: dict[str, str] = {}
    while len(got) < 2:  # "pid" (server) and "warm" (saver) may arrive in either order
        line = server.stdout.readline()
        assert line, "the fork server died"
        kind, _, value = line.strip().partition(" ")
        assert kind in ("pid", "warm"), line
        got[kind] = value
    pid = got["pid"]
    if delay is not None:
        time.sleep(delay)
        os.kill(int(pid), signal.SIGKILL)
    kind, status = server.stdout.readline().split()
    assert kind == "exit"
    assert os.WIFSIGNALED(int(status)) and os.WTERMSIG(int(status)) == signal.SIGKILL, status
    backend.fs.invalidate_cache()  # another process changed the store behind our back
    with open(log) as f:
        return f.read().splitlines()


ELEMS_ON = {"local": ELEMS, "s3": ELEMS // 4}  # S3 on moto costs per request: smaller there


def _expected(backend, i: int):
    return make_state(i, ELEMS_ON[backend.name])


def _load(backend, name: str):
    return ckptcore.load_state(backend.url(name), storage_options=backend.storage_options)


def _has_manifest(backend, name: str) -> bool:
    return "manifest.msgpack" in backend.listdir(name)


def _leftovers(backend, name: str) -> bool:
    """Traces of an interrupted save of ``name``: a temporary sibling (local) or stray shards."""
    if backend.name == "local":
        return any(n.startswith(f".{name}{TMP_MARK}") for n in backend.listdir())
    files = set(backend.listdir(name))
    if "manifest.msgpack" not in files:
        return bool(files)
    return bool(files - {"manifest.msgpack"} - set(ckptcore.inspect(
        backend.url(name), storage_options=backend.storage_options).shards))


def _check(backend, committed: dict[str, int], in_flight: tuple[str, int] | None, new: set[str]) -> str:
    """The invariants after one kill; returns where the kill landed: before/during/after a commit.

    Checks the checkpoints committed since the last kill and the last one before it (all of them
    are swept once more at the end).
    """
    fresh = sorted(n for n in committed if n != "hot")
    for name in set(fresh[-1:]) | (new - {"hot"}):
        assert_state_same(_load(backend, name), _expected(backend, committed[name]))
    if not in_flight:
        if "hot" in committed:
            assert_state_same(_load(backend, "hot"), _expected(backend, committed["hot"]))
        return "between saves"
    name, i = in_flight
    leftovers = _leftovers(backend, name)
    if name == "hot" and ("hot" in committed or _has_manifest(backend, "hot")):
        hot = _load(backend, "hot")
        assert hot.step in (committed.get("hot"), i)  # the old one or the new one, whole
        assert_state_same(hot, _expected(backend, hot.step))
        return "after commit" if hot.step == i else "during" if leftovers else "before"
    if _has_manifest(backend, name):
        assert_state_same(_load(backend, name), _expected(backend, i))
        return "after commit"
    with pytest.raises(CheckpointNotFoundError):
        _load(backend, name)
    return "during" if leftovers else "before"


def _sweep(backend) -> int:
    """Every directory with a manifest is whole, or (a temporary one) refused with a typed error."""
    checked = 0
    for name in backend.listdir():
        if not _has_manifest(backend, name):
            with pytest.raises(CheckpointNotFoundError):
                _load(backend, name)
            continue
        try:
            state = _load(backend, name)
        except CheckpointError:
            if TMP_MARK in name:
                continue
            raise
        assert ckptcore.verify(backend.url(name), storage_options=backend.storage_options) == [], name
        assert_state_same(state, _expected(backend, state.step))
        checked += 1
    return checked


def _kill_repeatedly(server, backend, log, runs: list) -> dict[str, int]:
    committed: dict[str, int] = {}
    landed: dict[str, int] = {}
    start, began = 1, 0
    for delay, hook in runs:
        lines = _run_saver(server, backend, log, start, delay, hook)
        in_flight, new = None, set()
        for line in lines:
            m = re.fullmatch(r"(begin|committed) (\S+) (\d+)", line)
            assert m, line
            kind, name, i = m.group(1), m.group(2), int(m.group(3))
            if kind == "begin":
                in_flight, began = (name, i), max(began, i)
            else:
                committed[name] = i
                in_flight = None
                new.add(name)
        where = _check(backend, committed, in_flight, new)
        if where == "after commit":  # committed, killed before it could say so
            committed[in_flight[0]] = in_flight[1]
        landed[where] = landed.get(where, 0) + 1
        start = began + 1
    assert _sweep(backend) >= len([n for n in committed if n != "hot"])
    print(f"{backend.name}: kills landed {landed}")
    return landed


@pytest.mark.slow
def test_sigkill_during_local_saves(local_backend, fork_server, tmp_path):
    rnd = random.Random(20240531)
    runs = [(None, hook) for hook in HOOK_KILLS] + [(rnd.uniform(0.0, 0.3), ("-", 0))
                                                    for _ in range(RANDOM_KILLS)]
    landed = _kill_repeatedly(fork_server(local_backend, ELEMS_ON["local"]), local_backend, tmp_path / "log", runs)
    assert sum(landed.values()) >= 20
    # The hooks guarantee each phase at least once, whatever the timing of the random kills.
    assert landed.get("before") and landed.get("during") and landed.get("after commit"), landed


S3_HOOK_KILLS = [
    ("begin", 3),         # about to start a save, nothing written yet
    ("open_write", 2),    # between shards
    ("publish", 1),       # shards written, manifest not yet published
    ("publish", 2),       # the overwrite's publish
    ("delete", 1),        # after the overwrite's publish, removing the old shards
]


@pytest.mark.slow
def test_sigkill_during_s3_saves(s3_backend, fork_server, tmp_path):
    """The same on S3 (moto in this process, s3fs in the saver): the manifest's publish is the commit."""
    rnd = random.Random(7)
    runs = [(None, hook) for hook in S3_HOOK_KILLS] + [(rnd.uniform(0.0, 0.5), ("-", 0))
                                                       for _ in range(6)]
    landed = _kill_repeatedly(fork_server(s3_backend, ELEMS_ON["s3"]), s3_backend, tmp_path / "log", runs)
    assert landed.get("before") and landed.get("during") and landed.get("after commit"), landed
