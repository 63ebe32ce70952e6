"""Cost: cost per 1000 steps, budget overrun, the three budget tiers (cost.rules.yml)."""

from __future__ import annotations

from trainguard import actions
from trainguard.alerts.promql import RATE, RUN, Alert, Group, Record, num
from trainguard.policy import Policy


def cost(policy: Policy) -> list[Group]:
    """The CostBudget* tiers over the agents' cost meters (trainguard/decide/cost.py), with the policy's numbers.

    The arithmetic (GPU-hours x price over the last `window_steps` steps, per 1000 steps) is done once, by the
    pure meter every agent runs and exports as `trainguard_cost_*`; these rules aggregate it per run and judge
    the tiers. A PromQL copy over a fixed time window would disagree with the meter: a run at budget pace on
    8 GPUs makes a step every 27 s, too few in 5 minutes for a steady rate. Like the meter, no tier is judged
    before `min_steps` steps have been made, nor while no step is being made.
    """
    c = policy.cost
    stepping = (f"and on ({RUN}) max by ({RUN}) (trainguard_training_steps_total) >= {c.min_steps}\n"
                f"and on ({RUN}) max by ({RUN}) (rate(trainguard_training_steps_total[{RATE}])) > 0")
    records = Group("cost", "trainguard-cost.records", (
        Record("trainguard:training_steps:rate" + RATE,
               f"max by ({RUN}) (rate(trainguard_training_steps_total[{RATE}]))"),
        Record("trainguard:billable_gpus:max", f"max by ({RUN}) (trainguard_cost_billable_gpus)"),
        Record("trainguard:cost_per_1k_steps:usd", f"max by ({RUN}) (trainguard_cost_per_1k_steps_usd)\n{stepping}"),
        Record("trainguard:cost_budget_overrun:ratio",
               f"trainguard:cost_per_1k_steps:usd / {num(c.budget_per_1k_steps)} - 1"),
    ))
    tiers = (("CostBudgetWarn", c.tiers.warn, actions.COST_WARN, "warning",
              "Evaluation and profiling are paused."),
             ("CostBudgetThrottle", c.tiers.throttle, actions.COST_THROTTLE, "critical",
              "Cached device memory is freed and the micro-batch cut by 25%, with gradient accumulation "
              "keeping the tokens per optimizer step."),
             ("CostBudgetStop", c.tiers.stop, actions.COST_STOP, "critical",
              "A verified checkpoint is saved, the run stops cleanly and writes a cost summary."))
    alerts = Group("cost", "trainguard-cost.alerts", tuple(
        Alert(name, f"trainguard:cost_budget_overrun:ratio >= {num(tier)}", severity,
              "Cost of run {{ $labels.run_id }} is {{ $value | humanizePercentage }} over budget",
              f"Cost per 1000 steps is at least {tier:.0%} over the budget of "
              f"${num(c.budget_per_1k_steps)} (at ${num(c.price_per_gpu_hour)} per GPU-hour). {did}",
              for_=policy.alerts.for_short, action=action)
        for name, tier, action, severity, did in tiers))
    return [records, alerts]
