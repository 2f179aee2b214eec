"""BackupAndRestore refuses an unusable root in its constructor, before anything is created.

Before, ``str(root)`` let ``""`` through (the manager then wrote into ``/``) and turned ``None``
into a folder named "None" in the working directory.
"""

from __future__ import annotations

import os

import pytest

keras = pytest.importorskip("keras")

import ckptcore_keras  # noqa: E402

BAD_ROOTS = [("", ValueError), ("   ", ValueError), (None, TypeError), (3, TypeError), (b"x", TypeError)]


@pytest.mark.parametrize("root, error", BAD_ROOTS, ids=["empty", "blank", "none", "int", "bytes"])
def test_bad_root_is_refused_and_nothing_is_created(root, error, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root_before = set(os.listdir("/"))
    with pytest.raises(error, match="root"):
        ckptcore_keras.BackupAndRestore(root, save_freq=1)
    assert os.listdir(tmp_path) == []
    assert set(os.listdir("/")) - root_before == set()


def test_path_like_root_is_kept_as_its_string(tmp_path):
    cb = ckptcore_keras.BackupAndRestore(tmp_path / "run")
    assert cb.root == str(tmp_path / "run")
    assert not (tmp_path / "run").exists()  # the manager opens it when fit begins
