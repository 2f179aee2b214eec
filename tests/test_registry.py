"""The adapter registry, through real entry points: a fake framework's adapter installed as a
distribution (a ``.dist-info`` with ``entry_points.txt`` on ``sys.path``), in a fresh interpreter
so this process's registry cache and installed adapters are not involved."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

GOOD = '''
class FakeModel:
    def __init__(self):
        self.w = __import__("numpy").arange(4.0)

class FakeAdapter:
    name = "fakefw"
    capture_views = False
    def handles(self, obj):
        return isinstance(obj, FakeModel)
    def capture(self, *, model, optimizer=None, cursor=None, rng=True, copy=True, **objects):
        from ckptcore import TrainingState
        return TrainingState(model={"w": model.w.copy()}, framework=self.name)
    def restore(self, state, *, model, optimizer=None, cursor=None, strict=True, rng=True, **objects):
        from ckptcore.adapter import RestorePlan
        plan = RestorePlan()
        plan.assign("w", state.model["w"], shape=model.w.shape, dtype=model.w.dtype,
                    put=lambda: model.w.__setitem__(slice(None), state.model["w"]))
        return plan.apply(strict)
    @property
    def dialect(self):
        raise AssertionError("the registry must not run an adapter's properties")
    formats = ()
    def demo(self, *, seed, features, classes):
        raise NotImplementedError

ADAPTER = FakeAdapter()
'''

BROKEN_IMPORT = 'raise ImportError("fakefw_broken needs libfake 2.0")\n'

INCOMPLETE = '''
class Half:
    name = "fakefw_half"
    def handles(self, obj):
        return False
    def capture(self, **kw): ...
    def restore(self, state, **kw): ...

ADAPTER = Half()
'''


def install(site: Path, dist: str, modules: dict[str, str], entry_points: dict[str, str]) -> None:
    """A minimal installed distribution: its modules and a dist-info declaring adapters."""
    for name, source in modules.items():
        (site / f"{name}.py").write_text(source)
    info = site / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[ckptcore.adapters]\n{lines}")


@pytest.fixture
def site(tmp_path) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    install(site, "fakefw_ckpt", {"fakefw_ckpt": GOOD}, {"fakefw": "fakefw_ckpt:ADAPTER"})
    install(site, "fakefw_broken", {"fakefw_broken": BROKEN_IMPORT},
            {"fakefw_broken": "fakefw_broken:ADAPTER"})
    install(site, "fakefw_half", {"fakefw_half": INCOMPLETE}, {"fakefw_half": "fakefw_half:ADAPTER"})
    return site


def check(run_python, tmp_path: Path, site: Path, body: str) -> dict:
    """Run ``body`` in a fresh interpreter with ``site`` on sys.path; return what it printed."""
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent(f'''
        import json, logging, sys
        sys.path.insert(0, {str(site)!r})
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())
        logging.getLogger("ckptcore").addHandler(Keep())
        from ckptcore import registry
        from ckptcore.errors import AdapterNotFoundError
        out = {{}}
    ''') + textwrap.dedent(body) + "\nout['log'] = records\nprint(json.dumps(out))\n")
    return json.loads(run_python(str(script)).strip().splitlines()[-1])


@pytest.mark.slow
def test_fake_adapter_is_found_and_chosen(run_python, tmp_path, site):
    out = check(run_python, tmp_path, site, '''
        import fakefw_ckpt
        out["available"] = registry.available_adapters()
        out["get"] = registry.get_adapter("fakefw") is fakefw_ckpt.ADAPTER
        out["for"] = registry.adapter_for(fakefw_ckpt.FakeModel()) is fakefw_ckpt.ADAPTER
    ''')
    assert "fakefw" in out["available"] and out["get"] and out["for"]
    assert "fakefw_broken" not in out["available"] and "fakefw_half" not in out["available"]


@pytest.mark.slow
def test_fake_adapter_saves_and_loads_through_the_api(run_python, tmp_path, site):
    out = check(run_python, tmp_path, site, f'''
        import ckptcore, fakefw_ckpt
        m = fakefw_ckpt.FakeModel()
        info = ckptcore.save_state({str(tmp_path / "ckpt")!r}, model=m)
        fresh = fakefw_ckpt.FakeModel()
        fresh.w[:] = 0
        ckptcore.load_state({str(tmp_path / "ckpt")!r}, model=fresh)
        out["framework"] = info.framework
        out["w"] = fresh.w.tolist()
    ''')
    assert out["framework"] == "fakefw" and out["w"] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.slow
def test_adapter_failing_to_import_is_reported_and_logged(run_python, tmp_path, site):
    out = check(run_python, tmp_path, site, '''
        try:
            registry.get_adapter("fakefw_broken")
        except AdapterNotFoundError as e:
            out["error"] = str(e)
            out["lookup"] = isinstance(e, LookupError)
        out["others"] = registry.get_adapter("fakefw").name
    ''')
    assert "installed but failed to load" in out["error"]
    assert "ImportError: fakefw_broken needs libfake 2.0" in out["error"] and out["lookup"]
    assert out["others"] == "fakefw"
    assert any("fakefw_broken" in r and "libfake 2.0" in r for r in out["log"]), out["log"]


@pytest.mark.slow
def test_adapter_lacking_contract_members_is_reported(run_python, tmp_path, site):
    out = check(run_python, tmp_path, site, '''
        try:
            registry.get_adapter("fakefw_half")
        except AdapterNotFoundError as e:
            out["error"] = str(e)
        out["others"] = registry.get_adapter("fakefw").name
    ''')
    assert "fakefw_half:ADAPTER lacks capture_views, dialect, formats, demo" in out["error"], out
    assert out["others"] == "fakefw"
    assert any("fakefw_half" in r for r in out["log"])


@pytest.mark.slow
def test_unknown_names_and_objects_are_adapter_not_found(run_python, tmp_path, site):
    out = check(run_python, tmp_path, site, '''
        try:
            registry.get_adapter("nosuchfw")
        except AdapterNotFoundError as e:
            out["name"] = str(e)
        class Stranger: pass
        try:
            registry.adapter_for(Stranger())
        except AdapterNotFoundError as e:
            out["object"] = str(e)
    ''')
    assert "no ckptcore adapter named 'nosuchfw'" in out["name"]
    assert "register" in out["name"] and "ckptcore.adapters" in out["name"]
    assert "__main__.Stranger" in out["object"] and "fakefw" in out["object"]


@pytest.mark.slow
def test_import_ckptcore_loads_no_adapter(run_python, tmp_path, site):
    out = check(run_python, tmp_path, site, '''
        import ckptcore
        out["loaded"] = sorted(m for m in sys.modules if m.startswith(("fakefw", "ckptcore_")))
        out["pytest"] = "pytest" in sys.modules
    ''')
    assert out == {"loaded": [], "pytest": False, "log": []}
