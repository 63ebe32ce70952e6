"""Steps with a loss and no gradient norm (`StepStats.grad_norm` None): DeepSpeed's `grad norm: 0.000`
placeholder, the MoE / random_ltd logs that print none, Megatron's loss-scale search intervals. The loss
rules decide them (NaN loss, the spike band, the warm-up spike, a level shift); the gradient rules pass
them and learn nothing; and replay's blocks (`batch.guard_block`) decide them exactly as `Guard.observe`."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.decide.test_columns import guard_state, healthy
from trainguard.decide import batch
from trainguard.decide.batch import Block
from trainguard.decide.guard import GradClimb, GradExplosion, Guard, LossDrift, StepStats


def loss_only(guard: Guard, losses, start: int = 1) -> list[tuple[int, str, str]]:
    found = []
    for step, loss in enumerate(losses, start):
        decision = guard.observe(StepStats(step, loss, None, None, float(step)))
        if decision:
            found.append((step, decision.action, decision.reason))
    return found


def falling(count: int, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    return (3.0 + 7.0 * np.exp(-np.arange(count) / 80.0) + rng.normal(0, 0.02, count)).tolist()


def test_a_healthy_loss_only_run_never_acts_and_the_gradient_rules_learn_nothing():
    guard = Guard()
    assert loss_only(guard, falling(2_000)) == []
    assert guard._rule_of(GradExplosion).ema is None and guard._rule_of(GradExplosion).good == 0
    assert len(guard._rule_of(GradClimb).window) == 0
    drift = guard._rule_of(LossDrift)
    assert drift.count == 0 and not drift.loss_means       # slow divergence needs both numbers (its docstring)


def test_a_nan_loss_without_a_gradient_norm_is_non_finite_and_counts():
    guard = Guard()
    found = loss_only(guard, falling(200) + [math.nan] * 3)
    assert found == [(201, "skip_step", "nan"), (202, "skip_step", "nan"), (203, "rollback", "repeated_nan")]


def test_a_loss_spike_without_a_gradient_norm_is_skipped_then_rolled_back():
    guard = Guard()
    losses = falling(300)
    found = loss_only(guard, losses + [5 * losses[-1]] * 3)
    assert found == [(301, "skip_step", "loss_spike"), (302, "skip_step", "loss_spike"),
                     (303, "rollback", "repeated_loss_spike")]


def test_a_warm_up_spike_without_a_gradient_norm_is_seen():
    """Megatron-DeepSpeed's real iteration 3: lm-loss 12.445 -> 41.03 with the placeholder norm."""
    assert loss_only(Guard(), [12.445, 41.03, 30.2]) == [(2, "skip_step", "warmup_spike"), (3, "skip_step", "warmup_spike")]


def test_a_level_shift_without_a_gradient_norm_is_accepted_not_rolled_back():
    guard = Guard()
    losses = falling(600)
    found = loss_only(guard, losses + [1.3 * loss for loss in losses[-300:]])
    assert found and {action for _, action, _ in found} == {"skip_step"}
    assert [notice["type"] for notice in guard.notices] == ["loss_level_shift"]


def test_an_absent_norm_leaves_the_gradient_statistics_as_they_were():
    guard = Guard()
    for step in range(1, 201):
        guard.observe(StepStats(step, 3.0, 1.0 + 0.01 * (step % 3), None, float(step)))
    before = guard._rule_of(GradExplosion).state_dict(), guard._rule_of(GradClimb).state_dict()
    for step in range(201, 260):
        assert not guard.observe(StepStats(step, 3.0, None, None, float(step)))
    assert (guard._rule_of(GradExplosion).state_dict(), guard._rule_of(GradClimb).state_dict()) == before
    # ... and the explosion rule still judges the next norm against them.
    assert guard.observe(StepStats(260, 3.0, 50.0, None, 260.0)).reason == "grad_explosion"


def masked_block(run: dict, absent) -> Block:
    grads = np.where(absent, np.nan, run["grads"])
    return Block(run["steps"], run["losses"], grads, run["times"], run["gpus"], run["codes"], run["seconds"],
                 ("node-0",), no_grad_norm=np.asarray(absent, dtype=bool))


def by_steps(guard: Guard, run: dict, absent) -> list:
    found = []
    for i, (step, loss, grad, when, gone) in enumerate(zip(run["steps"].tolist(), run["losses"].tolist(),
                                                           run["grads"].tolist(), run["times"].tolist(),
                                                           list(absent))):
        if decision := guard.observe(StepStats(step, loss, None if gone else grad, None, when)):
            found.append((i, decision))
    return found


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("pattern", ["all", "stretch", "sparse"])
def test_blocks_with_absent_norms_decide_as_the_step_loop(seed, pattern):
    """Three blocks in a row (the middle one with absent norms): the same decisions and state, to the bit,
    as `Guard.observe`; the NaN loss, the spikes and the explosion are found where they are."""
    rng = np.random.default_rng(seed)
    run = healthy(3_000, seed)
    run["losses"][[700, 1500, 2600]] *= rng.uniform(3, 8, 3)
    run["losses"][1200] = math.nan
    run["grads"][2300] *= 40
    absent = np.zeros(3_000, dtype=bool)
    middle = slice(1_000, 2_000)
    if pattern == "all":
        absent[middle] = True
    elif pattern == "stretch":
        absent[1_100:1_700] = True
    else:
        absent[middle] = rng.random(1_000) < 0.3
    guard, reference = Guard(), Guard()
    found = []
    for a, b in ((0, 1_000), (1_000, 2_000), (2_000, 3_000)):
        part = {key: value[a:b] for key, value in run.items()}
        found += [(a + i, decision) for i, decision in batch.guard_block(guard, masked_block(part, absent[a:b]))]
    assert repr(found) == repr(by_steps(reference, run, absent))
    assert guard_state(guard) == guard_state(reference)
    assert {1200} <= {i for i, decision in found if decision.reason == "nan"}
    assert 2300 in {i for i, _ in found}
