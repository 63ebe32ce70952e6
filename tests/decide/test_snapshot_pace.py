"""The snapshot tier's pace (trainguard/decide/snapshot_pace.py): the interval stretches until the snapshots
cost at most the budget's share of the time, from the medians of the rank's own records, and never goes
below the interval it was given."""

from __future__ import annotations

import math

from trainguard import event_types
from trainguard.decide.snapshot_pace import MIN_SAMPLES, STEP_SAMPLES, SnapshotPace, paced_every


def saved(step: int, blocking: float, write: float) -> dict:
    return {"event": {"type": event_types.SNAPSHOT_SAVED, "step": step, "blocking_seconds": blocking,
                      "write_seconds": write}}


def replicated(step: int, seconds: float) -> dict:
    return {"event": {"type": event_types.SNAPSHOT_REPLICATED, "step": step, "seconds": seconds}}


def stepped(seconds: float) -> dict:
    return {"step": 1, "metrics": {"step_time_seconds": seconds}}


def fed(pace: SnapshotPace, snapshots: int, steps: int, step_seconds: float = 0.1) -> SnapshotPace:
    for n in range(snapshots):
        pace.observe(saved(5 * n, 0.01, 0.03))
        pace.observe(replicated(5 * n, 0.02))
    for _ in range(steps):
        pace.observe(stepped(step_seconds))
    return pace


def test_the_interval_is_the_fewest_steps_that_keep_the_cost_within_the_budget():
    assert paced_every(5, cost_seconds=0.06, step_seconds=0.1, budget=0.02) == 30     # 0.06 / 0.002
    assert paced_every(5, cost_seconds=0.001, step_seconds=0.1, budget=0.02) == 5     # cheap: as given
    assert paced_every(5, cost_seconds=0.062, step_seconds=0.1, budget=0.02) == 35    # 31, up to a multiple of 5
    assert paced_every(5, cost_seconds=0.0, step_seconds=0.1, budget=0.02) == 5
    assert paced_every(5, cost_seconds=0.06, step_seconds=0.1, budget=0.0) == 5       # off


def test_on_a_cpu_run_the_writing_and_the_replication_count_on_a_gpu_only_the_blocking():
    cpu = fed(SnapshotPace(0.02), MIN_SAMPLES, MIN_SAMPLES)
    assert cpu.every(5) == math.ceil((0.01 + 0.03 + 0.02) / (0.02 * 0.1)) == 30
    gpu = fed(SnapshotPace(0.02, counts_beside=False), MIN_SAMPLES, MIN_SAMPLES)
    assert gpu.every(5) == 5                       # 0.01 s blocking: every 5 steps is within 2%
    assert gpu.inputs() == {"cost_seconds": 0.01, "step_seconds": 0.1, "budget": 0.02}


def test_nothing_moves_before_enough_samples_or_for_a_wobble():
    assert fed(SnapshotPace(0.02), MIN_SAMPLES - 1, 50).every(5) == 5
    assert fed(SnapshotPace(0.02), MIN_SAMPLES, MIN_SAMPLES - 1).every(5) == 5
    pace = fed(SnapshotPace(0.02), MIN_SAMPLES, MIN_SAMPLES)
    assert pace.every(5) == 30
    fed(pace, 0, STEP_SAMPLES, step_seconds=0.075)               # steps faster: 40 by the rule, within 50%
    assert pace.every(5) == 30
    fed(pace, 0, STEP_SAMPLES, step_seconds=0.3)                 # three times slower: 10
    assert pace.every(5) == 10
    assert pace.every(20) == 20                                  # never below the interval given

