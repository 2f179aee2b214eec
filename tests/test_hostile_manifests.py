"""The hostile-manifest corpus (tests/hostile_manifests.py): every case is a typed error, never a
crash, a hang, a wrong tensor or a file opened outside the checkpoint.

For each case: ``load_state`` and ``verify`` end in a ``CheckpointError`` (``verify`` may instead
return the problems it found); ``inspect`` does too whenever the manifest itself is what was
crafted (a checkpoint whose manifest is intact but whose shard is a link or a FIFO has an honest
manifest: inspect reads nothing else); ``ckpt verify`` exits non-zero without a traceback;
``CheckpointManager.restore()`` falls back to the older good step; no file outside the case
folder is opened.  A child process then runs the whole corpus once more to show it stays alive
and under 1 GB of peak memory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest

import ckptcore
from ckptcore import cli
from ckptcore.errors import CheckpointError, CheckpointExistsError, SchemaError

import hostile_manifests as corpus
from _support import assert_state_same

_opened: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # cannot be removed again: it records only inside watch()


@contextmanager
def watch(allowed: Path):
    """Fail if anything outside ``allowed`` (or Python's own installation) is opened."""
    global _opened
    _opened = []
    try:
        yield
    finally:
        opened, _opened = _opened, None
    ours = [p for p in opened if not p.startswith((sys.prefix, sys.base_prefix, "/proc/"))]
    outside = [p for p in ours if not os.path.abspath(p).startswith(str(allowed) + os.sep)]
    assert not outside, f"opened outside the case folder: {outside}"


# (format 4: the rows object is part of the manifest, so inspect refuses its damage too)
MANIFEST_CASES = [*corpus.BODY_CASES, *corpus.V2_CASES, *corpus.V3_CASES, *corpus.V4_CASES, *corpus.ENVELOPE_CASES,
                  "link-manifest-to-outside-copy", "manifest-is-fifo", "manifest-is-directory",
                  "manifest-sparse-3GiB"]
# A well-formed manifest naming a deduplicated chunk that is not there: the data is at fault.
MANIFEST_CASES.remove("shard-path-cas-missing")
# The cases that build tens of megabytes (48 MiB strings, tables and maps of 100k-1M entries)
# take seconds each: slow.  The others take milliseconds.
CASE_PARAMS = [pytest.param(n, marks=pytest.mark.slow) if re.search(r"-(48MiB|100k|1M)$", n) else n
               for n in corpus.CASES]


def test_corpus_is_large_enough():
    assert len(MANIFEST_CASES) >= 100
    assert len(corpus.CASES) >= 110


def _expect_error(fn, *args, **kwargs) -> CheckpointError:
    with pytest.raises(CheckpointError) as exc:
        fn(*args, **kwargs)
    return exc.value


@pytest.fixture
def case_dirs(tmp_path):
    case, outside = tmp_path / "case", tmp_path / "outside"
    case.mkdir()
    outside.mkdir()
    return case, outside


@pytest.mark.parametrize("name", CASE_PARAMS)
def test_case_is_a_typed_error(name, case_dirs, capsys):
    case, outside = case_dirs
    ckpt = str(corpus.build(name, case, outside))
    with watch(case):
        err = _expect_error(ckptcore.load_state, ckpt)
        assert ckpt in str(err) or "manifest" in str(err), f"{name}: message names no file: {err}"
        try:
            problems = ckptcore.verify(ckpt)
        except CheckpointError:
            pass
        else:
            assert problems and all(isinstance(p, CheckpointError) for p in problems), name
        if name in MANIFEST_CASES:
            _expect_error(ckptcore.inspect, ckpt)
        else:
            ckptcore.inspect(ckpt)  # an honest manifest: inspecting it reads nothing else
        code = cli.main(["verify", ckpt])
    out = capsys.readouterr()
    assert code != 0, f"{name}: ckpt verify exited 0"
    assert "Traceback" not in out.err + out.out


@pytest.mark.parametrize("name", CASE_PARAMS)
def test_manager_falls_back_to_the_older_good_step(name, tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    corpus.write_good(root / "step-000000000001", step=1)
    os.rename(corpus.build(name, tmp_path / "case", outside), root / "step-000000000002")
    with ckptcore.CheckpointManager(str(root), lock=False) as mgr:
        assert mgr.steps() == [1, 2]
        with warnings.catch_warnings(record=True) as caught, watch(root):
            warnings.simplefilter("always")
            state = mgr.restore()
        assert any(issubclass(w.category, ckptcore.CheckpointFallbackWarning) for w in caught)
        assert_state_same(state, corpus.good_state(1))


@pytest.mark.parametrize("name", ["envelope-junk", "envelope-empty-file", "body-junk-msgpack",
                                  "tree-step-inf", "shard-is-directory", "link-shard-to-outside-copy"])
def test_a_resumed_run_may_save_over_an_unreadable_step(name, tmp_path):
    """A junk or empty manifest (a torn write, a user's mistake) is damage like a bad checksum:
    the run that fell back over it can save that step again."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    corpus.write_good(root / "step-000000000001", step=1)
    os.rename(corpus.build(name, tmp_path / "case", outside), root / "step-000000000002")
    with ckptcore.CheckpointManager(str(root), keep=1) as mgr, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr.restore()
        mgr.save(2, corpus.good_state(2)).result()
        assert mgr.steps() == [2]
        assert_state_same(mgr.restore(), corpus.good_state(2))
    assert sorted(os.listdir(outside)) == sorted(os.listdir(outside))  # nothing deleted outside
    for f in outside.iterdir():
        assert f.exists()


def test_a_newer_format_is_never_replaced(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    corpus.write_good(root / "step-000000000001", step=1)
    os.rename(corpus.build("version-5", tmp_path / "case", tmp_path), root / "step-000000000002")
    with ckptcore.CheckpointManager(str(root)) as mgr, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr.restore()
        with pytest.raises(CheckpointExistsError):
            mgr.save(2, corpus.good_state(2))
    assert (root / "step-000000000002" / "manifest.msgpack").exists()


def test_five_thousand_nested_extensions_are_a_schema_error(tmp_path):
    ckpt = corpus.build("nest-tuples-5000", tmp_path, tmp_path)
    with pytest.raises(SchemaError, match="nest"):
        ckptcore.load_state(str(ckpt))


_CHILD = r"""
import json, os, sys, tempfile, warnings
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import ckptcore, hostile_manifests as corpus
from ckptcore.errors import CheckpointError
warnings.simplefilter("ignore")
bad = []
for name in corpus.CASES:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        root, outside = tmp / "root", tmp / "outside"
        root.mkdir(); outside.mkdir()
        corpus.write_good(root / "step-000000000001", step=1)
        os.rename(corpus.build(name, tmp / "case", outside), root / "step-000000000002")
        ckpt = str(root / "step-000000000002")
        # load_state and inspect of each case are test_case_is_a_typed_error's; here the
        # restore below loads it (then falls back) and verify reads every byte, in one process.
        try:
            if not ckptcore.verify(ckpt):
                bad.append(f"{name}: verify succeeded")
        except CheckpointError:
            pass
        except BaseException as e:
            bad.append(f"{name}: verify: {type(e).__name__}: {e}"[:300])
        try:
            with ckptcore.CheckpointManager(str(root), lock=False) as mgr:
                if mgr.restore().step != 1:
                    bad.append(f"{name}: restore did not fall back")
        except BaseException as e:
            bad.append(f"{name}: restore: {type(e).__name__}: {e}"[:300])
print(json.dumps({"cases": len(corpus.CASES), "bad": bad,
                  "maxrss_mb": corpus.peak_rss_mb()}))
"""


@pytest.mark.slow
def test_whole_corpus_in_a_live_process_under_1GB():
    here = str(Path(__file__).parent)
    proc = subprocess.run([sys.executable, "-c", _CHILD, here], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"child died ({proc.returncode}): {proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["bad"] == []
    assert report["cases"] >= 110
    assert report["maxrss_mb"] < 1024, report["maxrss_mb"]
