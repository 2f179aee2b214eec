"""A fault-schedule checker: the real manager, backup, gc and group code on ``memory://``, with
every mutating storage operation routed through ``ckptcore._storage._op_hook`` (paused, failed,
delayed or used as the moment a writer's lease lapses and another writer takes over), and the
writer lease's clock under the schedule's control (``ckptcore._lock.time`` replaced).

A schedule is ``(family, seed)``: ``random.Random(seed)`` draws everything (configuration, the
operation index a fault fires at, what the taker does), so a violation is replayed with
``run_schedule(family, seed)``.  After every schedule the invariants are checked:

1. every step a fresh reader lists (local and backup roots) restores bit for bit to what its
   writer saved (states encode writer id and step in their values);
2. no step acknowledged to a live holder is lost;
3. no commit of a fenced writer is visible (its saves that raised, its commits after a takeover);
4. no listed manifest of a backup root names a missing chunk;
5. every error raised to the user is a ``ckptcore.CheckpointError``.
"""

from __future__ import annotations

import collections
import contextlib
import random
import re
import threading
import time as _real_time
import uuid
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import fsspec
import msgpack
import numpy as np

import ckptcore
from ckptcore import CheckpointError, CheckpointManager, TrainingState, _knobs, _lock, _storage
from ckptcore import layout

_STEP_RE = re.compile(r"/step-(\d{12,})/manifest\.msgpack$")
LEASE_SECONDS = 100.0
LEASE = dict(lease=ckptcore.Lease(seconds=LEASE_SECONDS, heartbeat=30.0))


class Clock:
    """What ``ckptcore._lock`` sees as ``time``: real time plus an offset the schedule advances."""

    def __init__(self) -> None:
        self.offset = 0.0

    def time(self) -> float:
        return _real_time.time() + self.offset

    def monotonic(self) -> float:
        return _real_time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds

    strftime = staticmethod(_real_time.strftime)
    localtime = staticmethod(_real_time.localtime)
    sleep = staticmethod(_real_time.sleep)
    perf_counter = staticmethod(_real_time.perf_counter)


CLOCK = Clock()


@contextlib.contextmanager
def installed():
    """The clock in ckptcore._lock and fast knobs, for a whole test (restored after)."""
    saved_time, saved_hook = _lock.time, _storage._op_hook
    _lock.time = CLOCK  # type: ignore[assignment]
    logger = logging.getLogger("ckptcore")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with _knobs.override(threads=1, backup_retry_seconds=0.0, backup_retries=1), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        _lock.time = saved_time  # type: ignore[assignment]
        _storage._op_hook = saved_hook
        logger.setLevel(level)


# -- states ---------------------------------------------------------------------------------------
def make_state(writer: int, step: int) -> TrainingState:
    """A tiny state whose every value says who wrote it and for which step."""
    return TrainingState(model={"w": np.array([writer, step, writer * 1000 + step], np.int64),
                                "c": np.full(8, writer, np.int32)},
                         step=step)


def state_key(state: TrainingState) -> tuple[int, int]:
    w = np.asarray(state.model["w"])
    return int(w[0]), int(w[1])


def same_state(a: TrainingState, b: TrainingState) -> bool:
    if set(a.model) != set(b.model):
        return False
    for k in a.model:
        x, y = np.asarray(a.model[k]), np.asarray(b.model[k])
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            return False
    return a.step == b.step


# -- the hook -------------------------------------------------------------------------------------
@dataclass
class Trigger:
    prefix: str  # path prefix whose mutating operations are counted
    index: int  # fire before the index-th such operation (0-based)
    action: Callable[[str, str], None]
    fired_at: tuple[str, str] | None = None


class Scheduler:
    """The ``_op_hook``: counts operations per path prefix, fires triggers, records publishes.

    While an action runs (a takeover inside the hook), threads that existed before it started
    (the paused writer's other threads) wait in the hook, so the taker runs alone; its own
    operations (this thread and threads it starts) pass through uncounted."""

    def __init__(self, who: Callable[[], str]) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.triggers: list[Trigger] = []
        self.publishes: list[tuple[str, int, str]] = []  # (root prefix, step, who)
        self.roots: list[str] = []
        self.who = who  # label of the current writer for publishes outside actions
        self._mu = threading.RLock()
        self._acting: int | None = None
        self._before: set[threading.Thread] = set()
        self._done = threading.Event()
        self._done.set()
        self.ops_seen = 0
        self.fails: dict[tuple[str, int], BaseException] = {}  # (prefix, index) -> raise

    def root_of(self, path: str) -> str | None:
        for r in self.roots:
            if path.startswith(r + "/"):
                return r
        return None

    def __call__(self, op: str, path: str) -> None:
        me = threading.get_ident()
        if (self._acting is not None and me != self._acting
                and threading.current_thread() in self._before):
            self._done.wait(30)
        taker = self._acting is not None
        root = self.root_of(path)
        if taker or root is None:
            self._publish(op, path, root, "taker")
            return
        fire: Trigger | None = None
        with self._mu:
            self.ops_seen += 1
            for t in self.triggers:
                if path.startswith(t.prefix + "/"):
                    n = self.counts[t.prefix]
                    if t.fired_at is None and n == t.index and fire is None:
                        fire = t
            for p in {t.prefix for t in self.triggers} | {r for r in self.roots}:
                if path.startswith(p + "/"):
                    key = (p, self.counts[p])
                    self.counts[p] += 1
                    err = self.fails.pop(key, None)
                    if err is not None:
                        raise err
            if fire is not None:
                fire.fired_at = (op, path)
                self._acting = me
                # Thread objects, not idents: a thread the taker starts may reuse the ident
                # of one that ended (it must not wait for the action it belongs to).
                self._before = {t for t in threading.enumerate() if t.ident != me}
                self._done.clear()
        if fire is not None:
            try:
                fire.action(op, path)
            finally:
                self._acting = None
                self._done.set()
        self._publish(op, path, root, None)

    def _publish(self, op: str, path: str, root: str | None, who: str | None) -> None:
        """Record a manifest's publish with the newest generation of its root at that moment:
        a manifest recording an older generation is a fenced writer's commit."""
        if op == "publish" and root is not None:
            m = _STEP_RE.search(path)
            if m:
                gens = newest_generation(root)
                with self._mu:
                    self.publishes.append((root, int(m.group(1)), who or self.who(), gens))


# -- memory roots ---------------------------------------------------------------------------------
def new_prefix(family: str, seed: int) -> str:
    return f"/faults-{family}-{seed}-{uuid.uuid4().hex[:10]}"


def drop_prefix(prefix: str) -> None:
    fs = fsspec.filesystem("memory")
    for k in [k for k in fs.store if k.startswith(prefix + "/") or k == prefix]:
        fs.store.pop(k, None)
    fs.pseudo_dirs[:] = [d for d in fs.pseudo_dirs if not (d == prefix or d.startswith(prefix + "/"))]


def url(path: str) -> str:
    return "memory://" + path


# -- the record of one schedule -------------------------------------------------------------------
@dataclass
class Outcome:
    family: str
    seed: int
    schedule: list[str] = field(default_factory=list)  # human-readable steps, for replay
    violations: list[str] = field(default_factory=list)
    errors: collections.Counter = field(default_factory=collections.Counter)
    takeovers: int = 0
    fenced_refused: int = 0
    ops: set = field(default_factory=set)  # (target, index) covered

    def note(self, text: str) -> None:
        self.schedule.append(text)

    def violate(self, text: str) -> None:
        self.violations.append(text)

    def report(self) -> str:
        return (f"family={self.family} seed={self.seed}\n  schedule: " + "\n    ".join(self.schedule)
                + "\n  violations: " + "\n    ".join(self.violations))


def call(out: Outcome, what: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
    """Run a user-facing call; (ok, result or exception).  Invariant 5 checked here."""
    try:
        return True, fn()
    except Exception as e:  # noqa: BLE001 - classified
        out.errors[type(e).__name__] += 1
        if isinstance(e, ckptcore.FencedError):
            out.fenced_refused += 1
        out.note(f"{what} -> {type(e).__name__}: {str(e)[:160]}")
        if not isinstance(e, CheckpointError):
            out.violate(f"[5] {what} raised {type(e).__name__} (not a CheckpointError): {e!r:.300}")
        return False, e


def manager(root: str, **kw: Any) -> CheckpointManager:
    kw.setdefault("save_on_preemption", False)
    for k, v in LEASE.items():
        kw.setdefault(k, v)
    return CheckpointManager(url(root), **kw)


# -- invariants -----------------------------------------------------------------------------------
def listed(root: str) -> list[int]:
    return CheckpointManager(url(root), lock=False, save_on_preemption=False).steps()


def check_root(out: Outcome, root: str, saved: dict[tuple[int, int], TrainingState], *,
               must_have: dict[int, int], fenced_publish: set[int], raised: set[tuple[int, int]],
               damaged_ok: set[int] = frozenset(), backup: bool = False) -> set[int]:
    """Invariants 1-4 on one root.  ``must_have``: step -> writer that acknowledged it (2);
    ``fenced_publish``: steps whose last publish was a fenced writer's (3); ``raised``: (writer,
    step) saves that raised (3); ``damaged_ok``: steps whose bytes the schedule damaged (a typed
    load error is then the right answer).  Returns the listed steps."""
    try:
        steps = listed(root)
    except Exception as e:  # noqa: BLE001
        out.violate(f"[1] listing {root} raised {type(e).__name__}: {e!r:.200}")
        return set()
    for step in steps:
        ckpt = url(root) + "/" + layout.step_name(step)
        try:
            got = ckptcore.load_state(ckpt)
        except CheckpointError as e:
            if step not in damaged_ok:
                out.violate(f"[1] {root} step {step} is listed but does not load: "
                            f"{type(e).__name__}: {e}")
            continue
        except Exception as e:  # noqa: BLE001
            out.violate(f"[1/5] {root} step {step}: load raised {type(e).__name__}: {e!r:.200}")
            continue
        try:
            key = state_key(got)
        except Exception:  # noqa: BLE001
            out.violate(f"[1] {root} step {step} holds a state no writer saved")
            continue
        want = saved.get(key)
        if key[1] != step or want is None or not same_state(got, want):
            out.violate(f"[1] {root} step {step} restores to writer {key[0]}'s step {key[1]} "
                        f"{'(bytes differ)' if want is not None else '(never saved)'}")
        if step in fenced_publish:
            out.violate(f"[3] {root} step {step} (writer {key[0]}) was committed by a writer whose "
                        "generation was already superseded, yet readers list it")
        if key in raised:
            out.violate(f"[3] {root} step {step}: writer {key[0]}'s save of it raised, yet "
                        "readers list it")
    for step, writer in must_have.items():
        if step not in steps:
            out.violate(f"[2] {root} step {step}, acknowledged to writer {writer}, is not listed")
    if backup and steps:
        from ckptcore._replica import check_structure
        from ckptcore._storage import Store
        store = Store(url(root))
        for step in steps:
            if step in damaged_ok:
                continue
            try:
                problems = check_structure(store.child(layout.step_name(step)))[1]
            except Exception as e:  # noqa: BLE001
                problems = [e]
            if problems:
                out.violate(f"[4] {root} step {step}: {problems[0]}")
    return set(steps)


def newest_generation(root: str) -> dict[int, str]:
    """Every generation of ``root`` now, with its holder (read from its record; "?" when the
    record is gone): the snapshot a publish is judged against."""
    import json
    fs = fsspec.filesystem("memory")
    base = root + "/.ckptcore.gen/"
    gens = {}
    for k in list(fs.store):
        if k.startswith(base) and k[len(base):].isdigit():
            f = fs.store.get(k)
            try:
                gens[int(k[len(base):])] = str(json.loads(f.getvalue()).get("holder", "?"))
            except Exception:  # noqa: BLE001 - absent or being written
                gens[int(k[len(base):])] = "?"
    return gens


def fenced_commits(sched: Scheduler, root: str) -> set[int]:
    """Steps under ``root`` whose current manifest was published by a writer whose generation
    (recorded in the manifest) was already superseded when it published: a newer generation
    existed then, claimed by another holder (an overdue holder claiming the next generation for
    itself supersedes no one)."""
    from ckptcore._fence import manifest_generation
    from ckptcore._storage import Store
    last: dict[int, int] = {}
    for r, step, _who, newest in sched.publishes:
        if r == root:
            last[step] = newest
    out = set()
    store = Store(url(root))
    for step, newest in last.items():
        ckpt = store.child(layout.step_name(step))
        try:
            g = manifest_generation(ckpt)
        except Exception:  # noqa: BLE001
            continue
        if g is None:
            continue
        mine = newest.get(g, "?")
        if any(h2 != mine or mine == "?" for g2, h2 in newest.items() if g2 > g):
            out.add(step)
    return out


# -- families -------------------------------------------------------------------------------------
A, B = 1, 2
_CALIBRATED: dict[tuple, dict[str, int]] = {}


class Run:
    """One schedule's bookkeeping: roots, the scheduler, what each writer saved and was told."""

    def __init__(self, family: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.out = Outcome(family, seed)
        self.prefix = new_prefix(family, seed)
        self.local = self.prefix + "/run"
        self.bk = self.prefix + "/bk"
        self.fired = False
        self.sched = Scheduler(lambda: "A-late" if self.fired else "A")
        self.sched.roots = [self.local, self.bk]
        self.saved: dict[tuple[int, int], TrainingState] = {}
        self.acked: dict[int, int] = {}  # step -> writer, local root
        self.acked_bk: dict[int, int] = {}
        self.raised: set[tuple[int, int]] = set()
        self.managers: list[CheckpointManager] = []

    def __enter__(self) -> Run:
        _storage._op_hook = self.sched
        return self

    def __exit__(self, *exc: Any) -> None:
        _storage._op_hook = None
        for m in self.managers:
            with contextlib.suppress(Exception):
                m.close()
        drop_prefix(self.prefix)

    def mgr(self, root: str, **kw: Any) -> CheckpointManager:
        m = manager(root, **kw)
        self.managers.append(m)
        return m

    def save(self, who: int, m: CheckpointManager, step: int, label: str) -> Any:
        state = make_state(who, step)
        self.saved[(who, step)] = state
        ok, h = call(self.out, f"{label}.save({step})", lambda: m.save(step, state))
        if not ok:
            self.raised.add((who, step))
            return None
        return h

    def settle(self, who: int, handles: dict[int, Any]) -> None:
        """Acknowledged or raised, for every save handle of writer ``who``."""
        for step, h in handles.items():
            if h is None:
                continue
            if not h.done():
                with contextlib.suppress(Exception):
                    h.result(30)
            exc = h._future.exception() if h.done() else RuntimeError("never finished")
            if exc is None:
                self.acked[step] = who
            else:
                self.raised.add((who, step))
                if not isinstance(exc, CheckpointError):
                    self.out.violate(f"[5] writer {who} save({step}) failed with "
                                     f"{type(exc).__name__}: {exc!r:.200}")

    def check(self, *, damaged_ok: set[int] = frozenset()) -> None:
        for root, must, backup in ((self.local, self.acked, False), (self.bk, self.acked_bk, True)):
            fenced = fenced_commits(self.sched, root)
            check_root(self.out, root, self.saved, must_have=must, fenced_publish=fenced,
                       raised=self.raised, damaged_ok=damaged_ok if backup else frozenset(),
                       backup=backup)


def _takeover_b(run: Run, use_backup: bool) -> Callable[[str, str], None]:
    """Writer B taking over inside the hook: A's lease lapses, B restores, saves 1-3 steps,
    waits for its backup, maybe closes."""
    rng, out = run.rng, run.out
    n_b, close_b = rng.randint(1, 3), rng.random() < 0.5

    def action(op: str, path: str) -> None:
        run.fired = True
        out.takeovers += 1
        out.note(f"takeover at {op} {path[len(run.prefix):]}: clock +{LEASE_SECONDS + 1}s, "
                 f"B saves {n_b} step(s){', closes' if close_b else ''}")
        CLOCK.advance(LEASE_SECONDS + 1)
        ok, b = call(out, "B = CheckpointManager(...)",
                     lambda: run.mgr(run.local, backup=url(run.bk) if use_backup else None))
        if not ok:
            return
        ok, st = call(out, "B.restore()", b.restore)
        base = -1
        if ok:
            key = state_key(st)
            if key not in run.saved or not same_state(st, run.saved[key]):
                out.violate(f"[1] B.restore() returned writer {key[0]}'s step {key[1]}, not what "
                            "was saved")
            base = st.step
        elif not isinstance(st, ckptcore.CheckpointNotFoundError):
            ok2, steps = call(out, "B.latest_step()", b.latest_step)
            base = steps if ok2 and steps is not None else base
        handles = {}
        for i in range(1, n_b + 1):
            handles[base + i] = run.save(B, b, base + i, "B")
        run.settle(B, handles)
        if use_backup:
            ok, _ = call(out, "B.wait()", b.wait)
            if ok:
                run.acked_bk.update({s: B for s, h in handles.items() if (B, s) not in run.raised})
        if close_b:
            call(out, "B.close()", b.close)

    return action


def _family_a_config(rng: random.Random) -> tuple:
    use_backup = rng.random() < 0.4
    return (rng.random() < 0.5, use_backup, rng.randint(1, 3), rng.randint(0, 2),
            "bk" if use_backup and rng.random() < 0.5 else "local")


def _drive_a(run: Run, cfg: tuple) -> None:
    async_save, use_backup, n_a, n_more, _ = cfg
    out = run.out
    ok, a = call(out, "A = CheckpointManager(...)",
                 lambda: run.mgr(run.local, async_save=async_save,
                                 backup=url(run.bk) if use_backup else None))
    if not ok:
        return
    handles = {s: run.save(A, a, s, "A") for s in range(n_a)}
    ok, _ = call(out, "A.wait()", a.wait)
    run.settle(A, handles)
    more = {s: run.save(A, a, s, "A") for s in range(n_a, n_a + n_more)}
    ok2, _ = call(out, "A.close()", a.close)
    run.settle(A, more)
    if use_backup and ok and ok2 and not run.fired:
        run.acked_bk.update({s: A for s, w in run.acked.items() if w == A})


def calibrate(family: str, cfg: tuple, drive: Callable[[Run, tuple], None]) -> dict[str, int]:
    """Operations per root of a schedule's configuration without faults (cached)."""
    key = (family, cfg)
    if key not in _CALIBRATED:
        with Run(family + "-cal", 0) as run:
            drive(run, cfg)
            _CALIBRATED[key] = {"local": run.sched.counts[run.local], "bk": run.sched.counts[run.bk]}
    return _CALIBRATED[key]


def run_a(seed: int) -> Outcome:
    """(a) two writers: A's lease lapses at the k-th operation of its saves or replications;
    B takes over inside the hook; A continues."""
    rng = random.Random(seed)
    cfg = _family_a_config(rng)
    async_save, use_backup, n_a, n_more, target = cfg
    n_ops = calibrate("a", cfg, _drive_a)[target]
    with Run("a", seed) as run:
        run.rng = rng
        k = rng.randrange(max(1, n_ops))
        root = run.local if target == "local" else run.bk
        run.out.note(f"A: async_save={async_save} backup={use_backup} saves {n_a} then {n_more} "
                     f"more; lapse at op {k} of {n_ops} on {target}")
        run.out.ops.add((cfg, k))
        run.sched.triggers.append(Trigger(root, k, _takeover_b(run, use_backup)))
        _drive_a(run, cfg)
        run.check()
    return run.out


def _drive_b(run: Run, cfg: tuple) -> None:
    async_save, n_a, n_more = cfg
    out = run.out
    ok, a = call(out, "A = CheckpointManager(...)",
                 lambda: run.mgr(run.local, async_save=async_save, backup=url(run.bk)))
    if not ok:
        return
    handles = {s: run.save(A, a, s, "A") for s in range(n_a)}
    ok, _ = call(out, "A.wait()", a.wait)
    run.settle(A, handles)
    more = {s: run.save(A, a, s, "A") for s in range(n_a, n_a + n_more)}
    ok2, _ = call(out, "A.close()", a.close)
    run.settle(A, more)
    if ok and ok2 and not run.fired:
        run.acked_bk.update({s: A for s, w in run.acked.items() if w == A})


def run_b(seed: int) -> Outcome:
    """(b) a sweep racing A's replication: A's leases lapse at the k-th operation on the backup
    root, and inside the hook ``gc(grace=0)`` or a sync of the local root into the backup root
    (``ckpt sync``, with or without a retention) takes the backup root over."""
    from ckptcore._sync import sync
    rng = random.Random(seed)
    cfg = (rng.random() < 0.5, rng.randint(1, 3), rng.randint(0, 2))
    taker = rng.choice(["gc", "sync", "sync-keep"])
    n_ops = calibrate("b", cfg, _drive_b)["bk"]
    with Run("b", seed) as run:
        k = rng.randrange(max(1, n_ops))
        out = run.out
        out.note(f"A: async_save={cfg[0]} backup saves {cfg[1]} then {cfg[2]} more; lapse at "
                 f"op {k} of {n_ops} on the backup root; taker {taker}")
        out.ops.add((cfg, k, taker))

        def action(op: str, path: str) -> None:
            run.fired = True
            out.takeovers += 1
            out.note(f"takeover at {op} {path[len(run.prefix):]}: clock +101s, {taker}")
            CLOCK.advance(LEASE_SECONDS + 1)
            if taker == "gc":
                ok, removed = call(out, "gc(bk, grace=0)",
                                   lambda: ckptcore.gc(url(run.bk), grace=0))
                if ok:
                    out.note(f"gc removed {[r[len('memory://' + run.prefix):] for r in removed]}")
                return
            keep = ckptcore.KeepLast(1) if taker == "sync-keep" else None
            ok, report = call(out, f"sync(local, bk, keep={keep})",
                              lambda: sync(url(run.local), url(run.bk), keep=keep))
            if ok:
                out.note(f"sync: {report}")

        run.sched.triggers.append(Trigger(run.bk, k, action))
        _drive_b(run, cfg)
        run.check()
    return run.out


def _chunk_paths(bk: str) -> list[str]:
    fs = fsspec.filesystem("memory")
    return sorted(k for k in fs.store if k.startswith(bk + "/chunks/"))


def run_c(seed: int) -> Outcome:
    """(c) damaged and missing chunks of the backup root between replications."""
    rng = random.Random(seed)
    with Run("c", seed) as run:
        out = run.out
        fs = fsspec.filesystem("memory")
        # Every step of a writer holds the same "c" tensor: its chunk is shared by all of them,
        # so the steps saved after the damage reuse (or must re-upload) a damaged chunk.
        n1, n2 = rng.randint(1, 3), rng.randint(1, 3)
        ok, a = call(out, "A = CheckpointManager(...)",
                     lambda: run.mgr(run.local, backup=url(run.bk), async_save=rng.random() < 0.3))
        if not ok:
            return out
        handles = {s: run.save(A, a, s, "A") for s in range(n1)}
        okw, _ = call(out, "A.wait()", a.wait)
        run.settle(A, handles)
        chunks = _chunk_paths(run.bk)
        damaged: set[int] = set()
        if chunks:
            how = rng.choice(["flip", "delete", "swap", "truncate"])
            victim = rng.choice(chunks)
            out.note(f"A saved {n1} steps; damage {how} {victim[len(run.prefix):]}")
            out.ops.add((n1, n2, how, chunks.index(victim), len(chunks)))
            f = fs.store[victim]
            data = bytearray(f.getvalue())
            if how == "flip" and data:
                i = rng.randrange(len(data))
                data[i] ^= 1 << rng.randrange(8)
                f.seek(0); f.truncate(); f.write(bytes(data))
            elif how == "delete":
                fs.store.pop(victim)
            elif how == "swap" and len(chunks) > 1:
                other = rng.choice([c for c in chunks if c != victim])
                o = fs.store[other]
                od = o.getvalue()
                o.seek(0); o.truncate(); o.write(bytes(data))
                f.seek(0); f.truncate(); f.write(od)
            else:
                f.seek(0); f.truncate(); f.write(bytes(data[: len(data) // 2]))
            damaged = {s for s in listed(run.bk)}
        else:
            out.note(f"A saved {n1} steps; no chunks to damage")
        mark = len(run.sched.publishes)
        more = {}
        for s in range(n1, n1 + n2):
            more[s] = run.save(A, a, s, "A")
        ok2, _ = call(out, "A.wait()", a.wait)
        ok3, _ = call(out, "A.close()", a.close)
        run.settle(A, more)
        if ok2 and ok3:
            run.acked_bk.update({s: A for s in more if (A, s) not in run.raised})
        # steps replicated after the damage must be intact; the damaged old replicas may fail
        # to load, with a typed error, but never load wrong bytes
        again = {p[1] for p in run.sched.publishes[mark:] if p[0] == run.bk}
        run.check(damaged_ok=damaged - again)
    return run.out


# -- exploring many seeds -------------------------------------------------------------------------
def families() -> dict[str, Callable[[int], Outcome]]:
    """Every family by its letter (the group family lives in ``_faults_group``)."""
    import _faults_group
    return {"a": run_a, "b": run_b, "c": run_c, "d": _faults_group.run_d}


def explore(family: str, seeds: range) -> dict[str, Any]:
    """Run ``family`` over ``seeds`` in this process (a pool worker's job): the totals, and the
    reports of the first schedules that broke an invariant (each replayable by its seed)."""
    run = families()[family]
    errors: collections.Counter = collections.Counter()
    takeovers = refused = 0
    ops: set = set()
    bad: list[str] = []
    n_bad = 0
    t0 = _real_time.perf_counter()
    with installed():
        for seed in seeds:
            out = run(seed)
            errors.update(out.errors)
            takeovers += out.takeovers
            refused += out.fenced_refused
            ops |= {repr(o) for o in out.ops}
            if out.violations:
                n_bad += 1
                if len(bad) < 3:
                    bad.append(out.report())
    return {"family": family, "schedules": len(seeds), "seconds": _real_time.perf_counter() - t0,
            "errors": dict(errors), "takeovers": takeovers, "fenced_refused": refused,
            "ops": sorted(ops), "violations": n_bad, "reports": bad}
