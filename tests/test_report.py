"""``ckpt report`` (ckptcore.report): the page's data and HTML for a run resumed through a
CheckpointManager (exact), then rewound with its cursor left out (flagged), with a
deduplicated backup tier and metrics; old golden checkpoints without lineage or stats; hostile
strings from checkpoints escaped; the CLI's usage errors; and the page rendered in headless
Chromium (no console error, every plot drawn with data, none of them blank on a screenshot)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import warnings
import zlib
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

import ckptcore
from ckptcore import cli, report
from ckptcore_numpy import SGD, Model

GOLDEN = Path(__file__).parent / "golden"
# Strings a checkpoint may carry (tags, metric names): markup if a page let them through.
HOSTILE_TAG = '<script>document.title="pwned"</script>'
HOSTILE_METRIC = '<img src=x onerror="document.title=1">'


def _objects(step: int = 0):
    # "frozen" is above the backup's pack size: one blob shared by every step (deduplicated)
    return Model({"w": np.full(3, float(step), np.float32),
                  "frozen": np.ones(70_000, np.float32)}), SGD(lr=0.1)


def _save(mgr, step: int, model, opt, cursor) -> None:
    cursor.next_batch()
    model.params["w"][:] = step  # new weights each step: a new blob each step
    mgr.save(step, model=model, optimizer=opt, cursor=cursor,
             metrics={"loss": 1.0 / step, HOSTILE_METRIC: step / 10})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A root (its folder name is markup too) and its backup: a fresh session (steps 1-3), a
    resume through restore() with every part (async saves 4-5), and a rewind to step 4 whose
    restore left the cursor out (steps 5-6 again, flagged)."""
    base = tmp_path_factory.mktemp("report")
    root, backup = str(base / "run<i>x</i>"), str(base / "backup")
    model, opt = _objects()
    cursor = ckptcore.DataCursor(100, 10, seed=1)
    with ckptcore.CheckpointManager(root, backup=ckptcore.Backup(backup),
                                    tags={"exp": HOSTILE_TAG}) as mgr:
        for step in (1, 2, 3):
            _save(mgr, step, model, opt, cursor)
    model, opt = _objects()
    cursor = ckptcore.DataCursor(100, 10, seed=1)
    with ckptcore.CheckpointManager(root, backup=ckptcore.Backup(backup),
                                    async_save=True) as mgr:
        mgr.restore(model=model, optimizer=opt, cursor=cursor)
        for step in (4, 5):
            _save(mgr, step, model, opt, cursor)
    model, opt = _objects()
    cursor = ckptcore.DataCursor(100, 10, seed=1)
    with ckptcore.CheckpointManager(root) as mgr, warnings.catch_warnings():
        warnings.simplefilter("ignore", ckptcore.UnappliedStateWarning)
        mgr.restore(step=4, model=model, optimizer=opt)  # no cursor=: the epoch starts over
        mgr.rewind(5)
        for step in (5, 6):
            _save(mgr, step, model, opt, cursor)
    page = base / "report.html"
    data = report.write_report(root, page, backups=[backup])
    return {"root": root, "backup": backup, "data": data, "page": page,
            "html": page.read_text(encoding="utf-8")}


class _Doc(HTMLParser):
    """The tags of a page, and per ``svg.plot`` the number of its ``.pt`` marks."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.plots: list[int] = []
        self._svg_depth = 0
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "svg" and "plot" in (a.get("class") or "").split():
            self.plots.append(0)
            self._svg_depth = 1
        elif self._svg_depth:
            self._svg_depth += 1
            if "pt" in (a.get("class") or "").split():
                self.plots[-1] += 1

    def handle_endtag(self, tag):
        if self._svg_depth:
            self._svg_depth -= 1


def test_the_page_data_of_a_resumed_rewound_run_with_a_backup(run):
    d = run["data"]
    assert d["status"] == "bad"
    fresh, exact, rewound = d["sessions"]
    assert (fresh["verdict"], exact["verdict"], rewound["verdict"]) == ("fresh", "exact", "flagged")
    steps = {st["step"]: st for s in d["sessions"] for st in s["steps"]}
    # the restores' own figures, recorded in the lineage by the manager: every tensor loaded
    for s, restored in ((exact, 3), (rewound, 4)):
        rf = s["resumed_from"]
        assert rf["step"] == restored and rf["seconds"] > 0
        assert rf["bytes"] == steps[restored]["bytes"] > 280_000
    bad = [text for sev, text in d["findings"] if sev == "bad"]
    assert any("rewind: resumed from step 4 while step 5 was the newest" in t for t in bad)
    assert any("data position saved but not restored" in t for t in bad)
    # the backup never saw the rewound session's steps: its step 5 is the one rewound over
    warned = [text for sev, text in d["findings"] if sev == "warn"]
    assert any(f"backup {run['backup']} is 1 step(s) behind" in t for t in warned)
    assert any(f"backup {run['backup']} holds other checkpoints than the local tier under "
               "step(s) 5 " in t for t in warned)
    copies = d["copies"][run["backup"]]
    assert [s for s, c in copies.items() if c["differs"]] == [5]
    assert copies[5]["session"] == exact["session"] and copies[4]["session"] == exact["session"]
    # every step's save figures; the async ones say how long training waited
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    assert all(st["stats"]["seconds"] > 0 and st["stats"]["bytes"] == st["bytes"] == steps[1]["bytes"]
               for st in steps.values())
    assert steps[4]["stats"]["asynchronous"] and "seconds_blocked" in steps[4]["stats"]
    assert d["metrics"] == ["loss", HOSTILE_METRIC]
    # deduplication: the frozen tensor's blob is stored once, each step's new weights again
    dd = d["dedup"][run["backup"]]
    assert dd["kind"] == "deduplicated" and [r["step"] for r in dd["steps"]] == [1, 2, 3, 4, 5]
    first, *later = dd["steps"]
    assert first["new"] == first["bytes"] and first["bytes"] > 280_000 and not first["missing"]
    assert all(0 < r["new"] < 0.05 * r["bytes"] and r["ratio"] > 20 for r in later)


def test_the_page_shows_the_verdict_first_and_draws_every_plot_with_data(run):
    text = run["html"]
    doc = _Doc(text)
    # verdict before everything else; each section present
    order = [text.index(k) for k in ('class="verdict bad"', "Lineage: sessions and resumes",
                                     "<h2>Restores", "Timeline", "Save time", "Bytes per step",
                                     "deduplication", "Metrics by step", "Every step")]
    assert order == sorted(order)
    assert "Needs attention" in text and "FLAGGED" in text and "after its save" in text
    # timeline, save time, bytes, deduplication, and one plot per metric: all with data
    assert len(doc.plots) == 6 and all(n > 0 for n in doc.plots), doc.plots
    assert doc.plots[0] == 6 + 5  # the timeline: 6 local steps, 5 in the backup
    # self-contained: no script, nothing fetched, a policy forbidding both
    assert not [t for t, _ in doc.tags if t in ("script", "img", "link", "iframe", "object")]
    assert not [(t, a) for t, a in doc.tags for k in a if k in ("src", "href") or k.startswith("on")]
    (csp,) = [a["content"] for t, a in doc.tags if a.get("http-equiv") == "Content-Security-Policy"]
    assert "default-src 'none'" in csp and "script-src" not in csp


def test_strings_from_checkpoints_are_escaped(run):
    text = run["html"]
    for hostile in (HOSTILE_TAG, HOSTILE_METRIC, "<i>x</i>"):
        assert hostile not in text
    assert "&lt;script&gt;document.title=&quot;pwned&quot;&lt;/script&gt;" in text
    assert "&lt;img src=x onerror=&quot;document.title=1&quot;&gt;" in text
    assert "run&lt;i&gt;x&lt;/i&gt;" in text  # the root's own name, in the title and header
    doc = _Doc(text)
    assert not [t for t, _ in doc.tags if t in ("script", "img", "i")]


def test_old_checkpoints_without_lineage_or_stats_still_render(tmp_path):
    root = tmp_path / "old"
    for version, step in (("v1", 3), ("v2", 7), ("v4", 9)):
        shutil.copytree(GOLDEN / version / "full", root / f"step-{step:012d}")
    out = tmp_path / "old.html"
    d = report.write_report(root, out)
    (old,) = d["sessions"]
    assert old["verdict"] == "unrecorded" and [st["step"] for st in old["steps"]] == [3, 7, 9]
    assert d["status"] == "ok" and d["findings"] == [
        ("note", "3 step(s) saved without lineage (before ckptcore recorded it): their resumes "
                 "cannot be checked")]
    text = out.read_text(encoding="utf-8")
    assert "no lineage recorded" in text and "save time not recorded for 3 step(s)" in text
    assert "no resume recorded" in text
    assert all(n > 0 for n in _Doc(text).plots)  # timeline and bytes: still drawn
    # a step whose manifest cannot be read: the verdict's first line
    (root / "step-000000000011").mkdir()
    (root / "step-000000000011" / "manifest.msgpack").write_bytes(b"not a manifest")
    d = report.write_report(root, out)
    assert d["status"] == "bad" and d["findings"][0][0] == "bad"
    assert d["findings"][0][1].startswith("step 11 cannot be read (SchemaError: ")
    assert "unreadable" in out.read_text(encoding="utf-8")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "No committed checkpoints" in report.render(report.report_data(empty))


def _ckpt(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_ckpt_report_writes_the_page_and_types_its_usage_errors(run, tmp_path, capsys):
    root, backup = run["root"], run["backup"]
    out = tmp_path / "report.html"
    # -o after the verb is the output; storage options go in --storage-option (or -o before)
    rc, printed, _ = _ckpt(capsys, "-o", "auto_mkdir=true", "report", root, "-o", str(out),
                           "--backup", backup, "--storage-option", "auto_mkdir=true")
    assert rc == 0 and out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert printed == f"{out}: 6 step(s), 1 run(s), 2 resume(s); 3 PROBLEM(S) (see the page's verdict)\n"
    (tmp_path / "empty").mkdir()
    rc, printed, _ = _ckpt(capsys, "report", str(tmp_path / "empty"), "-o", str(out))
    assert rc == 0 and printed == f"{out}: no committed checkpoints under {tmp_path / 'empty'}\n"
    with pytest.raises(SystemExit) as e:  # -o is required
        cli.main(["report", root])
    assert e.value.code == 2 and "-o/--output" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a storage option where the output belongs
        cli.main(["report", root, "-o", "anon=true"])
    assert e.value.code == 2 and "--storage-option KEY=VALUE" in capsys.readouterr().err
    assert not Path("anon=true").exists()
    for argv, why in (([str(tmp_path / "missing"), "-o", str(out)], "does not exist"),
                      ([ckptcore.CheckpointManager(root, lock=False).step_url(6), "-o", str(out)],
                       "is one checkpoint, not a run's root"),
                      ([root, "-o", str(tmp_path / "no" / "r.html")], "has no folder to go in"),
                      ([root, "-o", str(tmp_path)], "is a folder")):
        rc, _, err = _ckpt(capsys, "report", *argv)
        assert rc == 2 and why in err, err


# -- the page in a browser --------------------------------------------------------------------------
# What the test build adds to the page: a record of every error and policy violation, then each
# plot's box on the page; allowed by their hashes in the page's own policy (nothing else runs).
_PROBE_HEAD = ("window.__errors=[];addEventListener('error',function(e){__errors.push("
               "String(e.message||e.type))},true);document.addEventListener("
               "'securitypolicyviolation',function(e){__errors.push('csp '+e.violatedDirective)});")
_PROBE_TAIL = ("document.querySelectorAll('svg.plot').forEach(function(s){var r="
               "s.getBoundingClientRect();s.setAttribute('data-box',[r.left+scrollX,r.top+scrollY,"
               "r.width,r.height].map(Math.round).join(','))});document.body.setAttribute("
               "'data-errors',JSON.stringify(__errors));")
_WIDTH, _HEIGHT = 1200, 3600  # the plots fit (each box is checked); the steps' table may not


def _probed(text: str) -> str:
    hashes = " ".join("'sha256-" + base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()
                      + "'" for s in (_PROBE_HEAD, _PROBE_TAIL))
    text = text.replace("default-src 'none';", f"default-src 'none'; script-src {hashes};", 1)
    head = text.index("<title>")  # after the policy's meta
    text = text[:head] + f"<script>{_PROBE_HEAD}</script>" + text[head:]
    return text.replace("</body>", f"<script>{_PROBE_TAIL}</script></body>", 1)


def _chromium(page: Path, shot: Path, profile: Path) -> tuple[str, str]:
    """One headless run: the screenshot, the DOM after load (stdout) and the log (stderr, with
    every console message)."""
    cmd = [shutil.which("chromium"), "--headless=new", "--no-sandbox", "--disable-gpu",
           "--no-first-run", "--no-default-browser-check", "--disable-extensions",
           "--hide-scrollbars", "--force-device-scale-factor=1", f"--user-data-dir={profile}",
           f"--window-size={_WIDTH},{_HEIGHT}", f"--screenshot={shot}", "--dump-dom",
           "--enable-logging=stderr", "--v=0", page.as_uri()]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the renderer and GPU processes too
        proc.communicate()
        raise
    assert proc.returncode == 0, err[-3000:]
    return out, err


def _png(data: bytes) -> np.ndarray:
    """An 8-bit RGB or RGBA PNG (what Chromium writes) as an (h, w, channels) array."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, []
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IHDR":
            w, h, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", data[pos + 8:pos + 21])
        elif kind == b"IDAT":
            idat.append(data[pos + 8:pos + 8 + n])
        pos += 12 + n
    assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
    bpp = 3 if color == 2 else 4
    stride = w * bpp
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8).reshape(h, stride + 1)
    out = np.zeros((h, stride), np.uint8)
    prev = out[0].copy()
    for y in range(h):
        f, line = raw[y, 0], raw[y, 1:]
        if f == 0:
            out[y] = line
        elif f == 1:  # Sub: a running sum per channel (mod 256)
            out[y] = np.cumsum(line.reshape(w, bpp).astype(np.uint32), axis=0).astype(np.uint8).ravel()
        elif f == 2:
            out[y] = line + prev
        else:  # Average, Paeth: each byte needs the one before it
            cur, up = bytearray(line.tobytes()), prev.tobytes()
            for i in range(stride):
                a = cur[i - bpp] if i >= bpp else 0
                b = up[i]
                if f == 3:
                    cur[i] = (cur[i] + ((a + b) >> 1)) & 255
                    continue
                c = up[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
            out[y] = np.frombuffer(bytes(cur), np.uint8)
        prev = out[y]
    return out.reshape(h, w, bpp)[:, :, :3]


def _colored(pixels: np.ndarray) -> int:
    """Pixels of a saturated colour: the series' (axes, grid and text are grey or black)."""
    p = pixels.astype(np.int16)
    return int(((p.max(axis=2) - p.min(axis=2)) > 60).sum())


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="chromium is not installed (scripts/test.sh installs Debian's package "
                           "with apt-get where it may)")
def test_the_page_renders_in_headless_chromium_with_every_plot_drawn(run, tmp_path):
    page = tmp_path / "probed.html"
    page.write_text(_probed(run["html"]), encoding="utf-8")
    shot = tmp_path / "shot.png"
    dom, log = _chromium(page, shot, tmp_path / "profile")
    console = [line for line in log.splitlines() if ":CONSOLE" in line]
    assert not console, console  # no error, no policy violation, no message at all
    body = re.search(r"<body([^>]*)>", dom).group(1)
    assert json.loads(re.search(r"data-errors=\"([^\"]*)\"", body).group(1)
                      .replace("&quot;", '"')) == []
    doc = _Doc(dom)
    # only the probe's two scripts ran: the hostile strings stayed text
    assert [t for t, _ in doc.tags].count("script") == 2 and "pwned" not in dom.split("</title>")[0]
    assert len(doc.plots) == 6 and all(n > 0 for n in doc.plots), doc.plots
    boxes = [[int(v) for v in a["data-box"].split(",")] for t, a in doc.tags
             if t == "svg" and "data-box" in a]
    assert len(boxes) == 6
    image = _png(shot.read_bytes())
    assert image.shape[:2] == (_HEIGHT, _WIDTH)
    for (x, y, w, h), n in zip(boxes, doc.plots):
        assert w > 500 and h > 50 and y + h <= _HEIGHT, (x, y, w, h)
        region = image[y:y + h, x:x + w]
        inked = int((region.min(axis=2) < 200).sum())  # anything but the white background
        assert inked > 0.01 * w * h, ((x, y, w, h), inked)
        assert _colored(region) >= 40 * min(n, 5), ((x, y, w, h), _colored(region))
    # and outside the plots, the verdict's coloured band is there (the screenshot is the page)
    assert _colored(image[:400]) > 1000
