"""A root is one location, however it is spelled: a backup that resolves to the manager's own root
is refused at construction (with or without the lock), and chained fsspec URLs, which no commit
protocol holds on, are refused with a clear error instead of a stray CheckpointExistsError or a
bare FileNotFoundError."""

from __future__ import annotations

import os

import numpy as np
import pytest

import ckptcore
from ckptcore import CheckpointManager


@pytest.mark.parametrize("lock", [True, False])
@pytest.mark.parametrize("spelling", ["relative", "dot", "file-url", "trailing-slash", "symlink"])
def test_a_backup_that_is_the_root_in_another_spelling_is_refused(tmp_path, monkeypatch, lock,
                                                                   spelling):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    os.symlink(tmp_path / "run", tmp_path / "link")
    root = str(tmp_path / "run")
    backup = {"relative": "run", "dot": "./run", "file-url": f"file://{root}",
              "trailing-slash": root + "/", "symlink": str(tmp_path / "link")}[spelling]
    with pytest.raises(ValueError, match="own root"):
        CheckpointManager(root, backup=ckptcore.Backup(backup, keep=1), lock=lock,
                          save_on_preemption=False)
    # and nothing was deleted or written by the attempt
    assert os.listdir(tmp_path / "run") == []


def test_a_backup_in_memory_under_another_spelling_is_refused():
    with pytest.raises(ValueError, match="own root"):
        CheckpointManager("memory://r/run", backup="memory://r/run/", save_on_preemption=False)


def test_keep_is_not_undone_by_an_aliased_backup_keep(tmp_path, monkeypatch):
    """What the alias did before: backup_keep=1 applied to the root itself deleted steps."""
    monkeypatch.chdir(tmp_path)
    with CheckpointManager("run", keep=None, save_on_preemption=False) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, ckptcore.TrainingState(model={"w": np.zeros(3)}, step=s))
    with pytest.raises(ValueError):
        CheckpointManager("run", backup=ckptcore.Backup("./run", keep=1), lock=False)
    with CheckpointManager("run", lock=False) as reader:
        assert reader.steps() == [1, 2, 3]


@pytest.mark.parametrize("url", ["a::b", "zip::x", "simplecache::memory://x"])
def test_chained_urls_are_refused_clearly(tmp_path, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="chained fsspec URL"):
        CheckpointManager(url, save_on_preemption=False)
    with pytest.raises(ValueError, match="chained fsspec URL"):
        CheckpointManager(str(tmp_path / "run"), backup=url, save_on_preemption=False)
    with pytest.raises(ValueError, match="chained fsspec URL"):
        ckptcore.gc(url)
    assert os.listdir(tmp_path) == []
