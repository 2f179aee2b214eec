"""Fault schedules: the real manager, backup, gc and group code on memory://, with every storage
operation under a seeded schedule's control (tests/_faults.py, tests/_faults_group.py).

Four families, each schedule checked against the invariants of tests/_faults.py:

(a) two writers, A's lease lapsing at every storage operation of its saves and replications
    (another manager takes the root over inside that operation; A goes on);
(b) gc(backup_root, grace=0) taking the backup root over in the middle of a replication;
(c) chunks of the backup root flipped, deleted, swapped or truncated between replications;
(d) group saves whose replies to rank 0 are dropped, duplicated or malformed, or whose rank stops
    right after replying.

``test_fault_schedules`` runs ``CKPTCORE_FAULT_SCHEDULES`` schedules (10,000 by default) over a
pool of processes, one per core; ``scripts/test.sh`` runs it as a suite of its own and prints its
time.  ``test_fault_schedules_sample`` runs a few hundred, for the quick loop
(``pytest -m "not slow"``).  A violation prints its schedule; replay it with
``_faults.families()[family](seed)`` inside ``with _faults.installed():``.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

import _faults as F

TOTAL = int(os.environ.get("CKPTCORE_FAULT_SCHEDULES", "10000"))
SHARE = {"a": 0.4, "b": 0.2, "c": 0.2, "d": 0.2}
JOB = 250  # seeds per pool job: small enough to balance two workers, large enough to amortise


def _init_worker(path: list[str]) -> None:
    sys.path[:] = path  # the tests folder, for _faults in the spawned interpreter


def _run(total: int, workers: int) -> dict[str, dict]:
    jobs = []
    for family, share in SHARE.items():
        n = max(1, int(total * share))
        jobs += [(family, range(s, min(n, s + JOB))) for s in range(0, n, JOB)]
    jobs.sort(key=lambda j: j[1].start)  # interleave the families: even the load on every worker
    if workers <= 1:
        results = [F.explore(f, seeds) for f, seeds in jobs]
    else:
        ctx = multiprocessing.get_context("spawn")  # never fork a process with threads running
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                 initargs=(list(sys.path),)) as pool:
            results = list(pool.map(F.explore, [f for f, _ in jobs], [s for _, s in jobs]))
    totals: dict[str, dict] = {}
    for r in results:
        t = totals.setdefault(r["family"], {"schedules": 0, "seconds": 0.0, "errors":
                                            collections.Counter(), "takeovers": 0,
                                            "fenced_refused": 0, "ops": set(), "violations": 0,
                                            "reports": []})
        for k in ("schedules", "seconds", "takeovers", "fenced_refused", "violations"):
            t[k] += r[k]
        t["errors"].update(r["errors"])
        t["ops"] |= set(r["ops"])
        t["reports"] += r["reports"]
    return totals


def _check(total: int) -> None:
    workers = max(1, min(4, os.cpu_count() or 1))
    t0 = time.perf_counter()
    totals = _run(total, workers)
    wall = time.perf_counter() - t0
    n = sum(t["schedules"] for t in totals.values())
    print(f"\nFAULT SCHEDULES: {n} schedules in {wall:.1f}s wall over {workers} processes")
    for family, t in sorted(totals.items()):
        print(f"[{family}] schedules={t['schedules']} cpu={t['seconds']:.1f}s "
              f"({1e3 * t['seconds'] / t['schedules']:.1f} ms each) "
              f"fault_points={len(t['ops'])} takeovers={t['takeovers']} "
              f"fenced_refused={t['fenced_refused']} errors={dict(t['errors'])} "
              f"violations={t['violations']}")
        for report in t["reports"][:3]:
            print(report)
    assert n >= total * 0.99
    bad = {f: t["reports"][0] for f, t in totals.items() if t["violations"]}
    assert not bad, "\n".join(f"family {f}: {r}" for f, r in bad.items())
    for family, t in totals.items():  # each family did what it is for
        if family in ("a", "b"):
            assert t["takeovers"] > 0.5 * t["schedules"], (family, t["takeovers"])


@pytest.mark.slow
def test_fault_schedules():
    _check(TOTAL)


def test_fault_schedules_sample():
    _check(min(TOTAL, 400))
