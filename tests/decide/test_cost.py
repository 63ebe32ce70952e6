import math

import numpy as np

from trainguard.decide import batch
from trainguard.decide.cost import CostMeter, cost_per_1k_steps, gpu_cost
from trainguard.policy import CostPolicy, CostTiers


def run(meter, steps, seconds_per_step, gpus=8, start_step=0, t0=0.0):
    out = []
    for i in range(steps):
        out += meter.observe(start_step + i, t0 + i * seconds_per_step, gpus)
    return out


def test_on_budget_run_never_acts():
    # 8 GPUs x $2/h = $16/h; $120 per 1000 steps -> 7.5 h per 1000 steps = 27 s a step.
    meter = CostMeter(CostPolicy())
    assert run(meter, 500, 27.0) == []
    assert abs(meter.state.cost_per_1k_steps - 120.0) < 1e-6
    assert abs(meter.state.overrun_ratio) < 1e-9


def test_each_tier_fires_once_in_order():
    meter = CostMeter(CostPolicy())
    decisions = run(meter, 100, 27.0 * 1.35) + run(meter, 100, 27.0 * 1.7, start_step=100, t0=100 * 27 * 1.35)
    decisions += run(meter, 200, 27.0 * 2.5, start_step=200, t0=1e6)
    assert [d.action for d in decisions] == ["cost_warn", "cost_throttle", "cost_stop"]
    assert meter.state.tier == "stop"
    assert decisions[0].detail["budget_per_1k_steps"] == 120.0


def test_tiers_wait_for_min_steps():
    meter = CostMeter(CostPolicy(min_steps=20))
    assert run(meter, 20, 1000.0) == []
    assert [d.action for d in meter.observe(20, 20 * 1000.0, 8)] == ["cost_warn", "cost_throttle", "cost_stop"]


def test_override_bills_cpu_runs_and_counts_spend():
    meter = CostMeter(CostPolicy(gpu_count_override=2, price_per_gpu_hour=3.6))
    run(meter, 11, 360.0, gpus=0)  # 10 intervals of 0.1 h on 2 devices at $3.6
    assert abs(meter.state.cost_usd - 7.2) < 1e-9


def test_steps_going_back_restart_the_window():
    meter = CostMeter(CostPolicy(tiers=CostTiers(warn=0.3, throttle=0.6, stop=1.0)))
    run(meter, 50, 27.0)
    assert meter.observe(10, 50 * 27.0, 8) == []
    assert meter.state.steps_in_window == 0


def test_state_round_trip_meters_on_exactly():
    a = CostMeter(CostPolicy())
    run(a, 30, 27.0 * 1.2)
    b = CostMeter(CostPolicy())
    b.load_state_dict(a.state_dict())
    for i in range(30, 60):
        assert a.observe(i, i * 27.0 * 1.5, 8) == b.observe(i, i * 27.0 * 1.5, 8)
    assert a.state == b.state


def test_a_record_without_a_clock_ends_the_clock_one_at_a_time_as_in_a_batch():
    """The agent meters a record at a time, replay a batch at a time: a record without a monotonic clock
    between two with one must leave both at the same state (the next clocked record at its wall time)."""
    times = [0.0, 27.0, 54.0, 5000.0]               # the wall clock steps forward before the last record
    clocks = [("n", 100.0), ("n", 127.0), None, ("n", 181.0)]
    one = CostMeter(CostPolicy())
    for step, (when, clock) in enumerate(zip(times, clocks)):
        one.observe(step, when, 8, clock)
    block = CostMeter(CostPolicy())
    codes = [-1 if clock is None else 0 for clock in clocks]
    seconds = [math.nan if clock is None else clock[1] for clock in clocks]
    batch.meter_block(block, batch.Block(np.arange(4), np.array(times), np.array(times), np.array(times),
                                         np.full(4, 8), np.array(codes), np.array(seconds), ["n"]))
    assert one.state_dict() == block.state_dict()
    assert one.state_dict()["clock_anchor"] == ["n", 181.0, 5000.0]


def test_the_cost_formula_is_one_function_for_numbers_and_columns():
    """The trainer's cost summary and the meter's screens call these: 8 GPUs for 7.5 h at $2 is $120."""
    assert gpu_cost(7.5 * 3600, 8, 2.0) == 120.0
    assert cost_per_1k_steps(7.5 * 3600, 8, 2.0, 1000) == 120.0
    columns = cost_per_1k_steps(np.array([27_000.0, 54_000.0]), np.array([8, 8]), 2.0, np.array([1000, 1000]))
    assert columns.tolist() == [120.0, 240.0]
