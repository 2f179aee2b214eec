"""The ``ckpt`` verbs over real checkpoints: inspect, verify, diff, ls, gc, and their errors.

Verbs run in-process through ``cli.main`` (the console script calls the same function); one test
runs the installed entry point in a subprocess, and one goes to the S3 server with ``-o`` options.
The registry's verbs (import, export, convert, demo) run in subprocesses that see a fake adapter,
registered through a real entry point (a ``*.dist-info`` folder on ``sys.path``), so they test the
command line without depending on any real framework or adapter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ckptcore
from ckptcore import CheckpointManager, DataCursor, cli
from _support import make_state


def _ckpt(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _saved(tmp_path, name="a", step=3, **kw) -> str:
    url = str(tmp_path / name)
    ckptcore.save_state(url, make_state(step), **kw)
    return url


def test_inspect_shows_step_sections_cursor_and_tensors(tmp_path, capsys):
    cursor = DataCursor(15, 4, seed=7)
    cursor.next_batch()
    cursor.next_batch()
    url = str(tmp_path / "c")
    ckptcore.save_state(url, make_state(5), cursor=cursor)
    rc, out, _ = _ckpt(capsys, "inspect", url)
    assert rc == 0
    assert "step        5" in out
    assert "data        epoch 0 / position 8 / seed 7" in out
    assert "kernel" in out and "float32" in out and "64x64" in out
    rc, out, _ = _ckpt(capsys, "inspect", url, "--json")
    d = json.loads(out)
    assert rc == 0 and d["step"] == 5 and d["data"]["position"] == 8 and d["data"]["seed"] == 7
    assert {t["name"] for t in d["tensors"]} >= {"model/dense/kernel", "model/dense/bias"}


def test_verify_is_ok_then_names_the_corrupt_tensor(tmp_path, capsys):
    url = _saved(tmp_path)
    rc, out, _ = _ckpt(capsys, "verify", url)
    assert rc == 0 and "OK" in out
    bias = next(t for t in ckptcore.inspect(url).tensors if t.name == "model/dense/bias")
    shard = os.path.join(url, bias.shard)
    with open(shard, "r+b") as f:
        data = f.read()
        at = data.find(make_state(3).model["dense/bias"].tobytes())  # the bias's bytes, in place
        assert at >= 0
        f.seek(at + 3)
        f.write(bytes([data[at + 3] ^ 0x40]))
    rc, out, _ = _ckpt(capsys, "verify", url)
    assert rc == 1
    assert "BAD" in out and "model/dense/bias" in out and "problem(s)" in out


def test_diff_reports_equal_and_differing_tensors(tmp_path, capsys):
    a, b = _saved(tmp_path, "a", 3), _saved(tmp_path, "b", 3)
    rc, out, _ = _ckpt(capsys, "diff", a, b)
    assert rc == 0 and "0 of" in out
    c = _saved(tmp_path, "c", 4)  # every value of make_state(4) is make_state(3)'s + 1 (the slot + 0.5)
    rc, out, _ = _ckpt(capsys, "diff", a, c)
    assert rc == 1
    assert "~ model/dense/kernel  max abs diff 1" in out
    assert ckptcore.diff(a, c).differences[0].describe() in out  # the CLI prints the library's result


def test_ls_lists_a_managers_committed_steps_only(tmp_path, capsys):
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        for s in (1, 2):
            mgr.save(s, make_state(s))
    (root / "step-000000000009").mkdir()  # a leftover without a manifest
    rc, out, _ = _ckpt(capsys, "ls", str(root))
    lines = [ln for ln in out.splitlines() if ln.startswith("step-")]
    assert rc == 0 and [ln.split()[0] for ln in lines] == ["step-000000000001", "step-000000000002"]
    (tmp_path / "empty").mkdir()  # an existing root without checkpoints: nothing to list yet
    rc, out, _ = _ckpt(capsys, "ls", str(tmp_path / "empty"))
    assert rc == 0 and "no committed checkpoints" in out


def test_gc_removes_leftovers_and_keeps_checkpoints(tmp_path, capsys):
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(1, make_state(1))
    leftover = root / "step-000000000002"
    leftover.mkdir()
    (leftover / "shard-00000-dead.bin").write_bytes(b"x" * 100)
    rc, out, _ = _ckpt(capsys, "gc", str(root), "--grace", "3600")
    assert rc == 0 and "0 leftover(s)" in out and leftover.exists()  # too young
    rc, out, _ = _ckpt(capsys, "gc", str(root), "--grace", "0")
    assert rc == 0 and "1 leftover(s)" in out and not leftover.exists()
    with CheckpointManager(root, lock=False) as reader:
        assert reader.steps() == [1]


def test_gc_is_refused_while_a_run_holds_the_lock(tmp_path, capsys):
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(1, make_state(1))
        rc, _, err = _ckpt(capsys, "gc", str(root), "--grace", "0")
    assert rc == 2 and "LockedError" in err


def test_gc_refuses_what_is_not_a_checkpoint_root(tmp_path, capsys):
    url = _saved(tmp_path, "single")  # a checkpoint folder, not a manager's root
    for target in (str(tmp_path / "typo"), url):
        rc, _, err = _ckpt(capsys, "gc", target, "--grace", "0")
        assert rc == 2 and "no checkpoint root" in err
    assert not (tmp_path / "typo").exists()
    assert not os.path.exists(os.path.join(url, ".ckptcore.lock"))
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(1, make_state(1))
    rc, _, err = _ckpt(capsys, "gc", str(root), "--grace", "-60")
    assert rc == 2 and "grace must be >= 0" in err


@pytest.mark.parametrize("verb", ["inspect", "verify", "ls"])
def test_missing_checkpoint_is_a_readable_error(tmp_path, capsys, verb):
    missing = str(tmp_path / "nope")
    rc, out, err = _ckpt(capsys, verb, missing)
    # ls too: a typo in a root is not an empty run
    assert rc == 2 and "nope" in err and "Traceback" not in err
    assert "no committed checkpoints" not in out
    if verb == "ls":
        assert "does not exist" in err


def test_bad_storage_option_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="key=value"):
        cli.main(["-o", "novalue", "ls", str(tmp_path)])


def test_storage_options_reach_s3(s3_backend, capsys):
    url = s3_backend.url("ck")
    ckptcore.save_state(url, make_state(2), storage_options=s3_backend.storage_options)
    so = s3_backend.storage_options
    opts = ["-o", f"client_kwargs.endpoint_url={so['client_kwargs']['endpoint_url']}",
            "-o", f"key={so['key']}", "-o", f"secret={so['secret']}"]
    rc, out, _ = _ckpt(capsys, *opts, "verify", url)
    assert rc == 0 and "OK" in out
    rc, out, _ = _ckpt(capsys, *opts, "inspect", url, "--json")
    assert rc == 0 and json.loads(out)["step"] == 2


@pytest.mark.slow
def test_console_script_runs(tmp_path):
    url = _saved(tmp_path)
    exe = os.path.join(os.path.dirname(sys.executable), "ckpt")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "ckptcore.cli"]
    done = subprocess.run(cmd + ["verify", url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "OK" in done.stdout


def test_ls_shows_an_unreadable_step_instead_of_hiding_it(tmp_path, capsys):
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(1, make_state(1))
        mgr.save(2, make_state(2))
    (root / "step-000000000002" / "manifest.msgpack").write_bytes(b"not a manifest")
    rc, out, _ = _ckpt(capsys, "ls", str(root))
    lines = out.splitlines()
    assert rc == 0 and lines[0].split()[:3] == ["step-000000000001", "step", "1"]
    assert lines[1].startswith("step-000000000002") and "unreadable" in lines[1]


# -- the registry's verbs, through a fake adapter ------------------------------------------------

FAKE_ADAPTER = textwrap.dedent("""
    import json
    import numpy as np
    from ckptcore import TrainingState
    from ckptcore.adapter import FileFormat

    def _detect(path):
        return str(path).endswith(".fake.json")

    def _read(src, model=None, optimizer=None, scale=None):
        with open(src) as f:
            d = json.load(f)
        model_arrays = {k: np.frombuffer(bytes.fromhex(v["hex"]), v["dtype"]).reshape(v["shape"])
                        for k, v in d["model"].items()}
        if scale is not None:
            model_arrays = {k: a * np.float32(scale) for k, a in model_arrays.items()}
        prefix = model["prefix"] if model else ""
        return TrainingState(model={prefix + k: a for k, a in model_arrays.items()}, step=d["step"],
                             framework="fake",
                             metadata={"optimizer_seen": optimizer} if optimizer else {})

    def _write(state, dst, model=None, optimizer=None, scale=None):
        prefix = model["prefix"] if model else ""
        d = {"step": state.step,
             "model": {prefix + k: {"hex": np.ascontiguousarray(a).tobytes().hex(),
                                    "dtype": str(a.dtype), "shape": list(a.shape)}
                       for k, a in state.model.items()}}
        with open(dst, "w") as f:
            json.dump(d, f)
        return (dst, None)

    def _write_strict(state, dst, model=None, optimizer=None, *, strict=True):
        with open(dst, "w") as f:
            json.dump({"step": state.step, "strict": strict}, f)
        return dst

    def _read_strict(src, model=None, optimizer=None, *, strict=True):
        with open(src) as f:
            return TrainingState(model={}, step=json.load(f)["step"], metadata={"strict": strict})

    def _broken_connection(*args, **kwargs):
        raise BrokenPipeError(32, "the store's connection broke")

    def _needs_framework(*args, **kwargs):
        import fakeframework_not_installed  # what a format of an absent framework runs into

    FORMATS = [
        FileFormat("fake-json", "fake", "a JSON file of hex tensors", _detect, _read, _write,
                   options={"scale": "multiply every value by this on reading"}),
        FileFormat("fake-named", "fake", "fake-json named through the live model",
                   lambda p: False, None, _write, needs_model=True),
        FileFormat("fake-strict", "fake", "takes strict=", lambda p: False, _read_strict,
                   _write_strict),
        FileFormat("fake-brokenpipe", "fake", "its writer's connection breaks", lambda p: False,
                   None, _broken_connection),
        FileFormat("fake-absent", "fake", "needs a framework that is not installed",
                   lambda p: False, _needs_framework, _needs_framework),
    ]

    class _Fake:
        name = "fake"
        capture_views = False
        def handles(self, obj):
            return isinstance(obj, dict) and obj.get("kind") == "fake-model"
        def capture(self, *, model, optimizer=None, cursor=None, rng=True, copy=True, **objects):
            if model.get("record"):  # tells the test which target objects a conversion passed
                got = {"optimizer": optimizer, "cursor": cursor, "rng": rng, **objects}
                raise RuntimeError("capture got " + json.dumps(got, sort_keys=True))
            return TrainingState(model={}, framework="fake")
        def restore(self, state, *, model, optimizer=None, cursor=None, strict=True, rng=True, **objects):
            raise NotImplementedError
        @property
        def dialect(self):
            return None
        @property
        def formats(self):
            return FORMATS
        def demo(self, *, seed, features, classes):
            raise NotImplementedError

    class _Broken(_Fake):
        name = "fakebroken"
        @property
        def formats(self):
            from fakeckpt_adapter import _files_not_written_yet  # noqa: F401
            return []

    ADAPTER = _Fake()
    BROKEN = _Broken()

    def build():
        return {"kind": "fake-model", "prefix": "net/"}, "the-optimizer"
""")


@pytest.fixture(scope="module")
def fake_env(tmp_path_factory) -> dict[str, str]:
    """An environment whose Python sees the ``fake`` and ``fakebroken`` adapters' entry points."""
    site = tmp_path_factory.mktemp("fake-site")
    (site / "fakeckpt_adapter.py").write_text(FAKE_ADAPTER)
    dist = site / "fakeckpt_adapter-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeckpt-adapter\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[ckptcore.adapters]\nfake = fakeckpt_adapter:ADAPTER\n"
                                           "fakebroken = fakeckpt_adapter:BROKEN\n")
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(repo), str(repo / "adapters"),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _run_ckpt(env, *argv: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptcore.cli", *map(str, argv)], env=env,
                          capture_output=True, text=True, timeout=120, cwd=cwd)


def _fake_file(path: Path, arrays: dict, step: int = 7) -> Path:
    import numpy as np
    d = {"step": step, "model": {k: {"hex": np.ascontiguousarray(a).tobytes().hex(),
                                     "dtype": str(a.dtype), "shape": list(a.shape)}
                                 for k, a in arrays.items()}}
    path.write_text(json.dumps(d))
    return path


def _arrays():
    import numpy as np
    rng = np.random.default_rng(0)
    return {"dense/kernel": rng.standard_normal((3, 4)).astype(np.float32),
            "dense/bias": np.array([np.nan, -0.0, np.inf, 1e-45], np.float32)}


@pytest.mark.slow
def test_verbs_take_their_choices_from_the_registry(fake_env):
    out = _run_ckpt(fake_env, "export", "--help")
    assert out.returncode == 0, out.stderr
    assert "fake-json" in out.stdout and "fake-named" in out.stdout
    assert "--scale" in out.stdout  # a format's own option became a command-line option
    out = _run_ckpt(fake_env, "convert", "--help")
    assert "fake" in out.stdout and "fake-json" in out.stdout
    out = _run_ckpt(fake_env, "demo", "--help")
    assert "fake" in out.stdout
    # An adapter whose formats fail to import offers none, says so, and breaks nothing.
    out = _run_ckpt(fake_env, "import", "--help")
    assert out.returncode == 0 and "fake-json" in out.stdout
    assert "'fakebroken' adapter's file formats are unavailable" in out.stderr
    out = _run_ckpt(fake_env, "export", "x", "y", "--to", "no-such-format")
    assert out.returncode == 2 and "invalid choice" in out.stderr


@pytest.mark.slow
def test_other_verbs_do_not_read_the_formats(fake_env, tmp_path):
    url = _saved(tmp_path)
    out = _run_ckpt(fake_env, "verify", url)
    assert out.returncode == 0, out.stderr
    assert "file formats are unavailable" not in out.stderr


@pytest.mark.slow
def test_import_export_round_trip_bit_for_bit(fake_env, tmp_path):
    arrays = _arrays()
    src = _fake_file(tmp_path / "m.fake.json", arrays)
    out = _run_ckpt(fake_env, "import", src, tmp_path / "ck")  # detected by its name
    assert out.returncode == 0, out.stderr
    assert "(fake-json)" in out.stdout
    state = ckptcore.load_state(str(tmp_path / "ck"))
    assert state.step == 7 and state.framework == "fake"
    for k, a in arrays.items():
        assert state.model[k].tobytes() == a.tobytes() and state.model[k].dtype == a.dtype
    out = _run_ckpt(fake_env, "export", tmp_path / "ck", tmp_path / "back.json", "--to", "fake-json")
    assert out.returncode == 0, out.stderr
    assert f"-> {tmp_path / 'back.json'}" in out.stdout
    assert json.loads((tmp_path / "back.json").read_text()) == json.loads(src.read_text())


@pytest.mark.slow
def test_import_from_and_format_options(fake_env, tmp_path):
    import numpy as np
    src = _fake_file(tmp_path / "no-suffix", {"w": np.arange(3, dtype=np.float32)})
    out = _run_ckpt(fake_env, "import", src, tmp_path / "a")
    assert out.returncode == 2 and "pass --from" in out.stderr and "Traceback" not in out.stderr
    out = _run_ckpt(fake_env, "import", src, tmp_path / "a", "--from", "fake-json", "--scale", "2")
    assert out.returncode == 0, out.stderr
    assert ckptcore.load_state(str(tmp_path / "a")).model["w"].tolist() == [0.0, 2.0, 4.0]
    out = _run_ckpt(fake_env, "export", tmp_path / "a", tmp_path / "b.json", "--to", "fake-absent",
                    "--scale", "2")
    assert out.returncode == 2 and "--scale does not apply to format 'fake-absent'" in out.stderr


@pytest.mark.slow
def test_model_factory_objects_reach_the_format(fake_env, tmp_path):
    import numpy as np
    src = _fake_file(tmp_path / "m.fake.json", {"w": np.ones(2, np.float32)})
    out = _run_ckpt(fake_env, "export", "unused", tmp_path / "n.json", "--to", "fake-named")
    assert out.returncode == 2 and "needs --model" in out.stderr
    out = _run_ckpt(fake_env, "import", src, tmp_path / "ck", "--model", "fakeckpt_adapter:build")
    assert out.returncode == 0, out.stderr
    state = ckptcore.load_state(str(tmp_path / "ck"))
    assert list(state.model) == ["net/w"] and state.metadata == {"optimizer_seen": "the-optimizer"}
    out = _run_ckpt(fake_env, "export", tmp_path / "ck", tmp_path / "n.json", "--to", "fake-named",
                    "--model", "fakeckpt_adapter:build")
    assert out.returncode == 0, out.stderr
    assert list(json.loads((tmp_path / "n.json").read_text())["model"]) == ["net/net/w"]


@pytest.mark.slow
def test_a_missing_framework_is_one_line_with_an_install_hint(fake_env, tmp_path):
    import numpy as np
    src = _fake_file(tmp_path / "m.fake.json", {"w": np.ones(2, np.float32)})
    out = _run_ckpt(fake_env, "import", src, tmp_path / "ck", "--from", "fake-absent")
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    line = [ln for ln in out.stderr.splitlines() if ln.startswith("ckpt import:")]
    assert len(line) == 1 and "'fakeframework_not_installed', which is not installed" in line[0]
    assert ckptcore.registry.install_hint("fake") in line[0]
    assert not (tmp_path / "ck").exists()


def test_install_hints_come_from_the_registry():
    from ckptcore.registry import install_hint
    assert install_hint("paddle") == "pip install 'ckptcore[paddle]'"
    assert "ckptcore.adapters" in install_hint("someframework")


CONVERT_PROBE = """
import ckptcore, numpy as np
from ckptcore import api
state = ckptcore.TrainingState(model={"w": np.zeros(2)}, framework="elsewhere")
model = {"kind": "fake-model", "record": True}
for call in (lambda: api.convert(state, "fake", model, "opt", scheduler="sched", scaler="scal",
                                 unused=None),
             lambda: api.convert_for(state, "fake", {"model": model, "optimizer": "opt",
                                     "cursor": "cur", "strict": False, "rng": True,
                                     "scheduler": "sched"})):
    try:
        call()
    except RuntimeError as e:
        print(e)
"""


@pytest.mark.slow
def test_convert_passes_every_target_object_to_the_adapter(fake_env):
    """``api.convert(**objects)`` hands framework-specific targets to the target adapter's capture;
    ``convert_for`` (a restore's conversion) passes all of a restore's objects but the cursor,
    ``strict`` and ``rng``."""
    out = subprocess.run([sys.executable, "-c", CONVERT_PROBE], env=fake_env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = [json.loads(ln.removeprefix("capture got ")) for ln in out.stdout.splitlines()]
    assert first == {"optimizer": "opt", "cursor": None, "rng": False, "scheduler": "sched",
                     "scaler": "scal"}
    assert second == {"optimizer": "opt", "cursor": None, "rng": False, "scheduler": "sched"}


# -- issue 12: options after the verb, missing roots, run roots, pipes, epochs, logging ----------

@pytest.mark.slow
def test_storage_options_and_verbose_after_the_verb(s3_backend, capsys):
    """``-o`` works before and after the verb (the README shows it after), and mixes."""
    url = s3_backend.url("ck")
    ckptcore.save_state(url, make_state(2), storage_options=s3_backend.storage_options)
    so = s3_backend.storage_options
    endpoint = ["-o", f"client_kwargs.endpoint_url={so['client_kwargs']['endpoint_url']}"]
    creds = ["-o", f"key={so['key']}", "-o", f"secret={so['secret']}"]
    rc, out, _ = _ckpt(capsys, "verify", url, *endpoint, *creds)
    assert rc == 0 and "OK" in out
    rc, out, _ = _ckpt(capsys, *creds, "inspect", url, "--json", *endpoint)
    assert rc == 0 and json.loads(out)["step"] == 2


def test_ls_of_a_missing_bucket_is_an_error(s3_backend, capsys):
    so = s3_backend.storage_options
    opts = ["-o", f"client_kwargs.endpoint_url={so['client_kwargs']['endpoint_url']}",
            "-o", f"key={so['key']}", "-o", f"secret={so['secret']}"]
    rc, out, err = _ckpt(capsys, "ls", "s3://no-such-bucket-ckptcore/run", *opts)
    assert rc == 2 and "no-such-bucket-ckptcore" in err and "no committed" not in out
    rc, out, err = _ckpt(capsys, "ls", s3_backend.url("never-written"), *opts)
    assert rc == 2 and "does not exist" in err


def test_inspect_of_a_run_root_points_to_ls(tmp_path, capsys):
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(1, make_state(1))
    for verb in ("inspect", "verify"):
        rc, _, err = _ckpt(capsys, verb, str(root))
        assert rc == 2 and f"ckpt ls {root}" in err and "run's root" in err
    rc, _, err = _ckpt(capsys, "inspect", str(tmp_path / "nope"))  # not a root: the plain error
    assert rc == 2 and "does not exist" in err and "ckpt ls" not in err


def test_epoch_column_shows_the_cursors_epoch_for_custom_loops(tmp_path, capsys):
    """A custom loop that never sets ``state.epoch``: the cursor knows the run is in epoch 2."""
    cursor = DataCursor(8, 4, seed=0)
    for _ in range(5):  # 2 epochs of 2 batches, then one batch into epoch 2
        cursor.next_batch()
    assert cursor.epoch == 2
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(5, make_state(5), cursor=cursor)
    assert ckptcore.list_checkpoints(root)[0].info.epoch == 0  # the state's own field
    rc, out, _ = _ckpt(capsys, "ls", str(root))
    assert rc == 0 and out.split()[:6] == ["step-000000000005", "step", "5", "epoch", "2", "-"]
    rc, out, _ = _ckpt(capsys, "inspect", ckptcore.list_checkpoints(root)[0].url)
    assert "epoch 2 (the data cursor's)" in out


def test_epoch_column_keeps_a_states_own_epoch(tmp_path, capsys):
    cursor = DataCursor(8, 4, seed=0)
    cursor.next_batch()
    import dataclasses
    root = tmp_path / "run"
    with CheckpointManager(root) as mgr:
        mgr.save(1, dataclasses.replace(make_state(1), epoch=7), cursor=cursor)
    rc, out, _ = _ckpt(capsys, "ls", str(root))
    assert out.split()[4] == "7"


def test_verbose_shows_the_ckptcore_log(tmp_path, capsys):
    """``-v`` (before or after the verb) shows the log of decisions on stderr; without it, INFO
    records stay quiet."""
    cursor = DataCursor(8, 4, seed=0)
    for _ in range(3):
        cursor.next_batch()
    url = str(tmp_path / "c")
    ckptcore.save_state(url, make_state(1), cursor=cursor)
    rc, _, err = _ckpt(capsys, "ls", str(tmp_path))
    assert rc == 0 and err == ""
    rc, _, err = _ckpt(capsys, "inspect", url, "-vv")
    assert rc == 0 and "data cursor's epoch 1" in err and "DEBUG" in err
    rc, _, err = _ckpt(capsys, "-vv", "inspect", url)
    assert rc == 0 and "data cursor's epoch 1" in err


def _many_tensor_checkpoint(tmp_path) -> str:
    import numpy as np
    url = str(tmp_path / "big")
    state = ckptcore.TrainingState(model={f"layer{i:04d}/kernel": np.zeros(2, np.float32)
                                          for i in range(3000)}, step=1)
    ckptcore.save_state(url, state)
    return url


@pytest.mark.parametrize("shell", [False, True])
@pytest.mark.slow
def test_a_reader_that_goes_away_ends_ckpt_quietly(tmp_path, shell):
    """``ckpt inspect URL | head``: the output (far more than a pipe holds) meets a closed pipe;
    ckpt stops without a traceback, with the shell's exit code for it (141) or 0."""
    url = _many_tensor_checkpoint(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    if shell:
        done = subprocess.run(["bash", "-c", f'set -o pipefail; "{sys.executable}" -m ckptcore.cli '
                               f'inspect "{url}" | head -n 2; echo "rc=$?" >&2'],
                              capture_output=True, text=True, env=env, timeout=120)
        assert len(done.stdout.splitlines()) == 2
        assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
        assert done.stderr.strip().splitlines()[-1] in ("rc=0", "rc=141")
        return
    proc = subprocess.Popen([sys.executable, "-m", "ckptcore.cli", "inspect", url], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"checkpoint")
    proc.stdout.close()  # the reader goes away after one line
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err
    assert rc in (0, 141)


@pytest.mark.slow
def test_strict_reaches_the_format_only_when_given(fake_env, tmp_path):
    """``--strict/--no-strict`` go to the format's reader/writer as ``strict=``; without them the
    format's default applies, and a format that takes no ``strict`` refuses it in one line."""
    ck = _saved(tmp_path, "ck", 4)
    out = _run_ckpt(fake_env, "export", ck, tmp_path / "a.json", "--to", "fake-strict", "--no-strict")
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "a.json").read_text()) == {"step": 4, "strict": False}
    out = _run_ckpt(fake_env, "export", ck, tmp_path / "b.json", "--to", "fake-strict")
    assert json.loads((tmp_path / "b.json").read_text())["strict"] is True
    out = _run_ckpt(fake_env, "import", tmp_path / "a.json", tmp_path / "imp", "--from", "fake-strict",
                    "--no-strict")
    assert out.returncode == 0, out.stderr
    assert ckptcore.load_state(str(tmp_path / "imp")).metadata == {"strict": False}
    out = _run_ckpt(fake_env, "export", ck, tmp_path / "c.json", "--to", "fake-json", "--strict")
    assert out.returncode == 2 and "strict" in out.stderr and "Traceback" not in out.stderr
    out = _run_ckpt(fake_env, "convert", ck, tmp_path / "d", "--to", "fake", "--model",
                    "fakeckpt_adapter:build", "--no-strict")
    assert out.returncode == 2 and "--strict/--no-strict applies to a file format" in out.stderr


@pytest.mark.slow
def test_export_creates_the_target_folder(fake_env, tmp_path):
    ck = _saved(tmp_path, "ck", 4)
    target = tmp_path / "new" / "deeper" / "out.json"
    out = _run_ckpt(fake_env, "-v", "export", ck, target, "--to", "fake-strict")
    assert out.returncode == 0, out.stderr
    assert json.loads(target.read_text())["step"] == 4
    assert f"creating the folder {target.parent}" in out.stderr  # -v shows the decision


# -- scripts/_venv.sh: install once, again only when pyproject.toml changes, quietly ------------

FAKE_VENV_PYTHON = """#!/usr/bin/env bash
# Stands in for .venv/bin/python: records each call; pip "installs" noisily, as a build backend does.
echo "$*" >> "$(dirname "$0")/calls.log"
if [ "$1 $2 $3" = "-m pip install" ]; then
  echo "SetuptoolsDeprecationWarning: License classifiers are deprecated." >&2
  echo "Successfully installed ckptcore-0.1.0"
  [ -f "$(dirname "$0")/fail" ] && { echo "ERROR: the build failed" >&2; exit 1; }
fi
exit 0
"""


def _source_venv(project: Path) -> subprocess.CompletedProcess:
    script = Path(__file__).resolve().parents[1] / "scripts" / "_venv.sh"
    return subprocess.run(["bash", "-c", f'set -euo pipefail; source "{script}" "dev"; echo sourced'],
                          cwd=project, capture_output=True, text=True, timeout=60)


def test_venv_script_installs_once_and_quietly(tmp_path):
    project = tmp_path / "project"
    (project / ".venv" / "bin").mkdir(parents=True)
    python = project / ".venv" / "bin" / "python"
    python.write_text(FAKE_VENV_PYTHON)
    python.chmod(0o755)
    (project / "pyproject.toml").write_text('[project]\nname = "ckptcore"\n')
    calls = project / ".venv" / "bin" / "calls.log"

    def installs() -> int:
        return sum("pip install" in ln for ln in calls.read_text().splitlines()) if calls.exists() else 0

    done = _source_venv(project)
    assert done.returncode == 0 and done.stdout == "sourced\n", done.stderr
    assert installs() == 1 and "Warning" not in done.stderr  # the backend's warnings stay hidden
    for _ in range(2):  # nothing changed: no pip at all
        assert _source_venv(project).returncode == 0
    assert installs() == 1
    (project / "pyproject.toml").write_text('[project]\nname = "ckptcore"\nversion = "2"\n')
    assert _source_venv(project).returncode == 0 and installs() == 2
    (project / "pyproject.toml").write_text('[project]\nname = "ckptcore"\nversion = "3"\n')
    (project / ".venv" / "bin" / "fail").write_text("")
    done = _source_venv(project)  # a failed install shows pip's output and is retried next time
    assert done.returncode != 0 and "the build failed" in done.stderr and "sourced" not in done.stdout
    (project / ".venv" / "bin" / "fail").unlink()
    assert _source_venv(project).returncode == 0 and installs() == 4
    assert _source_venv(project).returncode == 0 and installs() == 4


# -- ckpt demo: options after the verb reach the bucket; the frameworks' logs stay out ----------

@pytest.mark.slow
def test_demo_on_s3_with_options_after_the_verb(s3_backend):
    """What README shows: ``ckpt demo --root s3://... -o client_kwargs.endpoint_url=...``."""
    so = s3_backend.storage_options
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "adapters"),
         os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "ckptcore.cli", "demo", "--root", s3_backend.url("demo"),
                           "-o", f"client_kwargs.endpoint_url={so['client_kwargs']['endpoint_url']}",
                           "-o", f"key={so['key']}", "-o", f"secret={so['secret']}"],
                          env=env, capture_output=True, text=True, timeout=300)
    # The options after the verb reached the bucket: the killed run's checkpoints are there.
    assert any(n.startswith("step-") for n in s3_backend.listdir("demo", "run")), done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT: the resumed run equals the uninterrupted run" in done.stdout


@pytest.mark.slow
def test_framework_demo_keeps_the_frameworks_logs_out(tmp_path):
    """``ckpt demo --framework keras`` with no log settings of the user's: TensorFlow's start-up
    chatter (absl, CUDA probing, oneDNN notices) does not reach the terminal."""
    # find_spec, not importorskip: this process must not import a framework (importing
    # TensorFlow here left it loaded for every later test of this worker, where importing Paddle
    # would crash; only an absent framework skips).
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("tensorflow is not installed")
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items()
           if k not in ("TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS", "GLOG_minloglevel")}
    env["PYTHONPATH"] = os.pathsep.join([str(repo), str(repo / "adapters")])
    done = subprocess.run([sys.executable, "-m", "ckptcore.cli", "demo", "--framework", "keras",
                           "--root", str(tmp_path / "run")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT: the resumed run equals" in done.stdout
    noise = [ln for ln in (done.stdout + done.stderr).splitlines()
             if any(w in ln for w in ("absl", "cuda", "oneDNN", "I0000", "W0000", "E0000"))]
    assert not noise, noise


@pytest.mark.slow
def test_a_broken_connection_is_not_a_closed_pipe(fake_env, tmp_path):
    """A ``BrokenPipeError`` of a connection (stdout's reader still there) is an error, exit 2."""
    ck = _saved(tmp_path, "ck", 4)
    out = _run_ckpt(fake_env, "export", ck, tmp_path / "x", "--to", "fake-brokenpipe")
    assert out.returncode == 2 and "the store's connection broke" in out.stderr
