"""The batched guard and cost meter decide exactly as the plain step-by-step code did.

`Guard.check_many` and `CostMeter.observe_many` keep their state in local names and inline the healthy
path for speed (replay runs them once per recorded step). Held here to the plain implementations they
replaced (tests/decide/reference_*.py): over random runs with NaNs, spikes, exploding gradients and
layers, steps and clocks that go back, cut into random batches, every decision (action, reason, step,
time, detail) and the state left behind must be equal, to the bit.

`Guard.check_columns` and `CostMeter.observe_columns` (arrays in, a screened stretch advanced in bulk) are
held to the same references, over the same runs and over long ones (`long_runs`): hundreds of healthy
steps, so the bulk path is really taken, with a few rare events where the screens must hand over.
"""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
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


NODES = ("n0", "n1", "n0")        # clock sources by code; codes 0 and 2 name the same node
EVENTS = ("nan_loss", "inf_grad", "spike", "explode", "grad_edge", "layer_explode", "layer_edge", "layer_nan",
          "layer_zero", "no_layers", "step_back", "step_repeat", "time_back", "pause", "gpus", "no_gpus", "no_clock",
          "clock_switch", "clock_twin", "clock_back", "burst")


@st.composite
def long_runs(draw):
    """Hundreds of healthy steps (three layers at their own levels, a clock, a few GPUs: not a power of
    two, so that a reordered product rounds differently) with a few rare events at random places: what
    replay mostly sees. "edge" norms land about the explosion threshold (10 and 25 times the EMAs): with
    flat norms (every step the same) the screens' floor is the EMA itself, so a screen that let through
    what it must not would show there. A clock "twin" is another code for the same node. Rows as `runs`'
    plus each one's clock (code into NODES, seconds), or None."""
    count, rng = draw(st.integers(100, 900)), random.Random(draw(st.integers(0, 2 ** 32 - 1)))
    events = dict(draw(st.lists(st.tuples(st.integers(0, count - 1), st.sampled_from(EVENTS)), max_size=6)))
    step, when, seconds, code, gpus, burst, rows = 0, 1000.0, 100.0, 0, draw(st.sampled_from([6, 7])), 0, []
    flat = draw(st.booleans())
    noise = (lambda low, high: 1.0) if flat else rng.uniform
    for i in range(count):
        event = events.get(i)
        step = step - 5 if event == "step_back" else step if event == "step_repeat" else step + 1
        when += -3.0 if event == "time_back" else 4000.0 if event == "pause" else 0.5
        seconds += -10.0 if event == "clock_back" else 0.5 + rng.uniform(-0.01, 0.01)
        code = {"clock_switch": 1 - code % 2, "clock_twin": {0: 2, 1: 1, 2: 0}[code]}.get(event, code)
        gpus = 3 if event == "gpus" else gpus
        burst = 40 if event == "burst" else max(0, burst - 1)
        loss = 3.0 + rng.gauss(0, 0.02)
        loss = math.nan if event == "nan_loss" or burst else 50.0 if event == "spike" else loss
        grad = {"inf_grad": math.inf, "explode": 30.0, "grad_edge": 8.5 * rng.uniform(0.99, 1.01)}.get(
            event, 0.85 * noise(0.95, 1.05))
        layers = {"h.0": 0.5 * noise(1, 1.2), "h.1": 0.022 * noise(0.9, 1.1), "h.2": 0.3 * noise(1, 1.2)}
        layers = None if event == "no_layers" else {**layers, **{
            "layer_explode": {"h.1": 30.0}, "layer_edge": {"h.1": 0.55 * rng.uniform(0.99, 1.01)},
            "layer_nan": {"h.0": math.nan}, "layer_zero": {"h.2": 0.0}}.get(event, {})}
        clock = None if event == "no_clock" else (code, seconds)
        rows.append((step, loss, grad, layers, when, None if event == "no_gpus" else gpus, clock))
    return rows


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


def columns(rows):
    """`rows` as `check_columns` and `observe_columns` take them, and the layer names; with the rows' layers
    as `check_many` takes the same norms (NaN where a row has none, in the names' order)."""
    steps, losses, grads, layers, times, gpus, *clocks = zip(*rows)
    names = tuple(sorted({name for norms in layers if norms for name in norms})) or None
    norms = [[(row or {}).get(name, math.nan) for name in names or ()] for row in layers]
    clocks = clocks[0] if clocks else [None] * len(rows)
    return dict(steps=np.array(steps, dtype=np.int64), losses=np.array(losses), grads=np.array(grads),
                times=np.array(times), names=names, norms=np.array(norms).reshape(len(rows), len(names or ())),
                gpus=np.array([g or 0 for g in gpus], dtype=np.int64),
                codes=np.array([-1 if c is None else c[0] for c in clocks], dtype=np.int64),
                seconds=np.array([math.nan if c is None else c[1] for c in clocks]),
                layers=[dict(zip(names, row)) if names else None for row in norms])


def cut(draw, count):
    """Block edges over `count` steps: random cuts, or none (one long block)."""
    cuts = sorted(draw(st.one_of(st.just([]), st.lists(st.integers(0, count), max_size=6))))
    return [(a, b) for a, b in zip([0, *cuts], [*cuts, count]) if b > a]


@settings(max_examples=examples(100))
@given(rows=st.one_of(runs(), layered_runs(), long_runs(), long_runs()), data=st.data(),
       window=st.integers(4, 64), spike_min=st.integers(2, 40), grad_min=st.integers(1, 20),
       after=st.sampled_from([1, 2, 4, 1000]), per_hour=st.sampled_from([0, 1, 3, 1000]))
def test_guard_columns_decide_as_the_step_by_step_guard(rows, data, window, spike_min, grad_min, after, per_hour):
    """Escalation limits from none to soon, so that some guards stop and most run through their events."""
    policy = GuardPolicy(spike_window=window, spike_min_steps=spike_min, grad_min_steps=grad_min,
                         rollback_after=after, rollback_window=10, max_rollbacks_per_hour=per_hour)
    reference, guard, block = reference_guard.Guard(policy), Guard(policy), columns(rows)
    expected = [(i, d) for i, (step, loss, grad, layers, when) in enumerate(zip(
        block["steps"].tolist(), block["losses"].tolist(), block["grads"].tolist(), block["layers"],
        block["times"].tolist())) if (d := reference.check(step, loss, grad, layers, when)).action is not None]
    found = []
    for a, b in cut(data.draw, len(rows)):
        found += [(a + i, d) for i, d in guard.check_columns(
            block["steps"][a:b], block["losses"][a:b], block["grads"][a:b], block["times"][a:b],
            block["names"], block["norms"][a:b] if block["names"] else None)]
    assert [i for i, _ in found] == [i for i, _ in expected]
    assert all(same_decision(ours, theirs) for (_, ours), (_, theirs) in zip(found, expected))
    assert all(type(d.step) is int and type(d.timestamp) is float for _, d in found)
    state = guard.state_dict()
    assert state["losses"] == list(reference.losses.values)
    assert state["loss_sums"] == [reference.losses.total, reference.losses.total_sq]
    assert (state["grad_ema"], state["good_grad_steps"], state["layer_ema"]) == (
        reference.grad_ema, reference.good_grad_steps, reference.layer_ema)
    assert list(state["layer_ema"]) == list(reference.layer_ema)      # made in the same order
    assert (guard.observed, list(guard.bad), guard.stopped, list(guard.rollbacks)) == (
        reference.observed, list(reference.bad), reference.stopped, list(reference.rollbacks))


@settings(max_examples=examples(60))
@given(rows=st.one_of(runs(), long_runs(), long_runs()), data=st.data(), clocked=st.booleans(),
       window=st.integers(2, 60), min_steps=st.integers(1, 30),
       budget=st.sampled_from([0.01, 1.0, 2.5, 3.0, 5.0, 50.0]), override=st.sampled_from([0, 0, 2]))
def test_cost_columns_meter_as_the_step_by_step_meter(rows, data, clocked, window, min_steps, budget, override):
    """Without clocks held to the plain reference; with them (which it does not know) to the meter's own
    loop, `observe_many`, over one record at a time (a record without a clock as None in `clocks`: it ends
    the clock's run, where `observe(clock=None)` would leave it be)."""
    policy = CostPolicy(price_per_gpu_hour=2.5, budget_per_1k_steps=budget, window_steps=window,
                        min_steps=min_steps, gpu_count_override=override,
                        tiers=CostTiers(warn=0.0, throttle=0.5, stop=2.0))
    block, clocked = columns(rows), clocked and len(rows[0]) == 7
    reference = CostMeter(policy) if clocked else reference_cost.CostMeter(policy)
    meter = CostMeter(policy)
    expected = []
    for i, (step, when, gpus, code, seconds) in enumerate(zip(
            block["steps"].tolist(), block["times"].tolist(), block["gpus"].tolist(), block["codes"].tolist(),
            block["seconds"].tolist())):
        if clocked:
            clock = None if code < 0 else (NODES[code], seconds)
            expected += [(i, d) for _, d in reference.observe_many((step,), (when,), (gpus or None,), (clock,))]
        else:
            expected += [(i, d) for d in reference.observe(step, when, gpus or None)]
    found = []
    for a, b in cut(data.draw, len(rows)):
        found += [(a + i, d) for i, d in meter.observe_columns(
            block["steps"][a:b], block["times"][a:b], block["gpus"][a:b],
            *((block["codes"][a:b], block["seconds"][a:b], NODES) if clocked else ()))]
    assert [(i, d.action) for i, d in found] == [(i, d.action) for i, d in expected]
    assert all(same_decision(ours, theirs) for (_, ours), (_, theirs) in zip(found, expected))
    assert all(type(d.step) is int and type(d.timestamp) is float for _, d in found)
    assert dataclasses.asdict(meter.state) == dataclasses.asdict(reference.state)
    assert (list(meter.window), meter.fired, meter._last_time, meter._anchor) == (
        list(reference.window), reference.fired, reference._last_time, reference._anchor)
