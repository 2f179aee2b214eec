"""``ckpt report ROOT -o report.html``: one self-contained HTML page about a run, from its
checkpoints alone.

What someone debugging a preempted run needs first comes first: a verdict (did every resume
continue exactly? what is flagged, and why? which step would a restore take, and which tiers
hold it? is a backup behind? did a metric go NaN?), then the lineage (sessions, hosts, versions,
git commits, tags, conversions), a timeline of the steps each tier holds, what each save cost
(seconds, blocked seconds, bytes, and a backup's deduplication), the restores' times, and every
saved metric plotted against the step with each resume marked.

The data is :func:`ckptcore.run_log`'s (the model ``ckpt log --json`` prints), built from one
listing of each tier (each manifest read once), plus, for a deduplicated backup, one listing
of its blobs: a step's bytes against the bytes of the blobs no earlier listed step refers to
gives its deduplication.  The page (``ckptcore._report_page``) has inline CSS and SVG only, no
script and no external resource, under a Content-Security-Policy that allows neither; every
string from a checkpoint is escaped (they are untrusted).

Example:
    >>> import ckptcore, numpy as np                                   # doctest: +SKIP
    >>> ckptcore.report.write_report("runs/exp", "report.html")        # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from . import _report_page
from ._replica import list_blobs
from ._runlog import run_log
from ._storage import CAS_PREFIX, Store
from .errors import CheckpointError
from .layout import CheckpointListing, list_checkpoints

__all__ = ["report_data", "render", "write_report"]

log = logging.getLogger("ckptcore")


def report_data(root: str | os.PathLike, *, backups: Sequence[str | os.PathLike] = (),
                storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What the page shows, as plain data (what :func:`render` draws):

    * ``log``: :func:`ckptcore.run_log`'s result (``ckpt log --json``);
    * ``sessions``: every session of every run, in the order of their first step, with a
      pseudo-session (``session`` None, verdict ``"unrecorded"``) of the steps without lineage;
    * ``dedup``: per backup, each step's ``bytes`` and ``new`` bytes (of blobs no earlier listed
      step refers to), ``ratio`` and ``missing`` blobs; ``kind`` ``"plain"`` for plain copies;
    * ``copies``: per backup, each step's save time and session, and whether the local tier
      holds another checkpoint under that step (``differs``);
    * ``metrics``: the numeric metric names, in the order they first appear;
    * ``findings``: ``(severity, text)``, ``"bad"`` then ``"warn"`` then ``"note"``, and
      ``status``: the worst of them (``"ok"`` without bad or warn).
    """
    root = os.fspath(root)
    backups = [os.fspath(b) for b in backups]
    listings = {url: list_checkpoints(url, storage_options=storage_options)
                for url in [root, *backups]}
    data = run_log(root, backups=backups, storage_options=storage_options, listings=listings)
    sessions = [s for r in data["runs"] for s in r["sessions"]]
    if data["unrecorded"]:
        sessions.append({"session": None, "run_id": None, "resumed_from": None,
                         "verdict": "unrecorded", "flags": [], "notes": [],
                         "steps": data["unrecorded"], "resume_count": None})
    sessions.sort(key=lambda s: s["steps"][0]["step"])
    out: dict[str, Any] = {
        "root": root, "generated": time.time(), "log": data, "sessions": sessions,
        "dedup": {b: _dedup(b, listings[b], storage_options) for b in backups},
        "copies": {b: _copies(listings[root], listings[b]) for b in backups},
    }
    out["metrics"] = _metric_names(sessions)
    out["findings"] = _findings(out)
    severities = {sev for sev, _ in out["findings"]}
    out["status"] = "bad" if "bad" in severities else "warn" if "warn" in severities else "ok"
    return out


def render(data: Mapping[str, Any]) -> str:
    """The page of :func:`report_data`'s result, as HTML text."""
    return _report_page.page(data)


def write_report(root: str | os.PathLike, path: str | os.PathLike, *,
                 backups: Sequence[str | os.PathLike] = (),
                 storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write the report page of the run(s) under ``root`` (and its ``backups``' copies) to the
    local file ``path`` (replaced whole: written aside, then renamed); return
    :func:`report_data`'s result.  ``FileNotFoundError`` when ``path``'s folder is missing."""
    target = Path(path)
    if not target.parent.is_dir():
        raise FileNotFoundError(f"{target.parent} does not exist: the report {target} has no "
                                "folder to go in")
    if target.is_dir():
        raise IsADirectoryError(f"{target} is a folder: name the report's file, e.g. "
                                f"{target / 'report.html'}")
    data = report_data(root, backups=backups, storage_options=storage_options)
    text = render(data)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    log.info("report: %s written (%d bytes; %d step(s), status %s)", target, len(text),
             sum(len(s["steps"]) for s in data["sessions"]), data["status"])
    return data


def _dedup(url: str, listing: Sequence[CheckpointListing],
           storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """A backup's steps: ``bytes`` (of the blobs each refers to), ``new`` (of those no earlier
    listed step refers to: what its replication had to upload, unless an earlier step was
    deleted since) and ``missing`` (blobs it names that the listing lacks)."""
    readable = [c for c in listing if c.info is not None]
    refs = {c.step: [s for s in c.info.shards if s.startswith(CAS_PREFIX)] for c in readable}
    if not any(refs.values()):
        return {"url": url, "kind": "plain" if readable else "empty", "steps": [], "problem": None}
    try:
        blobs = list_blobs(Store(url, dict(storage_options or {})))
    except (CheckpointError, OSError) as e:
        log.warning("report: the blobs of the backup %s cannot be listed (%s: %s); its "
                    "deduplication is shown as unknown", url, type(e).__name__, e)
        return {"url": url, "kind": "deduplicated", "steps": [],
                "problem": f"{type(e).__name__}: {e}"}
    seen: set[str] = set()
    steps = []
    for c in readable:
        names = set(refs[c.step])
        missing = sorted(n for n in names if n not in blobs)
        size = sum(blobs[n][0] for n in names if n in blobs)
        new = sum(blobs[n][0] for n in names - seen if n in blobs)
        seen |= names
        steps.append({"step": c.step, "bytes": size, "new": new, "blobs": len(names),
                      "missing": missing, "ratio": size / new if new else math.inf})
    return {"url": url, "kind": "deduplicated", "steps": steps, "problem": None}


def _copies(local: Sequence[CheckpointListing],
            backup: Sequence[CheckpointListing]) -> dict[int, dict[str, Any]]:
    """A backup's readable steps: when saved, by which session, and whether the local tier
    holds another checkpoint under the same step (``differs``: a rewind the backup did not
    follow, or a step saved again since)."""
    mine = {c.step: c.info for c in local if c.info is not None}
    out = {}
    for c in backup:
        if c.info is None:
            continue
        other = mine.get(c.step)
        lin = c.info.lineage or {}
        out[c.step] = {"created": c.info.created, "session": lin.get("session"),
                       "differs": other is not None and (
                           other.writer.get("id") != c.info.writer.get("id")
                           or other.created != c.info.created)}
    return out


def _metric_names(sessions: Sequence[Mapping[str, Any]]) -> list[str]:
    names: dict[str, None] = {}
    for s in sessions:
        for st in s["steps"]:
            for k, v in (st.get("metrics") or {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    names.setdefault(str(k), None)
    return list(names)


def _findings(d: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What the verdict lists: ``(severity, text)``, the bad first."""
    out: list[tuple[str, str]] = []
    data = d["log"]
    for u in data["unreadable"]:
        out.append(("bad", f"step {u['step']} cannot be read ({u['problem']}): a restore "
                           "skips it and falls back to an older step"))
    for s in d["sessions"]:
        rf = s["resumed_from"] if isinstance(s["resumed_from"], Mapping) else None
        head = (f"resume {s['resume_count']} of run {s['run_id']} (session {s['session']}, "
                f"from step {rf.get('step')})" if rf else None)
        for f in s["flags"]:
            out.append(("bad", f"{head}: {f}"))
        if s["verdict"] == "unchecked":
            out.append(("warn", f"{head}: not checked: " + "; ".join(s["notes"])))
    out += _nonfinite(d["sessions"])
    for b, dd in d["dedup"].items():
        for st in dd["steps"]:
            if st["missing"]:
                out.append(("bad", f"backup {b}: step {st['step']} refers to "
                                   f"{len(st['missing'])} blob(s) its listing lacks: "
                                   f"`ckpt verify --deep {b}` checks and repairs it"))
        if dd["problem"]:
            out.append(("warn", f"backup {b}: its blobs cannot be listed ({dd['problem']})"))
    for b, copies in d["copies"].items():
        differ = [step for step, c in copies.items() if c["differs"]]
        if differ:
            out.append(("warn", f"backup {b} holds other checkpoints than the local tier under "
                                f"step(s) {', '.join(map(str, differ))} (saved before a rewind, or "
                                "by another run): a restore from that backup takes its own"))
    out += _tiers(data)
    out += _fresh_runs(data)
    if data["unrecorded"]:
        out.append(("note", f"{len(data['unrecorded'])} step(s) saved without lineage (before "
                            "ckptcore recorded it): their resumes cannot be checked"))
    order = {"bad": 0, "warn": 1, "note": 2}
    return sorted(out, key=lambda f: order[f[0]])


def _nonfinite(sessions: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    bad: dict[str, list[int]] = {}
    for s in sessions:
        for st in s["steps"]:
            for k, v in (st.get("metrics") or {}).items():
                if isinstance(v, float) and not math.isfinite(v):
                    bad.setdefault(str(k), []).append(st["step"])
    return [("bad", f"metric {k} is not finite (NaN or infinite) at step(s) "
                    f"{', '.join(map(str, steps[:10]))}" + (" ..." if len(steps) > 10 else ""))
            for k, steps in bad.items()]


def _tiers(data: Mapping[str, Any]) -> list[tuple[str, str]]:
    """How far each backup is behind the local tier's newest step."""
    held: dict[str, list[int]] = {t["url"] if t["name"] != "local" else "local": []
                                  for t in data["tiers"]}
    every = [st for r in data["runs"] for s in r["sessions"] for st in s["steps"]] \
        + list(data["unrecorded"]) + list(data["unreadable"])
    for st in every:
        for t in st["tiers"]:
            held.setdefault(t, []).append(st["step"])
    local = max(held.get("local") or [], default=None)
    out = []
    for name, steps in held.items():
        if name == "local" or local is None:
            continue
        newest = max(steps, default=None)
        if newest is None:
            out.append(("warn", f"backup {name} holds no step (newest local step: {local})"))
        elif newest < local:
            behind = sum(1 for s in held["local"] if s > newest)
            out.append(("warn", f"backup {name} is {behind} step(s) behind: its newest step is "
                                f"{newest}, the local tier's {local} (replication in progress, "
                                "failing, or the run stopped before it caught up)"))
    return out


def _fresh_runs(data: Mapping[str, Any]) -> list[tuple[str, str]]:
    """A run that starts fresh after another's steps: a restart that did not restore?"""
    out = []
    runs = data["runs"]
    for before, r in zip(runs, runs[1:]):
        first = r["sessions"][0]
        if first["resumed_from"] is None and first["conversion"] is None:
            out.append(("warn", f"run {r['run_id']} starts fresh (no resume) at step "
                                f"{r['steps'][0]}, after run {before['run_id']}'s steps "
                                f"{before['steps'][0]}..{before['steps'][1]}: a restart that "
                                "did not restore, or a new run in the same root"))
    return out
