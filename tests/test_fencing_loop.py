"""Fencing under a storm of pauses (docs/RELIABILITY.md, "Fencing"): real writer processes
(tests/_fence_loop_worker.py) share one bucket root on each object store (moto S3,
fake-gcs-server, Azurite) and keep taking it from each other, while this process stops random
writers with SIGSTOP for random times from well below to well above the lease (seeded) and lets
them go on with SIGCONT.

Each writer loops: take the root's lease, restore the newest step, save step after step (sync,
async, or each in turn); on LockedError or FencedError it opens a new manager and waits for the
lease.  Each writer logs every attempt, acknowledgement (with the manifest's writer id) and error,
one ``os.write`` per line on an O_APPEND descriptor.  Once every writer has stopped, a fresh
reader checks:

1. no fenced commit is visible: every step readers list (``CheckpointManager(lock=False)
   .steps()`` and ``list_checkpoints``) was acknowledged to its writer, with the writer id of its
   manifest, and none is a commit its writer was told landed after the takeover.  (A save that
   raised FencedError although readers accept its step is counted and printed apart:
   ``visible_after_fenced_error``, ``restored_after_fenced_error``.)
2. no acknowledged step is lost: the newest listed step is the newest acknowledged one, and every
   writer that took the root over restored a step at least as new as every step acknowledged
   before it began restoring (and that step was an acknowledged save);
3. every listed step loads bit for bit as its writer saved it;
4. writers only ever met LockedError and FencedError.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
import zlib
from collections import Counter
from pathlib import Path

import pytest

import ckptcore
from _fence_loop_worker import make_state
from _support import assert_tree_same, subprocess_env

HERE = Path(__file__).parent
LEASE, BEAT = 6.0, 2.0
LOOP_SECONDS = 70.0  # pauses are sent for this long (longer if fewer than MIN_PAUSES so far)
MAX_LOOP_SECONDS = 110.0
MIN_PAUSES = 50
# Saves must go on under the pauses (else the loop proves nothing).  Alone a store acknowledges
# 15-140 saves in the loop; on two cores shared with the other suites, as few as 6 (the writers
# spend the loop paused or waiting out leases): a floor, not a throughput target.
MIN_ACKS = 5
MAX_LONG_PAUSED = 2  # writers stopped at once before the third may be, and then only briefly
SHORT_PAUSE = 2.0
HOLDER_AIM = {False: 0.3, True: 0.8}  # chance to aim a pause (below, above the lease) at the holder
PAUSE_RANGE = (0.5, 15.0)  # log-uniform: a third of the pauses exceed the lease
WRITERS = ("sync", "async", "mixed")
KEEP = {"s3": "2", "gcs": "last3", "azure": "2"}
EXPECTED_ERRORS = {"LockedError", "FencedError"}


def _spawn(tmp_path: Path, root: str, options: dict, wid: int, mode: str, keep: str,
           stop: Path) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / f"writer{wid}.jsonl"
    err = open(tmp_path / f"writer{wid}.stderr", "wb")
    p = subprocess.Popen([sys.executable, str(HERE / "_fence_loop_worker.py"), root,
                          json.dumps(options), str(wid), str(log), str(stop), mode, keep,
                          str(LEASE), str(BEAT)],
                         env=subprocess_env(HERE), cwd=str(HERE), stdin=subprocess.DEVNULL,
                         stdout=err, stderr=err, start_new_session=True)
    err.close()
    return p, log


def _events(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _holder_pid(backend) -> int | None:
    """The pid recorded in the root's lease object (None: no lease right now)."""
    try:
        backend.fs.invalidate_cache()
        lease = json.loads(backend.read(".ckptcore.lock"))
        return int(lease["pid"])
    except Exception:  # noqa: BLE001 - absent, being replaced, unreadable: pick at random
        return None


def _storm(backend, procs: list[subprocess.Popen], rnd: random.Random) -> dict:
    """Send the pauses; return what was sent.  Every writer is running again on return."""
    paused: dict[int, float] = {}  # writer index -> when to SIGCONT it
    durations: list[float] = []
    holder_picks = 0
    t0 = time.monotonic()
    next_at = t0 + rnd.uniform(1.0, 2.0)
    try:
        while True:
            now = time.monotonic()
            for i, until in list(paused.items()):
                if now >= until:
                    os.kill(procs[i].pid, signal.SIGCONT)
                    del paused[i]
            elapsed = now - t0
            sending = elapsed < LOOP_SECONDS or (len(durations) < MIN_PAUSES
                                                 and elapsed < MAX_LOOP_SECONDS)
            if not sending and not paused:
                break
            dead = [i for i, p in enumerate(procs) if p.poll() is not None]
            assert not dead, f"writer(s) {dead} exited during the storm"
            running = [i for i in range(len(procs)) if i not in paused]
            if sending and now >= next_at and running:
                d = math.exp(rnd.uniform(math.log(PAUSE_RANGE[0]), math.log(PAUSE_RANGE[1])))
                next_at = now + rnd.uniform(0.2, 1.0)
                if len(paused) >= MAX_LONG_PAUSED and d > SHORT_PAUSE:
                    continue  # the last running writer is only ever stopped briefly
                # Most pauses longer than the lease go to the lease holder (when it runs): they
                # hand the root over; the others hit writers waiting for it, or a holder briefly.
                aim = HOLDER_AIM[d > LEASE]
                holder = _holder_pid(backend) if rnd.random() < aim else None
                pick = [i for i in running if procs[i].pid == holder]
                holder_picks += bool(pick)
                i = pick[0] if pick else rnd.choice(running)
                os.kill(procs[i].pid, signal.SIGSTOP)
                paused[i] = now + d
                durations.append(d)
            time.sleep(0.02)
    finally:
        for i in paused:
            os.kill(procs[i].pid, signal.SIGCONT)
    return {"pauses": len(durations), "holder_picks": holder_picks,
            "over_lease": sum(d > LEASE for d in durations),
            "min": min(durations, default=0.0), "max": max(durations, default=0.0),
            "seconds": round(time.monotonic() - t0, 1)}


def _stop(procs: list[subprocess.Popen], stop: Path) -> list[int]:
    """Ask every writer to stop after its current save; SIGTERM, then SIGKILL, the ones that do
    not.  Returns the writers that had to be killed."""
    stop.touch()
    killed = []
    deadline = time.monotonic() + 30
    for i, p in enumerate(procs):
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            killed.append(i)
            p.terminate()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
    return killed


def test_writers_paused_at_random_commit_nothing_fenced_and_lose_no_step(
        cloud_backend, tmp_path):
    backend = cloud_backend
    root, options = backend.url("run"), backend.storage_options
    rnd = random.Random(zlib.crc32(f"fencing-loop-{backend.name}".encode()))
    stop = tmp_path / "stop"
    spawned = [_spawn(tmp_path, backend.url("run"), options, i, mode, KEEP[backend.name], stop)
               for i, mode in enumerate(WRITERS)]
    procs = [p for p, _ in spawned]
    try:
        sent = _storm(backend.__class__(backend.name, root, options), procs, rnd)
        killed = _stop(procs, stop)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    logs = {i: _events(log) for i, (_, log) in enumerate(spawned)}
    stderr = {i: (tmp_path / f"writer{i}.stderr").read_text()[-2000:] for i in logs}
    for i, p in enumerate(procs):
        if i not in killed:
            assert p.returncode == 0, (i, p.returncode, stderr[i])

    events = [e for evs in logs.values() for e in evs]
    attempts = {e["nonce"]: e for e in events if e["ev"] == "attempt"}
    acks = {e["nonce"]: e for e in events if e["ev"] == "ack"}
    errors = [e for e in events if e["ev"] == "error"]
    save_errors = {e["nonce"]: e for e in errors if e["where"] == "save"}
    kinds = Counter(e["ev"] for e in events)
    fenced = [e for e in errors if e["type"] == "FencedError"]
    landed = [e for e in fenced if "landed after that" in e["msg"]]

    # (4) Only CheckpointErrors, and of those only the lease's own (LockedError, FencedError),
    # but for writers that had already been superseded when they failed, counted apart: their
    # view of the root is stale, and the library does not always say so with FencedError (a
    # restore() whose listed candidates the new holder's retention deleted meanwhile reports
    # CorruptCheckpointError "none of the N checkpoints verifies").  A save whose step order,
    # step in the way or missing shards a stale view explains asks whether it was superseded
    # and raises FencedError then (StepOrderError came through once, in a CI run under load);
    # CheckpointExistsError and IncompleteCheckpointError stay allowed for a store that could
    # not be asked.
    others = [e for e in errors + [e for e in events if e["ev"] == "close_error"
                                   and not e.get("repeat")]
              if e["type"] not in EXPECTED_ERRORS]
    superseded_other = [e for e in others if e.get("superseded")
                        and e["type"] in ("CorruptCheckpointError", "CheckpointExistsError",
                                          "IncompleteCheckpointError")]
    unexpected = [e for e in others if e not in superseded_other]
    # A save that raised FencedError although its manifest was committed in time (the new
    # holder's claim accepted the step): "stop writing here" from the refresh after the commit,
    # "nothing was deleted" from retention, and even "nothing was committed" were seen.  Such a
    # step is visible (and restored by the next holder) though its save raised; counted apart
    # from a commit that landed after the takeover ("landed after that": readers must ignore
    # it, so its being visible or restored is a fencing failure).
    landed_nonces = {e["nonce"] for e in landed if e.get("where") == "save"}
    post_commit = {e["nonce"] for e in fenced if e.get("where") == "save"} - landed_nonces

    # The reader's view, once every writer is gone.
    reader = ckptcore.CheckpointManager(root, storage_options=options, lock=False,
                                        save_on_preemption=False)
    listed = reader.steps()
    reader.close()
    listing = ckptcore.list_checkpoints(root, storage_options=options)
    assert [c.step for c in listing] == listed
    assert listed, "no step committed at all"

    # (1) + (3): every listed step is an acknowledged save of its writer, bit for bit.
    fenced_visible, unacked_visible, mismatched, raised_visible = [], [], [], []
    for c in listing:
        assert c.info is not None, c.problem
        state = ckptcore.load_state(c.url, storage_options=options)
        w, inc, step, restored_from, nonce = (int(x) for x in state.model["ident"])
        attempt = attempts.get(nonce)
        assert attempt is not None, f"step {c.step}: a save no writer attempted ({w}, {inc})"
        assert (step, w, inc) == (c.step, attempt["w"], attempt["inc"]), (c.step, attempt)
        want = make_state(w, inc, step, attempt["restored_from"], nonce)
        assert state.step == c.step
        assert_tree_same(state.model, want.model, f"step {c.step}")
        ack = acks.get(nonce)
        if ack is not None and ack["id"] == c.info.writer["id"]:
            continue
        record = (c.step, c.info.writer, save_errors.get(nonce, {}).get("msg"))
        if nonce in post_commit:
            raised_visible.append(record)
        elif nonce in landed_nonces:
            fenced_visible.append(record)
        elif ack is not None:
            mismatched.append(record)  # acknowledged, but with another manifest's writer id
        elif w not in killed:
            unacked_visible.append(record)
        # else: a writer killed at the end, between its commit and its acknowledgement

    # (2) No acknowledged step lost.
    newest_acked = max(a["step"] for a in acks.values())
    lost = []
    if listed[-1] != newest_acked:
        lost.append(("newest", listed[-1], newest_acked))
    restores = [e for e in events if e["ev"] == "restored"]
    restored_raised = []  # restored a step whose save raised FencedError after committing it
    restored_landed = []  # ... whose writer was told readers ignore it ("landed after that")
    for r in restores:
        before = [a["step"] for a in acks.values() if a["t"] < r["t_start"]]
        if before and (r["step"] is None or r["step"] < max(before)):
            lost.append(("restore", r["w"], r["inc"], r["step"], max(before)))
        if r["step"] is not None:  # continuity: what it restored was an acknowledged save
            ident = r["ident"]
            ack = acks.get(ident[4])
            if ident[4] in landed_nonces:
                restored_landed.append((r["w"], r["inc"], r["step"]))
            elif ident[4] in post_commit:
                restored_raised.append((r["w"], r["inc"], r["step"]))
            elif ack is None or ack["step"] != r["step"]:
                lost.append(("restored an unacknowledged save", r["w"], r["inc"], r["step"]))

    takeovers = kinds["takeover"]
    figures = {
        "store": backend.name, **sent, "killed": killed,
        "takeovers": takeovers, "reclaims": kinds["reclaim"], "generations": _generation(backend),
        "restores": len(restores), "acked": len(acks), "attempts": len(attempts),
        "fenced_errors": len(fenced), "fenced_commits_landed": len(landed),
        "locked_polls": kinds["locked"], "listed": listed,
        "fenced_commits_visible": len(fenced_visible), "unacked_visible": len(unacked_visible),
        "steps_lost": len(lost)}
    figures["fenced_errors_after_accepted_commit"] = len(post_commit)
    figures["visible_after_fenced_error"] = len(raised_visible)
    figures["restored_after_landed_error"] = len(restored_landed)
    figures["restored_after_fenced_error"] = len(restored_raised)
    figures["superseded_other_errors"] = sorted(f'{e["where"]}:{e["type"]}'
                                                for e in superseded_other)
    figures["unexpected_errors"] = len(unexpected)
    print("\nFENCING LOOP", json.dumps(figures))
    assert all(e["checkpoint_error"] for e in others), others[:5]
    assert not unexpected, [(e["where"], e["type"], e.get("superseded"), e.get("step"), e["msg"])
                            for e in unexpected[:5]]
    assert not fenced_visible, fenced_visible
    assert not unacked_visible, unacked_visible
    assert not mismatched, mismatched
    assert not lost, lost
    assert sent["pauses"] >= MIN_PAUSES
    assert takeovers >= 1, figures  # the root did change hands under the pauses
    assert len(acks) >= MIN_ACKS, figures
    # A writer told "its commit ... landed after that, and readers ignore it" must be right:
    # no later holder may have restored from that very save.
    assert not restored_landed, (restored_landed, figures)


def _generation(backend) -> int:
    try:
        return max(int(n) for n in backend.listdir("run", ".ckptcore.gen") if n.isdigit())
    except ValueError:
        return 0
