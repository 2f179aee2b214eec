"""ckptcore_paddle.Checkpoint refuses an unusable root in its constructor, before anything is created
(``""`` would put checkpoints in ``/`` and ``None`` in a folder called ``None``)."""

from __future__ import annotations

import os
import pathlib

import pytest

pytest.importorskip("paddle", reason="paddlepaddle is not installed")

import ckptcore_paddle  # noqa: E402


@pytest.mark.parametrize("root, error", [("", ValueError), ("   ", ValueError), (None, TypeError),
                                         (3, TypeError), (b"x", TypeError)])
def test_bad_root_is_refused_and_nothing_is_created(tmp_path, monkeypatch, root, error):
    monkeypatch.chdir(tmp_path)
    slash_before = set(os.listdir("/"))
    with pytest.raises(error, match="root"):
        ckptcore_paddle.Checkpoint(root)
    assert os.listdir(".") == []
    assert set(os.listdir("/")) - slash_before == set()


def test_path_like_root_is_kept_as_its_string(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert ckptcore_paddle.Checkpoint(pathlib.Path("run")).root == "run"
    assert not os.path.exists("run")  # nothing is created before fit starts
