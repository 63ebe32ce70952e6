"""The examples run as their headers and docs/integrations.md say, `python examples/NAME.py ...`: a script's
folder is its import path, so an example may import trainguard and its framework but no other example
(`from examples.hf_trainer import ...` was a ModuleNotFoundError). tests/test_wheel.py runs all three that
way from an installed wheel; this holds the rule and the copies each example carries."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NAMES = ("plain_loop", "hf_trainer", "lightning_module")


@pytest.mark.parametrize("name", NAMES)
def test_an_example_imports_no_other_example(name):
    tree = ast.parse((EXAMPLES / f"{name}.py").read_text())
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert [m for m in imported if m and m.split(".")[0] in ("examples", *NAMES)] == []
    assert f"python examples/{name}.py --run-dir" in ast.get_docstring(tree)


def test_the_examples_copies_of_faults_of_agree():
    sources = {name: ast.parse((EXAMPLES / f"{name}.py").read_text()) for name in NAMES}
    bodies = {name: next(ast.unparse(n.body[1:]) for n in tree.body if isinstance(n, ast.FunctionDef)
                         and n.name == "faults_of") for name, tree in sources.items()}
    assert len(set(bodies.values())) == 1, bodies      # the docstrings may differ, the code may not


def test_the_plain_loop_runs_as_documented_from_the_repository_root(tmp_path):
    done = subprocess.run([sys.executable, "examples/plain_loop.py", "--run-dir", str(tmp_path / "run"), "--steps", "4",
                           "--inject", "nan@2"], cwd=EXAMPLES.parent, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "TRAINGUARD_CHECKPOINT_KEY": str(tmp_path / "key")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exit_code=0" in done.stdout
