"""Module boundaries, checked on the source (AST), not by importing it:

(a) no module of ``ckptcore/`` uses another one's underscore names: ``from ._x import _y``,
    ``_x._y``, or a private attribute (``obj._y``) that the using module does not define itself
    (a private method of another module's class);
(b) no module of ``adapters/`` imports a private ``ckptcore._...`` module or name: what adapters
    need is public in ``ckptcore.adapter``;
(c) the modules of ``ckptcore/`` import each other without a cycle, counting imports inside
    functions and under ``TYPE_CHECKING``.

Each check is a function over a folder, so the tests at the end also run it on planted trees
(tmp_path), where it must find what was planted: none of these checks passes by finding nothing.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "ckptcore"
ADAPTERS = REPO / "adapters"

# Private names of other libraries the core calls on purpose: the standard library's frame
# access (warning stack levels), its atexit hook that runs before threads are joined, and the
# pure-Python unpickler (ckptcore/_unpickle.py checks each opcode of a native checkpoint file
# that is a pickle; the C unpickler offers no such hook) with its end-of-pickle signal.
STDLIB_PRIVATE = {("sys", "_getframe"), ("threading", "_register_atexit"),
                  ("pickle", "_Unpickler"), ("pickle", "_Stop")}
# fsspec's async filesystem API (``_cat_file``: one coroutine per piece of a ranged read) and
# s3fs's request call (``_call_s3``: the multipart upload API): documented for implementers and
# callers of async filesystems, underscore-named by fsspec's convention, not ckptcore's.
FOREIGN_PRIVATE = {"_cat_file", "_call_s3"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package`` (its folder's name is the
    package's name)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _target(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` in ``module`` (file ``path``) names."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _own_names(tree: ast.AST) -> set[str]:
    """The underscore names a module defines itself: functions, classes, assigned names, its
    classes' ``self._x``/``cls._x`` attributes and ``__slots__``, parameters."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            own.add(node.attr)
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            own.update(c.value for c in ast.walk(node.value)
                       if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return {n for n in own if _private(n)}


def private_uses(package: Path) -> list[str]:
    """Every use, in a module of ``package``, of another module's underscore name (check a)."""
    modules = _modules(package)
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(package.parent)
        aliases: dict[str, str] = {}  # local name -> package module it is bound to
        stdlib: dict[str, str] = {}  # local name -> standard-library module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _target(module, path, node)
                for a in node.names:
                    local = a.asname or a.name
                    if f"{target}.{a.name}" in modules:
                        aliases[local] = f"{target}.{a.name}"  # a module: fine to import
                    elif target in modules and target != module and _private(a.name):
                        found.append(f"{where}:{node.lineno}: from {target} import {a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in modules:
                        aliases[a.asname or a.name.split(".")[0]] = a.name
                    elif a.asname is None:
                        stdlib[a.name] = a.name
        own = _own_names(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            value = node.value
            if isinstance(value, ast.Name):
                if value.id in aliases and value.id not in own:
                    found.append(f"{where}:{node.lineno}: {value.id}.{node.attr} "
                                 f"(a private name of {aliases[value.id]})")
                    continue
                if value.id in ("self", "cls"):
                    continue
                if (stdlib.get(value.id), node.attr) in STDLIB_PRIVATE:
                    continue
            if node.attr in own or node.attr in FOREIGN_PRIVATE:
                continue
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)} (a private attribute this "
                         "module does not define)")
    return found


def adapter_private_imports(adapters: Path, core: str = "ckptcore") -> list[str]:
    """Every import of a private module or name of ``core`` in ``adapters`` (check b): import
    statements anywhere (functions included) and ``ckptcore._x`` attribute access."""
    found = []
    for path in sorted(adapters.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(adapters.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                parts = node.module.split(".")
                if parts[0] != core:
                    continue
                if any(_private(p) for p in parts[1:]):
                    found.append(f"{where}:{node.lineno}: from {node.module} import ...")
                found += [f"{where}:{node.lineno}: from {node.module} import {a.name}"
                          for a in node.names if _private(a.name)]
            elif isinstance(node, ast.Import):
                found += [f"{where}:{node.lineno}: import {a.name}" for a in node.names
                          if a.name.split(".")[0] == core
                          and any(_private(p) for p in a.name.split(".")[1:])]
            elif (isinstance(node, ast.Attribute) and _private(node.attr)
                  and ast.unparse(node.value).split(".")[0] == core):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in it (functions, TYPE_CHECKING)."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                target = _target(module, path, node)
                for a in node.names:
                    deps.add(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[module] = {d for d in deps if d in modules and d != module}
    return graph


def import_cycles(package: Path) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each strongly connected group of ``package``'s
    modules that import each other (check c); empty when the imports form no cycle."""
    graph = import_graph(package)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for group in groups:  # a shortest way back to the group's first module, for the message
        start = min(group)
        paths = {start: [start]}
        frontier = [start]
        while frontier and start not in [w for v in frontier for w in graph[v]]:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & group):
                    if w not in paths:
                        paths[w] = paths[v] + [w]
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if start in graph[v])
        cycles.append(paths[last] + [start])
    return sorted(cycles)


# -- the checks on this repository ----------------------------------------------------------------

def test_no_module_of_the_core_uses_another_ones_private_names():
    found = private_uses(CORE)
    assert not found, "underscore names used across modules (make them public in their module):\n" \
        + "\n".join(found)


def test_adapters_import_nothing_private_from_the_core():
    found = adapter_private_imports(ADAPTERS)
    assert not found, "adapters import private core modules (use ckptcore.adapter):\n" \
        + "\n".join(found)


def test_the_core_modules_import_each_other_without_a_cycle():
    cycles = import_cycles(CORE)
    graph = import_graph(CORE)
    knots = []
    for cycle in cycles:  # the whole knot each cycle belongs to, import by import
        group = {m for m in graph if cycle[0] in _reach(graph, m) and m in _reach(graph, cycle[0])}
        knots += [f"    {m} imports {', '.join(sorted(graph[m] & group))}" for m in sorted(group)]
    assert not cycles, "import cycles among ckptcore's modules:\n" \
        + "\n".join(" -> ".join(c) for c in cycles) + "\n  the modules in them:\n" + "\n".join(knots)


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


# -- each check finds what is planted ---------------------------------------------------------------

def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


CLEAN_CORE = {
    "pkg/__init__.py": "from . import _a\n",
    "pkg/_a.py": """
        import sys
        import threading
        from . import _b
        from ._b import helper

        class Box:
            __slots__ = ("_held",)

            def _beat(self):
                return self._held

        def _go(box, fs):
            box._beat()                      # its own class's private method: fine
            fs._cat_file("x")                # fsspec's async API: allowed by name
            threading._register_atexit(print)
            return sys._getframe(0), _b.helper(), helper()
        """,
    "pkg/_b.py": """
        from typing import TYPE_CHECKING

        def helper():
            return 1
        """,
}


@pytest.mark.parametrize("planted, expected", [
    ({"pkg/_b.py": "def _hidden(): pass\n", "pkg/_c.py": "from ._b import _hidden\n"},
     "pkg/_c.py:1: from pkg._b import _hidden"),
    ({"pkg/_b.py": "def _hidden(): pass\n", "pkg/_c.py": "from . import _b\nx = _b._hidden\n"},
     "pkg/_c.py:2: _b._hidden"),
    ({"pkg/_b.py": "class S:\n    def _remote(self): pass\n",
      "pkg/_c.py": "def f(store):\n    store._remote()\n"},
     "pkg/_c.py:2: store._remote"),
    ({"pkg/_c.py": "import os\nos._exit(0)\n"}, "pkg/_c.py:2: os._exit"),
    ({"pkg/sub/__init__.py": "", "pkg/sub/_d.py": "from .._b import _q\n",
      "pkg/_b.py": "_q = 1\n"}, "pkg/sub/_d.py:1: from pkg._b import _q"),
])
def test_check_a_finds_planted_private_uses(tmp_path, planted, expected):
    package = _tree(tmp_path, CLEAN_CORE) / "pkg"
    assert private_uses(package) == []
    _tree(tmp_path, planted)
    found = private_uses(package)
    assert any(f.startswith(expected) for f in found), found


@pytest.mark.parametrize("source", [
    "from ckptcore import _knobs\n",
    "from ckptcore._codec import parse_dtype\n",
    "import ckptcore._storage\n",
    "from ckptcore.migrate import _layouts\n",
    "def f():\n    from ckptcore import _codec\n    return _codec\n",
    "import ckptcore\nx = ckptcore._knobs.get('threads')\n",
])
def test_check_b_finds_planted_private_imports(tmp_path, source):
    adapters = _tree(tmp_path, {"adapters/fw/__init__.py": "from ckptcore.adapter import knobs\n",
                                "adapters/fw/_ok.py": "import ckptcore\nfrom ckptcore import api\n"}
                     ) / "adapters"
    assert adapter_private_imports(adapters) == []
    _tree(tmp_path, {"adapters/fw/_bad.py": source})
    assert adapter_private_imports(adapters), source


@pytest.mark.parametrize("planted, cycle", [
    ({"pkg/_b.py": "from . import _a\n"}, ["pkg._a", "pkg._b", "pkg._a"]),
    ({"pkg/_b.py": "def f():\n    from ._a import Box\n"}, ["pkg._a", "pkg._b", "pkg._a"]),
    ({"pkg/_b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._c import X\n",
      "pkg/_c.py": "from .sub import y\n", "pkg/sub/__init__.py": "from .. import _a\n"},
     ["pkg._a", "pkg._b", "pkg._c", "pkg.sub", "pkg._a"]),
])
def test_check_c_finds_planted_cycles(tmp_path, planted, cycle):
    package = _tree(tmp_path, CLEAN_CORE) / "pkg"
    assert import_cycles(package) == []
    _tree(tmp_path, planted)
    assert import_cycles(package) == [cycle]
