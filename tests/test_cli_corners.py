"""Corners of the ``ckpt`` command line a new user hit: ``ls`` of one checkpoint, of a missing
root with a backup, malformed ``-o``, ``diff --keys``, ``sync`` with retention and without a
terminal, ``gc``'s grace, ``--version``, ``ls --json``, ``import --help``, the ``inspect`` tree and
the ``ls`` columns.  Verbs run in-process through ``cli.main``."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import ckptcore
from ckptcore import CheckpointManager, _cli_read, cli
from ckptcore._version import __version__
from ckptcore.adapter import FileFormat
from _support import make_state


def _ckpt(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _run(tmp_path, steps=(1, 2), name="run", metrics=None) -> str:
    root = str(tmp_path / name)
    with CheckpointManager(root) as mgr:
        for s in steps:
            mgr.save(s, make_state(s), metrics=metrics)
    return root


# -- 1. ls of one checkpoint ---------------------------------------------------------------------
def test_ls_of_one_checkpoint_points_to_inspect(tmp_path, capsys):
    url = str(tmp_path / "single")
    ckptcore.save_state(url, make_state(3))
    rc, out, err = _ckpt(capsys, "ls", url)
    assert rc == 2, (out, err)
    assert "no committed checkpoints" not in out
    assert "one checkpoint" in err and f"ckpt inspect {url}" in err


# -- 2. ls of a missing root with --backup ------------------------------------------------------
def test_ls_of_a_missing_root_lists_the_backup(tmp_path, capsys):
    from ckptcore._sync import sync

    root = _run(tmp_path, steps=(1, 2))
    backup = str(tmp_path / "backup")
    sync(root, backup)
    gone = str(tmp_path / "fresh-machine-root")
    rc, out, err = _ckpt(capsys, "ls", gone, "--backup", backup)
    assert rc == 0, err
    steps = [ln for ln in out.splitlines() if ln.startswith("step-")]
    assert [ln.split()[0] for ln in steps] == ["step-000000000001", "step-000000000002"]
    assert all(ln.endswith(" backup") for ln in steps)
    assert "missing" in out + err and gone in out + err
    # without --backup it is still an error, and so is a missing backup too
    assert _ckpt(capsys, "ls", gone)[0] == 2
    rc, _, err = _ckpt(capsys, "ls", gone, "--backup", str(tmp_path / "nobackup"))
    assert rc == 2 and "does not exist" in err


# -- 3. a malformed storage option is a usage error ---------------------------------------------
@pytest.mark.parametrize("argv", [["ls", "{root}", "-o", "foo"], ["-o", "=x", "ls", "{root}"],
                                  ["sync", "{root}", "{root}2", "--dst-option", "foo"]])
def test_malformed_storage_option_exits_2(tmp_path, capsys, argv):
    root = _run(tmp_path, steps=(1,))
    with pytest.raises(SystemExit) as e:
        cli.main([a.format(root=root) for a in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "key=value" in err and "Traceback" not in err
    assert not (tmp_path / "run2").exists()


# -- 4. diff --keys -----------------------------------------------------------------------------
def test_diff_keys_compares_only_those_sections(tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ckptcore.save_state(a, make_state(3))
    changed = make_state(3)
    changed.model["dense/kernel"] = changed.model["dense/kernel"] + 1  # the model only
    ckptcore.save_state(b, changed)
    rc, out, _ = _ckpt(capsys, "diff", a, b, "--keys", "optimizer")
    assert rc == 0 and "0 of 1 tensors differ" in out and "model/" not in out
    rc, out, _ = _ckpt(capsys, "diff", a, b, "--keys", "model,optimizer")
    assert rc == 1 and "~ model/dense/kernel" in out and "1 of 3 tensors differ" in out
    rc, out, _ = _ckpt(capsys, "diff", a, b, "--keys", "model")
    assert rc == 1 and "1 of 2 tensors differ" in out
    rc, _, err = _ckpt(capsys, "diff", a, b, "--keys", "modle")
    assert rc == 2 and "modle" in err and "model" in err


# -- 5. sync copies only what the retention keeps ------------------------------------------------
def test_sync_keep_last_copies_only_the_kept_steps(tmp_path, capsys):
    src = _run(tmp_path, steps=(1, 2, 3), name="src")
    dst = str(tmp_path / "dst")
    rc, out, _ = _ckpt(capsys, "sync", src, dst, "--keep-last", "1")
    assert rc == 0
    assert re.findall(r"copied step (\d+)", out) == ["3"] and "deleted" not in out
    assert [c.step for c in ckptcore.list_checkpoints(dst)] == [3]
    dst2 = str(tmp_path / "dst2")
    rc, out, _ = _ckpt(capsys, "sync", src, dst2, "--keep-every", "2", "--dry-run")
    assert rc == 0 and re.findall(r"would copy step (\d+)", out) == ["2", "3"]  # (and the newest)


def test_sync_keep_last_counts_the_steps_dst_already_has(tmp_path, capsys):
    src = _run(tmp_path, steps=(1, 2, 3), name="src")
    dst = str(tmp_path / "dst")
    with CheckpointManager(dst) as mgr:
        mgr.save(10, make_state(10))  # newer than anything SRC has
    rc, out, _ = _ckpt(capsys, "sync", src, dst, "--keep-last", "2")
    assert rc == 0 and re.findall(r"copied step (\d+)", out) == ["3"]
    assert [c.step for c in ckptcore.list_checkpoints(dst)] == [3, 10]


# -- 6. sync's progress bar only on a terminal ---------------------------------------------------
def test_sync_progress_is_lines_without_a_terminal(tmp_path, capsys, monkeypatch):
    src = _run(tmp_path, steps=(1, 2), name="src")
    rc, _, err = _ckpt(capsys, "sync", src, str(tmp_path / "dst"))
    assert rc == 0 and "\r" not in err
    assert len([ln for ln in err.splitlines() if "step-00000000000" in ln]) == 2, err
    monkeypatch.setattr(_cli_read, "is_tty", lambda stream: True)
    rc, _, err = _ckpt(capsys, "sync", src, str(tmp_path / "dst2"))
    assert rc == 0 and "\r" in err


# -- 7. gc says what the grace kept ----------------------------------------------------------------
def test_gc_says_how_many_the_grace_kept(tmp_path, capsys):
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(1, make_state(1))
    leftover = root / "step-000000000002"
    leftover.mkdir()
    (leftover / "shard-00000-dead.bin").write_bytes(b"x" * 100)
    rc, out, _ = _ckpt(capsys, "gc", str(root), "--grace", "3600")
    assert rc == 0 and "0 leftover(s) removed" in out and leftover.exists()
    assert "1 kept" in out and "--grace 0" in out
    rc, out, _ = _ckpt(capsys, "gc", str(root), "--grace", "0")
    assert rc == 0 and "1 leftover(s) removed" in out and "kept" not in out


# -- 8. --version and ls --json ------------------------------------------------------------------
def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and __version__ in capsys.readouterr().out


def test_ls_json(tmp_path, capsys):
    root = _run(tmp_path, steps=(1, 2), metrics={"loss": 0.25})
    rc, out, _ = _ckpt(capsys, "ls", root, "--json")
    assert rc == 0
    rows = json.loads(out)
    assert [r["step"] for r in rows] == [1, 2]
    r = rows[1]
    assert r["folder"] == "step-000000000002" and r["saved_step"] == 2 and r["epoch"] == 0
    assert r["bytes"] > 0 and isinstance(r["created"], float) and r["metrics"] == {"loss": 0.25}
    assert r["tiers"] == ["local"] and "framework" in r
    (tmp_path / "empty").mkdir()
    rc, out, _ = _ckpt(capsys, "ls", str(tmp_path / "empty"), "--json")
    assert rc == 0 and json.loads(out) == []


# -- 9. import --help ----------------------------------------------------------------------------
def test_format_options_have_readable_names_and_metavars(capsys):
    import argparse

    fmt = FileFormat("dcp", "x", "a format", detect=lambda p: False, read=lambda *a, **k: None,
                     options={"unique_id": "which save", "pdopt": "the .pdopt file"})
    p = argparse.ArgumentParser(prog="t")
    cli._add_format_options(p, [fmt])
    text = p.format_help()
    assert "--unique-id UNIQUE_ID" in text and "--pdopt PDOPT" in text
    assert "FORMAT_OPTION" not in text and "--unique_id" not in text
    args = p.parse_args(["--unique_id", "3"])  # the spelling of the keyword still works
    assert cli._format_kwargs(args, fmt, [fmt]) == {"unique_id": "3", "pdopt": None}
    args = p.parse_args(["--unique-id", "4"])
    assert cli._format_kwargs(args, fmt, [fmt]) == {"unique_id": "4", "pdopt": None}


@pytest.mark.parametrize("verb", ["import", "convert"])
def test_overwrite_is_documented(capsys, verb):
    with pytest.raises(SystemExit):
        cli.main([verb, "--help"])
    text = capsys.readouterr().out
    assert re.search(r"--overwrite\s+\w", text), text
    assert "FORMAT_OPTION" not in text


# -- 10. the inspect tree and the ls columns -----------------------------------------------------
def test_inspect_tree_prints_each_folder_once_in_aligned_columns(tmp_path, capsys):
    state = make_state(3)
    state.model["encoder/layer_0/attention/query/kernel_with_a_long_name"] = np.zeros((4, 4), np.float32)
    state.model["encoder/layer_0/ffn/w"] = np.zeros(3, np.float32)
    state.model["dense/z"] = np.zeros(3, np.float32)  # model/dense/ again, after encoder/
    url = str(tmp_path / "c")
    ckptcore.save_state(url, state)
    rc, out, _ = _ckpt(capsys, "inspect", url)
    assert rc == 0
    lines = out.splitlines()
    assert lines.count("    dense/") == 1, out  # model/dense/ (optimizer's is deeper)
    assert lines.count("      layer_0/") == 1
    rows = [ln for ln in lines if re.search(r"\b(float32|int64)\b", ln)]
    assert len(rows) == 6
    assert len({re.search(r"\b(float32|int64)\b", ln).start() for ln in rows}) == 1, out
    z = next(i for i, ln in enumerate(lines) if ln.strip().startswith("z "))
    assert lines[z - 1].strip().startswith(("kernel", "bias"))  # under model/dense/, with them


def test_ls_names_its_columns_and_shows_time_and_metrics(tmp_path, capsys, monkeypatch):
    root = _run(tmp_path, steps=(100, 200), metrics={"loss": 0.5})
    monkeypatch.setattr(_cli_read, "is_tty", lambda stream: True)
    rc, out, _ = _ckpt(capsys, "ls", root)
    assert rc == 0
    lines = out.splitlines()
    header = lines[0].lower()
    assert "folder" in header and "saved step" in header and "epoch" in header
    assert "saved" in header and "metrics" in header
    row = next(ln for ln in lines if ln.startswith("step-000000000100"))
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", row) and "loss=0.5" in row
    monkeypatch.setattr(_cli_read, "is_tty", lambda stream: False)  # piped: data lines only
    rc, out, _ = _ckpt(capsys, "ls", root)
    assert out.splitlines()[0].startswith("step-000000000100")


# -- the backup roots a root's writer named ------------------------------------------------------
def test_a_root_names_its_backup_and_ls_log_report_read_it_on_request(tmp_path, capsys):
    root, backup = str(tmp_path / "run"), str(tmp_path / "bucket")
    with CheckpointManager(root, backup=ckptcore.Backup(backup)) as mgr:
        for s in (1, 2):
            mgr.save(s, make_state(s))
        mgr.wait()
    named = ckptcore.layout.recorded_backups(root)
    assert len(named) == 1 and named[0].rstrip("/").endswith("bucket")
    # Without --backup: named on stderr, not read (the listing is the local tier's alone).
    rc, out, err = _ckpt(capsys, "ls", root)
    assert rc == 0 and named[0] in err and "--backup recorded" in err
    assert "TIERS" not in out
    rc, out, err = _ckpt(capsys, "ls", root, "--backup", "recorded")
    assert rc == 0, err
    rows = [ln for ln in out.splitlines() if ln.startswith("step-")]
    assert len(rows) == 2 and all(ln.endswith("local+backup") for ln in rows), out
    rc, out, err = _ckpt(capsys, "log", root, "--backup", "recorded", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert [t["name"] for t in data["tiers"]] == ["local", "backup"]
    assert data["recorded_backups"] == named
    assert data["runs"][0]["sessions"][0]["steps"][0]["tiers"] == ["local", named[0]]
    page = tmp_path / "report.html"
    rc, out, err = _ckpt(capsys, "report", root, "-o", str(page), "--backup", "recorded")
    assert rc == 0 and page.exists(), err


def test_backup_recorded_without_a_recorded_backup_is_a_readable_error(tmp_path, capsys):
    root = _run(tmp_path)
    for verb in (["ls"], ["log"], ["report", "-o", str(tmp_path / "r.html")]):
        with pytest.raises(SystemExit) as e:
            cli.main([verb[0], root, *verb[1:], "--backup", "recorded"])
        assert e.value.code == 2 and "names no backup root" in capsys.readouterr().err, verb
    rc, out, err = _ckpt(capsys, "ls", root)
    assert rc == 0 and "replicates" not in err


@pytest.mark.parametrize("value", [
    ["x" * 5000], "s3://one", [1, 2], ["s3://a\nb"], [f"s3://b{i}" for i in range(17)],
    ["zip://x::http://127.0.0.1:9/a.zip"], ["http://169.254.169.254/latest"],
    ["sftp://user:pw@host/run"], ["s3://user:pw@bucket/run"], ["relative/path"],
    ["s3://ok", "s3://bad\u200bzero-width"]])
def test_a_malformed_backup_list_in_the_record_is_ignored_with_a_warning(tmp_path, capsys, caplog,
                                                                          value):
    from ckptcore import _fence
    from ckptcore._storage import Store

    root = _run(tmp_path)
    store = Store(root)
    g = _fence.generations(store)[-1]
    record = json.loads(store.read(_fence.gen_name(g)))
    record["backups"] = value
    store.write_bytes(_fence.gen_name(g), json.dumps(record).encode())
    with caplog.at_level("WARNING", logger="ckptcore"):
        assert ckptcore.layout.recorded_backups(root) == []
    assert "malformed" in caplog.text
    rc, out, err = _ckpt(capsys, "ls", root)
    assert rc == 0 and "replicates" not in err and "step" in out.lower()
    with pytest.raises(SystemExit) as e:
        cli.main(["ls", root, "--backup", "recorded"])
    assert e.value.code == 2 and "names no backup root" in capsys.readouterr().err


def test_gc_and_sync_keep_the_recorded_backups_and_home_paths_are_resolved(tmp_path, capsys,
                                                                            monkeypatch):
    import os

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    root = str(tmp_path / "run")
    with CheckpointManager(root, backup=ckptcore.Backup("~/bucket")) as mgr:
        mgr.save(1, make_state(1))
        mgr.wait()
    where = os.path.join(str(tmp_path / "home"), "bucket")
    assert os.path.isdir(os.path.join(where, "step-000000000001"))  # fsspec expanded "~"
    assert ckptcore.layout.recorded_backups(root) == [where]
    assert _ckpt(capsys, "gc", root)[0] == 0                       # a claim of its own
    assert ckptcore.layout.recorded_backups(root) == [where]
    assert _ckpt(capsys, "sync", where, root)[0] == 0              # the same, for a sync into it
    assert ckptcore.layout.recorded_backups(root) == [where]
    with CheckpointManager(root) as mgr:                           # a manager without backup= clears it
        mgr.save(2, make_state(2))
    assert ckptcore.layout.recorded_backups(root) == []


def test_a_backup_url_readers_would_refuse_is_not_recorded(tmp_path, caplog):
    root = str(tmp_path / "run")
    odd = tmp_path / "bk\u00a0copy"  # a real folder, but a name no reader accepts from a record
    with caplog.at_level("INFO", logger="ckptcore"):
        with CheckpointManager(root, backup=ckptcore.Backup(str(odd))) as mgr:
            mgr.save(1, make_state(1))
            mgr.wait()
    assert "not naming the backup root" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="ckptcore"):
        assert ckptcore.layout.recorded_backups(root) == []
    assert "malformed" not in caplog.text


def test_backup_recorded_of_a_missing_root_says_it_is_missing(tmp_path, capsys):
    rc, out, err = _ckpt(capsys, "ls", str(tmp_path / "nope"), "--backup", "recorded")
    assert rc != 0 and "does not exist" in err and "names no backup root" not in err
