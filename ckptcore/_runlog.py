"""``ckpt log ROOT``: a run's history from the lineage of its committed steps.

Every committed step of a root (and of its backups) is listed with :func:`list_checkpoints`
(each manifest read once, bounded like every manifest read) and grouped: runs (one run id,
kept across resumes), sessions (one manager or process that saved steps), the resume that
started each session and its verdict against the step it resumed from:

* ``exact``: every part the next step depends on (data position, RNG states, optimizer step)
  was restored as saved, in the same framework and world size;
* ``flagged``: something differs, each reason in ``flags``: a saved part not restored (no
  ``cursor=``, ``rng=False``, ``keys=``), a data position restored otherwise or one that does
  not continue from the resumed step (samples skipped or repeated), a changed world size or
  framework, a rewind (resumed from an older step than the newest committed);
* ``unchecked``: what was restored is not known (``save_state(resumed_from=...)``, or a
  ``restore()`` that returned the state without objects to restore into and no
  ``CheckpointManager.restored_into`` after it).

The result is plain data (``--json``; docs/FORMAT.md, "ckpt log --json"), and :func:`render`
turns it into the text ``ckpt log`` prints.
"""

from __future__ import annotations

import logging
import os
from datetime import datetime
from typing import Any, Mapping, Sequence

from . import lineage
from .layout import CheckpointListing, list_checkpoints, recorded_backups

__all__ = ["run_log", "render", "local_time", "lineage_lines"]

log = logging.getLogger("ckptcore")

_CONSEQUENCE = {
    "data": ("data position saved but not restored (no cursor= given): the run restarts its "
             "epoch and sees samples again"),
    "rng": "RNG states saved but not restored (rng=False): random draws differ from the saved run",
    "optimizer": ("optimizer state saved but not restored (no optimizer= given): the optimizer "
                  "starts over"),
}


def run_log(root: str | os.PathLike, *, backups: Sequence[str] = (),
            storage_options: Mapping[str, Any] | None = None,
            listings: Mapping[str, Sequence[CheckpointListing]] | None = None) -> dict[str, Any]:
    """The history of the run(s) under ``root`` (and ``backups``' copies) as plain data: runs,
    their sessions and each resume's verdict (the module docstring; the keys are in
    docs/FORMAT.md, section 13).  Reads every committed step's manifest, never tensor data; a
    step whose manifest cannot be read is listed under ``unreadable``, one without a lineage
    under ``unrecorded``.  ``listings``: a tier's :func:`list_checkpoints` already made, by its
    URL (``ckpt report`` reads the backups' blob references from the same listing; each
    manifest is read once).

    Example:
        >>> for run in ckptcore.run_log("s3://runs/exp1")["runs"]:                # doctest: +SKIP
        ...     print(run["run_id"], [s["verdict"] for s in run["sessions"]])
    """
    tiers = [("local", os.fspath(root))] + [(os.fspath(b), os.fspath(b)) for b in backups]
    steps: dict[int, dict[str, Any]] = {}
    for name, url in tiers:
        listed = (listings or {}).get(url)
        for c in (listed if listed is not None else
                  list_checkpoints(url, storage_options=storage_options)):
            row = steps.get(c.step)
            if row is None:
                row = steps[c.step] = {"step": c.step, "url": c.url, "tiers": [], "info": c.info,
                                       "problem": c.problem}
            elif row["info"] is None and c.info is not None:
                row.update(info=c.info, problem=None, url=c.url)
            row["tiers"].append(name)
    out: dict[str, Any] = {"root": os.fspath(root),
                           "tiers": [{"name": n if n == "local" else "backup", "url": u}
                                     for n, u in tiers], "runs": [],
                           "unrecorded": [], "unreadable": [],
                           "recorded_backups": recorded_backups(root,
                                                                storage_options=storage_options)}
    sessions: dict[str, dict[str, Any]] = {}
    for step in sorted(steps):
        row = steps[step]
        info = row["info"]
        if info is None:
            out["unreadable"].append({"step": step, "url": row["url"], "problem": row["problem"],
                                      "tiers": row["tiers"]})
            continue
        shown = _step_row(row, info)
        lin = info.lineage
        if not lin or not isinstance(lin.get("run_id"), str):
            out["unrecorded"].append(shown)
            continue
        key = lin.get("session") if isinstance(lin.get("session"), str) else (
            f"{lin['run_id']}/{lin.get('resume_count')}/{(lin.get('resumed_from') or {}).get('step')}")
        s = sessions.get(key)
        if s is None:
            s = sessions[key] = _session(key, lin)
        s["steps"].append(shown)
    runs: dict[str, dict[str, Any]] = {}
    for s in sessions.values():
        r = runs.setdefault(s["run_id"], {"run_id": s["run_id"], "tags": {}, "sessions": []})
        r["tags"].update(s["tags"])
        r["sessions"].append(s)
    by_step = {st["step"]: s for s in sessions.values() for st in s["steps"]}
    for s in sessions.values():
        _judge(s, sessions, by_step, set(steps))
    out["runs"] = sorted(runs.values(), key=lambda r: r["sessions"][0]["steps"][0]["step"])
    for r in out["runs"]:
        r["steps"] = [r["sessions"][0]["steps"][0]["step"],
                      max(st["step"] for s in r["sessions"] for st in s["steps"])]
        r["resumes"] = sum(1 for s in r["sessions"] if s["resumed_from"] is not None)
        r["flagged"] = sum(1 for s in r["sessions"] if s["verdict"] == "flagged")
    return out


def _step_row(row: Mapping[str, Any], info: Any) -> dict[str, Any]:
    lin = info.lineage or {}
    metrics = info.metadata.get("metrics") if isinstance(info.metadata, Mapping) else None
    return {"step": row["step"], "saved_step": info.step, "epoch": info.epoch,
            "created": info.created, "created_local": local_time(info.created),
            "metrics": dict(metrics) if isinstance(metrics, Mapping) else None,
            "framework": info.framework, "fingerprint": lin.get("fingerprint"),
            "bytes": info.nbytes, "stats": dict(info.stats) or None,
            "position": lin.get("position") or lineage.position(info.data),
            "tiers": list(row["tiers"]), "url": row["url"]}


def _session(key: str, lin: Mapping[str, Any]) -> dict[str, Any]:
    return {"session": key, "run_id": lin["run_id"], "parent": None,
            "started": lin.get("started"), "started_local": local_time(lin.get("started")),
            "resume_count": lin.get("resume_count", 0), "resumed_from": lin.get("resumed_from"),
            "conversion": lin.get("conversion"), "framework": lin.get("framework"),
            "world_size": lin.get("world_size"), "host": lin.get("host"),
            "versions": lin.get("versions") or {}, "git": lin.get("git"),
            "tags": dict(lin.get("tags") or {}), "verdict": "fresh", "flags": [], "notes": [],
            "steps": []}


def _judge(s: dict[str, Any], sessions: Mapping[str, Any], by_step: Mapping[int, Any],
           listed: set[int]) -> None:
    """The verdict of the resume that started session ``s`` (``fresh`` without one)."""
    rf = s["resumed_from"]
    if s["conversion"]:
        c = s["conversion"]
        s["notes"].append(f"converted from {c.get('root')} (format {c.get('format')}, framework "
                          f"{c.get('framework')})")
    if not isinstance(rf, Mapping):
        return
    parent = sessions.get(rf.get("session")) if isinstance(rf.get("session"), str) else None
    parent = parent or by_step.get(rf.get("step"))
    s["parent"] = parent["session"] if parent is not None and parent is not s else None
    flags, notes = s["flags"], s["notes"]
    if parent is None:
        notes.append(f"step {rf.get('step')} " + ("has no lineage recorded" if rf.get("step") in listed
                                                  else "is no longer listed"))
    if rf.get("tier") not in (None, "local"):
        notes.append(f"restored from the backup {rf.get('tier')}")
    newest = rf.get("newest_step")
    if isinstance(newest, int) and isinstance(rf.get("step"), int) and newest > rf["step"]:
        flags.append(f"rewind: resumed from step {rf['step']} while step {newest} was the newest "
                     "committed (a fallback over a damaged step, or restore(step=...))")
    if rf.get("world_size") is not None and s["world_size"] is not None \
            and rf["world_size"] != s["world_size"]:
        flags.append(f"world size changed: {rf['world_size']} -> {s['world_size']}")
    if rf.get("framework") and s["framework"] and rf["framework"] != s["framework"]:
        flags.append(f"framework changed: {rf['framework']} -> {s['framework']} (migrated; RNG "
                     "states reseeded)")
    unchecked = _parts(rf, flags, notes)
    _continuity(s, rf, parent, flags, [x for x in sessions.values() if x["run_id"] == s["run_id"]])
    s["verdict"] = "flagged" if flags else "unchecked" if unchecked else "exact"


def _parts(rf: Mapping[str, Any], flags: list[str], notes: list[str]) -> bool:
    """Flags for each part restored otherwise than saved; whether some could not be checked."""
    restored, saved = rf.get("restored"), rf.get("parts") or {}
    if not isinstance(restored, Mapping):
        notes.append("what was restored is not recorded (save_state(resumed_from=...))")
        return True
    unchecked = False
    for part in lineage.PARTS:
        got, want = restored.get(part), saved.get(part) if isinstance(saved, Mapping) else None
        if got == want:
            continue
        if got == lineage.IGNORED:
            flags.append(_CONSEQUENCE[part])
        elif got == lineage.NOT_LOADED:
            flags.append(f"{part} saved but left out on purpose (keys=[...] without {part!r})")
        elif got == lineage.RETURNED:
            notes.append(f"{part}: not checked (restore() returned the state without objects; "
                         "the loop applies it)")
            unchecked = True
        elif part == "data":
            flags.append(f"data position restored differs from the one saved ({_pos(rf)})")
        else:
            flags.append(f"{part} restored differs from the one saved")
    return unchecked


def _pos(rf: Mapping[str, Any]) -> str:
    p = rf.get("position")
    if isinstance(p, Mapping):
        return f"restored at epoch {p.get('epoch')} position {p.get('position')}, seed {p.get('seed')}"
    return "position unknown"


def _index(p: Any, per_epoch: int | None) -> int | None:
    if not isinstance(p, Mapping) or per_epoch is None:
        return None
    e, q = p.get("epoch"), p.get("position")
    return e * per_epoch + q if isinstance(e, int) and isinstance(q, int) else None


def _continuity(s: dict[str, Any], rf: Mapping[str, Any], parent: Any, flags: list[str],
                run: list) -> None:
    """Whether the data position of the session's first step follows from the resumed step's at
    the rate of samples per step seen within the run's sessions (samples skipped or repeated
    otherwise)."""
    if parent is None or not s["steps"]:
        return
    base = next((st for st in parent["steps"] if st["step"] == rf.get("step")), None)
    first = s["steps"][0]
    if base is None or not isinstance(base.get("position"), Mapping) \
            or not isinstance(first.get("position"), Mapping):
        return
    if base["position"].get("seed") != first["position"].get("seed"):
        flags.append(f"data order changed: cursor seed {base['position'].get('seed')} -> "
                     f"{first['position'].get('seed')}")
        return
    per_epoch, rate = _rate(run)
    a, b = _index(base["position"], per_epoch), _index(first["position"], per_epoch)
    if a is None or b is None or rate is None:
        return
    expected = a + (first["step"] - base["step"]) * rate
    if b != expected:
        what = "repeated" if b < expected else "skipped"
        flags.append(f"data {what}: at step {first['step']} the cursor is at sample {b} of the run, "
                     f"{abs(b - expected)} {'before' if b < expected else 'after'} the {expected} "
                     f"that step {base['step']} and {rate} samples per step give")


def _rate(sessions: list) -> tuple[int | None, int | None]:
    """Samples per epoch (the cursor's) and samples per step, when every pair of consecutive
    steps within a session agrees on it; None for what is not known."""
    per_epoch = None
    for s in sessions:
        for st in s["steps"]:
            info_pos = st.get("position")
            if isinstance(info_pos, Mapping) and isinstance(info_pos.get("per_epoch"), int):
                per_epoch = info_pos["per_epoch"]
    rates = set()
    for s in sessions:
        steps = s["steps"]
        for x, y in zip(steps, steps[1:]):
            px, py = x.get("position"), y.get("position")
            if per_epoch is None and isinstance(px, Mapping) and isinstance(py, Mapping):
                return None, None
            ix, iy = _index(px, per_epoch), _index(py, per_epoch)
            if ix is None or iy is None or (iy - ix) % (y["step"] - x["step"]):
                return per_epoch, None
            rates.add((iy - ix) // (y["step"] - x["step"]))
    return (per_epoch, rates.pop()) if len(rates) == 1 else (per_epoch, None)


def local_time(t: Any) -> str | None:
    """A Unix time as local time, ISO 8601 to the second with its UTC offset; None for none."""
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        return None
    try:
        return datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")
    except (ValueError, OverflowError, OSError):
        return None


def _shown_time(iso: str | None) -> str:
    return iso[:19].replace("T", " ") if iso else "?"


# -- text ----------------------------------------------------------------------------------------
def render(data: Mapping[str, Any]) -> list[str]:
    """The lines ``ckpt log`` prints for :func:`run_log`'s result."""
    runs = data["runs"]
    resumes = sum(r["resumes"] for r in runs)
    flagged = sum(r["flagged"] for r in runs)
    n = sum(len(s["steps"]) for r in runs for s in r["sessions"]) + len(data["unrecorded"]) \
        + len(data["unreadable"])
    lines = [f"{data['root']}: {n} step(s), {len(runs)} run(s), {resumes} resume(s)"
             + (f", {flagged} FLAGGED" if flagged else "")]
    for r in runs:
        tags = " ".join(f"{k}={v}" for k, v in r["tags"].items())
        lines.append(f"run {r['run_id']}  steps {r['steps'][0]}..{r['steps'][1]}"
                     + (f"  tags {tags}" if tags else ""))
        children: dict[Any, list] = {}
        for s in r["sessions"]:
            children.setdefault(s["parent"], []).append(s)
        for s in children.get(None, []):
            _render_session(s, children, lines, 1)
    if data["unrecorded"]:
        lines.append(f"no lineage recorded (saved before ckptcore recorded it): "
                     f"{len(data['unrecorded'])} step(s)")
        for st in data["unrecorded"]:
            lines.append("  " + _step_text(st))
    for u in data["unreadable"]:
        lines.append(f"unreadable step {u['step']}: {u['problem']}")
    return lines


def _render_session(s: Mapping[str, Any], children: Mapping[Any, list], lines: list[str],
                    depth: int) -> None:
    pad = "  " * depth
    rf = s["resumed_from"]
    if isinstance(rf, Mapping):
        head = (f"resume {s['resume_count']} from step {rf.get('step')} "
                f"({rf.get('tier') or 'local'}"
                + (f", generation {rf['generation']}" if rf.get("generation") is not None else "")
                + f"): {s['verdict'].upper() if s['verdict'] == 'flagged' else s['verdict']}")
    else:
        head = "started"
    git = s["git"]
    where = [f"session {s['session']}", _shown_time(s["started_local"]),
             f"host {s['host']}", f"world size {s['world_size']}",
             f"framework {s['framework'] or '-'}"]
    if isinstance(git, Mapping) and git.get("commit"):
        where.append(f"git {str(git['commit'])[:10]}" + (" (dirty)" if git.get("dirty") else ""))
    lines.append(f"{pad}{'└─ ' if depth > 1 else ''}{head}   " + "  ".join(w for w in where if w))
    for f in s["flags"]:
        lines.append(f"{pad}     ! {f}")
    for note in s["notes"]:
        lines.append(f"{pad}     - {note}")
    for st in s["steps"]:
        lines.append(f"{pad}   " + _step_text(st))
    for child in sorted(children.get(s["session"], []), key=lambda c: c["steps"][0]["step"]):
        _render_session(child, children, lines, depth + 1)


def _step_text(st: Mapping[str, Any]) -> str:
    metrics = st.get("metrics") or {}
    shown = " ".join(f"{k}={v:.6g}" if isinstance(v, (int, float)) and not isinstance(v, bool)
                     else f"{k}={v}" for k, v in metrics.items())
    return (f"step {st['step']:<8} {_shown_time(st['created_local']):<19}  epoch {st['epoch']:<4}"
            + (f" {shown}" if shown else "")
            + (f"  fp {st['fingerprint']}" if st.get("fingerprint") else "")
            + f"  [{'+'.join(t if t == 'local' else 'backup' for t in st['tiers'])}]")


def lineage_lines(lin: Mapping[str, Any] | None) -> list[str]:
    """A checkpoint's lineage as the few lines ``ckpt inspect`` shows."""
    if not lin:
        return ["no lineage recorded (saved before ckptcore recorded it)"]
    out = [f"run {lin.get('run_id')}  session {lin.get('session')}  resume count "
           f"{lin.get('resume_count', 0)}  world size {lin.get('world_size')}  host {lin.get('host')}"]
    rf = lin.get("resumed_from")
    if isinstance(rf, Mapping):
        out.append(f"resumed from step {rf.get('step')} ({rf.get('tier') or 'local'}: "
                   f"{rf.get('url')}), its fingerprint {rf.get('fingerprint')}, restored as "
                   f"{rf.get('restored_fingerprint') or 'unknown'}")
    c = lin.get("conversion")
    if isinstance(c, Mapping):
        out.append(f"converted from {c.get('root')} (format {c.get('format')}, framework "
                   f"{c.get('framework')})")
    versions = lin.get("versions") if isinstance(lin.get("versions"), Mapping) else {}
    git = lin.get("git")
    out.append(" ".join(f"{k} {v}" for k, v in versions.items())
               + (f"  git {git.get('commit')}" + (" (dirty)" if git.get("dirty") else "")
                  if isinstance(git, Mapping) else "  git -"))
    parts = lin.get("parts") if isinstance(lin.get("parts"), Mapping) else {}
    out.append(f"fingerprint {lin.get('fingerprint')} ("
               + ", ".join(f"{p} {parts.get(p) or '-'}" for p in lineage.PARTS) + ")")
    tags = lin.get("tags") if isinstance(lin.get("tags"), Mapping) else {}
    if tags:
        out.append("tags " + " ".join(f"{k}={v}" for k, v in tags.items()))
    return out
