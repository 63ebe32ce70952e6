"""The Prometheus rules of trainguard, from one source of truth (the monitoring-mixin pattern).

Every alert and recording rule is defined once here, with its thresholds taken from the policy
(`trainguard.policy.Policy().alerts` and `.cost`), and rendered into one rule file per concern:

    training.rules.yml   loss, gradients, stalls, throughput, data utilisation, checkpoints
    hardware.rules.yml   GPU temperature, Xid errors, allocator fragmentation
    io-nccl.rules.yml    disk await, data loader starvation, communication overhead, NCCL watchdog
    cost.rules.yml       cost per 1000 steps, budget overrun, the three budget tiers
    meta.rules.yml       the agent itself, environment drift between nodes
    fleet-shard.rules.yml   at scale (docs/scale.md): per-node aggregates each shard Prometheus records
                         and remote-writes to the global one
    fleet-global.rules.yml  on the global Prometheus: the rules that need every node (the job stalled
                         everywhere, one node far slower than the rest, the job's cost)

The files under alerts/ are generated with the default policy and checked in; a test renders them
again and fails on any difference. `trainguard alerts render --policy FILE` renders a run's own.

An alert that should act carries an `action` label from `trainguard.actions`; Alertmanager routes those
to the agent's webhook (see alertmanager.py) and the agent's ledger decides what to do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from trainguard import actions
from trainguard.policy import Policy

RUNBOOK_BASE = "https://github.com/trainguard/trainguard/blob/main/docs/runbooks.md"
AGENT_JOB = "trainguard"

# Windows: rates over RATE, baselines (median, peak) over BASELINE. Counters are left raw by the agent
# (as node_exporter leaves them) so every ratio below is a ratio of rates over the same window.
RATE = "5m"
BASELINE = "30m"
# A baseline needs this many samples before a spike or an explosion can be judged against it.
BASELINE_MIN_SAMPLES = 10
STEPPING_LOSS = "trainguard:training_loss:stepping"
# Per run: nodes of one run report the same step counter, so steps are `max`ed and GPUs `sum`med.
RUN = "job, run_id"
NODE = "job, instance"
# A node's ranks are running (the host collector checks the pids in RUN/control/ranks): a run that ended
# or was stopped is not stalled, and its checkpoints do not go stale.
RANKS_UP = f"max by ({NODE}) (trainguard_rank_process_up) > 0"


@dataclass(frozen=True)
class Record:
    record: str
    expr: str

    def to_dict(self) -> dict:
        return {"record": self.record, "expr": _clean(self.expr)}


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    severity: str                  # critical | warning | info
    summary: str
    description: str
    for_: str = "0s"
    action: str | None = None      # from trainguard.actions; routed to the agent's webhook
    labels: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.action is not None and self.action not in actions.REMOTE_ACTIONS:
            raise ValueError(f"alert {self.name}: action {self.action!r} is not one of {actions.REMOTE_ACTIONS}")

    def to_dict(self) -> dict:
        labels = {"severity": self.severity, **self.labels}
        if self.action:
            labels["action"] = self.action
        rule = {"alert": self.name, "expr": _clean(self.expr)}
        if self.for_ not in ("0s", "0", ""):
            rule["for"] = self.for_
        rule["labels"] = labels
        rule["annotations"] = {
            "summary": self.summary,
            "description": self.description,
            "runbook_url": f"{RUNBOOK_BASE}#{self.name.lower()}",
        }
        return rule


@dataclass(frozen=True)
class Group:
    file: str          # rule file stem: <file>.rules.yml
    name: str
    rules: tuple

    def to_dict(self) -> dict:
        return {"name": self.name, "rules": [rule.to_dict() for rule in self.rules]}


def _clean(expr: str) -> str:
    """One line per clause, no trailing blanks: readable in the YAML and in Prometheus' UI."""
    return "\n".join(line.rstrip() for line in expr.strip().splitlines())


def _num(value: float) -> str:
    """A threshold as PromQL writes it: 0.3, not 0.30000000000000004; 10, not 10.0."""
    text = f"{value:.10g}"
    return text


# ----------------------------------------------------------------------------------------- training

def training(policy: Policy) -> list[Group]:
    a = policy.alerts
    records = Group("training", "trainguard-training.records", (
        # The loss while the run steps. A stalled rank's gauge repeats its last loss at every scrape;
        # let those samples into the baseline and a long stall becomes most of it, its spread falls to
        # 0, and the steps re-done after a restore from an earlier checkpoint read as a spike. A step
        # that has not moved for stall_seconds is a stall (TrainingStalled), not training.
        Record(STEPPING_LOSS,
               f"trainguard_training_loss\n"
               f"and changes(trainguard_training_step[{_num(a.stall_seconds)}s]) > 0"),
        Record("trainguard:training_loss:median" + BASELINE,
               f"quantile_over_time(0.5, {STEPPING_LOSS}[{BASELINE}])"),
        # A robust spread (interquartile range / 1.349 estimates sigma for normal noise): one spike
        # barely moves it, so the spike stands out against the baseline it is part of.
        Record("trainguard:training_loss:robust_stddev" + BASELINE,
               f"(quantile_over_time(0.75, {STEPPING_LOSS}[{BASELINE}])\n"
               f" - quantile_over_time(0.25, {STEPPING_LOSS}[{BASELINE}])) / 1.349"),
        Record("trainguard:training_grad_norm:median" + BASELINE,
               f"quantile_over_time(0.5, trainguard_training_grad_norm[{BASELINE}])"),
        # tokens_trained and tokens_loaded are the trainer's running totals, gauges that a rollback
        # sets back: their slope (deriv) is the rate, and a rollback shows as the loss it is.
        Record("trainguard:effective_throughput:tokens_per_second",
               f"sum by ({RUN}) (deriv(trainguard_training_tokens_trained[{RATE}]))"),
        Record("trainguard:data_utilization:ratio",
               f"sum by ({RUN}) (deriv(trainguard_training_tokens_trained[{RATE}]))\n"
               f"/ (sum by ({RUN}) (deriv(trainguard_training_tokens_loaded[{RATE}])) > 0)"),
    ))
    alerts = Group("training", "trainguard-training.alerts", (
        Alert("LossNaN", "trainguard_training_loss != trainguard_training_loss\n"
                         "or abs(trainguard_training_loss) == +Inf",
              "critical", "Training loss is NaN or infinite on {{ $labels.instance }}",
              "The loss has stayed non-finite for " + a.for_short + ". The guard skips a non-finite step "
              "on its own; a loss that stays non-finite means the weights or optimizer state are "
              "already corrupt, so the run is rolled back to its last stable checkpoint.",
              for_=a.for_short, action=actions.ROLLBACK),
        Alert("LossSpike",
              f"trainguard_training_loss\n"
              f"> trainguard:training_loss:median{BASELINE}\n"
              f"  + {_num(a.loss_spike_sigma)} * trainguard:training_loss:robust_stddev{BASELINE}\n"
              f"  + 0.001 * abs(trainguard:training_loss:median{BASELINE})\n"
              f"and count_over_time({STEPPING_LOSS}[{BASELINE}]) >= {BASELINE_MIN_SAMPLES}",
              "critical", "Loss spike on {{ $labels.instance }}: {{ $value | printf \"%.4g\" }}",
              f"The loss is more than {_num(a.loss_spike_sigma)} robust standard deviations above its "
              f"{BASELINE} median. The run is rolled back to its last stable checkpoint, the data window "
              "is skipped and the learning rate lowered.",
              action=actions.ROLLBACK),
        Alert("GradNormExplosion",
              f"trainguard_training_grad_norm\n"
              f"> {_num(a.grad_explode_factor)} * trainguard:training_grad_norm:median{BASELINE}\n"
              f"and count_over_time(trainguard_training_grad_norm[{BASELINE}]) >= {BASELINE_MIN_SAMPLES}",
              "critical", "Gradient norm explosion on {{ $labels.instance }}: {{ $value | printf \"%.4g\" }}",
              f"The global gradient norm is more than {_num(a.grad_explode_factor)} times its {BASELINE} "
              "median. The run is rolled back to its last stable checkpoint with a lower learning rate.",
              action=actions.ROLLBACK),
        Alert("TrainingStalled",
              f"min by ({NODE}, run_id) (time() - trainguard_training_last_step_timestamp_seconds)\n"
              f"> {_num(a.stall_seconds)}\n"
              f"and on ({NODE}) {RANKS_UP}",
              "critical", "No training step for over " + _num(a.stall_seconds) + "s on {{ $labels.instance }}",
              "The ranks on this node have not finished a step for " + _num(a.stall_seconds) + " s and the "
              "run has not ended: a hung collective, a dead rank or a stuck data loader. The agent ends "
              "the node's ranks; torch's elastic launcher starts them again and they resume from the "
              "latest verified checkpoint.",
              for_=a.for_short, action=actions.RESTORE),
        Alert("LowEffectiveThroughput",
              f"trainguard:effective_throughput:tokens_per_second\n"
              f"< {_num(a.low_throughput_ratio)} * max_over_time(trainguard:effective_throughput:tokens_per_second[{BASELINE}])",
              "warning", "Effective throughput of {{ $labels.job }} is under "
              + f"{a.low_throughput_ratio:.0%} of its recent peak",
              "Tokens trained per second (skipped and rolled-back steps excluded) fell under "
              f"{a.low_throughput_ratio:.0%} of the best of the last {BASELINE}. Look at the data loader, "
              "the disks, communication overhead and stragglers.",
              for_=a.for_long),
        Alert("LowDataUtilization",
              "trainguard:data_utilization:ratio < " + _num(a.data_utilization_min),
              "warning", "Only {{ $value | humanizePercentage }} of loaded tokens are trained",
              f"Tokens trained / tokens loaded is under {a.data_utilization_min:.0%} over {RATE}: steps are "
              "skipped or rolled back, or batches are padded. Each lost token was paid for.",
              for_=a.for_long),
        Alert("CheckpointStale",
              "time() - trainguard_checkpoint_last_timestamp_seconds > " + _num(a.checkpoint_stale_seconds)
              + f"\nand on ({NODE}) {RANKS_UP}",
              "warning", "No checkpoint for over {{ $value | humanizeDuration }} on {{ $labels.instance }}",
              f"The newest verified checkpoint is older than {_num(a.checkpoint_stale_seconds)} s: a "
              "failure now loses that much work. Check the checkpoint directory's disk and the trainer's "
              "checkpoint events.",
              for_=a.for_short),
    ))
    return [records, alerts]


# ----------------------------------------------------------------------------------------- hardware

def hardware(policy: Policy) -> list[Group]:
    a = policy.alerts
    records = Group("hardware", "trainguard-hardware.records", (
        Record("trainguard:memory_fragmentation:ratio",
               "trainguard_training_memory_allocated_bytes\n"
               "/ (trainguard_training_memory_reserved_bytes > 0)"),
    ))
    alerts = Group("hardware", "trainguard-hardware.alerts", (
        Alert("GPUOverheating", "DCGM_FI_DEV_GPU_TEMP > " + _num(a.gpu_temp_c),
              "warning", "GPU {{ $labels.gpu }} on {{ $labels.instance }} at {{ $value }} °C",
              f"The GPU is above {_num(a.gpu_temp_c)} °C and will throttle its clocks, slowing every rank "
              "that waits for it. Check airflow, fans and the power limit.",
              for_=a.for_long),
        Alert("GPUXidError", f"increase(trainguard_gpu_xid_errors_total[{RATE}]) > 0",
              "critical", "Xid {{ $labels.xid }} on GPU {{ $labels.gpu }} of {{ $labels.instance }}",
              "The driver reported an Xid error (NVML events and the kernel log). Some (48, 63, 64, 74, 79, "
              "94, 95) mean the GPU needs a reset or the node needs draining; see the runbook before "
              "restarting the run here."),
        Alert("GPUMemoryFragmented", "trainguard:memory_fragmentation:ratio < " + _num(a.fragmentation_min),
              "warning", "Allocator memory fragmented on {{ $labels.instance }}: "
              "{{ $value | humanizePercentage }} of reserved memory in use",
              f"Allocated / reserved device memory is under {_num(a.fragmentation_min)}: the caching "
              "allocator holds blocks it cannot reuse, which ends in out-of-memory errors at a "
              "batch that used to fit.",
              for_=a.for_long),
    ))
    return [records, alerts]


# ----------------------------------------------------------------------------------------- io, nccl

def io_nccl(policy: Policy) -> list[Group]:
    a = policy.alerts
    records = Group("io-nccl", "trainguard-io-nccl.records", (
        # Average time per completed operation, as iostat's await: time spent / operations.
        Record("instance_device:node_disk_await:seconds",
               f"(rate(node_disk_read_time_seconds_total[{RATE}]) + rate(node_disk_write_time_seconds_total[{RATE}]))\n"
               f"/ (rate(node_disk_reads_completed_total[{RATE}]) + rate(node_disk_writes_completed_total[{RATE}]) > 0)"),
        # Per-step timings are gauges of each rank's latest step; their means over the window are a
        # sample of the window's steps.
        Record("trainguard:data_wait:ratio",
               f"avg_over_time(trainguard_training_data_wait_seconds[{RATE}])\n"
               f"/ (avg_over_time(trainguard_training_step_time_seconds[{RATE}]) > 0)"),
        Record("trainguard:comm_overhead:ratio",
               f"avg_over_time(trainguard_training_comm_seconds[{RATE}])\n"
               f"/ (avg_over_time(trainguard_training_step_time_seconds[{RATE}]) > 0)"),
    ))
    alerts = Group("io-nccl", "trainguard-io-nccl.alerts", (
        Alert("DiskAwaitHigh", "instance_device:node_disk_await:seconds > " + _num(a.disk_await_ms / 1000.0),
              "warning", "Disk {{ $labels.device }} on {{ $labels.instance }} averages "
              "{{ $value | humanizeDuration }} per operation",
              f"Average disk await is above {_num(a.disk_await_ms)} ms over {RATE}: data loading and "
              "checkpoint writes on this disk are slow.",
              for_=a.for_long),
        Alert("DataLoaderStarved", "trainguard:data_wait:ratio > " + _num(a.data_wait_ratio),
              "warning", "Ranks on {{ $labels.instance }} wait for data {{ $value | humanizePercentage }} of the time",
              f"More than {a.data_wait_ratio:.0%} of step time is spent waiting for the next batch: add "
              "loader workers, prefetch, or move the data to faster storage.",
              for_=a.for_long),
        Alert("CommOverheadHigh", "trainguard:comm_overhead:ratio > " + _num(a.comm_overhead_max),
              "warning", "Communication takes {{ $value | humanizePercentage }} of step time on {{ $labels.instance }}",
              f"More than {a.comm_overhead_max:.0%} of step time is spent in collectives: a slow link, a "
              "straggler rank, or buckets too small to overlap with compute.",
              for_=a.for_long),
        Alert("NCCLWatchdogTimeout",
              f'sum by ({NODE}) (increase(trainguard_nccl_events_total{{kind=~"watchdog_timeout|watchdog_stuck"}}[{RATE}])) > 0',
              "critical", "NCCL watchdog timed out on {{ $labels.instance }}",
              "A collective did not finish within the process group's timeout: a rank is hung or a link "
              "is down. The agent ends the node's ranks; torch's elastic launcher starts them again from "
              "the latest verified checkpoint.",
              action=actions.RESTORE),
    ))
    return [records, alerts]


# --------------------------------------------------------------------------------------------- cost

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
               f"trainguard:cost_per_1k_steps:usd / {_num(c.budget_per_1k_steps)} - 1"),
    ))
    tiers = (("CostBudgetWarn", c.tiers.warn, actions.COST_WARN, "warning",
              "Evaluation and profiling are paused."),
             ("CostBudgetThrottle", c.tiers.throttle, actions.COST_THROTTLE, "critical",
              "Cached device memory is freed and the micro-batch cut by 25%, with gradient accumulation "
              "keeping the tokens per optimizer step."),
             ("CostBudgetStop", c.tiers.stop, actions.COST_STOP, "critical",
              "A verified checkpoint is saved, the run stops cleanly and writes a cost summary."))
    alerts = Group("cost", "trainguard-cost.alerts", tuple(
        Alert(name, f"trainguard:cost_budget_overrun:ratio >= {_num(tier)}", severity,
              "Cost of run {{ $labels.run_id }} is {{ $value | humanizePercentage }} over budget",
              f"Cost per 1000 steps is at least {tier:.0%} over the budget of "
              f"${_num(c.budget_per_1k_steps)} (at ${_num(c.price_per_gpu_hour)} per GPU-hour). {did}",
              for_=policy.alerts.for_short, action=action)
        for name, tier, action, severity, did in tiers))
    return [records, alerts]


# --------------------------------------------------------------------------------------------- meta

def meta(policy: Policy, agent_job: str = AGENT_JOB) -> list[Group]:
    a = policy.alerts
    alerts = Group("meta", "trainguard-meta.alerts", (
        Alert("AgentDown", f'up{{job="{agent_job}"}} == 0',
              "critical", "trainguard agent {{ $labels.instance }} is down",
              "Prometheus cannot scrape the agent: this node's GPUs, IO and training are unwatched and "
              "its alerts cannot act. Check the agent's process and its log.",
              for_=a.for_short),
        Alert("EnvironmentMismatch",
              "count by (job) (\n"
              "  count by (job, torch, cuda, nccl, driver, python, trainguard) (trainguard_node_info)\n"
              ") > 1",
              "warning", "Nodes of {{ $labels.job }} run {{ $value }} different software environments",
              "The nodes of this run report different torch, CUDA, NCCL, driver or Python versions: "
              "numerics and collectives may differ between ranks. Compare trainguard_node_info "
              "across nodes.",
              for_=a.for_short),
    ))
    return [alerts]


# --------------------------------------------------------------------------------------------- fleet

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
              f"time() - max by ({JOB}) (trainguard:node:last_step_timestamp_seconds) > {_num(a.stall_seconds)}\n"
              f"and on (job) max by (job) (trainguard:node:ranks_up) > 0",
              "critical", "Run {{ $labels.run_id }} has made no step on any node for over "
              + _num(a.stall_seconds) + "s",
              f"No node of the run has finished a step for {_num(a.stall_seconds)} s while its ranks are up: a "
              "collective hung across the job. One restore for the job: the agent ends its node's ranks, "
              "and torch's elastic rendezvous restarts every node's workers from the latest verified "
              "checkpoint. Every agent gets the alert; the first to claim it acts (docs/scale.md).",
              for_=a.for_short, action=actions.RESTORE),
        Alert("JobNodeSlow",
              f"trainguard:node:step_time_seconds\n"
              f"> on ({JOB}) group_left () ({_num(a.slow_node_factor)} * trainguard:job:step_time_seconds:median)\n"
              f"and on ({JOB}) trainguard:job:nodes >= 3",
              "warning", "{{ $labels.instance }} steps far slower than the rest of run {{ $labels.run_id }}",
              f"The node's slowest rank takes over {_num(a.slow_node_factor)} times the median node's step time; "
              "every other node waits for it at each collective. Look at its GPUs (clocks, temperature), its "
              "HCAs and its data loader; `trainguard diagnose` names the layer.",
              for_=a.for_long),
    ))
    return [records, alerts]


# ----------------------------------------------------------------------------- silent corruption

def sdc(policy: Policy) -> list[Group]:
    """Replica mismatches (trainer/replica_check.py): the trainer has already rolled back on its own,
    within the step; the alert tells a human, who decides about the hardware."""
    alerts = Group("sdc", "trainguard-sdc.alerts", (
        Alert("ReplicaMismatch",
              f'max by ({RUN}) (increase(trainguard_training_events_total{{type="replica_mismatch"}}[{RATE}])) > 0',
              "critical", "Replicas of run {{ $labels.run_id }} disagreed: silent data corruption",
              "Data-parallel replicas that train in lockstep held different weights or gradients at a replica "
              "check (bit-exact fingerprints). The trainer rolled every rank back to the newest verified "
              "checkpoint on its own; the incident under RUN/incidents/ names the rank and node when that can "
              "be told, and a node named twice within guard.replica_cordon_window_seconds is cordoned."),
    ))
    return [alerts]


# ------------------------------------------------------------------------------------------ culprit

def culprit(policy: Policy) -> list[Group]:
    """A hang's culprit named, and its node kept out (agent/culprit.py, docs/incidents.md)."""
    alerts = Group("culprit", "trainguard-culprit.alerts", (
        Alert("HangCulprit",
              'max by (job, node, kind) (increase(trainguard_culprit_verdicts_total{node!=""}[10m])) > 0',
              "critical", "A {{ $labels.kind }} was traced to node {{ $labels.node }}",
              "The agents gathered the evidence of a stall (Flight Recorder, py-spy stacks, the nodes' "
              "signals) and named this node's rank(s) as the culprit. `trainguard incidents RUN` shows the "
              "verdict and its evidence; with restore.evict the node is cordoned and the job re-forms "
              "without it."),
        Alert("NodeCordoned", "max by (job, node) (trainguard_node_cordoned) > 0",
              "warning", "Node {{ $labels.node }} is cordoned: kept out of the job",
              "The node was the culprit of a hang and is kept out of the job (RUN/control/cordon/<host>); "
              "its launcher refuses to join. Repair or replace it, then `trainguard uncordon RUN HOST`."),
    ))
    return [alerts]


CONCERNS = (training, hardware, io_nccl, cost, meta, sdc, culprit)
# The global tier's files are rendered and checked in beside the node tier's, but not loaded by
# `write()` unless asked: one Prometheus scraping the agents needs only CONCERNS.
FLEET_CONCERNS = (fleet_shard, fleet_global)


# --------------------------------------------------------------------------------------- fail-slow

def fail_slow(policy: Policy) -> list[Group]:
    """A rank slower than the fastest for a while (trainguard/decide/straggler.py scores it in the agent).

    Every agent of a run reads the shared run directory's rank logs, so the same (rank, node) score may
    come from several instances: `min by` keeps one series per rank. It does not act: eviction of a
    persistent straggler is not built yet (`restore.evict_stragglers` accepts only off)."""
    score_min = policy.diagnose.straggler_score_min
    alerts = Group("training", "trainguard-straggler.alerts", (
        Alert("TrainingStraggler",
              f"min by (job, run_id, rank, node) (trainguard_rank_straggler_score) < {_num(score_min)}",
              "warning", "Rank {{ $labels.rank }} on {{ $labels.node }} is a straggler: "
              "{{ $value | printf \"%.2f\" }} of the fastest rank's speed",
              f"The rank's recent compute time (step time less data wait and communication) has stayed more "
              f"than {1 / score_min:.2f} times the fastest rank's (NVRx relative score under {_num(score_min)}) "
              f"for {policy.alerts.for_long}: every other rank waits for it in each all-reduce. Look at that "
              "node's GPU clocks, temperature and neighbours; `trainguard diagnose` scores it offline.",
              for_=policy.alerts.for_long),
    ))
    return [alerts]


CONCERNS += (fail_slow,)


def groups(policy: Policy | None = None) -> list[Group]:
    policy = policy or Policy()
    return [group for concern in CONCERNS for group in concern(policy)]


def alerts(policy: Policy | None = None) -> list[Alert]:
    return [rule for group in groups(policy) for rule in group.rules if isinstance(rule, Alert)]


HEADER = "# Generated by `trainguard alerts render` from alerts/rules.py and the policy. Do not edit.\n"


class _Dumper(yaml.SafeDumper):
    """Multi-line expressions as YAML block scalars (``|``), so the files read like hand-written rules."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(data: dict) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=120)


def render(policy: Policy | None = None, concerns=None) -> dict[str, str]:
    """{file name: YAML text} of every rule file (of `concerns`; default: both tiers)."""
    policy = policy or Policy()
    concerns = CONCERNS + FLEET_CONCERNS if concerns is None else concerns
    files: dict[str, list[dict]] = {}
    for group in (g for concern in concerns for g in concern(policy)):
        files.setdefault(f"{group.file}.rules.yml", []).append(group.to_dict())
    return {name: HEADER + dump({"groups": body}) for name, body in files.items()}


def write(out_dir: str | Path, policy: Policy | None = None, concerns=None) -> list[Path]:
    """The rule files of `concerns` (default: the node tier, CONCERNS) written under `out_dir`."""
    concerns = CONCERNS if concerns is None else concerns
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render(policy, concerns).items():
        path = out / name
        path.write_text(text)
        written.append(path)
    return written
