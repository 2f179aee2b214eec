"""`ckpt demo`: the README's first command kills a real training process and resumes it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

CKPT = [sys.executable, "-m", "ckptcore.cli", "demo"]


def run_demo(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CKPT, "--root", str(tmp_path / "demo"), *extra], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.slow
def test_numpy_demo_resumes_bit_exactly(tmp_path):
    out = run_demo(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SIGKILLed at step 23" in out.stdout
    assert "RESULT: the resumed run equals the uninterrupted run" in out.stdout
    assert (tmp_path / "demo" / "run").is_dir()


@pytest.mark.slow
def test_numpy_demo_runs_again_on_the_same_root(tmp_path):
    # A second demo on the same root used to resume the finished runs and fail on its final
    # save (CheckpointExistsError ... mgr.rewind(48)).  The demo owns its root: it starts over.
    first = run_demo(tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "previous demo" not in first.stdout
    second = run_demo(tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "CheckpointExistsError" not in second.stdout + second.stderr
    for name in ("reference", "run"):
        assert (f"{tmp_path / 'demo' / name} held a previous demo's checkpoints (steps 40..48); "
                "starting over: removed them") in second.stdout
    assert "1. uninterrupted reference run (its own process): 48 steps" in second.stdout
    assert "SIGKILLed at step 23" in second.stdout and "newest checkpoint: step 20" in second.stdout
    assert "RESULT: the resumed run equals the uninterrupted run" in second.stdout
    assert f"the checkpoints stay in {tmp_path / 'demo'}" in second.stdout


@pytest.mark.slow
def test_demo_without_root_removes_its_temporary_folder(tmp_path):
    # Without --root the demo works in a ckpt-demo-* temporary folder: removed at the end, saying
    # so (nothing is left behind in the temporary directory).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)}
    out = subprocess.run(CKPT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "RESULT: the resumed run equals the uninterrupted run" in out.stdout
    assert f"removed the temporary folder {tmp_path}/ckpt-demo-" in out.stdout
    assert not list(tmp_path.glob("ckpt-demo-*"))
    # Asked to keep it (python -m ckptcore.demo run --keep), the folder stays and is named.
    out = subprocess.run([sys.executable, "-m", "ckptcore.demo", "run", "--keep"], capture_output=True,
                         text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    kept = list(tmp_path.glob("ckpt-demo-*"))
    assert len(kept) == 1 and f"the checkpoints are kept in {kept[0]}" in out.stdout


@pytest.mark.slow
def test_demo_refuses_memory_root():
    out = subprocess.run([*CKPT, "--root", "memory://x"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "memory://" in out.stderr


@pytest.mark.parametrize("framework", ["paddle", "keras", "torch", "jax"])
@pytest.mark.slow
def test_framework_demo_resumes_bit_exactly(tmp_path, framework):
    # find_spec, not importorskip: this process must not import a framework (they clash).
    if importlib.util.find_spec({"keras": "tensorflow"}.get(framework, framework)) is None:
        pytest.skip(f"{framework} is not installed")
    out = run_demo(tmp_path, "--framework", framework)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "RESULT: the resumed run equals the uninterrupted run" in out.stdout


CRASHING = '''
class CrashingAdapter:
    name = "crashfw"
    capture_views = False
    def handles(self, obj):
        return False
    def capture(self, **objects): ...
    def restore(self, state, **objects): ...
    dialect = None
    formats = ()
    def demo(self, *, seed, features, classes):
        raise RuntimeError("the crashfw demo model cannot be built")

ADAPTER = CrashingAdapter()
'''


@pytest.mark.slow
def test_crashing_worker_fails_clearly(tmp_path):
    # An adapter whose demo program cannot be built: the worker exits 1 at once.  The demo must
    # say so (exit code, the worker's own error), not stumble on the missing steps later.
    site = tmp_path / "site"
    (site / "crashfw_ckpt-0.1.dist-info").mkdir(parents=True)
    (site / "crashfw_ckpt.py").write_text(CRASHING)
    (site / "crashfw_ckpt-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: crashfw_ckpt\nVersion: 0.1\n")
    (site / "crashfw_ckpt-0.1.dist-info" / "entry_points.txt").write_text(
        "[ckptcore.adapters]\ncrashfw = crashfw_ckpt:ADAPTER\n")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    out = subprocess.run([sys.executable, "-m", "ckptcore.demo", "run", "--framework", "crashfw",
                          "--root", str(tmp_path / "demo")], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": path})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "the crashfw training worker exited with code 1 (it reported 0 steps)" in out.stderr
    assert "RuntimeError: the crashfw demo model cannot be built" in out.stderr
    assert "non-negative int" not in out.stderr + out.stdout and "RESULT" not in out.stdout


def test_demo_names_a_missing_adapter_in_one_line(tmp_path, capsys):
    from ckptcore.demo import run_demo
    assert run_demo(str(tmp_path / "demo"), "nosuchfw") == 2
    err = capsys.readouterr().err
    assert err.startswith("ckpt demo: no ckptcore adapter named 'nosuchfw'") and err.count("\n") == 1


@pytest.mark.slow
def test_numpy_demo_on_s3_resumes_at_once_after_the_kill(s3_backend, capsys):
    # The killed worker's lease object stays on the bucket; the resumed worker, on the same
    # machine, takes it over at once (its process is gone) instead of waiting for it to expire.
    from ckptcore.demo import run_demo
    code = run_demo(s3_backend.url("demo"), "numpy", storage_options=s3_backend.storage_options)
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert "RESULT: the resumed run equals the uninterrupted run" in captured.out
    assert "resumed process:" in captured.out and "taking over the writer lock" in captured.out
    assert "step-" in "".join(s3_backend.listdir("demo", "run"))


@pytest.mark.slow
def test_numpy_demo_on_s3_runs_again_on_the_same_root(s3_backend, capsys):
    from ckptcore.demo import run_demo
    url = s3_backend.url("demo2")
    assert run_demo(url, "numpy", storage_options=s3_backend.storage_options) == 0
    capsys.readouterr()
    code = run_demo(url, "numpy", storage_options=s3_backend.storage_options)
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert f"{url}/run held a previous demo's checkpoints (steps 40..48); starting over" in captured.out
    assert "RESULT: the resumed run equals the uninterrupted run" in captured.out
