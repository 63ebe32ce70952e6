"""Where the library sits: the core package `trainguard/` imports neither torch, the trainer, the library
nor its runtime at import time (the agent, replay and the report run without torch), so the library lives
beside it."""

from __future__ import annotations

import subprocess
import sys

WALK = """
import pkgutil, sys, importlib, trainguard
for info in pkgutil.walk_packages(trainguard.__path__, "trainguard."):
    if info.name.split(".")[1] not in ("agent", "trainer", "protect", "alerts", "dashboards"):
        importlib.import_module(info.name)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith(("trainguard.protect", "trainguard.trainer",
                                                                     "trainguard.runtime"))))
"""


def test_core_modules_import_neither_torch_nor_trainer_nor_the_library():
    result = subprocess.run([sys.executable, "-c", WALK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_the_library_imports_without_the_bundled_trainer_loop():
    code = "import sys, trainguard.protect; print([m for m in sys.modules if m.startswith('trainguard.trainer.loop')])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
