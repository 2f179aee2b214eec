"""Two writers racing for one checkpoint: exactly one commits, the other is told, nothing leaks.

Two processes are released together (a multiprocessing barrier) and both save step 7: with
``save_state`` to the same URL, and through managers on the same root (``lock=False``, so only
the commit protocol stands between them; and ``lock=True``, where the writer lock may turn the
second away first).  The ``commit`` variants hold both writers at a second barrier right before
their commit (the rename on local disk, the create-only manifest PUT on S3), so each round is a
true race of two complete, checked saves for the commit itself.

moto's server checks ``If-None-Match`` and stores the object in two steps while serving requests
on parallel threads; S3 itself decides a conditional PUT atomically.  The ``atomic_s3_puts``
fixture serialises moto's PutObject handling so that the test server keeps S3's promise; it
changes nothing on the client side.
"""

from __future__ import annotations

import json
import threading

import pytest

import ckptcore
from ckptcore import CheckpointManager
from manager_support import gc_and_check_clean, leftovers, mp, race_child, step_url
from _support import assert_state_of, store_params

ROUNDS = {"local": 3, "s3": 2}


@pytest.fixture
def atomic_s3_puts(monkeypatch):
    from moto.s3.responses import S3Response
    lock = threading.Lock()
    put_object = S3Response.put_object

    def serialised(self):
        with lock:
            return put_object(self)

    monkeypatch.setattr(S3Response, "put_object", serialised)


@pytest.fixture(params=store_params("local", "s3"))
def where(request, tmp_path):
    """(base URL, storage options, rounds) of one backend."""
    if request.param == "local":
        return str(tmp_path / "store"), None, ROUNDS["local"]
    request.getfixturevalue("atomic_s3_puts")
    backend = request.getfixturevalue("s3_backend")
    return backend.prefix, backend.storage_options, ROUNDS["s3"]


def _race(tmp_path, name: str, mode: str, url: str, options: dict | None, *, lock: bool = False,
          at_commit: bool = False) -> list[dict]:
    barrier = mp().Barrier(2)
    commit_barrier = mp().Barrier(2) if at_commit else None
    paths = [str(tmp_path / f"{name}-{i}.json") for i in range(2)]
    procs = [mp().Process(target=race_child,
                          args=(mode, url, options, barrier, path, lock, commit_barrier))
             for path in paths]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    outcomes = []
    for path in paths:
        with open(path) as f:
            outcomes.append(json.load(f))
    return outcomes


def _check_one_winner(outcomes: list[dict], root: str, options: dict | None, *,
                      losers=("CheckpointExistsError",)) -> dict:
    results = sorted(o["result"] for o in outcomes)
    winners = [o for o in outcomes if o["result"] == "ok"]
    assert len(winners) == 1, outcomes  # exactly one commits, never both, never neither
    loser = next(o for o in outcomes if o["result"] != "ok")
    assert loser["result"] in losers, loser.get("tb", loser)
    # The checkpoint at step 7 is the winner's own, whole and verified.
    url = step_url(root, 7)
    info = ckptcore.inspect(url, storage_options=options)
    assert info.writer["pid"] == winners[0]["pid"], (info.writer, outcomes)
    assert ckptcore.verify(url, storage_options=options) == []
    assert_state_of(ckptcore.load_state(url, storage_options=options), 7)
    # The loser cleaned up after itself: no temporary folder, no stray shard.
    with CheckpointManager(root, storage_options=options, lock=False) as reader:
        assert reader.steps() == [7]
    assert leftovers(root, options) == [], results
    gc_and_check_clean(root, options)
    return loser


@pytest.mark.parametrize("mode", ["save_state", "manager"])
@pytest.mark.parametrize("at_commit", [False, True], ids=["free", "commit"])
@pytest.mark.slow
def test_two_writers_one_commit(where, tmp_path, mode, at_commit):
    base, options, rounds = where
    for i in range(rounds):
        root = f"{base}/{mode}-{at_commit}-{i}"
        url = step_url(root, 7) if mode == "save_state" else root
        outcomes = _race(tmp_path, f"{mode}-{at_commit}-{i}", mode, url, options,
                         at_commit=at_commit)
        loser = _check_one_winner(outcomes, root, options)
        if at_commit:  # both passed the "already exists?" check: the commit itself decided
            assert "another writer committed" in loser["message"], loser["message"]


@pytest.mark.slow
def test_two_managers_with_the_writer_lock(where, tmp_path):
    # Which error the second writer gets depends on timing (the lock, or the finished
    # checkpoint if the first had already released the lock); two commits are never correct.
    base, options, rounds = where
    for i in range(rounds):
        root = f"{base}/locked-{i}"
        outcomes = _race(tmp_path, f"locked-{i}", "manager", root, options, lock=True)
        _check_one_winner(outcomes, root, options, losers=("LockedError", "CheckpointExistsError"))
