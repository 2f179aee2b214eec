"""The HTML of ``ckpt report``'s page, from :func:`ckptcore.report.report_data`'s result.

One file: inline CSS, inline SVG (``ckptcore._report_svg``), no script, no external resource,
and a Content-Security-Policy that forbids both (a string that escaped escaping still could not
run, nor fetch anything).  Every value that comes from a checkpoint goes through :func:`esc`.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any, Mapping, Sequence

from ._report_svg import PALETTE, Mark, Series, bar_plot, esc, line_plot, timeline
from ._runlog import local_time
from ._version import __version__

__all__ = ["page", "CSP"]

# No script, no fetch: styles inline only; images only as data: URLs (none today).
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
_GRAY = "#999999"
_MAX_METRICS = 24

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;max-width:1120px;
padding:12px 20px 40px;color:#1a1a1a;background:#fff}
h1{font-size:20px;margin:6px 0 2px}h2{font-size:17px;margin:26px 0 6px;border-bottom:1px solid #ddd}
h3{font-size:14px;margin:14px 0 4px}.sub{color:#666;margin:0 0 10px}
.verdict{border-left:8px solid;padding:8px 14px;margin:10px 0;background:#fafafa}
.verdict.bad{border-color:#c00000;background:#fff4f4}.verdict.warn{border-color:#e69f00;
background:#fffaf0}.verdict.ok{border-color:#009e73;background:#f3fbf7}
.headline{font-size:18px;font-weight:600;margin:2px 0 6px}
li.bad{color:#a00000}li.warn{color:#8a5a00}li.note{color:#555}
table{border-collapse:collapse;margin:4px 0;font-size:13px}
td,th{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}
.mono{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px}
.sw{display:inline-block;width:11px;height:11px;margin-right:5px;vertical-align:-1px}
.legend span.item{margin-right:16px;white-space:nowrap}
svg.plot{display:block;margin:4px 0 10px;font:11px system-ui,sans-serif;background:#fff}
.none{color:#777;font-style:italic}.flag{color:#c00000;font-weight:600}
"""


def page(d: Mapping[str, Any]) -> str:
    sessions = d["sessions"]
    colors = {id(s): (_GRAY if s["session"] is None else PALETTE[i % len(PALETTE)])
              for i, s in enumerate(sessions)}
    parts = [_head(d), _verdict(d), _legend(sessions, colors), _lineage(sessions),
             _restores(sessions), _timeline(d, colors), _costs(d, colors), _metrics(d, colors),
             _steps(d)]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">"
            f"<title>ckpt report: {esc(d['root'])}</title><style>{_CSS}</style></head><body>"
            + "\n".join(parts) + "</body></html>\n")


# -- text helpers ---------------------------------------------------------------------------------
def _when(t: Any) -> str:
    iso = local_time(t)
    return iso[:19].replace("T", " ") if iso else "?"


def _size(n: Any) -> str:
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return "not recorded"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _secs(v: Any) -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return "not recorded"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 172800 else f"{seconds / 86400:.1f} days"


def _who(s: Mapping[str, Any]) -> str:
    if s["session"] is None:
        return "no lineage recorded"
    return f"run {str(s['run_id'])[:8]} · session {str(s['session'])[:8]}"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A table; the cells are HTML already (escaped by the caller)."""
    return ("<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>"
            + "".join("<tr>" + "".join(c if c.startswith("<td") else f"<td>{c}</td>" for c in r)
                      + "</tr>" for r in rows) + "</table>")


def _num(text: str) -> str:
    return f'<td class="num">{text}</td>'


# -- sections --------------------------------------------------------------------------------------
def _head(d: Mapping[str, Any]) -> str:
    tiers = ", ".join(f"{esc(t['name'])} {esc(t['url'])}" for t in d["log"]["tiers"])
    return (f"<h1>ckpt report: <span class=\"mono\">{esc(d['root'])}</span></h1>"
            f"<p class=\"sub\">generated {esc(_when(d['generated']))} by ckptcore "
            f"{esc(__version__)} · tiers: {tiers}</p>")


def _verdict(d: Mapping[str, Any]) -> str:
    sessions, data = d["sessions"], d["log"]
    steps = [st for s in sessions for st in s["steps"]]
    if not steps and not data["unreadable"]:
        return (f'<div class="verdict warn"><p class="headline">No committed checkpoints under '
                f'{esc(d["root"])}</p></div>')
    resumed = [s for s in sessions if isinstance(s["resumed_from"], Mapping)]
    counts = {v: sum(1 for s in resumed if s["verdict"] == v) for v in ("exact", "flagged",
                                                                         "unchecked")}
    bad = [f for f in d["findings"] if f[0] == "bad"]
    headline = {"bad": f"Needs attention: {len(bad)} problem(s) found",
                "warn": "Check the warnings below", "ok": (
                    "OK: every resume continued exactly" if resumed else "OK: no resume, "
                    "nothing flagged")}[d["status"]]
    facts = []
    if steps:
        newest = max(steps, key=lambda st: st["step"])
        facts.append(f"newest step <b>{newest['step']}</b>, saved {esc(_when(newest['created']))} "
                     f"({esc(_ago(max(0.0, d['generated'] - newest['created'])))} before this "
                     f"report), held by {esc(' + '.join(newest['tiers']))}; a restore without a "
                     "step takes it (verifying it as it loads; a damaged copy falls back to its "
                     "replica, then to an older step)")
    runs = data["runs"]
    facts.append(f"{len(runs)} run(s): " + "; ".join(
        f"<span class=\"mono\">{esc(r['run_id'])}</span> steps {r['steps'][0]}..{r['steps'][1]}, "
        f"{r['resumes']} resume(s)" for r in runs) if runs else "no run recorded a lineage")
    facts.append(f"{len(resumed)} resume(s): {counts['exact']} exact, "
                 + (f"<span class=\"flag\">{counts['flagged']} FLAGGED</span>"
                    if counts["flagged"] else "0 flagged") + f", {counts['unchecked']} unchecked")
    if resumed:
        last = max(resumed, key=lambda s: s["steps"][0]["step"])
        rf = last["resumed_from"]
        facts.append(f"last resume: from step {esc(rf.get('step'))} ({esc(rf.get('tier'))}) at "
                     f"{esc(_when(rf.get('at')))}, restore took {esc(_secs(rf.get('seconds')))}, "
                     f"verdict {esc(last['verdict'])}")
    items = "".join(f'<li class="{sev}">{esc(text)}</li>' for sev, text in d["findings"])
    return (f'<div class="verdict {d["status"]}"><p class="headline">{esc(headline)}</p><ul>'
            + "".join(f"<li>{f}</li>" for f in facts) + "</ul>"
            + (f"<h3>Findings</h3><ul>{items}</ul>" if items else "") + "</div>")


def _legend(sessions: Sequence[Mapping[str, Any]], colors: Mapping[int, str]) -> str:
    items = []
    for s in sessions:
        rf = s["resumed_from"]
        how = (f"resume {s['resume_count']} from step {rf.get('step')}: {s['verdict']}"
               if isinstance(rf, Mapping) else s["verdict"])
        items.append(f'<span class="item"><span class="sw" style="background:{colors[id(s)]}">'
                     f'</span>{esc(_who(s))} ({esc(how)})</span>')
    return f'<p class="legend">{"".join(items)}</p>' if items else ""


def _lineage(sessions: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    for s in sessions:
        if s["session"] is None:
            rows.append([esc(_who(s)), f"{s['steps'][0]['step']}..{s['steps'][-1]['step']}"]
                        + ['<span class="none">not recorded</span>'] * 7)
            continue
        rf = s["resumed_from"]
        start = ("fresh" if not isinstance(rf, Mapping) else
                 f"resume {esc(s['resume_count'])} from step {esc(rf.get('step'))} "
                 f"({esc(rf.get('tier'))}, generation {esc(rf.get('generation'))}): "
                 + (f'<span class="flag">FLAGGED</span>' if s["verdict"] == "flagged"
                    else esc(s["verdict"])))
        notes = "".join(f'<div class="flag">! {esc(f)}</div>' for f in s["flags"]) + "".join(
            f"<div>- {esc(n)}</div>" for n in s["notes"])
        git = s["git"] if isinstance(s["git"], Mapping) else None
        rows.append([
            f'<span class="mono">{esc(s["session"])}</span><br>{esc(_when(s["started"]))}',
            f"{s['steps'][0]['step']}..{s['steps'][-1]['step']}", start + notes,
            esc(s["host"]), esc(s["world_size"]), esc(s["framework"] or "-"),
            esc(" ".join(f"{k} {v}" for k, v in (s["versions"] or {}).items())),
            ('<span class="none">not a git checkout</span>' if git is None else
             f'<span class="mono">{esc(str(git.get("commit"))[:12])}</span>'
             + (' <span class="flag">dirty</span>' if git.get("dirty") else "")),
            esc(" ".join(f"{k}={v}" for k, v in (s["tags"] or {}).items()))
            + (f"<div>converted from {esc(s['conversion'].get('root'))} (format "
               f"{esc(s['conversion'].get('format'))})</div>"
               if isinstance(s.get("conversion"), Mapping) else "")])
    return ("<h2>Lineage: sessions and resumes</h2>" + _table(
        ["session (started)", "steps", "started as", "host", "world size", "framework",
         "versions", "git", "tags, conversion"], rows))


def _restores(sessions: Sequence[Mapping[str, Any]]) -> str:
    saved = {st["step"]: st["created"] for s in sessions for st in s["steps"]}
    rows = []
    for s in sessions:
        rf = s["resumed_from"]
        if not isinstance(rf, Mapping):
            continue
        at, then = rf.get("at"), saved.get(rf.get("step"))
        # from the restored step's save to the restore: the work lost plus the time down
        gap = (_ago(at - then) if isinstance(at, (int, float)) and then is not None
               and at >= then else "unknown")
        rows.append([esc(s["resume_count"]), esc(_who(s)), esc(rf.get("step")), esc(rf.get("tier")),
                     esc(_when(at)), _num(esc(gap)), _num(esc(_secs(rf.get("seconds")))),
                     _num(esc(_size(rf.get("bytes")))), esc(rf.get("newest_step")),
                     f'<span class="flag">FLAGGED</span>' if s["verdict"] == "flagged"
                     else esc(s["verdict"])])
    if not rows:
        return '<h2>Restores</h2><p class="none">no resume recorded</p>'
    return ("<h2>Restores</h2>" + _table(
        ["resume", "by", "step restored", "tier", "at", "after its save", "took",
         "bytes loaded", "newest step then", "verdict"], rows)
        + '<p class="sub">after its save: from the restored step\'s save to the restore (the '
        "work lost and the time the run was down)</p>")


def _time_fmt(axis: tuple[float, float]):
    """Tick labels of a time axis, as fine as its range needs (a test's run lasts seconds)."""
    span = axis[1] - axis[0]

    def fmt(t: float) -> str:
        if not math.isfinite(t):
            return "?"
        when = datetime.fromtimestamp(t)
        if span < 30:
            return when.strftime("%H:%M:%S.%f")[:-4]
        return when.strftime("%H:%M:%S" if span < 86400 else "%m-%d %H:%M")
    return fmt


def _timeline(d: Mapping[str, Any], colors: Mapping[int, str]) -> str:
    lanes: dict[str, list] = {"local": []}
    by_session = {s["session"]: s for s in d["sessions"] if s["session"] is not None}
    for s in d["sessions"]:
        for st in s["steps"]:
            if "local" in st["tiers"]:
                lanes["local"].append((float(st["created"]), colors[id(s)],
                                       f"step {st['step']} saved {_when(st['created'])} "
                                       f"({_who(s)}) in local"))
    for url, copies in d["copies"].items():  # each backup's own copies: their own sessions
        lanes[url] = []
        for step, c in sorted(copies.items()):
            s = by_session.get(c["session"])
            lanes[url].append((float(c["created"]), colors[id(s)] if s is not None else _GRAY,
                               f"step {step} saved {_when(c['created'])} in {url}"
                               + (f" (NOT the local tier's step {step}: saved before a rewind, "
                                  "or by another run)" if c["differs"] else "")))
    marks = _resume_marks(d["sessions"], lambda s, rf: rf.get("at"))
    if not any(lanes.values()):
        return '<h2>Timeline</h2><p class="none">no step to place</p>'
    return ("<h2>Timeline: steps per tier, by save time</h2><p class=\"sub\">one mark per step "
            "each tier holds (a gap in a backup's lane: not replicated, or deleted by its "
            "retention); dashed lines: resumes, at the restore's time</p>"
            + timeline("steps per tier", list(lanes.items()), marks, _time_fmt))


def _resume_marks(sessions: Sequence[Mapping[str, Any]], where) -> list[Mark]:
    marks = []
    for s in sessions:
        rf = s["resumed_from"]
        if isinstance(rf, Mapping):
            x = where(s, rf)
            if isinstance(x, (int, float)) and not isinstance(x, bool):
                marks.append(Mark(float(x), f"resume {s['resume_count']}",
                                  s["verdict"] == "flagged",
                                  f"resume {s['resume_count']} from step {rf.get('step')} "
                                  f"({s['verdict']})" + "".join(f"; {f}" for f in s["flags"])))
    return marks


def _costs(d: Mapping[str, Any], colors: Mapping[int, str]) -> str:
    rows = sorted(((st, s) for s in d["sessions"] for st in s["steps"]), key=lambda x: x[0]["step"])
    if not rows:
        return ""
    steps = [st["step"] for st, _ in rows]
    index = {st["step"]: i for i, (st, _) in enumerate(rows)}
    marks = _resume_marks(d["sessions"], lambda s, rf: index[s["steps"][0]["step"]] - 0.5)
    stats = [st.get("stats") or {} for st, _ in rows]
    out = ["<h2>Saves: seconds and bytes per step</h2>"]
    secs = [_number(x.get("seconds")) for x in stats]
    blocked = [_number(x.get("seconds_blocked")) if x.get("asynchronous") else None for x in stats]
    if any(v is not None for v in secs):
        tips = [f"step {s}: save {_secs(a)}" + (f", blocked {_secs(b)} (async)" if b is not None
                                                else "") for s, a, b in zip(steps, secs, blocked)]
        out.append("<h3>Save time (light: until committed; dark: what training waited, for an "
                   "async save)</h3>" + bar_plot("save seconds", steps, [
                       ("#56B4E9", secs), ("#0072B2", blocked)], marks, _secs, tips))
    missing = [s for s, v in zip(steps, secs) if v is None]
    if missing:
        out.append(f'<p class="none">save time not recorded for {len(missing)} step(s) '
                   f'({esc(_list(missing))}): saved before ckptcore recorded it</p>')
    nbytes = [_number(st.get("bytes")) for st, _ in rows]
    written = [_number(x.get("bytes_written")) for x in stats]
    tips = [f"step {s}: {_size(b)} of tensors, {_size(w)} written" for s, b, w in
            zip(steps, nbytes, written)]
    out.append("<h3>Bytes per step (light: tensors; dark: shards written)</h3>"
               + bar_plot("bytes per step", steps, [("#E69F00", nbytes), ("#D55E00", written)],
                          marks, _size, tips))
    for url, dd in d["dedup"].items():
        out.append(_dedup(url, dd))
    return "\n".join(out)


def _dedup(url: str, dd: Mapping[str, Any]) -> str:
    head = f"<h3>Backup <span class=\"mono\">{esc(url)}</span>: deduplication</h3>"
    if dd["problem"]:
        return head + ('<p class="none">unknown: its blobs cannot be listed '
                       f'({esc(dd["problem"])})</p>')
    if dd["kind"] != "deduplicated":
        return head + ('<p class="none">plain copies: every step uploads all its bytes '
                       '(no deduplication)</p>' if dd["kind"] == "plain" else
                       '<p class="none">no step readable in this tier</p>')
    rows = dd["steps"]
    steps = [r["step"] for r in rows]
    total, new = sum(r["bytes"] for r in rows), sum(r["new"] for r in rows)
    tips = [f"step {r['step']}: {_size(r['bytes'])} in {r['blobs']} blob(s), {_size(r['new'])} "
            f"new, deduplication {_ratio(r['ratio'])}" for r in rows]
    return (head + f"<p>{esc(_size(total))} referenced by the listed steps, {esc(_size(new))} "
            f"stored: {esc(_ratio(total / new if new else math.inf))} overall (new: bytes of "
            "blobs no earlier listed step refers to; a step deleted since makes its successor's "
            "look new). Light: a step's bytes; dark: its new bytes.</p>"
            + bar_plot("deduplication", steps, [("#CC79A7", [r["bytes"] for r in rows]),
                                                ("#7a3d63", [r["new"] for r in rows])],
                       (), _size, tips))


def _ratio(r: float) -> str:
    return "all reused" if math.isinf(r) else f"{r:.2f}x"


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _list(values: Sequence[Any], n: int = 12) -> str:
    return ", ".join(map(str, values[:n])) + (f" and {len(values) - n} more" if len(values) > n
                                              else "")


def _metrics(d: Mapping[str, Any], colors: Mapping[int, str]) -> str:
    names = d["metrics"]
    if not names:
        return '<h2>Metrics</h2><p class="none">no metric saved (save(..., metrics={...}))</p>'
    marks = _resume_marks(d["sessions"], lambda s, rf: rf.get("step"))
    out = ["<h2>Metrics by step</h2><p class=\"sub\">saved with each checkpoint (metrics=); one "
           "colour per session (the legend above); dashed lines: the step each resume restored "
           "(red: flagged); a red cross on the top edge: NaN or infinite</p>"]
    for name in names[:_MAX_METRICS]:
        series = []
        for s in d["sessions"]:
            pts = [(float(st["step"]), float(v), f"{name} = {v:.6g} at step {st['step']} "
                    f"({_who(s)})") for st in s["steps"]
                   for v in [{str(k): x for k, x in (st.get("metrics") or {}).items()}.get(name)]
                   if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if pts:
                series.append(Series(_who(s), colors[id(s)], pts))
        out.append(f"<h3>{esc(name)}</h3>" + line_plot(name, series, marks))
    if len(names) > _MAX_METRICS:
        out.append(f'<p class="none">{len(names) - _MAX_METRICS} more metric(s) not drawn: '
                   f'{esc(_list(names[_MAX_METRICS:]))}</p>')
    return "\n".join(out)


def _steps(d: Mapping[str, Any]) -> str:
    rows = []
    for s in d["sessions"]:
        for st in s["steps"]:
            stats = st.get("stats") or {}
            metrics = " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in (st.get("metrics") or {}).items())
            rows.append((st["step"], [
                esc(st["step"]), esc(_when(st["created"])), esc(_who(s)), esc(st["epoch"]),
                esc(" + ".join(st["tiers"])), _num(esc(_size(st.get("bytes")))),
                _num(esc(_secs(stats.get("seconds")))),
                esc("async" if stats.get("asynchronous") else "sync" if stats else "-"),
                esc(metrics or "-"),
                f'<span class="mono">{esc(st.get("fingerprint") or "-")}</span>']))
    for u in d["log"]["unreadable"]:
        rows.append((u["step"], [esc(u["step"]), "", f'<span class="flag">unreadable</span>',
                                 "", esc(" + ".join(u["tiers"])), "", "", "", esc(u["problem"]),
                                 ""]))
    rows.sort(key=lambda r: r[0])
    table = _table(["step", "saved at", "by", "epoch", "tiers", "bytes", "save", "mode",
                    "metrics", "fingerprint"], [r for _, r in rows])
    return (f"<h2>Every step</h2><details{' open' if len(rows) <= 60 else ''}><summary>"
            f"{len(rows)} step(s)</summary>{table}</details>")
