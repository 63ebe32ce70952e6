"""The batch path decides exactly as the rules do, step by step.

`trainguard.decide.batch` decides a block of steps with array screens beside the guard's rules and the
cost meter's loop, and takes healthy stretches in bulk. Held here to the product's own step loops
(`Guard.observe`, `CostMeter.observe`) over random runs with NaNs, spikes, exploding gradients and layers,
steps and clocks that go back, cut into random blocks, and over long ones (`long_runs`): hundreds of
healthy steps, so the bulk path is really taken, with a few rare events where the screens must hand over.
Every decision (action, reason, step, time, detail) and the state left behind must be equal, to the bit.
"""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.property.conftest import examples
from trainguard.decide import batch
from trainguard.decide.cost import CostMeter
from trainguard.decide.guard import Guard, StepStats
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


def same_decision(ours, theirs) -> bool:
    return (ours.action, ours.reason, ours.step, ours.timestamp, repr(ours.detail)) == (
        theirs.action, theirs.reason, theirs.step, theirs.timestamp, repr(theirs.detail))


def columns(rows):
    """`rows` as columns, and the layer names; with the rows' layers as the rules read the same norms (NaN
    where a row has none, in the names' order)."""
    steps, losses, grads, layers, times, gpus, *clocks = zip(*rows)
    names = tuple(sorted({name for norms in layers if norms for name in norms})) or None
    norms = [[(row or {}).get(name, math.nan) for name in names or ()] for row in layers]
    clocks = clocks[0] if clocks else [None] * len(rows)
    return dict(steps=np.array(steps, dtype=np.int64), losses=np.array(losses), grads=np.array(grads),
                times=np.array(times), names=names, norms=np.array(norms).reshape(len(rows), len(names or ())),
                gpus=np.array([g or 0 for g in gpus], dtype=np.int64),
                codes=np.array([-1 if c is None else c[0] for c in clocks], dtype=np.int64),
                seconds=np.array([math.nan if c is None else c[1] for c in clocks]),
                layers=[dict(zip(names, row)) if names else None for row in norms], rows=layers)


def block(columns: dict, a: int, b: int, *, as_dicts: bool = False, nodes=NODES) -> batch.Block:
    """Rows [a, b) as a block: layer norms as one array, or (`as_dicts`) each row's own dict, as replay
    hands over layer groups that differ from step to step."""
    layers = {"layers": list(columns["rows"][a:b])} if as_dicts else {
        "layer_names": columns["names"], "layer_norms": columns["norms"][a:b] if columns["names"] else None}
    return batch.Block(columns["steps"][a:b], columns["losses"][a:b], columns["grads"][a:b], columns["times"][a:b],
                       columns["gpus"][a:b], columns["codes"][a:b], columns["seconds"][a:b], nodes, **layers)


def cut(draw, count):
    """Block edges over `count` steps: random cuts, or none (one long block)."""
    cuts = sorted(draw(st.one_of(st.just([]), st.lists(st.integers(0, count), max_size=6))))
    return [(a, b) for a, b in zip([0, *cuts], [*cuts, count]) if b > a]


@settings(max_examples=examples(100))
@given(rows=st.one_of(runs(), layered_runs(), long_runs(), long_runs()), data=st.data(), as_dicts=st.booleans(),
       window=st.integers(4, 64), spike_min=st.integers(2, 40), grad_min=st.integers(1, 20),
       after=st.sampled_from([1, 2, 4, 1000]), per_hour=st.sampled_from([0, 1, 3, 1000]),
       climb=st.tuples(st.sampled_from([1.0, 3.0, 6.0]), st.integers(4, 64), st.integers(2, 40), st.integers(1, 8),
                       st.integers(0, 40)))
def test_guard_blocks_decide_as_the_guards_rules(rows, data, as_dicts, window, spike_min, grad_min, after, per_hour,
                                                 climb):
    """Escalation limits from none to soon, so that some guards stop and most run through their events; the
    gradient-climb rule from touchy (sigma 1: it fires often, sustained or not) to the default."""
    sigma, climb_window, climb_min, climb_steps, lag = climb
    policy = GuardPolicy(spike_window=window, spike_min_steps=spike_min, grad_min_steps=grad_min,
                         rollback_after=after, rollback_window=10, max_rollbacks_per_hour=per_hour,
                         grad_climb_sigma=sigma, grad_climb_window=climb_window, grad_climb_min_steps=climb_min,
                         grad_climb_steps=climb_steps, grad_climb_lag=lag)
    reference, guard, block_columns = Guard(policy), Guard(policy), columns(rows)
    layers = block_columns["rows"] if as_dicts else block_columns["layers"]
    expected = [(i, d) for i, (step, loss, grad, norms, when) in enumerate(zip(
        block_columns["steps"].tolist(), block_columns["losses"].tolist(), block_columns["grads"].tolist(), layers,
        block_columns["times"].tolist())) if (d := reference.observe(StepStats(step, loss, grad, norms, when)))]
    found = []
    for a, b in cut(data.draw, len(rows)):
        found += [(a + i, d) for i, d in batch.guard_block(guard, block(block_columns, a, b, as_dicts=as_dicts))]
    assert [i for i, _ in found] == [i for i, _ in expected]
    assert all(same_decision(ours, theirs) for (_, ours), (_, theirs) in zip(found, expected))
    assert all(type(d.step) is int and type(d.timestamp) is float for _, d in found)
    assert repr(guard.state_dict()) == repr(reference.state_dict())
    assert list(guard.state_dict()["layer_ema"]) == list(reference.state_dict()["layer_ema"])   # the same order
    assert (guard.observed, list(guard.bad)) == (reference.observed, list(reference.bad))


@settings(max_examples=examples(60))
@given(rows=st.one_of(runs(), long_runs()), data=st.data(), share=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
       stretch=st.booleans(), spike_min=st.integers(2, 40), after=st.sampled_from([1, 3, 1000]))
def test_guard_blocks_with_absent_grad_norms_decide_as_the_guards_rules(rows, data, share, stretch, spike_min, after):
    """Steps with a loss and no gradient norm (`Block.no_grad_norm`; None to the rules), none, a few, half
    or all of them, scattered or in one stretch, among blocks that have every norm: the same decisions and
    state as `Guard.observe`, to the bit."""
    policy = GuardPolicy(spike_min_steps=spike_min, rollback_after=after, rollback_window=10, grad_min_steps=5)
    reference, guard, block_columns = Guard(policy), Guard(policy), columns(rows)
    rng = random.Random(data.draw(st.integers(0, 2 ** 32 - 1)))
    count = len(rows)
    if stretch:
        first = rng.randrange(count)
        absent = np.array([first <= i < first + int(share * count) for i in range(count)])
    else:
        absent = np.array([rng.random() < share for _ in range(count)])
    expected = [(i, d) for i, (step, loss, grad, norms, when, gone) in enumerate(zip(
        block_columns["steps"].tolist(), block_columns["losses"].tolist(), block_columns["grads"].tolist(),
        block_columns["layers"], block_columns["times"].tolist(), absent.tolist()))
        if (d := reference.observe(StepStats(step, loss, None if gone else grad, norms, when)))]
    found = []
    for a, b in cut(data.draw, count):
        part = block(block_columns, a, b)
        part = dataclasses.replace(part, grad_norms=np.where(absent[a:b], np.nan, part.grad_norms),
                                   no_grad_norm=absent[a:b] if data.draw(st.booleans()) or absent[a:b].any() else None)
        found += [(a + i, d) for i, d in batch.guard_block(guard, part)]
    assert [i for i, _ in found] == [i for i, _ in expected]
    assert all(same_decision(ours, theirs) for (_, ours), (_, theirs) in zip(found, expected))
    assert repr(guard.state_dict()) == repr(reference.state_dict())
    assert (guard.observed, list(guard.bad)) == (reference.observed, list(reference.bad))


@settings(max_examples=examples(60))
@given(rows=st.one_of(runs(), long_runs(), long_runs()), data=st.data(), clocked=st.booleans(),
       window=st.integers(2, 60), min_steps=st.integers(1, 30),
       budget=st.sampled_from([0.001, 0.01, 1.0, 2.5, 3.0, 5.0, 50.0]), override=st.sampled_from([0, 0, 2]))
def test_meter_blocks_meter_as_the_meters_loop(rows, data, clocked, window, min_steps, budget, override):
    """A record without a clock (code -1) is `observe(..., clock=None)`: it ends the clock being followed."""
    policy = CostPolicy(price_per_gpu_hour=2.5, budget_per_1k_steps=budget, window_steps=window,
                        min_steps=min_steps, gpu_count_override=override,
                        tiers=CostTiers(warn=0.0, throttle=0.5, stop=2.0))
    block_columns = columns(rows)
    if not clocked:
        block_columns["codes"][:] = -1
    reference, meter = CostMeter(policy), CostMeter(policy)
    expected = []
    for i, (step, when, gpus, code, seconds) in enumerate(zip(
            block_columns["steps"].tolist(), block_columns["times"].tolist(), block_columns["gpus"].tolist(),
            block_columns["codes"].tolist(), block_columns["seconds"].tolist())):
        clock = None if code < 0 else (NODES[code], seconds)
        expected += [(i, d) for d in reference.observe(step, when, gpus or None, clock)]
    found = []
    for a, b in cut(data.draw, len(rows)):
        found += [(a + i, d) for i, d in batch.meter_block(meter, block(block_columns, a, b))]
    assert [(i, d.action) for i, d in found] == [(i, d.action) for i, d in expected]
    assert all(same_decision(ours, theirs) for (_, ours), (_, theirs) in zip(found, expected))
    assert all(type(d.step) is int and type(d.timestamp) is float for _, d in found)
    assert dataclasses.asdict(meter.state) == dataclasses.asdict(reference.state)
    assert repr(meter.state_dict()) == repr(reference.state_dict())
