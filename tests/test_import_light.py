"""``import ckptcore`` (and the adapter packages) must not import any framework.

Each check runs in a fresh interpreter, because this test process may already hold frameworks.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

import ckptcore

HEAVY = ["tensorflow", "keras", "paddle", "paddlepaddle", "torch", "jax",
         "s3fs", "botocore", "aiobotocore", "gcsfs", "adlfs"]

PROBE = """
import json, sys
{code}
print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}})))
"""


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(code=code)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_probe_sees_imports():
    """The probe itself works: importing json shows up (so the checks below can fail)."""
    assert "fsspec" in _modules_after("import fsspec")


@pytest.mark.parametrize("code", [
    "import ckptcore",
    "import ckptcore.cli",
    "from ckptcore import registry; registry.available_adapters()",
    # A whole save/load/inspect/verify of a NumPy state touches no framework either.
    "import numpy as np, ckptcore\n"
    "s = ckptcore.TrainingState(model={'w': np.zeros(3)})\n"
    "ckptcore.save_state('memory://light/c', s); ckptcore.load_state('memory://light/c')\n"
    "ckptcore.inspect('memory://light/c'); ckptcore.verify('memory://light/c')",
], ids=["import", "cli", "adapter-registry", "save-load"])
@pytest.mark.slow
def test_ckptcore_is_light(code):
    loaded = _modules_after(code)
    assert "ckptcore" in loaded
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


@pytest.mark.parametrize("adapter", ["ckptcore_keras", "ckptcore_paddle"])
@pytest.mark.slow
def test_adapter_packages_are_light(adapter):
    try:
        found = importlib.util.find_spec(adapter) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        pytest.skip(f"{adapter} is not installed")
    loaded = _modules_after(f"import {adapter}")
    assert adapter in loaded
    assert not loaded & {"tensorflow", "keras", "paddle"}, sorted(loaded & {"tensorflow", "keras", "paddle"})


@pytest.mark.slow
def test_import_ckptcore_leaves_migrate_unloaded():
    """``import ckptcore`` loads none of migrate/ (its MigrationWarning lives in errors.py)."""
    out = subprocess.run([sys.executable, "-c", "import json, sys, ckptcore\n"
                          "print(json.dumps(sorted(m for m in sys.modules if m.startswith('ckptcore'))))"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "ckptcore.errors" in loaded  # the probe sees ckptcore's own modules
    assert not [m for m in loaded if m == "ckptcore.migrate" or m.startswith("ckptcore.migrate.")]
