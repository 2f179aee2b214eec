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
from ckptcore import CheckpointManager, cli
from ckptcore._version import __version__
from ckptcore.adapter import FileFormat
from manager_support import make_state


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


