"""Shared by every test directory: the repository root on sys.path, so ``tests.servers`` and other
helpers import the same way under ``pytest`` and ``python -m pytest``."""

import sys
from pathlib import Path

import pytest
import structlog

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(autouse=True)
def _fresh_logging():
    """`trainguard.cli.main` points structlog at the stream of the moment (capsys's, closed afterwards)."""
    yield
    structlog.reset_defaults()
