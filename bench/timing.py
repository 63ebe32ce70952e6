"""Timing helpers shared by the benches (each bench runs as `python bench/<name>.py`, so this imports)."""

from __future__ import annotations

import time
from typing import Callable


def best_of(repeat: int, run: Callable[[], object]) -> float:
    """The shortest wall time of `repeat` calls of `run`: the least disturbed by a shared machine."""
    best = float("inf")
    for _ in range(repeat):
        began = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - began)
    return best
