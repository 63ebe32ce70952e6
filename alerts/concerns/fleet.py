"""The fleet tiers (docs/scale.md): what each shard Prometheus records per node and remote-writes, and the
rules the global Prometheus runs over every node (fleet-shard.rules.yml, fleet-global.rules.yml).
"""

from __future__ import annotations

from trainguard import actions
from trainguard.alerts.promql import NODE, Alert, Group, Record, num
from trainguard.policy import Policy


# What a shard Prometheus remote-writes to the global one (docs/scale.md): its per-node aggregates, and
# the few raw families the run-wide rules of cost.rules.yml and meta.rules.yml read, so those run on the
# global tier unchanged. A few dozen series per node instead of ~1,200.
GLOBAL_FEED = ("trainguard:node:.*", "trainguard_cost_.*", "trainguard_training_steps_total", "trainguard_node_info",
               "up")
JOB = "job, run_id"


def fleet_shard(policy: Policy) -> list[Group]:
    """Per node, on the shard that scrapes it: one series per node and run for the global tier to compare."""
    return [Group("fleet-shard", "trainguard-fleet.shard-records", (
        Record("trainguard:node:last_step_timestamp_seconds",
               f"max by ({NODE}, run_id) (trainguard_training_last_step_timestamp_seconds)"),
        Record("trainguard:node:step_time_seconds",   # the node's slowest rank: the one its peers wait for
               f"max by ({NODE}, run_id) (trainguard_training_step_time_seconds)"),
        Record("trainguard:node:ranks_up", f"max by ({NODE}) (trainguard_rank_process_up)"),
        Record("trainguard:node:cost_usd", f"max by ({NODE}, run_id) (trainguard_cost_usd)"),
    ))]


def fleet_global(policy: Policy) -> list[Group]:
    """On the global Prometheus, over every shard's trainguard:node:* series (the `shard` label aggregated away)."""
    a = policy.alerts
    records = Group("fleet-global", "trainguard-fleet.global-records", (
        # Each node's meter bills the run's GPUs (system.gpu_count is the world's), so the nodes agree and
        # the job's cost is their max, not their sum.
        Record("trainguard:job:cost_usd", f"max by ({JOB}) (trainguard:node:cost_usd)"),
        Record("trainguard:job:nodes", f"count by ({JOB}) (trainguard:node:last_step_timestamp_seconds)"),
        Record("trainguard:job:step_time_seconds:median",
               f"quantile by ({JOB}) (0.5, trainguard:node:step_time_seconds)"),
    ))
    alerts = Group("fleet-global", "trainguard-fleet.global-alerts", (
        Alert("JobStalledEverywhere",
              f"time() - max by ({JOB}) (trainguard:node:last_step_timestamp_seconds) > {num(a.stall_seconds)}\n"
              f"and on (job) max by (job) (trainguard:node:ranks_up) > 0",
              "critical", "Run {{ $labels.run_id }} has made no step on any node for over "
              + num(a.stall_seconds) + "s",
              f"No node of the run has finished a step for {num(a.stall_seconds)} s while its ranks are up: a "
              "collective hung across the job. One restore for the job: the agent ends its node's ranks, "
              "and torch's elastic rendezvous restarts every node's workers from the latest verified "
              "checkpoint. Every agent gets the alert; the first to claim it acts (docs/scale.md).",
              for_=a.for_short, action=actions.RESTORE),
        Alert("JobNodeSlow",
              f"trainguard:node:step_time_seconds\n"
              f"> on ({JOB}) group_left () ({num(a.slow_node_factor)} * trainguard:job:step_time_seconds:median)\n"
              f"and on ({JOB}) trainguard:job:nodes >= 3",
              "warning", "{{ $labels.instance }} steps far slower than the rest of run {{ $labels.run_id }}",
              f"The node's slowest rank takes over {num(a.slow_node_factor)} times the median node's step time; "
              "every other node waits for it at each collective. Look at its GPUs (clocks, temperature), its "
              "HCAs and its data loader; `trainguard diagnose` names the layer.",
              for_=a.for_long),
    ))
    return [records, alerts]
