"""The ``ckpt`` verbs over real checkpoints: inspect, verify, diff, ls, gc, and their errors.

Verbs run in-process through ``cli.main`` (the console script calls the same function); one test
runs the installed entry point in a subprocess, and one goes to the S3 server with ``-o`` options.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import ckptcore
from ckptcore import CheckpointManager, DataCursor, cli
from manager_support import make_state


def _ckpt(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _saved(tmp_path, name="a", step=3, **kw) -> str:
    url = str(tmp_path / name)
    ckptcore.save_state(url, make_state(step), **kw)
    return url


def test_inspect_shows_step_sections_cursor_and_tensors(tmp_path, capsys):
    cursor = DataCursor(15, 4, seed=7)
    cursor.next_batch()
    cursor.next_batch()
    url = str(tmp_path / "c")
    ckptcore.save_state(url, make_state(5), cursor=cursor)
    rc, out, _ = _ckpt(capsys, "inspect", url)
    assert rc == 0
    assert "step        5" in out
    assert "data        epoch 0 / position 8 / seed 7" in out
    assert "kernel" in out and "float32" in out and "64x64" in out
    rc, out, _ = _ckpt(capsys, "inspect", url, "--json")
    d = json.loads(out)
    assert rc == 0 and d["step"] == 5 and d["data"]["position"] == 8 and d["data"]["seed"] == 7
    assert {t["name"] for t in d["tensors"]} >= {"model/dense/kernel", "model/dense/bias"}


def test_verify_is_ok_then_names_the_corrupt_tensor(tmp_path, capsys):
    url = _saved(tmp_path)
    rc, out, _ = _ckpt(capsys, "verify", url)
    assert rc == 0 and "OK" in out
    bias = next(t for t in ckptcore.inspect(url).tensors if t.name == "model/dense/bias")
    shard = os.path.join(url, bias.shard)
    with open(shard, "r+b") as f:
        data = f.read()
        at = data.find(make_state(3).model["dense/bias"].tobytes())  # the bias's bytes, in place
        assert at >= 0
        f.seek(at + 3)
        f.write(bytes([data[at + 3] ^ 0x40]))
    rc, out, _ = _ckpt(capsys, "verify", url)
    assert rc == 1
    assert "BAD" in out and "model/dense/bias" in out and "problem(s)" in out


def test_diff_reports_equal_and_differing_tensors(tmp_path, capsys):
    a, b = _saved(tmp_path, "a", 3), _saved(tmp_path, "b", 3)
    rc, out, _ = _ckpt(capsys, "diff", a, b)
    assert rc == 0 and "0 of" in out
    c = _saved(tmp_path, "c", 4)  # every value of make_state(4) is make_state(3)'s + 1 (the slot + 0.5)
    rc, out, _ = _ckpt(capsys, "diff", a, c)
    assert rc == 1
    assert "~ model/dense/kernel  max abs diff 1" in out


def test_ls_lists_a_managers_committed_steps_only(tmp_path, capsys):
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        for s in (1, 2):
            mgr.save(s, make_state(s))
    (root / "step-000000000009").mkdir()  # a leftover without a manifest
    rc, out, _ = _ckpt(capsys, "ls", str(root))
    lines = [ln for ln in out.splitlines() if ln.startswith("step-")]
    assert rc == 0 and [ln.split()[0] for ln in lines] == ["step-000000000001", "step-000000000002"]
    rc, out, _ = _ckpt(capsys, "ls", str(tmp_path / "empty"))
    assert "no committed checkpoints" in out


def test_gc_removes_leftovers_and_keeps_checkpoints(tmp_path, capsys):
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(1, make_state(1))
    leftover = root / "step-000000000002"
    leftover.mkdir()
    (leftover / "shard-00000-dead.bin").write_bytes(b"x" * 100)
    rc, out, _ = _ckpt(capsys, "gc", str(root), "--grace", "3600")
    assert rc == 0 and "0 leftover(s)" in out and leftover.exists()  # too young
    rc, out, _ = _ckpt(capsys, "gc", str(root), "--grace", "0")
    assert rc == 0 and "1 leftover(s)" in out and not leftover.exists()
    assert CheckpointManager(root, lock=False).steps() == [1]


def test_gc_is_refused_while_a_run_holds_the_lock(tmp_path, capsys):
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(1, make_state(1))
        rc, _, err = _ckpt(capsys, "gc", str(root), "--grace", "0")
    assert rc == 2 and "LockedError" in err


def test_gc_refuses_what_is_not_a_checkpoint_root(tmp_path, capsys):
    url = _saved(tmp_path, "single")  # a checkpoint folder, not a manager's root
    for target in (str(tmp_path / "typo"), url):
        rc, _, err = _ckpt(capsys, "gc", target, "--grace", "0")
        assert rc == 2 and "no checkpoint root" in err
    assert not (tmp_path / "typo").exists()
    assert not os.path.exists(os.path.join(url, ".ckptcore.lock"))
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(1, make_state(1))
    rc, _, err = _ckpt(capsys, "gc", str(root), "--grace", "-60")
    assert rc == 2 and "grace must be >= 0" in err


@pytest.mark.parametrize("verb", ["inspect", "verify", "ls"])
def test_missing_checkpoint_is_a_readable_error(tmp_path, capsys, verb):
    missing = str(tmp_path / "nope")
    rc, out, err = _ckpt(capsys, verb, missing)
    if verb == "ls":
        assert rc == 0 and "no committed checkpoints" in out
    else:
        assert rc == 2 and "nope" in err and "Traceback" not in err


def test_bad_storage_option_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="key=value"):
        cli.main(["-o", "novalue", "ls", str(tmp_path)])


def test_storage_options_reach_s3(s3_backend, capsys):
    url = s3_backend.url("ck")
    ckptcore.save_state(url, make_state(2), storage_options=s3_backend.storage_options)
    so = s3_backend.storage_options
    opts = ["-o", f"client_kwargs.endpoint_url={so['client_kwargs']['endpoint_url']}",
            "-o", f"key={so['key']}", "-o", f"secret={so['secret']}"]
    rc, out, _ = _ckpt(capsys, *opts, "verify", url)
    assert rc == 0 and "OK" in out
    rc, out, _ = _ckpt(capsys, *opts, "inspect", url, "--json")
    assert rc == 0 and json.loads(out)["step"] == 2


def test_console_script_runs(tmp_path):
    url = _saved(tmp_path)
    exe = os.path.join(os.path.dirname(sys.executable), "ckpt")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "ckptcore.cli"]
    done = subprocess.run(cmd + ["verify", url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "OK" in done.stdout
