"""Dependencies point one way, between every top-level package: a matrix declared once, checked whole.

setup.py's ROOTS names the top-level packages (the core `trainguard/`, and runtime/, protect/, trainer/,
agent/, preflight/, alerts/, dashboards/, demo/ installed as trainguard.runtime, ...). BUILDS_ON below
says what each one is built on; a package may import the packages under it, directly or through others,
and nothing else. Every import counts: absolute, relative, at module level and inside functions. The one
exception is the command line's: a command module named in trainguard/cli.py's table (COMMANDS) may
import any package inside the function that runs the command, because the table imports it only when
that command runs (docs/architecture.md, "Layers"). A package missing from BUILDS_ON, an import against
it and a cycle between top-level packages (declared or found) each fail, naming file, line and module.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# package -> the packages it is built on (each may import those, and what they may import, transitively).
BUILDS_ON: dict[str, tuple[str, ...]] = {
    "trainguard": (),                    # the core: tls, policy, actions, rundir, decide, metrics, replay...
    "runtime": ("trainguard",),          # what the running job's two sides share: checkpoints, control...
    "protect": ("runtime",),             # the protection library any loop calls
    "trainer": ("protect",),             # the bundled loop, built on the library's public API
    "agent": ("runtime",),               # the node's sidecar: nothing of the trainer or the library
    "preflight": ("agent", "trainer"),   # runs the real parts it vouches for
    "alerts": ("trainguard",),           # the generated rules and route
    "dashboards": ("alerts",),           # boards whose panels show the alerts
    "demo": ("alerts",),                 # the whole product on one machine (the others as processes)
}


def roots(root: Path = ROOT) -> dict[str, str]:
    """setup.py's ROOTS as {package: folder} by short name ("trainguard" for the core, "agent", ...)."""
    tree = ast.parse((root / "setup.py").read_text())
    table = next(node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "ROOTS" for t in node.targets))
    return {name.rpartition(".")[2]: folder for name, folder in ast.literal_eval(table).items()}


def may_import(builds_on: dict[str, tuple[str, ...]] = BUILDS_ON) -> dict[str, set[str]]:
    """package -> every package it may import: itself and all it is built on, transitively."""
    allowed: dict[str, set[str]] = {}
    for package in builds_on:
        seen, todo = {package}, list(builds_on[package])
        while todo:
            below = todo.pop()
            if below not in seen:
                seen.add(below)
                todo += builds_on.get(below, ())
        allowed[package] = seen
    return allowed


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


def package_of(module: str, packages: dict[str, str]) -> str | None:
    """The top-level package a module name belongs to; None outside trainguard. A folder's bare name
    (`import agent`) counts as that package: it resolves only in a checkout, never installed."""
    parts = module.split(".")
    if parts[0] == "trainguard":
        return parts[1] if len(parts) > 1 and parts[1] in packages and parts[1] != "trainguard" else "trainguard"
    bare = {folder: name for name, folder in packages.items() if name != "trainguard"}
    return bare.get(parts[0])


def commands(root: Path = ROOT) -> set[str]:
    """The module names in trainguard/cli.py's COMMANDS table."""
    tree = ast.parse((root / "trainguard" / "cli.py").read_text())
    table = next(node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "COMMANDS" for t in node.targets))
    return {module for module, _ in ast.literal_eval(table).values()}


@functools.lru_cache(maxsize=None)   # the tree is read once per session, however many tests ask
def imports(root: Path = ROOT) -> list[tuple[str, str, str, bool]]:
    """(importer, imported, "file:line: imports module", by a command when it runs) of every import of
    one top-level package by another."""
    packages, command_modules, found = roots(root), commands(root), []
    for name, folder in packages.items():
        prefix = "trainguard" if name == "trainguard" else f"trainguard.{name}"
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root / folder).with_suffix("")
            parts = [prefix, *relative.parts]
            is_package = parts[-1] == "__init__"
            module = ".".join(parts[:-1] if is_package else parts)
            package = module if is_package else module.rpartition(".")[0]
            tree = ast.parse(path.read_text(), str(path))
            for node, imported, at_top in imported_modules(tree, package):
                target = package_of(imported, packages)
                if target is None or target == name:
                    continue
                where = f"{path.relative_to(root)}:{node.lineno}: imports {imported}"
                found.append((name, target, where, module in command_modules and not at_top))
    return found


def violations(root: Path = ROOT, builds_on: dict[str, tuple[str, ...]] = BUILDS_ON) -> list[str]:
    allowed = may_import(builds_on)
    return sorted({f"{where} ({importer} may import {', '.join(sorted(allowed.get(importer, ())))})"
                   for importer, target, where, by_command in imports(root)
                   if not by_command and target not in allowed.get(importer, ())})


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """Every cycle in a directed graph, each once, as [a, b, ..., a] starting from its smallest name."""
    graph: dict[str, set[str]] = {}
    for source, target in edges:
        graph.setdefault(source, set()).add(target)
    found: set[tuple[str, ...]] = set()

    def walk(path: list[str]) -> None:
        for following in sorted(graph.get(path[-1], ())):
            if following == path[0]:
                found.add(tuple(path))
            elif following not in path and following > path[0]:
                walk(path + [following])

    for start in sorted(graph):
        walk([start])
    return [[*cycle, cycle[0]] for cycle in sorted(found)]


def test_every_top_level_package_has_its_row():
    """A package setup.py installs and the matrix leaves out would be checked against nothing."""
    assert set(roots()) == set(BUILDS_ON)
    assert all(below in BUILDS_ON for row in BUILDS_ON.values() for below in row)


def test_the_declared_layers_have_no_cycle():
    declared = {(package, below) for package, row in BUILDS_ON.items() for below in row}
    assert cycles(declared) == []


def test_every_import_between_packages_follows_the_layers():
    assert violations() == []


def test_no_cycle_between_top_level_packages():
    """Implied by the two tests above while BUILDS_ON is acyclic; checked on the imports themselves so a
    cycle is named as one, path and all, whatever the declaration says."""
    found = imports(ROOT)
    edges = {(importer, target) for importer, target, _, by_command in found if not by_command}
    assert [" -> ".join(cycle) + ": " + "; ".join(sorted({where for i, t, where, c in found if not c
                                                          and (i, t) in zip(cycle, cycle[1:])}))
            for cycle in cycles(edges)] == []


def test_the_architecture_page_shows_this_matrix():
    """docs/architecture.md's table of the layers is this declaration, row for row."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = {}
    for line in text.split("## Layers", 1)[1].splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and cells[0] in BUILDS_ON:
            built_on = set() if cells[1] == "(nothing)" else {name.strip() for name in cells[1].split(",")}
            below = set() if cells[2] == "the core only" else {name.strip() for name in cells[2].split(",")}
            rows[cells[0]] = (built_on, below)
    allowed = may_import()
    assert rows == {package: (set(row), allowed[package] - {package}) for package, row in BUILDS_ON.items()}


def test_every_command_is_the_cli_module_of_its_package():
    """Where a command lives (docs/architecture.md): its package's `cli.py`, a second one `<command>_cli.py`
    beside it; none in the core's root, whose one command module is the dispatcher."""
    table = commands()
    for module in sorted(table):
        package, _, name = module.rpartition(".")
        assert package != "trainguard", f"{module}: a command in the core's root"
        assert name == "cli" or (name.endswith("_cli") and f"{package}.cli" in table), module
    stray = [path.name for path in (ROOT / "trainguard").glob("*cli.py") if path.name != "cli.py"]
    assert stray == []


def test_the_packages_are_folders_of_their_own():
    """A package moved inside the core would be checked as core, not against its row."""
    packages = roots()
    assert not [name for name in packages if name != "trainguard" and (ROOT / "trainguard" / name).exists()]
    assert all((ROOT / folder / "__init__.py").exists() for folder in packages.values())


# ------------------------------------------------------------------------------------ the check can fail

def test_the_walk_sees_absolute_relative_and_nested_imports():
    source = ("import trainguard.agent.restore\nfrom ..agent import tail\n"
              "def f():\n    from trainguard.trainer.control import ControlChannel\n")
    found = {module for _, module, _ in imported_modules(ast.parse(source), "trainguard.replay")}
    assert {"trainguard.agent.restore", "trainguard.agent", "trainguard.trainer.control"} <= found


def planted(tmp_path: Path, folder: str, source: str, command: bool = False) -> Path:
    """A copy of setup.py's and cli.py's tables with one module planted in `folder`."""
    (tmp_path / "trainguard").mkdir(parents=True)
    (tmp_path / "setup.py").write_text((ROOT / "setup.py").read_text())
    cli = (ROOT / "trainguard" / "cli.py").read_text()
    if command:
        module = "trainguard.planted" if folder == "trainguard" else f"trainguard.{folder}.planted"
        cli = cli.replace("COMMANDS = {", f'COMMANDS = {{\n    "planted": ("{module}", ""),')
    (tmp_path / "trainguard" / "cli.py").write_text(cli)
    for package_folder in roots(tmp_path).values():
        (tmp_path / package_folder).mkdir(exist_ok=True)
    (tmp_path / folder / "planted.py").write_text(source)
    return tmp_path


def test_an_import_of_the_trainer_by_the_agent_is_found(tmp_path):
    root = planted(tmp_path, "agent", "def f():\n    from trainguard.trainer import loop\n")
    assert [v.split(" (")[0] for v in violations(root)] == [
        "agent/planted.py:2: imports trainguard.trainer", "agent/planted.py:2: imports trainguard.trainer.loop"]


def test_an_import_of_the_core_by_the_runtime_passes_and_of_protect_does_not(tmp_path):
    root = planted(tmp_path, "runtime", "from trainguard import rundir\nfrom ..protect import Protector\n")
    assert [v.split(" (")[0] for v in violations(root)] == [
        "runtime/planted.py:2: imports trainguard.protect", "runtime/planted.py:2: imports trainguard.protect.Protector"]


def test_a_bare_folder_name_counts_as_its_package(tmp_path):
    root = planted(tmp_path, "trainguard", "from agent import evidence\n")
    assert [v.split(" (")[0] for v in violations(root)] == [
        "trainguard/planted.py:1: imports agent", "trainguard/planted.py:1: imports agent.evidence"]


def test_a_command_may_import_when_it_runs_and_only_then(tmp_path):
    lazy = planted(tmp_path / "lazy", "trainguard", "def run(args):\n    from trainguard.agent import evidence\n",
                   command=True)
    assert violations(lazy) == []
    eager = planted(tmp_path / "eager", "trainguard", "from trainguard.agent import evidence\n", command=True)
    assert len(violations(eager)) == 2
    not_in_table = planted(tmp_path / "other", "trainguard", "def run(args):\n    from trainguard.agent import x\n")
    assert len(violations(not_in_table)) == 2


def test_a_cycle_is_found_and_named():
    assert cycles({("protect", "trainer"), ("trainer", "protect"), ("agent", "runtime")}) == [
        ["protect", "trainer", "protect"]]
    assert cycles({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == [["a", "b", "c", "a"]]


def test_a_declared_back_edge_is_a_cycle():
    declared = dict(BUILDS_ON, runtime=("trainguard", "protect"))
    edges = {(package, below) for package, row in declared.items() for below in row}
    assert ["protect", "runtime", "protect"] in cycles(edges)
