"""Family (d) of the fault-schedule checker (tests/_faults.py): group replies.

2-4 ranks (threads of a ``ckptcore.ThreadGroup``), each with a ``CheckpointManager(group=)`` on
one ``memory://`` root, save 1-3 steps (plain or ``ckptcore.Shard`` states, sync or async).  At
one seeded save ONE fault hits the replies to rank 0: a reply malformed (bytes, msgpack, types,
shard entries, rows), replaced by another rank's or a stale one, never sent (the rank hangs
until the group times out, or dies and the engine notices at once), or a rank stops right after
replying; or a storage operation of rank 0's merge/commit fails.  Checked, besides
``_faults.check_root`` (listed steps restore bit for bit, acknowledged ones listed, failed ones
not): [O] one outcome per save on every live rank; [5] every error a CheckpointError; [6] the
outcome the fault calls for (a bad or foreign reply refused, a rank lost after its reply not
undoing the commit, the save after a refused one working); [7] no rank hangs; [8] the root
holds only lock files, listed manifests and the shards they name at their sizes.  A seed
replays the schedule, not the thread interleaving (the collectives race as they would).
"""

from __future__ import annotations

import random
import re
import threading
import time
from functools import partial

import fsspec
import msgpack
import numpy as np

from ckptcore import Shard, StorageError, ThreadGroup, TrainingState, _codec, _knobs, layout
from ckptcore._dist import _ROW_DTYPES
from ckptcore._replies import COLUMNS as _CHUNK_REPLY

import _faults as F

LONG = 4.0  # the knob: no healthy collective comes near it (a loaded machine included); a wait this long is a finding
SHORT = 0.025  # the timeout of the waits a hung or dead rank is meant to break (room for load)


class _Gone(BaseException):
    """A dead rank: a BaseException, so that no ``except Exception`` of the library reports it."""


# -- reply mutations: name -> (expected outcome, fn(decoded reply, rng) -> text, None if n/a) ----
def _col(reply: dict, key: str):
    """(a row column's copy, its setter) in a plain (rows) or chunked (chunks) reply, or None
    (a chunk reply has no "length" column: rank 0 computes it from the chunk's shape)."""
    chunked = "chunks" in reply
    box, types = (reply["chunks"], _CHUNK_REPLY) if chunked else (reply["rows"], _ROW_DTYPES)
    key = {"crc": "checksum", "index": "tensor"}.get(key, key) if chunked else key
    if key not in types or not len(box[key]):
        return None
    return (np.frombuffer(box[key], types[key]).copy(),
            lambda v: box.__setitem__(key, np.ascontiguousarray(v, types[key]).tobytes()))


def _row(key: str, value):  # row i of column key -> value(reply, column, i, rng) (None: n/a)
    def fn(reply, g):
        c = _col(reply, key)
        i = c and g.randrange(len(c[0]))
        v = c and value(reply, c[0], i, g)
        if v is None:
            return None
        text, c[0][i] = f"{key}[{i}] {c[0][i]} -> {v}", v
        c[1](c[0])
        return text
    return fn


def _field(k: int, value):  # shard entry i's field k (0 name, 1 size, 2 checksum) -> value(v, g)
    def fn(reply, g):
        e = reply["shards"][g.randrange(len(reply["shards"]))]  # every rank has >= 1 shard
        old, e[k] = e[k], value(e[k], g)
        return f"shard entry {old!r:.60} field {k} -> {e[k]!r:.60}"
    return fn


def _same_shard(r, a, i):  # another row of row i's shard, or None
    sh = _col(r, "shard")[0]
    return next((int(j) for j in np.flatnonzero(sh == sh[i]) if j != i), None)


def _short(reply, g):
    key = g.choice(["offset", "shard", "crc", "index"])
    c = _col(reply, key)
    return c and (c[1](c[0][:-1]), f"column {key} one short")[1]


MUTATIONS = {  # "fail": rank 0 must refuse it; "any": a lie rank 0 cannot see (it reads no bytes)
    "escape": ("fail", _field(0, lambda v, g: g.choice(["../evil.bin", "a/" + v, "", v + "\n"]))),
    "rank-0-name": ("fail", _field(0, lambda v, g: v[:12] + "r00000" + v[18:])),
    "other-token": ("fail", _field(0, lambda v, g: v[:19] + "0123456789abcdef.bin")),
    "size+": ("fail", _field(1, lambda v, g: v + g.choice([1, 64, 4096, 2 ** 62]))),
    "bad-size": ("fail", _field(1, lambda v, g: g.choice([-1, str(v), None, 1.5]))),
    "bad-crc": ("fail", _field(2, lambda v, g: g.choice([-1, 2 ** 32, str(v), None]))),
    "entry-crc": ("any", _field(2, lambda v, g: v ^ 1)),
    "listed-twice": ("fail", lambda r, g: (r["shards"].append(list(r["shards"][0])), "twice")[1]),
    "entry-dropped": ("fail", lambda r, g: f"dropped {r['shards'].pop()!r:.60}"),
    "offset-beyond": ("fail", _row("offset", lambda r, a, i, g: r["shards"][int(_col(
        r, "shard")[0][i])][1] + g.choice([0, 1, 2 ** 40]))),  # at or past its shard's end
    "offset-shift": ("any", _row("offset", lambda r, a, i, g: a[i] + g.choice([1, 8, 32]))),
    "overlap": ("fail", _row("offset", lambda r, a, i, g: None if (j := _same_shard(
        r, a, i)) is None else a[j])),
    "crc": ("any", _row("crc", lambda r, a, i, g: a[i] ^ 1)),
    "length": ("fail", _row("length", lambda r, a, i, g: a[i] + 1)),
    "shard-index": ("fail", _row("shard", lambda r, a, i, g: len(r["shards"]) + g.randrange(3))),
    "index-range": ("fail", _row("index", lambda r, a, i, g: 10 ** 6)),
    "index-twice": ("fail", _row("index", lambda r, a, i, g: a[i - 1] if len(a) > 1 else None)),
    "short-column": ("fail", _short),
    "digest": ("fail", lambda r, g: (r.__setitem__("digest", b"x" * 16), "digest changed")[1]),
    "key-missing": ("fail", lambda r, g: (k := g.choice(sorted(r)), r.pop(k), f"no {k!r}")[2]),
    "key-type": ("fail", lambda r, g: (k := g.choice(sorted(r)), v := g.choice(
        [None, 5, "x", {}, []]), r.__setitem__(k, v), f"{k!r} -> {v!r}")[3]),
}
RAW = {  # whole-message faults, all to be refused: fn(data, rng) -> (data, text)
    "random-bytes": lambda d, g: (n := g.randrange(41), bytes(g.randrange(256) for _ in range(n)),
                                  f"{n} random bytes")[1:],
    "truncated": lambda d, g: (k := g.randrange(len(d)), d[:k], f"cut to {k}/{len(d)} bytes")[1:],
    "sent-twice": lambda d, g: (d + d, "the reply twice in one message"),
    "not-a-map": lambda d, g: (v := g.choice([5, "x", [1, 2], None, True, b"z", 2.5]),
                               msgpack.packb(v), f"msgpack {v!r}")[1:],
}
KINDS = {"mutate": 50, "raw": 14, "dup-other": 7, "dup-stale": 6, "drop-hang": 6, "drop-fast": 5,
         "stop-timeout": 5, "stop-fast": 4, "store": 3}
EXPECT = {"drop-hang": "fail", "drop-fast": "fail", "stop-timeout": "ok", "stop-fast": "any",
          "store": "any"}  # mutate: per mutation; raw, dup-*: "fail"
INTACT = ("mutate", "raw", "dup-other", "dup-stale")  # faults after which the group lives on


class _Rank:
    """A rank's group handle: at its gather number ``at`` (one per save on every rank) the fault
    hits the victim's reply or rank 0's gathered list.  Waits the fault must trip get SHORT here,
    the others keep the knob's LONG (a short knob would fail healthy saves at random)."""

    def __init__(self, inner: ThreadGroup, s: dict) -> None:
        self._inner, self.s, self.rank, self.size = inner, s, inner.rank, inner.size
        self.n, self.gone, self.short = 0, "", False

    def _call(self, fn, *a, timeout):
        if self.gone == "fast" or self.short:  # first, every rank left the previous round: a
            # break while one is still leaving it fails that completed round there (ThreadGroup)
            rv, mine = self._inner._rv, self._inner._round
            with rv.cond:
                rv.cond.wait_for(lambda: rv.round >= mine or rv.broken, LONG)
                if self.gone == "fast":  # the engine notices at once: GroupError, no timeout
                    rv.broken = rv.broken or f"rank {self.rank} died"
                    rv.cond.notify_all()
        if self.gone:
            raise _Gone()
        return fn(*a, timeout=SHORT if self.short else timeout)

    def gather(self, data, *, timeout):
        s, k, g = self.s, self.s["kind"], self.s["rng"]
        self.n += 1
        if self.n - 1 != s["at"]:
            s["last"][self.rank] = data
            return self._call(self._inner.gather, data, timeout=timeout)
        self.short = k == "drop-hang"  # every rank's waits from the hung reply on
        if self.rank == s["victim"]:
            if k == "drop-hang":  # never sends; wakes (and fails) once the others broke the group
                with self._inner._rv.cond:
                    self._inner._rv.cond.wait_for(lambda: self._inner._rv.broken, LONG)
                s["done"].append(f"rank {self.rank} hung instead of replying")
            elif k == "drop-fast":
                s["done"].append(f"rank {self.rank} died instead of replying")
                self.gone = "fast"
            elif k in ("mutate", "raw"):
                data = self._tamper(data, g)
        if self.rank == 0 and k == "store":  # the n-th storage operation from here (rank 0's
            sched, root = s["run"].sched, s["run"].local  # merge and commit) fails
            n = g.randrange(4)
            sched.fails[(root, sched.counts[root] + n)] = StorageError("injected: EIO")
            s["done"].append(f"storage op {n} after rank 0's gather raises StorageError")
        out = self._call(self._inner.gather, data, timeout=timeout)
        if k.startswith("stop") and self.rank == s["victim"]:
            s["done"].append(f"rank {self.rank} stops after replying ({k})")
            self.gone = k[5:]  # "timeout": never arrives again; "fast": the engine notices
        # a stop noticed by rank 0's own timeout, after its commit (the others' stay LONG)
        self.short = self.short or (k == "stop-timeout" and self.rank == 0)
        if self.rank == 0 and k.startswith("dup"):
            out, j = list(out), s["victim"]
            if k == "dup-stale" and j in s["last"]:
                out[j] = s["last"][j]
                s["done"].append(f"rank 0 gets rank {j}'s reply of the previous save again")
            else:
                i = g.choice([r for r in range(self.size) if r != j])
                out[j] = out[i]
                s["done"].append(f"rank 0 gets rank {i}'s reply in rank {j}'s place")
        return out

    def _tamper(self, data: bytes, g: random.Random) -> bytes:
        names = [g.choice(sorted(RAW))] if self.s["kind"] == "raw" else g.sample(
            sorted(MUTATIONS), len(MUTATIONS))
        for name in names:  # the first that applies to this reply
            if name in RAW:
                new, text = RAW[name](data, g)
            else:
                reply = msgpack.unpackb(data, raw=False)
                text = MUTATIONS[name][1](reply, g)
                new = msgpack.packb(reply, use_bin_type=True)
                self.s["expect"] = MUTATIONS[name][0]
            if text:
                text = re.sub(r"[0-9a-f]{16}", "<token>", text)  # the save's: not seeded
                self.s["done"].append(f"rank {self.rank}'s reply: {name}: {text}")
                return new
        raise AssertionError("no mutation applies")  # a checker bug: every reply has rows

    def broadcast(self, data, *, timeout):
        return self._call(self._inner.broadcast, data, timeout=timeout)

    def barrier(self, *, timeout):
        return self._call(self._inner.barrier, timeout=timeout)


def _states(writer: int, step: int, cfg: dict) -> tuple[TrainingState, list[TrainingState]]:
    """The whole state (what a reader must get back) and each rank's: the same replicated
    tensors, every value saying writer and step; with ``cuts``, rank r's rows of "s" as a Shard."""
    model = dict(F.make_state(writer, step).model)
    for k, (dt, n) in enumerate(cfg["extra"]):
        model[f"x{k}"] = (np.arange(n) + 100 * k + 10_000 * writer + step).astype(dt)
    cuts = cfg["cuts"]
    if not cuts:
        return TrainingState(model=model, step=step), [TrainingState(model=model, step=step)] * 4
    s = np.arange(cuts[-1] * 3, dtype=np.int64).reshape(-1, 3) + writer * 10 ** 6 + step * 1000
    return TrainingState(model={**model, "s": s}, step=step), [
        TrainingState(model={**model, "s": Shard(s[a:b], s.shape, (a, 0))}, step=step)
        for a, b in zip(cuts, cuts[1:])]


def _rank_body(run: F.Run, g: _Rank, cfg: dict, plan: list, res: list) -> None:
    """One rank: its manager, the saves (async: ``wait()`` says the outcome), close; records
    None or the exception per save, ("mgr", e) for the constructor or close."""
    m = None
    try:
        m = run.mgr(run.local, group=g, async_save=cfg["async"])
        for step, _w, _whole, states in plan:
            try:
                m.save(step, states[g.rank])
                if cfg["async"]:
                    m.wait()
                res.append(None)
            except Exception as e:  # noqa: BLE001 - classified by the main thread
                res.append(e)
        m.close()
    except _Gone as e:  # dead: its manager is never closed (Run.__exit__'s close would re-raise)
        res.append(e)
        run.managers.remove(m)
    except Exception as e:  # noqa: BLE001
        res.append(("mgr", e))


def run_d(seed: int) -> F.Outcome:
    rng = random.Random(seed)
    # Weighted to the small end: a rank-save costs ~2 ms of library CPU, so 4 ranks x 3 saves
    # would cost ~30 ms; every fault needs only a victim and another rank.
    size = rng.choices([2, 3, 4], [50, 32, 18])[0]
    extra = [(rng.choice(["<i8", "<i4", "<f4", "u1", "<f8"]), rng.randint(1, 40))
             for _ in range(rng.randint(size, 2 * size))]  # >= size tensors: every rank has rows
    rows = rng.randint(size, 3 * size)  # of "s", cut unevenly (empty blocks too)
    cuts = ([0, *sorted(rng.randint(0, rows) for _ in range(size - 1)), rows]
            if rng.random() < 0.35 else None)
    cfg = {"size": size, "extra": extra, "cuts": cuts, "async": rng.random() < 0.25}
    kind = rng.choices(list(KINDS), list(KINDS.values()))[0]
    n = rng.choices([1, 2, 3], [45, 35, 20])[0]
    at = rng.randrange(n)
    retry = rng.random() < 0.35  # the faulty save's step saved again (after a refusal: must work)
    steps = list(range(at + 1)) + ([at] if retry else []) + list(range(at + 1, n))
    with F.Run("d", seed) as run, _knobs.override(group_timeout=LONG):
        s = {"kind": kind, "at": at, "victim": rng.randrange(1, size), "run": run, "done": [],
             "rng": random.Random(rng.getrandbits(32)), "expect": EXPECT.get(kind, "fail"),
             "last": {}}  # only the fault's thread draws from s["rng"]: deterministic
        out = run.out
        out.ops.add((kind, size, bool(cuts), at))
        out.note(f"{size} ranks, {f'Shard rows {cuts}' if cuts else 'plain'}, async={cfg['async']}"
                 f", {len(extra) + 2} tensors; saves steps {steps}; fault at save {at}: {kind} "
                 f"(victim rank {s['victim']})")
        plan = [(step, i + 1, *_states(i + 1, step, cfg)) for i, step in enumerate(steps)]
        run.saved.update({(w, step): whole for step, w, whole, _ in plan})  # writer: attempt no.
        res: list[list] = [[] for _ in range(size)]
        threads = [threading.Thread(target=_rank_body, args=(run, _Rank(h, s), cfg, plan,
                                                             res[h.rank]), daemon=True)
                   for h in ThreadGroup.create(size)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * LONG + 1)
        wall = time.perf_counter() - t0
        for text in s["done"]:
            out.note(text)
        hung = [r for r, t in enumerate(threads) if t.is_alive()]
        if hung:
            out.violate(f"[7] ranks {hung} still running {wall:.1f} s after the start")
            run.managers.clear()  # closing a hung rank's manager could hang here too
            return out
        if wall > LONG * 0.75:
            out.violate(f"[7] the ranks took {wall:.2f} s: a collective waited near the timeout")
        _judge(run, s, plan, res)
    return out


def _raise(e: BaseException):  # for F.call: a rank's recorded exception, classified there
    raise e


def _judge(run: F.Run, s: dict, plan: list, res: list) -> None:
    out, at, damaged = run.out, s["at"], set()
    for r, rs in enumerate(res):
        for x in rs:
            if isinstance(x, tuple):  # the constructor or close failed: [5] only
                F.call(out, f"rank {r} CheckpointManager()/close()", partial(_raise, x[1]))
    fault = "; ".join(s["done"]) or s["kind"]
    for i, (step, w, _, _) in enumerate(plan):
        got = {r: rs[i] for r, rs in enumerate(res)
               if i < len(rs) and not isinstance(rs[i], (_Gone, tuple))}  # the live ranks
        for r, x in got.items():
            if x is not None:
                F.call(out, f"save {i} (step {step}) rank {r}", partial(_raise, x))
        ok = sorted(r for r, x in got.items() if x is None)
        failed = sorted(set(got) - set(ok))
        if ok and failed:
            out.violate(f"[O] save {i} (step {step}): ranks {ok} returned, ranks {failed} raised")
        if 0 in got:  # what the coordinator was told decides acknowledged / raised
            if got[0] is None:
                run.acked[step] = w
                damaged.discard(step)
            else:
                run.raised.add((w, step))
        want = s["expect"] if i == at else "ok" if i > at and s["kind"] in INTACT else None
        if want == "fail" and ok:
            out.violate(f"[6] save {i} (step {step}) was committed despite the fault ({fault})")
        elif want == "ok" and failed:
            out.violate(f"[6] save {i} (step {step}) raised on ranks {failed}: "
                        f"{'after ' if i > at else ''}the fault ({fault}) should not fail it")
        if i == at and s["expect"] == "any" and ok:
            damaged.add(step)  # a lied checksum or offset: a typed load error is the answer
    listed = F.check_root(out, run.local, run.saved, must_have=run.acked, fenced_publish=set(),
                          raised=run.raised, damaged_ok=damaged)
    _leftovers(run, s, listed)


def _leftovers(run: F.Run, s: dict, listed: set[int]) -> None:
    """[8] every file under the root is a lock file, a listed step's manifest or a shard it
    names, at the size it declares; every shard a listed manifest names is there."""
    store, base = fsspec.filesystem("memory").store, run.local + "/"
    keep = {f"{layout.step_name(st)}/manifest.msgpack": None for st in listed}
    for man in list(keep):
        try:  # only the shard list (check_root loaded the step; a full parse again: ~1 ms)
            outer = _codec.unpack_plain(store[base + man].getvalue(), man)
            keep.update({man.split("/")[0] + "/" + sh["path"]: sh["size"]
                         for sh in _codec.unpack_plain(outer["body"], man)["shards"]})
        except Exception as e:  # noqa: BLE001 - check_root said why
            run.out.note(f"{man} unreadable: {type(e).__name__}")
    have = {k[len(base):]: len(f.getvalue()) for k, f in list(store.items()) if k.startswith(base)}
    for rel, size in keep.items():
        if size is not None and have.get(rel) != size:
            run.out.violate(f"[8] {rel}: {have.get(rel, 'missing')} bytes, manifest says {size}")
    for rel in set(have) - set(keep):  # a failed delete (kind "store") may leave one for gc
        if not rel.startswith(".ckptcore.") and s["kind"] != "store":
            run.out.violate(f"[8] {rel} is left under the root (no listed step names it)")
