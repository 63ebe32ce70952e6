"""The batched guard and cost meter decide exactly as the plain step-by-step code did.

`Guard.check_many` and `CostMeter.observe_many` keep their state in local names and inline the healthy
path for speed (replay runs them once per recorded step). Held here to the plain implementations they
replaced (tests/decide/reference_*.py): over random runs with NaNs, spikes, exploding gradients and
layers, steps and clocks that go back, cut into random batches, every decision (action, reason, step,
time, detail) and the state left behind must be equal, to the bit.
"""

from __future__ import annotations

import dataclasses
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.decide import reference_cost, reference_guard
from tests.property.conftest import examples
from trainguard.decide.cost import CostMeter
from trainguard.decide.guard import Guard
from trainguard.policy import CostPolicy, CostTiers, GuardPolicy

LOSSES = st.one_of(st.floats(2.0, 3.0), st.floats(2.0, 3.0), st.floats(2.0, 3.0), st.floats(3.0, 100.0),
                   st.sampled_from([math.nan, math.inf, -math.inf]))
GRADS = st.one_of(st.floats(0.5, 1.5), st.floats(0.5, 1.5), st.floats(1.5, 50.0), st.just(math.nan))
LAYERS = st.one_of(st.none(), st.none(), st.dictionaries(st.sampled_from(["h.0", "h.1"]),
                                                         st.one_of(st.floats(0.1, 2.0), st.floats(2.0, 40.0),
                                                                   st.just(math.nan)), min_size=1))


@st.composite
def runs(draw):
    """Steps that mostly advance, sometimes repeat or go back; times that mostly advance."""
    count = draw(st.integers(1, 200))
    step, when, rows = 0, 1000.0, []
    for _ in range(count):
        step = draw(st.sampled_from([step + 1] * 8 + [step, max(0, step - 5)]))
        when += draw(st.sampled_from([0.5] * 8 + [0.0, -3.0, 4000.0]))
        rows.append((step, draw(LOSSES), draw(GRADS), draw(LAYERS), when, draw(st.sampled_from([None, 8, 8, 4]))))
    return rows


@st.composite
def layered_runs(draw):
    """Every step carrying the same two layers, mostly steady, sometimes jumping, NaN or exploding: the
    batches the guard screens and decides a column at a time (and, where the screen fails, step by step)."""
    rare = draw(st.sampled_from([0, 0.02, 0.2]))      # how often a norm is not steady (none, few, many)

    def norm():
        if draw(st.floats(0, 1)) >= rare:
            return draw(st.floats(0.2, 1.0))
        return draw(st.sampled_from([math.nan, 0.0, 12.0, 30.0, 500.0]))

    return [(step, loss, grad, {"h.0": norm(), "h.1": norm()}, when, gpus)
            for step, loss, grad, _, when, gpus in draw(runs())]


def batches(draw, rows):
    """`rows` cut into consecutive batches of random sizes."""
    cuts = sorted(draw(st.lists(st.integers(0, len(rows)), max_size=6)))
    edges = [0, *cuts, len(rows)]
    return [rows[a:b] for a, b in zip(edges, edges[1:]) if b > a]


def same_decision(ours, theirs) -> bool:
    return (ours.action, ours.reason, ours.step, ours.timestamp, repr(ours.detail)) == (
        theirs.action, theirs.reason, theirs.step, theirs.timestamp, repr(theirs.detail))


@settings(max_examples=examples(60))
@given(rows=st.one_of(runs(), layered_runs()), data=st.data(), window=st.integers(4, 32), spike_min=st.integers(2, 40),
       grad_min=st.integers(1, 20), after=st.integers(1, 4), per_hour=st.integers(0, 3))
def test_guard_batches_decide_as_the_step_by_step_guard(rows, data, window, spike_min, grad_min, after, per_hour):
    policy = GuardPolicy(spike_window=window, spike_min_steps=spike_min, grad_min_steps=grad_min,
                         rollback_after=after, rollback_window=10, max_rollbacks_per_hour=per_hour)
    reference, guard = reference_guard.Guard(policy), Guard(policy)
    expected = [(i, d) for i, (step, loss, grad, layers, when, _) in enumerate(rows)
                if (d := reference.check(step, loss, grad, layers, when)).action is not None]
    found, offset = [], 0
    for batch in batches(data.draw, rows):
        steps, losses, grads, layers, times, _ = zip(*batch)
        found += [(offset + i, d) for i, d in guard.check_many(steps, losses, grads, times, layers)]
        offset += len(batch)
    assert [i for i, _ in found] == [i for i, _ in expected]
    assert all(same_decision(ours, theirs) for (_, ours), (_, theirs) in zip(found, expected))
    state = guard.state_dict()
    assert state["losses"] == list(reference.losses.values)
    assert state["loss_sums"] == [reference.losses.total, reference.losses.total_sq]
    assert (state["grad_ema"], state["good_grad_steps"], state["layer_ema"]) == (
        reference.grad_ema, reference.good_grad_steps, reference.layer_ema)
    assert (guard.observed, list(guard.bad), guard.stopped) == (reference.observed, list(reference.bad), reference.stopped)


@settings(max_examples=examples(60))
@given(rows=runs(), data=st.data(), window=st.integers(2, 40), min_steps=st.integers(1, 30),
       budget=st.sampled_from([0.001, 0.01, 0.05, 1.0]), override=st.sampled_from([0, 0, 2]))
def test_cost_batches_meter_as_the_step_by_step_meter(rows, data, window, min_steps, budget, override):
    policy = CostPolicy(price_per_gpu_hour=2.5, budget_per_1k_steps=budget, window_steps=window,
                        min_steps=min_steps, gpu_count_override=override,
                        tiers=CostTiers(warn=0.0, throttle=0.5, stop=2.0))
    reference, meter = reference_cost.CostMeter(policy), CostMeter(policy)
    expected = [(i, d) for i, (step, _, _, _, when, gpus) in enumerate(rows)
                for d in reference.observe(step, when, gpus)]
    found, offset = [], 0
    for batch in batches(data.draw, rows):
        steps, _, _, _, times, gpus = zip(*batch)
        found += [(offset + i, d) for i, d in meter.observe_many(steps, times, gpus)]
        offset += len(batch)
    assert [(i, d.action) for i, d in found] == [(i, d.action) for i, d in expected]
    assert all(same_decision(ours, theirs) for (_, ours), (_, theirs) in zip(found, expected))
    assert dataclasses.asdict(meter.state) == dataclasses.asdict(reference.state)
    assert (list(meter.window), meter.fired, meter._last_time) == (
        list(reference.window), reference.fired, reference._last_time)
