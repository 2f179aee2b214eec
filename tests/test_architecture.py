"""docs/ARCHITECTURE.md is the map of the house: its module lists must match the tree."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def _section(title: str) -> str:
    start = DOC.index(title)
    end = DOC.find("\n## ", start + 1)
    return DOC[start:] if end < 0 else DOC[start:end]


def _named(text: str) -> set[str]:
    """Every ``name.py`` the text mentions (in tables, diagrams and prose)."""
    return set(re.findall(r"(?<![/\w])(_{0,2}[a-z][a-z0-9_]*\.py)\b", text))


def test_the_core_map_names_every_module_and_only_those():
    tree = {p.name for p in (ROOT / "ckptcore").glob("*.py") if p.name != "__init__.py"}
    named = _named(_section("## The core, in layers"))
    assert tree - named == set(), f"modules missing from ARCHITECTURE.md's core map: {tree - named}"
    assert named - tree == set(), f"ARCHITECTURE.md names modules that do not exist: {named - tree}"


def test_the_adapter_module_map_names_every_adapter_module():
    section = _section("## The adapter contract")
    named = _named(section)
    tree: set[str] = set()
    for pkg in (ROOT / "adapters").iterdir():
        if pkg.name.startswith("ckptcore_") and pkg.is_dir():
            tree |= {p.name for p in pkg.glob("*.py")}
    assert tree - named == set(), f"adapter modules missing from the module map: {tree - named}"
    assert named - tree == set(), f"the module map names modules no adapter has: {named - tree}"


def test_tests_readme_maps_every_core_module():
    text = (ROOT / "tests" / "README.md").read_text()
    tree = {p.name for p in (ROOT / "ckptcore").glob("*.py")}
    missing = {m for m in tree if m not in _named(text)}
    assert not missing, f"tests/README.md does not say which tests cover: {sorted(missing)}"


def test_the_checker_can_fail():
    assert _named("`_io.py` and manager.py, not ckptcore") == {"_io.py", "manager.py"}
