"""The modules of kestrel import each other without a cycle.

The graph is read from the source with `ast`, counting every import a run can execute: at module level
and inside functions alike (a function-level import only hides a cycle until the function runs).
Imports under `if TYPE_CHECKING:` are left out: they are annotations, and never run.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "kestrel"


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (a package is its __init__)."""
    files = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST):
    """Every Import / ImportFrom node, skipping the bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is one of our modules."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if (prefix := ".".join(parts[:end])) in modules:
            return prefix
    return None


def imports_of(module: str, modules: dict[str, Path]) -> set[str]:
    """The kestrel modules `module` imports. `from pkg import name` counts as pkg.name when that is a
    module (a submodule import), else as pkg; relative imports are resolved against the module's package."""
    path = modules[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in _runtime_imports(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        found.update(owner for t in targets if (owner := _owner(t, modules)) is not None)
    found.discard(module)
    return found


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    modules = module_files(root, package)
    return {m: imports_of(m, modules) for m in modules}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None: a depth-first search that meets a module on its own path."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_kestrel_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_config_imports_no_subsystem():
    """config.py is plain data: resolving it (which calls every subsystem) lives in config_resolve."""
    assert imports_of("kestrel.config", module_files()) == set()


@pytest.fixture
def tiny_package(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n"
                              "def f():\n    from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("from ..c import thing\n")
    (pkg / "c.py").write_text("import os\nthing = 1\n")
    return tmp_path


def test_the_graph_sees_function_level_and_relative_imports_but_not_type_checking_ones(tiny_package):
    graph = import_graph(tiny_package, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b"}  # `from .sub import b` is the module b, inside f
    assert graph["pkg.sub.b"] == {"pkg.c"}  # `from ..c import thing`: a name, so the module c
    assert find_cycle(graph) is None


def test_a_cycle_is_found_and_spelled_out(tiny_package):
    (tiny_package / "pkg" / "c.py").write_text("def g():\n    import pkg.a\n")
    assert find_cycle(import_graph(tiny_package, "pkg")) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
