"""A checkpoint's lineage (ckptcore.lineage) and ``ckpt log`` (ckptcore._runlog), on real files:
the lineage map through save/load and the manager, a run SIGKILLed in a subprocess and resumed,
a resume that ignored the saved cursor, hostile lineage maps, old checkpoints without one, and
the git commit of a temporary repository."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import msgpack
import numpy as np
import pytest

import ckptcore
from ckptcore import cli, lineage
from ckptcore_numpy import SGD, Model

from _support import subprocess_env
from hostile_manifests import read_body, write_manifest

GOLDEN = Path(__file__).parent / "golden"


def _state(step: int, cursor: ckptcore.DataCursor | None = None) -> ckptcore.TrainingState:
    return ckptcore.TrainingState(
        model={"w": np.full(3, float(step), np.float32)},
        optimizer=ckptcore.OptimizerState("sgd", step=step),
        rng={"python": (3, tuple(range(4)), None), "numpy": np.uint32(step),
             "gen": ckptcore.capture_rng()["numpy"]},
        data=cursor.state_dict() if cursor is not None else {}, step=step)


def _log(root: str, *extra: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["log", root, "--json", *extra]) == 0
    return json.loads(out.getvalue())


def _log_text(root: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["log", root]) == 0
    return out.getvalue()


def _objects():
    return Model({"w": np.ones(3, np.float32)}), SGD(lr=0.1)


def test_lineage_round_trips_through_save_and_load(tmp_path):
    cursor = ckptcore.DataCursor(100, 10, seed=3)
    cursor.next_batch()
    state = _state(5, cursor)
    url = str(tmp_path / "ckpt")
    info = ckptcore.save_state(url, state, tags={"experiment": "lr-sweep"})
    lin = ckptcore.inspect(url).lineage
    assert lin == info.lineage
    assert lin["tags"] == {"experiment": "lr-sweep"} and lin["resume_count"] == 0
    assert lin["resumed_from"] is None and lin["conversion"] is None and lin["world_size"] == 1
    assert lin["versions"]["numpy"] == np.__version__ and lin["versions"]["ckptcore"]
    assert lin["position"] == {"seed": 3, "epoch": 0, "position": 10, "per_epoch": 100}
    # the fingerprint of the state as loaded back is the one saved (tuples, numpy scalars, arrays)
    loaded = ckptcore.load_state(url)
    parts = lineage.fingerprint_parts(loaded)
    assert parts == lin["parts"] and lineage.fingerprint(parts) == lin["fingerprint"]
    assert len(lin["fingerprint"]) == 16
    # every save of one process is one run; a save that resumed from a checkpoint keeps its run
    other = ckptcore.save_state(str(tmp_path / "other"), state).lineage
    assert other["run_id"] == lin["run_id"]
    resumed = ckptcore.save_state(str(tmp_path / "next"), _state(6, cursor), resumed_from=url)
    rf = resumed.lineage["resumed_from"]
    assert resumed.lineage["resume_count"] == 1 and rf["step"] == 5
    assert rf["fingerprint"] == lin["fingerprint"] and rf["restored"] is None
    with pytest.raises(TypeError, match="tags must map str to str"):
        ckptcore.save_state(str(tmp_path / "bad"), state, tags={"a": 1})
    assert not (tmp_path / "bad").exists()


def test_the_manager_keeps_the_run_across_a_resume_and_ckpt_log_says_it_was_exact(tmp_path):
    root = str(tmp_path / "run")
    model, opt = _objects()
    cursor = ckptcore.DataCursor(100, 10, seed=1)
    with ckptcore.CheckpointManager(root, tags={"exp": "a"}) as mgr:
        for step in (1, 2):
            cursor.next_batch()
            mgr.save(step, model=model, optimizer=opt, cursor=cursor, metrics={"loss": 1 / step})
    model, opt = _objects()
    cursor = ckptcore.DataCursor(100, 10, seed=1)
    with ckptcore.CheckpointManager(root) as mgr:
        mgr.restore(model=model, optimizer=opt, cursor=cursor)
        cursor.next_batch()
        info = mgr.save(3, model=model, optimizer=opt, cursor=cursor).result()
    first = ckptcore.inspect(ckptcore.CheckpointManager(root, lock=False).step_url(2)).lineage
    lin = info.lineage
    assert lin["run_id"] == first["run_id"] and lin["session"] != first["session"]
    assert lin["resume_count"] == 1 and lin["tags"] == {"exp": "a"}
    rf = lin["resumed_from"]
    assert (rf["step"], rf["tier"], rf["newest_step"]) == (2, "local", 2)
    assert rf["fingerprint"] == first["fingerprint"] == rf["restored_fingerprint"]
    data = _log(root)
    (run,) = data["runs"]
    assert (run["run_id"], run["resumes"], run["flagged"], run["steps"]) == (lin["run_id"], 1, 0, [1, 3])
    fresh, resumed = run["sessions"]
    assert fresh["verdict"] == "fresh" and [s["step"] for s in fresh["steps"]] == [1, 2]
    assert fresh["steps"][1]["metrics"] == {"loss": 0.5} and fresh["steps"][0]["created_local"]
    assert resumed["verdict"] == "exact" and resumed["parent"] == fresh["session"]
    assert resumed["flags"] == []
    assert "resume 1 from step 2 (local, generation 1): exact" in _log_text(root)


def test_a_resume_that_ignored_the_saved_cursor_is_flagged(tmp_path):
    root = str(tmp_path / "run")
    model, opt = _objects()
    cursor = ckptcore.DataCursor(100, 10, seed=1)
    with ckptcore.CheckpointManager(root) as mgr:
        for step in (1, 2, 3):
            cursor.next_batch()
            mgr.save(step, model=model, optimizer=opt, cursor=cursor)
    model, opt = _objects()
    cursor = ckptcore.DataCursor(100, 10, seed=1)
    with ckptcore.CheckpointManager(root) as mgr, warnings.catch_warnings():
        warnings.simplefilter("ignore", ckptcore.UnappliedStateWarning)
        mgr.restore(model=model, optimizer=opt, rng=False)  # no cursor=: the epoch starts over
        cursor.next_batch()
        mgr.save(4, model=model, optimizer=opt, cursor=cursor)
    (run,) = _log(root)["runs"]
    resumed = run["sessions"][1]
    assert resumed["verdict"] == "flagged" and run["flagged"] == 1
    flags = " | ".join(resumed["flags"])
    assert "data position saved but not restored (no cursor= given)" in flags
    # and the positions saved show what it cost: 30 samples seen again
    assert "data repeated: at step 4 the cursor is at sample 10 of the run, 30 before the 40" in flags
    assert "RNG states saved but not restored (rng=False)" in flags
    assert resumed["resumed_from"]["restored"]["optimizer"] == resumed["resumed_from"]["parts"]["optimizer"]
    text = _log_text(root)
    assert "FLAGGED" in text and "! data position saved but not restored" in text


_CHILD = textwrap.dedent("""
    import sys, time, numpy as np, ckptcore
    from ckptcore_numpy import Model, SGD
    root, report = sys.argv[1], sys.argv[2]
    model, opt = Model({"w": np.ones(3, np.float32)}), SGD(lr=0.1)
    cursor = ckptcore.DataCursor(1000, 10, seed=7)
    mgr = ckptcore.CheckpointManager(root, keep=10)
    step = 0
    if mgr.latest_step() is not None:
        step = mgr.restore(model=model, optimizer=opt, cursor=cursor).step
    while True:
        cursor.next_batch()
        step += 1
        mgr.save(step, model=model, optimizer=opt, cursor=cursor, metrics={"loss": 1.0 / step})
        with open(report, "a") as f:
            f.write(f"{step}\\n")
        if len(sys.argv) > 3 and step >= int(sys.argv[3]):
            mgr.close()
            break
        time.sleep(0.05)
""")


def test_a_sigkilled_run_resumed_shows_its_resume_in_ckpt_log(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    root, report = str(tmp_path / "run"), tmp_path / "report"
    child = subprocess.Popen([sys.executable, str(script), root, str(report)],
                             env=subprocess_env(), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not (report.exists() and len(report.read_text().split()) >= 3):
            assert child.poll() is None and time.monotonic() < deadline, "the child did not save"
            time.sleep(0.02)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    killed_at = max(s.step for s in ckptcore.list_checkpoints(root))
    subprocess.run([sys.executable, str(script), root, str(report), str(killed_at + 2)],
                   env=subprocess_env(), cwd=tmp_path, check=True, timeout=60)
    data = _log(root)
    (run,) = data["runs"]
    fresh, resumed = run["sessions"]
    assert resumed["resume_count"] == 1 and resumed["resumed_from"]["step"] == killed_at
    assert resumed["verdict"] == "exact", resumed["flags"]
    assert [s["step"] for s in resumed["steps"]] == [killed_at + 1, killed_at + 2]
    assert fresh["steps"][-1]["step"] == killed_at
    assert f"resume 1 from step {killed_at}" in _log_text(root)


_BAD = {
    "not a map": "x",
    "negative resume count": {"run_id": "r", "resume_count": -1},
    "boolean resume count": {"run_id": "r", "resume_count": True},
    "run id not a str": {"run_id": 7},
    "tags not str": {"run_id": "r", "tags": {"a": 1}},
    "int map key": {"run_id": "r", "extra": {1: "x"}},
    "too deep": {"run_id": "r", "extra": json.loads("[" * 20 + "]" * 20)},
    "too many values": {"run_id": "r", "extra": list(range(5000))},
    "long string": {"run_id": "r" * 5000},
    "not finite": {"run_id": "r", "started": math.nan},
    "bytes": {"run_id": "r", "extra": b"\x00"},
    "extension": {"run_id": "r", "extra": msgpack.ExtType(1, msgpack.packb(0))},
    # the restore's figures a report plots: nil or non-negative numbers
    "negative restore seconds": {"run_id": "r", "resumed_from": {"step": 1, "seconds": -0.5}},
    "restore bytes a bool": {"run_id": "r", "resumed_from": {"step": 1, "bytes": True}},
}


@pytest.mark.parametrize("case", sorted(_BAD))
def test_a_hostile_lineage_map_is_a_schema_error(tmp_path, case):
    ckpt = tmp_path / "step-000000000001"
    ckptcore.save_state(str(ckpt), _state(1))
    body = read_body(ckpt)
    body["lineage"] = _BAD[case]
    write_manifest(ckpt, body, version=2)
    with pytest.raises(ckptcore.SchemaError, match="field 'lineage'"):
        ckptcore.inspect(str(ckpt))
    with pytest.raises(ckptcore.SchemaError):
        ckptcore.load_state(str(ckpt))
    (bad,) = _log(str(tmp_path))["unreadable"]
    assert bad["step"] == 1 and "SchemaError" in bad["problem"]


def test_old_checkpoints_load_and_ckpt_log_says_no_lineage_was_recorded(tmp_path):
    root = tmp_path / "run"
    shutil.copytree(GOLDEN / "v2" / "full", root / "step-000000000007")
    assert ckptcore.inspect(str(root / "step-000000000007")).lineage is None
    assert ckptcore.load_state(str(root / "step-000000000007")).step == 7
    data = _log(str(root))
    assert data["runs"] == [] and [s["step"] for s in data["unrecorded"]] == [7]
    assert "no lineage recorded" in _log_text(str(root))
    # a manager resuming from it starts the lineage there
    with ckptcore.CheckpointManager(str(root)) as mgr:
        state = mgr.restore()
        info = mgr.save(8, state).result()
    assert info.lineage["resume_count"] == 1 and info.lineage["resumed_from"]["step"] == 7
    (run,) = _log(str(root))["runs"]
    assert run["sessions"][0]["verdict"] == "unchecked"  # restore() returned it: the loop applies it


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True,
                          text=True, timeout=30).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_the_git_commit_and_a_dirty_checkout_are_recorded(tmp_path):
    commits = {}
    for name in ("clean", "dirty"):
        repo = tmp_path / name
        (repo / "src").mkdir(parents=True)
        _git(repo, "init", "-q", "-b", "main")
        (repo / "train.py").write_text("print(1)\n")
        _git(repo, "add", "train.py")
        _git(repo, "commit", "-q", "-m", "one")
        commits[name] = _git(repo, "rev-parse", "HEAD")
    (tmp_path / "dirty" / "train.py").write_text("print(2)\n")
    _git(tmp_path / "clean", "pack-refs", "--all")  # the branch only in packed-refs now
    assert lineage.git_state(tmp_path / "clean" / "src") == {"commit": commits["clean"], "dirty": False}
    assert lineage.git_state(tmp_path / "dirty") == {"commit": commits["dirty"], "dirty": True}
    outside = tmp_path / "plain"
    outside.mkdir()
    if lineage.git_state(tmp_path) is None:  # (tmp_path itself may sit in some checkout)
        assert lineage.git_state(outside) is None


def test_a_group_run_records_its_world_size_and_every_rank_sees_the_lineage(tmp_path):
    from _support import run_ranks

    root = str(tmp_path / "run")

    def first(g):
        with ckptcore.CheckpointManager(root, group=g, save_on_preemption=False) as mgr:
            return mgr.save(1, _state(1)).result().lineage

    def second(g):
        with ckptcore.CheckpointManager(root, group=g, save_on_preemption=False) as mgr:
            mgr.restore()
            return mgr.save(2, _state(2)).result().lineage

    saved = run_ranks(ckptcore.ThreadGroup.create(2), first)
    assert saved[0] == saved[1] and saved[0]["world_size"] == 2  # rank 1's from rank 0's summary
    resumed = run_ranks(ckptcore.ThreadGroup.create(2), second)
    assert resumed[1] == resumed[0]
    assert resumed[0]["resume_count"] == 1 and resumed[0]["run_id"] == saved[0]["run_id"]
    assert resumed[0]["resumed_from"]["world_size"] == 2


def test_ckpt_log_shows_the_tiers_and_flags_a_rewind(tmp_path):
    root, backup = str(tmp_path / "run"), str(tmp_path / "backup")
    with ckptcore.CheckpointManager(root, backup=ckptcore.Backup(backup)) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    with ckptcore.CheckpointManager(root) as mgr:
        mgr.restore(step=1)            # back to step 1 on purpose
        mgr.rewind(2)
        mgr.save(2, _state(2))
    data = _log(root, "--backup", backup)
    assert data["tiers"] == [{"name": "local", "url": root}, {"name": "backup", "url": backup}]
    (run,) = data["runs"]
    first, again = run["sessions"]
    assert first["steps"][0]["tiers"] == ["local", backup]
    assert again["verdict"] == "flagged" and again["resumed_from"]["step"] == 1
    assert any(f.startswith("rewind: resumed from step 1 while step 2 was the newest")
               for f in again["flags"])


def test_ckpt_log_shows_a_conversion_and_flags_a_change_of_framework(tmp_path):
    root = tmp_path / "run"
    source = lineage.converted(framework="keras", format="tf-checkpoint", root="/data/ckpt-9")
    keras_state = dataclasses.replace(_state(1), framework="keras")
    ckptcore.save_state(str(root / "step-000000000001"), keras_state, lineage=source)
    with ckptcore.CheckpointManager(str(root)) as mgr:
        state = mgr.restore()
        mgr.save(2, dataclasses.replace(state, framework="numpy", step=2))
    (run,) = _log(str(root))["runs"]
    imported, migrated = run["sessions"]
    assert imported["conversion"]["root"] == "/data/ckpt-9"
    assert "converted from /data/ckpt-9 (format tf-checkpoint, framework keras)" in imported["notes"]
    assert "framework changed: keras -> numpy (migrated; RNG states reseeded)" in migrated["flags"]
    # ckpt ls --json carries the run and the local save time too
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["ls", str(root), "--json"]) == 0
    rows = json.loads(out.getvalue())
    assert [r["resume_count"] for r in rows] == [0, 1]
    assert {r["run_id"] for r in rows} == {run["run_id"]} and rows[0]["created_local"][:2] == "20"


def test_a_caller_that_applies_the_state_itself_tells_the_manager_and_the_resume_is_judged(tmp_path):
    import warnings

    from ckptcore.adapter import unapplied_parts
    from ckptcore.api import restore_objects

    # What the Keras and Lightning callbacks do: restore() without objects, restore_objects(),
    # then restored_into() with the objects the state went into.
    root = str(tmp_path / "run")
    model, opt = _objects()
    cursor = ckptcore.DataCursor(100, 10, seed=1)
    with ckptcore.CheckpointManager(root) as mgr:
        for step in (1, 2):
            cursor.next_batch()
            mgr.save(step, model=model, optimizer=opt, cursor=cursor)
    for left_out, verdict in (((), "exact"), (("cursor",), "flagged")):
        model, opt = _objects()
        cursor = ckptcore.DataCursor(100, 10, seed=1)
        objects = {k: v for k, v in {"model": model, "optimizer": opt, "cursor": cursor}.items()
                   if k not in left_out}
        with ckptcore.CheckpointManager(root) as mgr:
            state = mgr.restore()
            with unapplied_parts() as unapplied, warnings.catch_warnings(record=True) as shown:
                warnings.simplefilter("always")
                restore_objects(state, objects)
            assert bool(shown) == bool(left_out)  # the saved cursor went nowhere: warned
            mgr.restored_into(state, unapplied=unapplied, **objects)
            cursor.next_batch()
            mgr.save(mgr.latest_step() + 1, model=model, optimizer=opt, cursor=cursor).result()
        session = _log(root)["runs"][0]["sessions"][-1]
        assert session["verdict"] == verdict, session["flags"]
