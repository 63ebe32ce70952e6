"""Dependencies point one way: the core (the trainguard/ folder) imports none of the packages built on it.

agent/, trainer/, protect/ and preflight/ (installed as trainguard.agent, trainguard.trainer, ...) use
the core; the core uses none of them, so decide/, replay/, report/, diagnose/, formats/, metrics/ and the
run directory's contract can be read, tested and reused without a trainer or an agent. The command line
(trainguard/cli.py) reaches every command through the module name in its table, imported when the
command runs; the command modules of trainguard/ (`*_cli.py`) may import an outer package inside the
function that runs the command (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "trainguard"
OUTER = ("trainguard.agent", "trainguard.trainer", "trainguard.protect", "trainguard.preflight")
OUTER_FOLDERS = ("agent", "trainer", "protect", "preflight")


def imported_modules(tree: ast.AST, package: str) -> list[tuple[ast.stmt, str, bool]]:
    """(statement, module, at module level) of every import in `tree` (relative ones resolved)."""
    found = []
    top_level = {id(node) for node in getattr(tree, "body", [])}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node, alias.name, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
            found += [(node, name, id(node) in top_level) for name in [base, *names]]
    return found


def outer(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in OUTER)


def is_command(path: Path) -> bool:
    return path.parent == CORE and (path.name == "cli.py" or path.name.endswith("_cli.py"))


def violations() -> list[str]:
    problems = []
    for path in sorted(CORE.rglob("*.py")):
        relative = path.relative_to(ROOT)
        package = ".".join(relative.with_suffix("").parts[:-1])
        tree = ast.parse(path.read_text(), str(relative))
        for node, module, at_top in imported_modules(tree, package):
            if not outer(module):
                continue
            if is_command(path) and not at_top:
                continue      # a command imports the outer package it runs, when it runs
            problems.append(f"{relative}:{node.lineno}: imports {module}")
    return sorted(set(problems))


def test_the_core_imports_no_outer_package():
    assert violations() == []


def test_the_outer_packages_are_not_inside_the_core():
    """An outer package moved into trainguard/ would pass the check above without being core."""
    assert not [name for name in OUTER_FOLDERS if (CORE / name).exists()]
    assert all((ROOT / name / "__init__.py").exists() for name in OUTER_FOLDERS)


def test_the_check_finds_an_import_of_the_agent(tmp_path):
    """The walk sees absolute, relative and nested imports (so the test above can fail)."""
    source = ("import trainguard.agent.restore\nfrom ..agent import tail\n"
              "def f():\n    from trainguard.trainer.control import ControlChannel\n")
    found = [module for _, module, _ in imported_modules(ast.parse(source), "trainguard.replay") if outer(module)]
    assert {"trainguard.agent.restore", "trainguard.agent", "trainguard.trainer.control"} <= set(found)
