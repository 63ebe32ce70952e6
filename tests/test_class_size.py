"""No product class has more than 15 methods: a class that grows past it is doing several jobs, and is
split into parts, each passed what it needs (the executor: agent/action_log.py, dispatch.py,
evidence_first.py, action_metrics.py). Every `def` in a class body counts, properties and dunders too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("trainguard", "agent", "trainer", "runtime", "protect", "preflight", "alerts", "dashboards", "demo")
MOST_METHODS = 15


def large_classes(source: str, name: str) -> list[str]:
    """`name:line Class (N methods)` for each class of `source` with more than MOST_METHODS methods."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            methods = sum(isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) for item in node.body)
            if methods > MOST_METHODS:
                found.append(f"{name}:{node.lineno} {node.name} ({methods} methods)")
    return found


def test_no_product_class_has_more_than_15_methods():
    found = [large for root in PRODUCT for path in sorted((ROOT / root).rglob("*.py"))
             for large in large_classes(path.read_text(), path.relative_to(ROOT).as_posix())]
    assert not found, f"split these into parts of at most {MOST_METHODS} methods:\n" + "\n".join(found)


def test_the_scan_finds_a_planted_16_method_class_and_passes_15():
    def planted(count: int) -> str:
        methods = "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(count - 1))
        return f"class Planted:\n    @property\n    def p(self):\n        return 0\n{methods}"
    assert large_classes(planted(16), "planted.py") == ["planted.py:1 Planted (16 methods)"]
    assert large_classes(planted(15), "planted.py") == []
