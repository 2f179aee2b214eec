"""``import ckptcore_keras`` (and asking its adapter about an object) never imports TensorFlow."""

from __future__ import annotations

CODE = """
import sys
import ckptcore_keras
from ckptcore_keras import ADAPTER
assert ADAPTER.name == "keras"
assert not ADAPTER.handles(object()) and not ADAPTER.handles([1, 2])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras", "tf_keras", "paddle"))
assert not heavy, heavy
print("light")
"""


def test_import_does_not_load_tensorflow(run_python):
    assert run_python("-c", CODE).strip() == "light"
