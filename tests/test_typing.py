"""mypy, strict, over the pure decision core and the TLS codec (pyproject.toml [tool.mypy]:
trainguard/decide/, trainguard/tls.py).

Skipped only where mypy is not installed (it is in the dev extras); under CI=true a missing mypy fails."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_decision_core_type_checks_strictly():
    if importlib.util.find_spec("mypy") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("mypy is not installed (pip install -e '.[dev]')")
        pytest.skip("mypy is not installed")
    done = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
