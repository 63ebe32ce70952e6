"""Run a dev-extras tool (mypy, ruff) over the repository; skipped where it is not installed, failed
under CI=true (where `scripts/setup` installs the dev extras)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_dev_tool(module: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(module) is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{module} is not installed (pip install -e '.[dev]')")
        pytest.skip(f"{module} is not installed")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
