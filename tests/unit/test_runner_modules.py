"""The runner package's seams: bucket lookup of the graph runners, and an import graph without knots
(the graph runners and core/ never import the model runner)."""
from __future__ import annotations

import ast
from pathlib import Path

import kestrel
from kestrel.runner.graph_capture import batch_size_buckets, bucket_for

ROOT = Path(kestrel.__file__).parent


def test_buckets():
    assert batch_size_buckets(40) == [1, 2, 4, 8, 12, 16, 24, 32, 40]
    buckets = batch_size_buckets(64)
    assert [bucket_for(buckets, n) for n in (1, 3, 12, 13, 33, 64)] == [1, 4, 12, 16, 48, 64]


def imports(package: str) -> dict[str, set[str]]:
    """kestrel module -> the kestrel modules it imports anywhere in its text (function bodies too)."""
    graph = {}
    for path in (ROOT / package).glob("*.py"):
        module = f"kestrel.{package}.{path.stem}"
        graph[module] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kestrel"):
                graph[module].add(node.module)
            elif isinstance(node, ast.Import):
                graph[module] |= {a.name for a in node.names if a.name.startswith("kestrel")}
    return graph


def test_no_import_cycle_through_the_runner_and_core():
    graph = imports("runner") | imports("core")
    for module, targets in graph.items():
        if module.startswith("kestrel.core."):
            assert not {t for t in targets if t.startswith("kestrel.runner")}, module
        elif module != "kestrel.runner.model_runner" and module != "kestrel.runner.build":
            assert "kestrel.runner.model_runner" not in targets, module

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for t in graph.get(todo.pop(), ()):
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return seen

    assert not [m for m in graph if m in reach(m)]
