"""Every collector module, imported by an explicit list so each registers itself (see agent/collector.py).

A module that cannot be imported (not written yet, or a dependency missing) only makes that collector
unavailable: the reason is kept in `UNAVAILABLE` and the agent logs it in one line at start. Any other
error in a module (a SyntaxError, a bug at import) is loud, as it should be.
"""

from __future__ import annotations

import importlib

MODULES = ("gpu", "io", "ib", "nccl", "host", "training", "preflight", "health_reports")

# module name -> why it could not be imported
UNAVAILABLE: dict[str, str] = {}

for _module in MODULES:
    try:
        importlib.import_module(f"{__name__}.{_module}")
    except ImportError as exc:
        UNAVAILABLE[_module] = f"{type(exc).__name__}: {exc}"
