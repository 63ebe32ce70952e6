"""The gradient-climb rule (`trainguard.decide.guard.GradClimb`): a global norm that climbs smoothly from
0.8 to 12.7 over 30 steps (the seed's own case: "grad norm soared to 12.7, normal < 3") is caught during
the climb, where the EMA-based explosion rule follows it and never fires; a healthy run, its single
spikes and its short bursts are not."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from trainguard.decide import batch
from trainguard.decide.guard import Guard, StepStats
from trainguard.policy import GuardPolicy

CLIMB = [0.8 * (12.7 / 0.8) ** (k / 29) for k in range(30)]      # 0.8 .. 12.7, smoothly (geometric)
LINEAR = [0.8 + (12.7 - 0.8) * k / 29 for k in range(30)]


def healthy_norms(count: int, seed: int = 1, noisy: bool = False) -> list[float]:
    """Global norms of a healthy run: 0.8-0.9, or (noisy) 1-3 with now and then a spike of 4x."""
    rng = random.Random(seed)
    if not noisy:
        return [0.8 + 0.1 * rng.random() for _ in range(count)]
    return [(6.0 if rng.random() < 0.01 else 1.0 + 2.0 * rng.random()) for _ in range(count)]


def decide(norms: list[float], policy: GuardPolicy | None = None) -> list[tuple[int, str, str]]:
    guard = Guard(policy)
    found = []
    for step, norm in enumerate(norms):
        decision = guard.observe(StepStats(step, 3.0 + 0.01 * math.sin(step), norm, None, float(step)))
        if decision:
            found.append((step, decision.action, decision.reason))
    return found


@pytest.mark.parametrize("climb", [CLIMB, LINEAR], ids=["geometric", "linear"])
@pytest.mark.parametrize("noisy", [False, True])
def test_a_smooth_climb_to_12_7_is_caught_during_the_climb(climb, noisy):
    found = decide(healthy_norms(300, noisy=noisy) + climb + [12.7] * 5)     # ... and stays up there
    assert found, "the climb went through unflagged"
    first, action, reason = found[0]
    assert reason == "grad_climb" and action == "skip_step"
    assert 300 <= first < 300 + len(climb)                  # at the step, before the climb ends
    assert [a for _, a, _ in found[:3]] == ["skip_step", "skip_step", "rollback"]


def test_the_ema_rule_alone_would_follow_the_climb():
    """Why the rule exists: with the climb rule off (it needs more steps than the run has), nothing fires."""
    off = GuardPolicy(grad_climb_min_steps=10 ** 9)
    assert decide(healthy_norms(300) + CLIMB, off) == []


def test_a_healthy_run_with_spikes_and_a_short_burst_is_left_alone():
    norms = healthy_norms(2_000, noisy=True)
    norms[1_000:1_005] = [3.5, 4.2, 3.9, 4.7, 5.5]         # a burst of five steps (as healthy-long has)
    assert decide(norms) == []


def test_the_detail_names_the_norm_the_band_and_the_steps():
    guard = Guard()
    for step, norm in enumerate(healthy_norms(300) + CLIMB):
        decision = guard.observe(StepStats(step, 3.0, norm, None, float(step)))
        if decision:
            break
    assert decision.detail["grad_norm"] == norm and decision.detail["steps"] == GuardPolicy().grad_climb_steps
    assert 0.9 < decision.detail["threshold"] < norm


def test_its_state_round_trips_through_a_checkpoint():
    a, b = Guard(), Guard()
    for step, norm in enumerate(healthy_norms(300)):
        a.observe(StepStats(step, 3.0, norm, None, float(step)))
    b.load_state_dict(a.state_dict())
    for step, norm in enumerate(CLIMB, 300):
        assert a.observe(StepStats(step, 3.0, norm)) == b.observe(StepStats(step, 3.0, norm))


def test_replay_blocks_catch_it_at_the_same_step_as_the_live_guard():
    """The batch path (array screens, in bulk) decides the climb as the step loop does."""
    norms = np.array(healthy_norms(5_000) + CLIMB + healthy_norms(1_000, seed=2))
    n = len(norms)
    block = batch.Block(np.arange(n), 3.0 + 0.01 * np.sin(np.arange(n)), norms, np.arange(n, dtype=float),
                        np.zeros(n, dtype=np.int64), np.full(n, -1), np.full(n, np.nan), [])
    guard, by_steps = Guard(), Guard()
    found = batch.guard_block(guard, block)
    assert [(i, d.action, d.reason) for i, d in found][:1] == decide(norms.tolist())[:1]
    expected = [(i, d) for i, norm in enumerate(norms.tolist())
                if (d := by_steps.observe(StepStats(i, 3.0 + 0.01 * math.sin(i), norm, None, float(i))))]
    assert repr(found) == repr(expected)
    assert repr(guard.state_dict()) == repr(by_steps.state_dict())
