"""Fencing races forced with the storage operation hook (``ckptcore._storage._op_hook``) and the
lease clock of ``tests/_faults.py`` (docs/RELIABILITY.md, "Fencing"):

* a claim that cannot read the newest writer record (an I/O failure) raises a retryable
  ``StorageError`` instead of writing every step, a fenced writer's commit included, into its
  own ``accepted`` list; readers raise it too; a malformed record is still judged as none;
* a holder whose renewal was overdue and that races a taker is never told a save succeeded
  while readers ignore the step: it is fenced, or the taker accepts the step.

Every thread pause stands for a slow request or a stopped process (SIGSTOP).
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
import warnings

import pytest

import ckptcore
from ckptcore import CheckpointManager, FencedError, Lease, StorageError, _fence, _storage
from ckptcore._storage import RemoteStore, Store

import _faults
from _support import tiny_state

LEASE = Lease(seconds=30, heartbeat=10)


@pytest.fixture
def clock():
    with _faults.installed():
        logging.getLogger("ckptcore").setLevel(logging.NOTSET)  # (installed() mutes it)
        yield _faults.CLOCK


def _root(name: str) -> str:
    return f"memory://fencing-races-{name}-{uuid.uuid4().hex[:10]}/run"


def _mgr(root: str, **kw) -> CheckpointManager:
    return CheckpointManager(root, lease=LEASE, save_on_preemption=False, **kw)


def _reader_steps(root: str) -> list[int]:
    return CheckpointManager(root, lock=False, save_on_preemption=False).steps()


def _fenced_step_3(root: str, clock) -> None:
    """Writer A commits step 1, is paused right before publishing step 3 while T takes the
    root over (A's lease lapses) and saves step 2; A then publishes step 3: readers ignore it."""
    a = _mgr(root)
    a.save(1, tiny_state(1))
    fired = []

    def hook(op, path):
        if op == "publish" and "step-000000000003" in path and not fired:
            fired.append(path)
            clock.advance(LEASE.seconds + 1)
            with _mgr(root) as t:
                t.restore()
                t.save(2, tiny_state(2))

    _storage._op_hook = hook
    try:
        with pytest.raises(FencedError, match="readers ignore it"):
            a.save(3, tiny_state(3))
    finally:
        _storage._op_hook = None
    assert fired and _reader_steps(root) == [1, 2]


class _FailOnce:
    """One read of the newest writer record fails as the store would after its retries."""

    def __init__(self, monkeypatch, exc=None) -> None:
        self.failed: list[str] = []
        self.exc = exc
        real = RemoteStore.read

        def read(store, rel, **kw):
            if f"{_fence.GEN_DIR}/" in rel and not rel.endswith(".index") and not self.failed:
                self.failed.append(rel)
                raise self.exc or StorageError(f"{store.url}/{rel}: read failed: "
                                               "ReadTimeoutError (injected)")
            return real(store, rel, **kw)

        monkeypatch.setattr(RemoteStore, "read", read)


def test_a_claim_that_cannot_read_the_newest_record_raises_and_accepts_nothing(clock, monkeypatch):
    root = _root("claim-io")
    _fenced_step_3(root, clock)
    gens = _fence.generations(Store(root))
    fail = _FailOnce(monkeypatch)
    c = _mgr(root)
    with pytest.raises(StorageError, match="generation 2 cannot be read.*try again"):
        c._lock.acquire()  # a save's, gc's or ckpt sync's acquisition
    assert fail.failed
    assert _fence.generations(Store(root)) == gens  # nothing claimed from an unread view
    c.close()
    # Retried (the read works now): the fenced step stays fenced for every reader.
    with _mgr(root) as c:
        c._lock.acquire()
        assert sorted(c._lock._accepted) == [1, 2]
        assert c.restore().step == 2
    assert _reader_steps(root) == [1, 2]


@pytest.mark.parametrize("exc", [None, PermissionError("access denied (injected)")],
                         ids=["storage-error", "permission-error"])
def test_a_reader_that_cannot_read_the_newest_record_raises_a_typed_error(clock, monkeypatch, exc):
    """A listing (restore, steps, ckpt ls) facing an I/O failure on the record raises a
    ``StorageError`` (an ``OSError``, as a failed listing does) rather than accept every step,
    the fenced one included."""
    root = _root("reader-io")
    _fenced_step_3(root, clock)
    _FailOnce(monkeypatch, exc)
    with pytest.raises(StorageError, match="cannot be read") as info:
        _reader_steps(root)
    assert isinstance(info.value, OSError)
    assert _reader_steps(root) == [1, 2]  # once it reads again


def test_ckpt_ls_reports_an_unreadable_record_as_an_error(clock, monkeypatch, capsys):
    from ckptcore import cli
    root = _root("ls-io")
    _fenced_step_3(root, clock)
    _FailOnce(monkeypatch)
    assert cli.main(["ls", root]) != 0
    err = capsys.readouterr().err
    assert "cannot be read" in err and "Traceback" not in err


def test_a_malformed_record_is_judged_as_none_and_the_claim_says_so(clock, caplog):
    """A record that is there but is no record (junk, a hostile write), which no retry changes:
    readers accept every step (none is hidden), and a claim over it records them all, logged."""
    root = _root("malformed")
    _fenced_step_3(root, clock)
    store = Store(root)
    newest = _fence.generations(store)[-1]
    store.write_bytes(_fence.gen_name(newest), b"{not json")
    with caplog.at_level(logging.WARNING, logger="ckptcore"):
        assert _reader_steps(root) == [1, 2, 3]
        with _mgr(root) as c:
            c._lock.acquire()
            assert sorted(c._lock._accepted) == [1, 2, 3]
    text = caplog.text
    assert f"record of writer generation {newest} is malformed" in text
    assert "every committed step is accepted" in text
    assert f"claiming writer generation {newest + 1} over a newest record that is absent or " \
           "malformed" in text
    assert json.loads(store.read(_fence.gen_name(newest + 1)))["accepted"] == [1, 2, 3]


# -- the reclaim race (review defect 6) ----------------------------------------------------------
def _race(root: str, clock, pause_t, pause_a, *, t_waits_at_gen: bool):
    """A saved step 1 and stalls past its lease; T takes the root over while A saves step 2.
    ``pause_t(op, path, n)``: True at the operation of T (its n-th lease write) where T waits
    until A reaches ``pause_a``; A then waits until T reaches its generation create (if
    ``t_waits_at_gen``: T waits there until A's save is over)."""
    a = _mgr(root)
    a.save(1, tiny_state(1))
    clock.advance(LEASE.seconds + 1)
    ev = {k: threading.Event() for k in ("t", "a", "t_gen", "a_done")}
    seen, lease_writes = set(), {"T": 0}

    def hook(op, path):
        who = threading.current_thread().name
        if who == "T" and op == "write_bytes" and path.endswith("/.ckptcore.lock"):
            lease_writes["T"] += 1
        if who == "T" and "T" not in seen and pause_t(op, path, lease_writes["T"]):
            seen.add("T"); ev["t"].set(); ev["a"].wait(10)
        elif who == "A" and "A" not in seen and pause_a(op, path):
            seen.add("A"); ev["a"].set(); ev["t_gen"].wait(10)
        elif (who == "T" and "gen" not in seen and op == "write_bytes"
              and f"/{_fence.GEN_DIR}/" in path and not path.endswith(".index")):
            seen.add("gen"); ev["t_gen"].set()
            if t_waits_at_gen:
                ev["a_done"].wait(10)

    res = {}

    def run_t():
        try:
            t = _mgr(root)
            t._lock.acquire()
            res["T"] = t
        except Exception as e:  # noqa: BLE001 - reported below
            res["T"] = e

    def run_a():
        ev["t"].wait(10)  # A wakes while T is in the middle of its takeover
        try:
            res["A"] = a.save(2, tiny_state(2)).result()
        except Exception as e:  # noqa: BLE001 - reported below
            res["A"] = e
        finally:
            ev["a_done"].set()

    _storage._op_hook = hook
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            threads = [threading.Thread(target=run_t, name="T"),
                       threading.Thread(target=run_a, name="A")]
            for th in threads:
                th.start()
            for th in threads:
                th.join(30)
    finally:
        _storage._op_hook = None
    assert {"T", "A", "gen"} <= seen, seen
    return res


def _consistent(root: str, res: dict) -> None:
    """A's save(2) was acknowledged iff readers accept step 2."""
    acked = not isinstance(res["A"], BaseException)
    if not acked:
        assert isinstance(res["A"], FencedError), res["A"]
    assert (2 in _reader_steps(root)) == acked, (res, _reader_steps(root))


def test_a_reclaim_whose_lease_create_loses_to_a_taker_is_fenced(clock):
    """A reclaims in the window where T deleted the lapsed lease but has not created its own:
    A claims generation 2, and its create of the lease loses to T's.  A cannot tell whether T's
    claim comes after its own (then T supersedes it, listing the steps before A's next commit),
    so it stops: its save raises FencedError, and readers never list step 2.  (It was told
    the save succeeded while every reader ignored step 2.)"""
    root = _root("reclaim-lost-create")
    res = _race(root, clock,
                # T's create of the lease after its delete (its 2nd lease write)
                pause_t=lambda op, path, n: op == "write_bytes" and n == 2,
                pause_a=lambda op, path: op == "write_bytes" and path.endswith("/.ckptcore.lock"),
                t_waits_at_gen=True)
    assert isinstance(res["A"], FencedError), res["A"]
    assert not isinstance(res["T"], BaseException), res["T"]
    assert res["T"]._lock.generation == 3
    _consistent(root, res)
    assert _reader_steps(root) == [1]


def test_a_commit_between_a_takers_listing_and_its_claim_is_accepted(clock):
    """T judged A's lease lapsed and deletes it; A (overdue) reclaims meanwhile, renewing the
    lease T then deletes; T lists the steps, and before T creates its generation A commits step
    2, records it and finds no newer generation after it.  T reads A's record again once its
    generation exists, so it accepts step 2: A's acknowledged save is listed by every reader."""
    root = _root("taker-relists")
    res = _race(root, clock,
                pause_t=lambda op, path, n: op == "delete" and path.endswith("/.ckptcore.lock"),
                pause_a=lambda op, path: op == "write_bytes" and path.endswith("/.ckptcore.lock"),
                t_waits_at_gen=True)
    assert not isinstance(res["A"], BaseException), res["A"]
    _consistent(root, res)
    assert _reader_steps(root) == [1, 2]


def test_a_writer_renewed_in_time_still_finds_a_claim_made_before_its_commit(clock):
    """As above, but T's claim completes before A publishes step 2 (A is paused between its
    fence check and the PUT).  A renewed its lease in time, yet T had judged it lapsed: the
    check after the commit lists the generations, finds T's, and tells A that readers ignore
    step 2 (FencedError) instead of acknowledging it."""
    root = _root("after-commit-lists")
    res_holder = {}
    a = _mgr(root)
    a.save(1, tiny_state(1))
    clock.advance(LEASE.seconds + 1)
    ev = {k: threading.Event() for k in ("t_at_delete", "a_renewed", "t_done")}
    seen = set()

    def hook(op, path):
        who = threading.current_thread().name
        if who == "T" and "T" not in seen and op == "delete" and path.endswith("/.ckptcore.lock"):
            seen.add("T"); ev["t_at_delete"].set(); ev["a_renewed"].wait(10)
        elif (who == "A" and "A-lease" not in seen and op == "write_bytes"
              and path.endswith("/.ckptcore.lock")):
            seen.add("A-lease")
        elif who == "A" and "A-pub" not in seen and op == "publish":
            seen.add("A-pub"); ev["a_renewed"].set(); ev["t_done"].wait(10)

    def run_t():
        try:
            t = _mgr(root)
            t._lock.acquire()
            res_holder["T"] = t
        except Exception as e:  # noqa: BLE001
            res_holder["T"] = e
        finally:
            ev["t_done"].set()

    def run_a():
        ev["t_at_delete"].wait(10)
        try:
            res_holder["A"] = a.save(2, tiny_state(2)).result()
        except Exception as e:  # noqa: BLE001
            res_holder["A"] = e

    _storage._op_hook = hook
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            threads = [threading.Thread(target=run_t, name="T"),
                       threading.Thread(target=run_a, name="A")]
            for th in threads:
                th.start()
            for th in threads:
                th.join(30)
    finally:
        _storage._op_hook = None
    assert seen == {"T", "A-lease", "A-pub"}, seen
    assert not isinstance(res_holder["T"], BaseException), res_holder["T"]
    assert isinstance(res_holder["A"], FencedError), res_holder["A"]
    assert "readers ignore it" in str(res_holder["A"])
    _consistent(root, res_holder)
    assert _reader_steps(root) == [1]

