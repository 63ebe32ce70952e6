"""Shared by every test directory: the repository root on sys.path, so ``tests.servers`` and other
helpers import the same way under ``pytest`` and ``python -m pytest``."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
