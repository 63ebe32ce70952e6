"""Action names are spelled once, in the action table (trainguard/actions.py): every other product module
imports them, so one search finds every place that decides, carries out, records or reads an action.

The scan: every string constant in product code equal to an action's name, outside trainguard/actions.py,
except docstrings (prose) and the few `ALLOWED` places where the same word names something else.
"""

from __future__ import annotations

import ast
from pathlib import Path

from trainguard import actions

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("trainguard", "agent", "trainer", "runtime", "protect", "preflight", "alerts", "dashboards", "demo")
OWNER = "trainguard/actions.py"

# (file, word): the same word in another vocabulary, owned there. Each entry says which.
ALLOWED = {
    # the cost meter's tier names (warn, throttle, stop): a tier, not the guard's stop action
    ("trainguard/decide/cost.py", "stop"),
    ("trainguard/metrics/training.py", "stop"),
    ("trainguard/report/html.py", "stop"),
    ("dashboards/build.py", "stop"),
    # subcommand names of the command line (`trainguard cordon`, `trainguard checkpoint restore`)
    ("trainguard/cli.py", "cordon"),
    ("runtime/checkpoint/cli.py", "restore"),
    # the run directory's folder of cordon files, RUN/control/cordon/ (rundir owns its paths)
    ("trainguard/rundir.py", "cordon"),
    # what a file is, in an error message (safe_read's `what`): "cordon: too large"
    ("trainguard/cordon/__init__.py", "cordon"),
    # the report's marker kinds, named after what they mark (a rollback, a restart from a checkpoint)
    ("trainguard/report/html.py", "rollback"),
    ("trainguard/report/html.py", "restore"),
    ("trainguard/report/charts.py", "rollback"),
    ("trainguard/report/charts.py", "restore"),
    ("trainguard/report/data.py", "rollback"),
    ("trainguard/report/data.py", "restore"),
    # a field of an incident's record and of replay's replica verdict: the hosts cordoned
    ("trainer/replica_check.py", "cordon"),
    ("trainguard/replay/replica.py", "cordon"),
}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def spelled(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, word) of every string constant of `source` equal to one of `names`, docstrings left out."""
    tree = ast.parse(source)
    prose = _docstrings(tree)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
            and id(node) not in prose]


def stray_names(names: set[str]) -> list[str]:
    found = []
    for path in sorted(p for root in PRODUCT for p in (ROOT / root).rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative == OWNER:
            continue
        for line, word in spelled(path.read_text(), names):
            if (relative, word) not in ALLOWED:
                found.append(f"{relative}:{line}: {word!r}")
    return found


def test_no_product_module_spells_an_action_name():
    stray = stray_names(set(actions.BY_NAME))
    assert not stray, "import the name from trainguard/actions.py instead:\n" + "\n".join(stray)


def test_every_allowed_place_still_spells_its_word():
    """An allowance nothing needs any more is removed, so the list stays the reasoned minimum."""
    needed = {(path, word) for path, word in ALLOWED
              if any(w == word for _, w in spelled((ROOT / path).read_text(), {word}))}
    assert needed == ALLOWED, sorted(ALLOWED - needed)


def test_the_scan_finds_a_planted_name_and_leaves_docstrings_alone():
    source = '"""A rollback module: "rollback" in prose."""\n\ndef f(event):\n    """restore"""\n' \
             '    return event.get("type") == "rollback"\n'
    assert spelled(source, set(actions.BY_NAME)) == [(5, "rollback")]
