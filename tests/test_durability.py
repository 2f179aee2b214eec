"""A save whose write, fsync or close fails below Python fails, and commits nothing.

Real failures, injected where the kernel would report them: ``tests/fault_shim.c``, compiled
here and loaded with ``LD_PRELOAD`` into a child Python process, makes ``fsync``/``fdatasync``
fail with EIO, ``write`` with ENOSPC, or ``close`` with EIO (after closing) for descriptors whose
path contains a given substring.  The child saves a checkpoint (to a fresh path, and over an
existing one); then:

* the save raised an ``OSError`` (or a ``CheckpointError``);
* nothing is committed at the path: no manifest (fresh), or the previous checkpoint, which still
  loads bit for bit with the very same files (overwrite);
* no temporary folder is left behind.

The last case fails the fsync of the parent folder, after the rename: the save raises saying the
checkpoint is in place but may not survive a power loss.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import ckptcore
from ckptcore import TrainingState
from ckptcore._manifest import MANIFEST_NAME

from _support import assert_state_same

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="LD_PRELOAD and /proc/self/fd are Linux's")

SHIM_SRC = os.path.join(os.path.dirname(__file__), "fault_shim.c")

CHILD = r"""
import json, sys
import numpy as np
import ckptcore
from ckptcore import TrainingState

url, overwrite = sys.argv[1], sys.argv[2] == "1"
state = TrainingState(model={f"w{k}": np.arange(50_000, dtype=np.float32) * (k + 7)
                             for k in range(4)}, extra={"new": True}, step=2)
try:
    ckptcore.save_state(url, state, overwrite=overwrite)
    print(json.dumps({"ok": True}))
except BaseException as e:
    print(json.dumps({"ok": False, "type": type(e).__name__,
                      "oserror": isinstance(e, OSError),
                      "checkpoint_error": isinstance(e, ckptcore.errors.CheckpointError),
                      "message": str(e)}))
"""


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc) to build the fault-injection shim")
    out = str(tmp_path_factory.mktemp("shim") / "fault_shim.so")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", out, SHIM_SRC, "-ldl"], check=True,
                   capture_output=True)
    return out


def _old_state() -> TrainingState:
    return TrainingState(model={f"w{k}": np.arange(50_000, dtype=np.float32) - k for k in range(4)},
                         extra={"old": True}, step=1)


def _run_child(shim: str, url: str, overwrite: bool, fail: dict[str, str]) -> dict:
    env = dict(os.environ, LD_PRELOAD=shim, PYTHONDONTWRITEBYTECODE="1",
               CKPTCORE_SHARD_SIZE=str(300_000))  # several shards, written by several threads
    env.update(fail)
    p = subprocess.run([sys.executable, "-c", CHILD, url, "1" if overwrite else "0"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def _files(path: str) -> dict[str, bytes]:
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}


CASES = {  # name: environment for the shim
    "fsync-shard": {"CKPT_FAIL_FSYNC": "/shard-"},
    "fsync-manifest": {"CKPT_FAIL_FSYNC": "/" + MANIFEST_NAME},
    "fsync-tmp-folder": {"CKPT_FAIL_FSYNC": ".tmp-", "CKPT_FAIL_DIRS_ONLY": "1"},
    "write-shard-enospc": {"CKPT_FAIL_WRITE": "/shard-"},
    "close-shard": {"CKPT_FAIL_CLOSE": "/shard-"},
    "write-manifest-enospc": {"CKPT_FAIL_WRITE": "/" + MANIFEST_NAME},
    "close-manifest": {"CKPT_FAIL_CLOSE": "/" + MANIFEST_NAME},
}


def test_the_shim_really_fails_calls(shim, tmp_path):
    """The shim itself: a plain Python fsync of a matching file gets EIO, others do not."""
    code = ("import os\n"
            "for name in ('victim-1', 'bystander'):\n"
            "    fd = os.open(os.path.join(%r, name), os.O_CREAT | os.O_WRONLY)\n"
            "    try:\n"
            "        os.fsync(fd); print(name, 'ok')\n"
            "    except OSError as e:\n"
            "        print(name, e.errno)\n"
            "    os.close(fd)\n" % str(tmp_path))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, LD_PRELOAD=shim, CKPT_FAIL_FSYNC="victim-"))
    assert p.stdout.split("\n")[:2] == ["victim-1 5", "bystander ok"], p.stdout + p.stderr


@pytest.mark.parametrize("overwrite", [False, True], ids=["fresh", "overwrite"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_a_failed_save_commits_nothing(shim, tmp_path, case, overwrite):
    parent = tmp_path / "parent"
    parent.mkdir()
    url = str(parent / "ckpt")
    old = _old_state()
    if overwrite:
        ckptcore.save_state(url, old)
        before = _files(url)
    result = _run_child(shim, url, overwrite, CASES[case])
    assert not result["ok"], f"{case}: the save returned success although the disk failed"
    assert result["oserror"] or result["checkpoint_error"], result
    assert os.listdir(parent) == (["ckpt"] if overwrite else []), \
        f"{case}: leftovers {os.listdir(parent)}"
    if overwrite:
        assert _files(url) == before, f"{case}: the previous checkpoint changed"
        assert_state_same(ckptcore.load_state(url), old)
        assert ckptcore.verify(url) == []
    else:
        assert not os.path.exists(os.path.join(url, MANIFEST_NAME))


@pytest.mark.slow
def test_failed_shard_fsync_names_the_file(shim, tmp_path):
    result = _run_child(shim, str(tmp_path / "ckpt"), False, CASES["fsync-shard"])
    assert result["type"] == "OSError" and "Input/output error" in result["message"]
    assert "shard-" in result["message"] and "fsync" in result["message"]


@pytest.mark.slow
def test_write_enospc_names_the_file(shim, tmp_path):
    result = _run_child(shim, str(tmp_path / "ckpt"), False, CASES["write-shard-enospc"])
    assert "No space left on device" in result["message"] and "shard-" in result["message"]


@pytest.mark.parametrize("overwrite", [False, True], ids=["fresh", "overwrite"])
@pytest.mark.slow
def test_a_failed_fsync_of_the_parent_after_the_rename_is_raised(shim, tmp_path, overwrite):
    """The rename has happened (readers may see the checkpoint), but its folder entry is not
    durable: the save raises, saying so, rather than returning."""
    parent = tmp_path / "parent-for-fsync"
    parent.mkdir()
    url = str(parent / "ckpt")
    if overwrite:
        ckptcore.save_state(url, _old_state())
    result = _run_child(shim, url, overwrite, {"CKPT_FAIL_FSYNC": "/parent-for-fsync$",
                                                "CKPT_FAIL_DIRS_ONLY": "1"})
    assert not result["ok"] and result["oserror"], result
    assert "renamed into place" in result["message"] and "power loss" in result["message"]
    assert os.listdir(parent) == ["ckpt"]  # no temporary folder, no old copy
    assert ckptcore.load_state(url).extra == {"new": True}
