"""The cost meter's token and energy budgets (trainguard/decide/cost.py): tiers on dollars per million
(useful) tokens and on kWh per 1000 steps, beside the per-step budget, with the same tiers."""

from __future__ import annotations

import dataclasses

from trainguard.actions import COST_STOP, COST_THROTTLE, COST_WARN
from trainguard.decide.cost import CostMeter, Usage, usage_of
from trainguard.policy import CostPolicy, from_mapping

# One GPU at $3.6/hour: a cent per 10 s. Steps of 1 s with 1000 tokens each: $1 per million tokens.
BASE = CostPolicy(price_per_gpu_hour=3.6, budget_per_1k_steps=1e9, window_steps=10, min_steps=5)


def run(policy, usage_at, steps=40):
    meter, acted = CostMeter(policy), []
    for step in range(1, steps + 1):
        acted += [(d.action, d.detail.get("basis")) for d in meter.observe(step, float(step), 1, None, usage_at(step))]
    return meter, acted


def test_useful_tokens_budget_acts_when_rollbacks_undo_work():
    # $1 per million processed tokens; a rollback at step 20 undid 10 steps: useful tokens lag behind
    usage = lambda step: Usage(1000.0, 1000.0 * (step if step <= 20 else step - 10))   # noqa: E731
    processed = dataclasses.replace(BASE, budget_per_million_tokens=1.2, token_basis="tokens")
    assert run(processed, usage)[1] == []                       # $1/M against 1.2: within budget
    useful = dataclasses.replace(processed, token_basis="useful_tokens")
    meter, acted = run(useful, usage)
    # right after the rollback: step 21 paid $0.021 for 11,000 kept tokens, $1.91 per million, +59%: warn
    assert acted == [(COST_WARN, "useful_tokens")]
    assert meter.state.usd_per_million_tokens > meter.state.cost_usd / meter.state.tokens * 1e6


def test_energy_budget_tiers():
    # 700 W on one GPU, 1 s steps: 0.194 kWh per 1000 steps; a budget of 0.1 kWh is 94% over (throttle)
    policy = dataclasses.replace(BASE, energy_budget_kwh_per_1k_steps=0.1)
    meter, acted = run(policy, lambda step: Usage(0.0, None, 700.0 * step))
    assert acted == [(COST_WARN, "energy"), (COST_THROTTLE, "energy")]
    assert abs(meter.state.kwh_per_1k_steps - 0.7 / 3.6) < 1e-9
    stop = dataclasses.replace(policy, energy_budget_kwh_per_1k_steps=0.05)
    assert (COST_STOP, "energy") in run(stop, lambda step: Usage(0.0, None, 700.0 * step))[1]
    assert run(BASE, lambda step: Usage(0.0, None, 700.0 * step))[1] == []        # off by default


def test_usage_of_a_step_record_and_the_policy_keys():
    record = {"metrics": {"tokens_per_second": 500.0, "step_time_seconds": 2.0, "tokens_trained": 4000},
              "system": {"world_size": 4}, "hardware": {"energy_joules": 10.0}}
    assert usage_of(record, gpus=8) == Usage(4000.0, 16000.0, 80.0)
    assert usage_of({"metrics": {}}) == Usage(0.0, None, None)
    policy = from_mapping({"cost": {"budget_per_million_tokens": 2.5, "token_basis": "tokens",
                                    "energy_budget_kwh_per_1k_steps": 0.3}})
    assert policy.cost.token_basis == "tokens"
