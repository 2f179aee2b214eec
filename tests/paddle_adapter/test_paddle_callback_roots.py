"""ckptcore_paddle.Checkpoint refuses an unusable root in its constructor, before anything is created.

Before, ``os.fspath(root)`` let ``""`` through (the manager then wrote into ``/``).  Paddle runs in a
child process, as in the other Paddle tests (it cannot share a process with TensorFlow).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _paddle_util import HAVE_PADDLE, worker_env

pytestmark = pytest.mark.skipif(not HAVE_PADDLE, reason="paddlepaddle is not installed")

_SCRIPT = r"""
import json, os, pathlib
import ckptcore_paddle

root_before = set(os.listdir("/"))
out = {}
for label, root in [("empty", ""), ("blank", "   "), ("none", None), ("int", 3), ("bytes", b"x")]:
    try:
        ckptcore_paddle.Checkpoint(root)
        out[label] = ["accepted", ""]
    except Exception as e:
        out[label] = [type(e).__name__, str(e)]
out["cwd_after"] = sorted(os.listdir("."))
out["new_in_slash"] = sorted(set(os.listdir("/")) - root_before)
out["path_like"] = ckptcore_paddle.Checkpoint(pathlib.Path("run")).root
out["path_like_created"] = os.path.exists("run")
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("paddle_roots")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=worker_env(), cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("label, error", [("empty", "ValueError"), ("blank", "ValueError"),
                                          ("none", "TypeError"), ("int", "TypeError"),
                                          ("bytes", "TypeError")])
def test_bad_root_is_refused(outcome, label, error):
    kind, message = outcome[label]
    assert kind == error and "root" in message, (label, kind, message)


def test_nothing_is_created_in_the_cwd_or_slash(outcome):
    assert outcome["cwd_after"] == [] and outcome["new_in_slash"] == []


def test_path_like_root_is_kept_as_its_string(outcome):
    assert outcome["path_like"] == "run" and outcome["path_like_created"] is False
