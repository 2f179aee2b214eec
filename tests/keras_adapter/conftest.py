"""Keras adapter tests: deterministic TensorFlow settings before anything imports it.

TensorFlow and Paddle never share a process (importing both segfaults), so the
Keras tests live here and run in their own pytest process or subprocesses (the
``run_python``/``spawn_python`` fixtures of ``tests/conftest.py``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (REPO / "adapters", REPO):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
