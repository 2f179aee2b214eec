"""``import ckptcore_keras`` (and asking its adapter about an object or a file) never imports TensorFlow."""

from __future__ import annotations

CODE = """
import sys
import ckptcore_keras
from ckptcore_keras import ADAPTER
assert ADAPTER.name == "keras"
assert not ADAPTER.handles(object()) and not ADAPTER.handles([1, 2])
(fmt,) = ADAPTER.formats
assert (fmt.name, fmt.framework, fmt.needs_model) == ("tf-checkpoint", "keras", True)
assert not fmt.detect(sys.argv[1] + "/ck")
open(sys.argv[1] + "/ck.index", "wb").close()
assert fmt.detect(sys.argv[1] + "/ck") and not fmt.detect(sys.argv[1])
open(sys.argv[1] + "/checkpoint", "w").close()
assert fmt.detect(sys.argv[1])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras", "tf_keras", "paddle"))
assert not heavy, heavy
print("light")
"""


def test_import_does_not_load_tensorflow(run_python, tmp_path):
    assert run_python("-c", CODE, str(tmp_path)).strip() == "light"
