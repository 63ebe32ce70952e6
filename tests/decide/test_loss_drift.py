"""The guard on the soak's healthy shape (tests/efficacy/corpus.py `soak_healthy`: the tiny model reading
text files in order, whose fault-free reference the old rules rolled back and skipped): `LossDrift` needs a
climb of the loss and of the gradient norm, floors from pairs of chunks and two climbing chunks in a row;
a loss above its band beside a normal gradient norm is a hard batch, not skipped. And the replay screens of
the changed rule decide as its own step loop, to the bit."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.decide.test_columns import block, guard_many, guard_state, healthy
from tests.efficacy import corpus
from tests.property.conftest import examples
from trainguard.decide import batch
from trainguard.decide.arrays import pair_floors
from trainguard.decide.guard import Guard, LossDrift, LossSpike, StepStats, pair_floor
from trainguard.policy import GuardPolicy


def soak_columns(seed: int, steps: int = 9_000) -> tuple[np.ndarray, np.ndarray]:
    records = corpus.soak_healthy(seed, steps).files["rank-0.jsonl"]
    return (np.array([r["metrics"]["loss"] for r in records]), np.array([r["metrics"]["grad_norm"] for r in records]))


def soak_run(seed: int, steps: int = 9_000) -> dict:
    run = healthy(steps, seed)
    run["losses"], run["grads"] = soak_columns(seed, steps)
    return run


def decided(guard: Guard, losses: np.ndarray, grads: np.ndarray) -> list[tuple[int, str | None, str]]:
    run = healthy(len(losses))
    run["losses"], run["grads"] = losses, grads
    return [(i + 1, d.action, d.reason) for i, d in batch.guard_block(guard, block(run, layers=False))]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_soaks_healthy_shape_takes_no_action_from_any_chunk_phase(seed):
    """Fed from each of 32 offsets (where the 32-step chunks start), 9,000 steps: no rollback, no skip."""
    losses, grads = soak_columns(seed)
    for offset in range(32):
        assert decided(Guard(), losses[offset:], grads[offset:]) == [], offset


def test_the_soaks_shape_climbs_where_steadiness_is_not_asked():
    """What the defaults tell apart is there: without the steadiness of both climbs the rule rolls back."""
    loose = GuardPolicy(drift_steadiness=1e-9, drift_grad_steadiness=1e-9)
    losses, grads = soak_columns(0)
    assert any(reason == "loss_drift" for _, _, reason in decided(Guard(loose), losses, grads))


def test_a_slow_divergence_after_the_soaks_healthy_steps_is_rolled_back():
    """The loss +50% and the norm x2.5 over 600 steps from step 7000 of the noisy shape (a smooth run's
    divergence is tests/efficacy/test_shapes.py's): caught, after its healthy 7000 steps took no action."""
    losses, grads = soak_columns(0)
    ramp = np.clip((np.arange(len(losses)) - 7_000) / 600, 0, 1)
    found = decided(Guard(), losses * (1 + 0.5 * ramp), grads * (1 + 1.5 * ramp))
    assert found and found[0][1:] == ("rollback", "loss_drift") and 7_000 < found[0][0] <= 7_600


def flat(guard: Guard, steps: int, grad: float = 1.0) -> None:
    for step in range(1, steps + 1):
        assert not guard.observe(StepStats(step, 3.0 + 0.01 * (step % 5), grad + 0.01 * (step % 3), None, float(step)))


@pytest.mark.parametrize("factor,grad,action", [
    (1.9, 1.0, None),           # a hard stretch, the norm normal: not skipped
    (2.6, 1.0, None),           # over a level shift's factor, under the hard batch's: not skipped either
    (1.9, 3.0, "skip_step"),    # the norm out of its normal range: a spike
    (4.0, 1.0, "skip_step"),    # beyond hard_batch_loss_factor: a spike whatever the gradients say
    (1.9, None, "skip_step"),   # no norm logged: the loss alone decides
])
def test_a_hard_stretch_beside_a_normal_norm_is_neither_skipped_nor_learned(factor, grad, action):
    guard = Guard()
    flat(guard, 300)
    band = guard._rule_of(LossSpike).state_dict()
    decisions = [guard.observe(StepStats(300 + i, 3.0 * factor, grad, None, 300.0 + i)) for i in range(1, 5)]
    assert [d.reason for d in decisions[:2]] == ["loss_spike"] * 2
    assert decisions[0].action == action
    if action is None:
        assert not any(decisions) and guard._rule_of(LossSpike).state_dict() == band and not guard.bad


def test_one_climbing_chunk_is_no_drift_two_in_a_row_are():
    """Chunks of 4 steps: flat, then a climb of small steps (+5% loss, +10% norm a chunk: the third such
    chunk is a steady climb against the largest move), then the loss back; later the same climb goes on."""
    rule = LossDrift(4, 8, 4, 0.04, 0.10, 2.5, 2.0)

    def chunk(loss: float, grad: float) -> list:
        found = []
        for _ in range(4):
            stats = StepStats(0, loss, grad)
            detail = rule.check(stats)
            found.append(detail)
            if detail is None:
                rule.learn(stats)
        return found

    def level() -> None:
        rule.rolled_back()
        for i in range(6):
            assert chunk(3.0 + 0.001 * (i % 2), 1.0 + 0.001 * (i % 2)) == [None] * 4

    level()
    for k in (1, 2):
        assert chunk(3.0 + 0.15 * k, 1.0 + 0.1 * k) == [None] * 4 and not rule.climbing
    assert chunk(3.45, 1.3) == [None] * 4 and rule.climbing           # one chunk climbs ...
    assert chunk(3.0, 1.0) == [None] * 4 and not rule.climbing        # ... and the next does not: no drift
    level()
    for k in (1, 2, 3):
        assert chunk(3.0 + 0.15 * k, 1.0 + 0.1 * k) == [None] * 4
    *before, detail = chunk(3.6, 1.4)                                 # two in a row: a drift
    assert before == [None] * 3 and detail is not None and detail["steps"] == 8
    rule.rolled_back()
    assert not rule.climbing and not rule.loss_means


def test_a_chunk_low_by_chance_does_not_set_the_floor():
    assert pair_floor([1.0, 1.0, 0.8, 1.0, 1.0]) == pytest.approx(0.9)
    rng = random.Random(3)
    for _ in range(200):
        size = rng.randint(2, 9)
        held = deque((rng.uniform(0, 2) for _ in range(rng.randint(0, 12))), maxlen=size)
        means = np.array([rng.uniform(0, 2) for _ in range(rng.randint(1, 20))])
        floors = pair_floors(held, means)
        chain = [*held, *means.tolist()]
        for j, floor in enumerate(floors.tolist()):
            window = chain[max(0, len(held) + j - size):len(held) + j]
            assert floor == (pair_floor(window) if len(window) >= 2 else float("inf"))


TOUCHY = GuardPolicy(drift_chunk=8, drift_chunks=6, drift_min_chunks=2, drift_loss_ratio=0.01, drift_grad_ratio=0.01,
                     drift_steadiness=0.8, drift_grad_steadiness=0.5, max_rollbacks_per_hour=10**6)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("policy", [GuardPolicy(), TOUCHY], ids=["defaults", "touchy"])
def test_replay_blocks_decide_the_soaks_shape_as_the_guard_does(seed, policy):
    """The changed rule's screen (pair floors, both steadinesses, a climb carried from the chunk before) against
    its step loop, the run cut into blocks at random places: the same decisions and the same state."""
    run = soak_run(seed, 3_000)
    run["losses"][1_200:1_260] *= np.linspace(1.0, 1.6, 60)     # a climb to find within a block
    run["grads"][1_200:1_260] *= np.linspace(1.0, 2.0, 60)
    by_steps = Guard(policy)
    expected = guard_many(by_steps, run)
    if policy is TOUCHY:
        assert sum(d.reason == "loss_drift" for _, d in expected) >= 3, "the touchy rule must act"
    cuts = sorted(random.Random(seed).sample(range(1, 3_000), 6))
    guard, found = Guard(policy), []
    for a, b in zip([0, *cuts], [*cuts, 3_000]):
        found += [(a + i, d) for i, d in batch.guard_block(guard, block(run, a, b))]
    assert repr(found) == repr(expected)
    assert guard_state(guard) == guard_state(by_steps)


def test_a_resumed_guard_carries_a_climb_begun():
    """`drift_climbing` is in the guard's state: a guard resumed between the two chunks acts as one that ran on."""
    # the loss and norm bands wide open: flat chunks of 4 steps make every climb a spike otherwise
    policy = GuardPolicy(drift_chunk=4, drift_chunks=8, drift_min_chunks=4, spike_sigma=1e3, grad_climb_sigma=1e3)
    levels = [(3.0 + 0.001 * (i % 2), 1.0 + 0.001 * (i % 2)) for i in range(24)]
    levels += [(3.0 + 0.15 * k, 1.0 + 0.1 * k) for k in (1, 2, 3, 4) for _ in range(4)]
    steps = [StepStats(i + 1, loss, grad, None, float(i + 1)) for i, (loss, grad) in enumerate(levels)]
    whole = Guard(policy)
    assert [(d.step, d.reason) for d in (whole.observe(stats) for stats in steps) if d] == [(40, "loss_drift")]
    first, second = Guard(policy), Guard(policy)
    for stats in steps[:36]:
        first.observe(stats)
    assert first.state_dict()["drift_climbing"] is True
    second.load_state_dict(first.state_dict())
    second.last_step = 36
    assert [(d.step, d.reason) for d in (second.observe(stats) for stats in steps[36:]) if d] == [(40, "loss_drift")]


# ------------------------------------------------------------------------------ property: screen == loop

SEGMENTS = ("flat", "climb", "drop", "spike", "hard", "nan", "back")


@st.composite
def drift_runs(draw):
    """Runs made of segments a drift rule must judge: flat stretches, steady climbs of the loss and the norm
    (some of the norm only), drops, a spike, a hard stretch beside a normal norm, a NaN, a step going back."""
    rng = random.Random(draw(st.integers(0, 2 ** 32 - 1)))
    losses, grads, steps, step, loss, grad = [], [], [], 0, 3.0, 1.0
    for _ in range(draw(st.integers(2, 12))):
        kind, length = draw(st.sampled_from(SEGMENTS)), draw(st.integers(1, 120))
        rise, grad_rise = draw(st.floats(0.0, 0.01)), draw(st.floats(0.0, 0.01))
        for i in range(length):
            step = step - 7 if kind == "back" and i == 0 and step > 7 else step + 1
            if kind == "climb":
                loss, grad = loss * (1 + rise), grad * (1 + grad_rise)
            elif kind == "drop":
                loss = loss * 0.995
            noise = 1 + rng.gauss(0, 0.01)
            value = {"spike": loss * 8, "hard": loss * 1.9, "nan": float("nan")}.get(kind, loss) * noise
            losses.append(value)
            grads.append(grad * (1 + rng.gauss(0, 0.02)) * (40.0 if kind == "spike" else 1.0))
            steps.append(step)
    return np.array(steps, dtype=np.int64), np.array(losses), np.array(grads)


@settings(max_examples=examples(60))
@given(run=drift_runs(), data=st.data(), chunk=st.integers(1, 12), chunks=st.integers(2, 10),
       ratios=st.tuples(st.sampled_from([0.0001, 0.01, 0.04]), st.sampled_from([0.0001, 0.01, 0.1])),
       steadiness=st.tuples(st.sampled_from([0.3, 1.0, 2.5]), st.sampled_from([0.3, 1.0, 2.0])))
def test_the_drift_screen_decides_as_the_rule_over_random_runs(run, data, chunk, chunks, ratios, steadiness):
    steps, losses, grads = run
    min_chunks = data.draw(st.integers(2, chunks))
    policy = GuardPolicy(drift_chunk=chunk, drift_chunks=chunks, drift_min_chunks=min_chunks,
                         drift_loss_ratio=ratios[0], drift_grad_ratio=ratios[1], drift_steadiness=steadiness[0],
                         drift_grad_steadiness=steadiness[1], max_rollbacks_per_hour=10**6)
    columns = healthy(len(steps))
    columns.update(steps=steps, losses=losses, grads=grads)
    reference = Guard(policy)
    expected = guard_many(reference, columns)
    cuts = sorted(data.draw(st.lists(st.integers(1, max(1, len(steps) - 1)), max_size=5)))
    guard, found = Guard(policy), []
    for a, b in zip([0, *cuts], [*cuts, len(steps)]):
        if b > a:
            found += [(a + i, d) for i, d in batch.guard_block(guard, block(columns, a, b))]
    assert repr(found) == repr(expected)
    assert guard_state(guard) == guard_state(reference)
