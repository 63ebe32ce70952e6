"""`trainguard.decide.batch`: a long healthy block is advanced in bulk (the step-by-step loop barely runs),
one event in it is found at its index with a short stretch decided step by step, and the decisions and
the state are those of the rules' own loop (`Guard.observe`, `CostMeter.observe`), to the bit.

The random comparisons are in tests/property/test_decide_properties.py; here the cases they reach rarely:
a norm one ulp over the threshold where the screens' floor is the EMA itself, clock codes naming one node,
and a rule without a screen (decided step by step, correctly).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from trainguard.decide import batch
from trainguard.decide.batch import MIN_SCREENED, Block
from trainguard.decide.cost import CostMeter
from trainguard.decide.guard import Guard, StepStats
from trainguard.policy import CostPolicy, GuardPolicy

NAMES = ("embed", "h.0", "h.1", "ln_f")
LEVELS = np.array([0.5, 0.4, 0.4, 0.02])


def healthy(count: int, seed: int = 0, start: int = 1) -> dict:
    """A healthy run: loss ~3 with noise, norms steady, a step every 0.25 s on 7 GPUs, one clock."""
    rng = np.random.default_rng(seed)
    return dict(steps=np.arange(start, start + count, dtype=np.int64), losses=3.0 + rng.normal(0, 0.02, count),
                grads=rng.uniform(0.8, 0.9, count), times=1000.0 + 0.25 * np.arange(count),
                norms=LEVELS * rng.uniform(1.0, 1.2, (count, len(NAMES))), gpus=np.full(count, 7, dtype=np.int64),
                codes=np.zeros(count, dtype=np.int64),
                seconds=50.0 + 0.25 * np.arange(count) + rng.uniform(0, 1e-3, count))


def block(run: dict, a: int = 0, b: int | None = None, nodes=("node-0",), layers: bool = True) -> Block:
    b = len(run["steps"]) if b is None else b
    return Block(run["steps"][a:b], run["losses"][a:b], run["grads"][a:b], run["times"][a:b], run["gpus"][a:b],
                 run["codes"][a:b], run["seconds"][a:b], nodes, NAMES if layers else None,
                 run["norms"][a:b] if layers else None)


def guard_columns(guard: Guard, run: dict, a: int = 0, b: int | None = None):
    return batch.guard_block(guard, block(run, a, b))


def guard_many(guard: Guard, run: dict):
    """The guard's own loop, one step at a time."""
    found = []
    for i, (step, loss, grad, when, row) in enumerate(zip(run["steps"].tolist(), run["losses"].tolist(),
                                                          run["grads"].tolist(), run["times"].tolist(),
                                                          run["norms"].tolist())):
        if decision := guard.observe(StepStats(step, loss, grad, dict(zip(NAMES, row)), when)):
            found.append((i, decision))
    return found


def meter_columns(meter: CostMeter, run: dict, nodes=("node-0",)):
    return batch.meter_block(meter, block(run, nodes=nodes))


def meter_many(meter: CostMeter, run: dict, nodes=("node-0",)):
    """The meter's own loop, one record at a time."""
    found = []
    for i, (step, when, gpus, code, at) in enumerate(zip(run["steps"].tolist(), run["times"].tolist(),
                                                         run["gpus"].tolist(), run["codes"].tolist(),
                                                         run["seconds"].tolist())):
        found += [(i, d) for d in meter.observe(step, when, gpus or None, None if code < 0 else (nodes[code], at))]
    return found


def guard_state(guard: Guard) -> tuple:
    return repr(guard.state_dict()), guard.observed, list(guard.bad)


def meter_state(meter: CostMeter) -> tuple:
    return repr(dataclasses.asdict(meter.state)), repr(meter.state_dict())


@pytest.fixture
def stepped(monkeypatch):
    """How many steps (and records) went through the rules' own step loops."""
    counted = {"guard": 0, "meter": 0}
    observe, take = Guard.observe, CostMeter.take

    def counting_observe(self, stats):
        counted["guard"] += 1
        return observe(self, stats)

    def counting_take(self, *args):
        counted["meter"] += 1
        return take(self, *args)

    monkeypatch.setattr(Guard, "observe", counting_observe)
    monkeypatch.setattr(CostMeter, "take", counting_take)
    return counted


def test_a_long_healthy_block_is_advanced_in_bulk(stepped):
    run, guard, by_steps = healthy(20_000), Guard(), Guard()
    assert guard_columns(guard, run, 0, 10_000) == []
    # A fresh guard meets each layer's first norm step by step (its EMA is made there), then bulk.
    assert stepped["guard"] <= MIN_SCREENED
    stepped["guard"] = 0
    assert guard_columns(guard, run, 10_000) == []
    assert stepped["guard"] == 0
    assert guard_many(by_steps, run) == []      # (the loop itself: counted from here on)
    assert guard_state(guard) == guard_state(by_steps)


def test_one_spike_among_10000_steps_is_found_with_the_rest_in_bulk(stepped):
    run = healthy(10_000)
    run["losses"][6_543] = 50.0
    guard, by_steps = Guard(), Guard()
    guard_columns(guard, healthy(200, seed=1, start=-200))      # warmed up
    guard_many(by_steps, healthy(200, seed=1, start=-200))
    stepped["guard"] = 0
    found = guard_columns(guard, run)
    assert [(i, d.action, d.reason, d.step) for i, d in found] == [(6_543, "skip_step", "loss_spike", 6_544)]
    assert stepped["guard"] <= MIN_SCREENED
    assert repr(found) == repr(guard_many(by_steps, run))
    assert guard_state(guard) == guard_state(by_steps)


@pytest.mark.parametrize("where", ["global", "layer"])
@pytest.mark.parametrize("ulps", [0, 1])
def test_a_norm_one_ulp_over_the_threshold_explodes(where, ulps):
    """Flat norms: the EMA is exactly the norm, so the screens' floor is the EMA and their margin is all
    that stands between a healthy norm at the threshold and an explosion one ulp over it."""
    run = healthy(2_000)
    run["grads"][:], run["norms"][:] = 0.85, LEVELS
    policy = GuardPolicy()
    column, factor = (run["grads"], policy.grad_explode_factor) if where == "global" else (
        run["norms"][:, 3], policy.layer_explode_factor)
    threshold = factor * column[0]
    column[1_500] = np.nextafter(threshold, np.inf) if ulps else threshold
    guard, by_steps = Guard(policy), Guard(policy)
    found = guard_columns(guard, run)
    assert [(i, d.reason) for i, d in found] == ([(1_500, "grad_explosion")] if ulps else [])
    assert repr(found) == repr(guard_many(by_steps, run))
    assert guard_state(guard) == guard_state(by_steps)


def test_missing_layer_norms_and_a_late_layer(stepped):
    run = healthy(5_000)
    run["norms"][::7, 1] = np.nan           # a layer without a norm now and then
    run["norms"][:3_000, 3] = np.nan        # a layer that appears late: its EMA is made then
    guard, by_steps = Guard(), Guard()
    found = guard_columns(guard, run)
    assert stepped["guard"] <= 3 * MIN_SCREENED
    assert repr(found) == repr(guard_many(by_steps, run))
    assert guard_state(guard) == guard_state(by_steps)
    assert list(guard.state_dict()["layer_ema"]) == list(by_steps.state_dict()["layer_ema"])


def test_a_run_of_bad_steps_rolls_back_then_stops_as_step_by_step():
    run = healthy(5_000)
    for start in (1_000, 2_000, 3_000, 4_000):
        run["losses"][start:start + 3] = np.nan
    policy = GuardPolicy(max_rollbacks_per_hour=2)
    guard, by_steps = Guard(policy), Guard(policy)
    found = guard_columns(guard, run)
    assert [d.action for _, d in found][:9] == ["skip_step", "skip_step", "rollback"] * 2 + [
        "skip_step", "skip_step", "stop"]
    assert len(found) == 9 + 5_000 - 3_003      # stopped: every later step answers stop
    assert repr(found) == repr(guard_many(by_steps, run))
    assert guard_state(guard) == guard_state(by_steps)


def test_a_long_metered_block_is_advanced_in_bulk(stepped):
    run, meter, by_steps = healthy(20_000), CostMeter(), CostMeter()
    assert meter_columns(meter, run) == []
    assert stepped["meter"] == 0
    assert meter_many(by_steps, run) == []
    assert meter_state(meter) == meter_state(by_steps)


@pytest.mark.parametrize("clocked", [True, False])
def test_a_pause_crosses_the_tiers_at_its_record(stepped, clocked):
    """A pause of the run is billed (with a clock too: the clock measured it) and crosses every tier."""
    run = healthy(10_000)
    run["times"][7_000:] += 4_000.0
    run["seconds"][7_000:] += 4_000.0
    if not clocked:
        run["codes"][:] = -1
    policy = CostPolicy(budget_per_1k_steps=1.2)
    meter, by_steps = CostMeter(policy), CostMeter(policy)
    found = meter_columns(meter, run)
    assert [(i, d.action) for i, d in found] == [(7_000, "cost_warn"), (7_000, "cost_throttle"), (7_000, "cost_stop")]
    # Over budget for a window after the pause: every tier already fired, so no record needs the loop long.
    assert stepped["meter"] <= MIN_SCREENED
    assert repr(found) == repr(meter_many(by_steps, run))
    assert meter_state(meter) == meter_state(by_steps)


def test_over_budget_after_every_tier_fired_is_still_bulk(stepped):
    run = healthy(10_000)
    policy = CostPolicy(budget_per_1k_steps=0.4)       # ~0.97 $ per 1000 steps: far over, from the start
    meter, by_steps = CostMeter(policy), CostMeter(policy)
    found = meter_columns(meter, run)
    assert [d.action for _, d in found] == ["cost_warn", "cost_throttle", "cost_stop"]
    assert stepped["meter"] <= MIN_SCREENED
    assert repr(found) == repr(meter_many(by_steps, run))
    assert meter_state(meter) == meter_state(by_steps)


def test_clocks_that_switch_go_back_or_name_one_node_twice():
    """Codes 0 and 2 name the same node: one clock. Steps and wall times going back on the way."""
    run = healthy(6_000)
    run["codes"][1_000:2_000] = 2           # the same node under another code: its clock goes on
    run["codes"][2_000:2_500] = 1           # another node: wall time, then its own clock
    run["codes"][3_000:3_010] = -1          # records without a clock
    run["seconds"][4_000:] -= 100.0         # a reboot: the clock went back
    run["steps"][5_000:] -= 50              # a rollback
    run["times"][5_500:] -= 30.0            # the wall clock stepped back
    run["gpus"][200:300] = 0                # no count seen: the last one holds
    nodes = ("node-0", "node-1", "node-0")
    meter, by_steps = CostMeter(CostPolicy(budget_per_1k_steps=4.0)), CostMeter(CostPolicy(budget_per_1k_steps=4.0))
    for a, b in ((0, 1_500), (1_500, 4_000), (4_000, 6_000)):
        part = {key: column[a:b] for key, column in run.items()}
        assert repr(meter_columns(meter, part, nodes)) == repr(meter_many(by_steps, part, nodes))
        assert meter_state(meter) == meter_state(by_steps)


def test_a_slow_drift_crosses_each_tier_at_its_record(stepped):
    """Steps slowing down bit by bit: each tier is crossed by a hair, at the record the loop crosses it."""
    run = healthy(12_000)
    run["times"] = 1000.0 + np.cumsum(0.25 * (1 + np.arange(12_000) / 5_000))
    run["codes"][:] = -1
    policy = CostPolicy(price_per_gpu_hour=2.0, budget_per_1k_steps=0.25 * 7 * 2.0 / 3.6)   # on budget at first
    meter, by_steps = CostMeter(policy), CostMeter(policy)
    found = meter_columns(meter, run)
    assert [d.action for _, d in found] == ["cost_warn", "cost_throttle", "cost_stop"]
    assert stepped["meter"] <= 3 * MIN_SCREENED
    assert repr(found) == repr(meter_many(by_steps, run))
    assert meter_state(meter) == meter_state(by_steps)


def test_a_layer_with_a_single_norm_in_a_block_learns_it():
    run = healthy(6_000)
    run["norms"][3_000:, 2] = np.nan
    run["norms"][4_500, 2] = 0.41          # one norm in the second block: its EMA learns just that
    guard, by_steps = Guard(), Guard()
    for a, b in ((0, 3_000), (3_000, 6_000)):
        part = {key: column[a:b] for key, column in run.items()}
        assert repr(guard_columns(guard, part)) == repr(guard_many(by_steps, part))
        assert guard_state(guard) == guard_state(by_steps)


@pytest.mark.parametrize("at", [98, 100, 102])
def test_an_explosion_as_the_warm_up_ends(at):
    """The global norm is judged from the grad_min_steps-th healthy step on, not before: the screen must
    tell the two apart where it finds a step it cannot clear."""
    run = healthy(2_000)
    run["grads"][at] = 50.0
    policy = GuardPolicy(grad_min_steps=100)
    guard, by_steps = Guard(policy), Guard(policy)
    found = guard_columns(guard, run)
    assert [i for i, _ in found] == ([at] if at >= 100 else [])
    assert repr(found) == repr(guard_many(by_steps, run))
    assert guard_state(guard) == guard_state(by_steps)


def test_steps_going_back_near_the_end_of_a_block_leave_a_short_window():
    run = healthy(3_000)
    run["steps"][1_990:] -= 500            # a rollback 10 records before the end of a block
    run["steps"][2_990:] -= 500            # and again, the window full from the block before
    meter, by_steps = CostMeter(), CostMeter()
    for a, b in ((0, 2_000), (2_000, 3_000)):
        part = {key: column[a:b] for key, column in run.items()}
        assert repr(meter_columns(meter, part)) == repr(meter_many(by_steps, part))
        assert meter_state(meter) == meter_state(by_steps)
        assert list(meter.window) == list(by_steps.window)


class Climb:
    """A rule with no screen of its own: the grad norm above 2 after step 100 is "too high"."""

    reason = "too_high"

    def __init__(self):
        self.seen = 0

    def check(self, stats):
        return {"grad_norm": stats.grad_norm} if self.seen > 100 and stats.grad_norm > 2.0 else None

    def learn(self, stats):
        self.seen += 1

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state.get("seen", 0)


def test_a_rule_without_a_screen_is_decided_step_by_step_and_correctly(stepped):
    """The trap the old guard had (forget a screen, and replay skips the rule in bulk) cannot happen:
    a guard with a rule that has no screen goes through the rules' loop for every step."""
    run = healthy(3_000)
    run["grads"][2_000] = 3.0
    guard, by_steps = Guard(), Guard()
    guard.rules += (Climb(),)
    by_steps.rules += (Climb(),)
    found = guard_columns(guard, run)
    assert [(i, d.reason) for i, d in found] == [(2_000, "too_high")]
    assert stepped["guard"] == 3_000
    assert repr(found) == repr(guard_many(by_steps, run))
    assert guard_state(guard) == guard_state(by_steps)
