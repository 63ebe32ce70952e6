"""`straggler_windows` names a rank that stayed under the threshold for a stretch, not one whose dips on a
busy machine add up (the fail-slow e2e run named rank 0 beside the injected rank 1)."""

from __future__ import annotations

import random

from tests.diagnose import records
from trainguard.diagnose import diagnose_run

STEPS = 150
SLOW_RANK, SLOW_STEPS = 1, range(30, 70)        # slowrank@30:1: 4x for 40 steps, as the e2e run injects
BUSY_STEPS = (range(80, 92), range(110, 122), range(135, 147))   # rank 0 crowded out 12 steps at a time


def busy_machine(step: int, rank: int, rng: random.Random) -> records.Step:
    """Rank 1 injected 4x slower for 40 steps; later rank 0 loses its core to other work three times, 1.6x
    slower for 12 steps each; the waiting rank's comm time holds the wait, as in DDP."""
    s = records.healthy(step, rank, rng)
    factor = 4.0 if step in SLOW_STEPS else 1.6 if any(step in busy for busy in BUSY_STEPS) else 1.0
    slow = 1 if step in SLOW_STEPS else 0
    if factor > 1:
        if rank == slow:
            s.compute *= factor
        else:
            s.comm += s.compute * (factor - 1)
    return s


def test_only_a_rank_under_the_threshold_for_a_whole_window_in_a_row_is_named(tmp_path):
    records.write_ranks(tmp_path, records.run_of(busy_machine, steps=STEPS))
    [windows] = [f for f in diagnose_run(tmp_path) if f.check == "straggler_windows"]
    assert windows.evidence["lowest_score"]["0"] < 0.75          # rank 0 did dip under it, a few steps at a time
    assert windows.evidence["rank"] == SLOW_RANK and windows.evidence["stragglers"] == [SLOW_RANK], windows
    first, last = windows.evidence["steps"]
    assert SLOW_STEPS.start <= first and last <= SLOW_STEPS.stop + 16
