"""ruff over the whole tree (pyproject.toml [tool.ruff]: pyflakes and bugbear, the rules that find bugs).

Skipped only where ruff is not installed (it is in the dev extras); under CI=true a missing ruff fails."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_tree_is_clean_under_ruff():
    if importlib.util.find_spec("ruff") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("ruff is not installed (pip install -e '.[dev]')")
        pytest.skip("ruff is not installed")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
