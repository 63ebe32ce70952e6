"""trainguard's Grafana dashboards, from one source of truth (the monitoring-mixin pattern).

Five dashboards, each a list of panels written with the builders in grafana.py; thresholds come from the
policy (trainguard.policy), the same numbers the alerts and the guard act on. The JSON files beside this
module are generated from it and checked in; tests/dashboards fails when they drift, and runs every
query below against a real Prometheus that scraped a real training run.

    python -m trainguard.dashboards.build            # rewrite dashboards/*.json
    trainguard dashboards render --out DIR           # the same, elsewhere, optionally with a policy

A query that can only have data when something happens (an event, such as an Xid error) or on some
hardware (a CUDA device) says so, `only_when="..."` with the reason, or falls back to zero with
`or vector(0)`; nothing is left out of the query test silently.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from trainguard import actions, event_types
from trainguard.alerts.mixin import Mixin
from trainguard.policy import Policy
from trainguard.dashboards.grafana import (ORANGE, RED, YELLOW, Annotation, Board, Query, Row, Threshold,
                                           Variable, q, stat, state_timeline, table, timeseries)

OUT_DIR = Path(__file__).resolve().parent
RATE = "$__rate_interval"

# Label matchers by dashboard scope. `run_id` and `hostname` default to ".*" (All), so series without
# the label still match. GPU series carry dcgm-exporter's labels (Hostname, gpu, UUID, modelName; the
# agent's too), so the GPU board draws dcgm-exporter's series or the agent's, whichever the job holds.
RUN = '{job=~"$job", run_id=~"$run_id"}'
GPU = '{job=~"$job", Hostname=~"$hostname", gpu=~"$gpu"}'
AGENT = '{job=~"$job"}'
# node_* series (node_exporter's beside the agent, `coexist`; else the agent's) carry no node name, and
# node_exporter's come from another job and port: they are joined by the host part of their instance to
# the instances of the agents of $job on $hostname.
HOST_OF_INSTANCE = '"host", "$1", "instance", "(.*):[0-9]+"'
ON_HOST = f'and on (host) label_replace(trainguard_agent_info{{job=~"$job", node=~"$hostname"}}, {HOST_OF_INSTANCE})'


def run(metric: str, **labels: str) -> str:
    """`metric{job=~"$job", run_id=~"$run_id", label="value"...}`."""
    extra = "".join(f', {key}="{value}"' for key, value in labels.items())
    return metric + RUN[:-1] + extra + "}"


def gpu(metric: str) -> str:
    return metric + GPU


def node(expr: str) -> str:
    return f"label_replace({expr}, {HOST_OF_INSTANCE}) {ON_HOST}"


CUDA_WHY = "needs a CUDA device: a CPU run has no caching allocator"
IB_WHY = "needs an InfiniBand or RoCE port on the node (the ib collector's counters)"
MFU_DESCRIPTION = ("Model FLOPs utilisation: the model's FLOPs per token x tokens/s over the device's documented peak "
                   "(runtime/mfu.py's table by GPU model, or the peak the run was given). No series, and n/a here, "
                   "where no peak is documented (a CPU, a GPU not in the table) or the model's FLOPs per token are "
                   "unknown: never an estimate.")
XID_WHY = "DCGM_FI_DEV_XID_ERRORS holds the last Xid, so it has no series before a GPU's first Xid"


# ------------------------------------------------------------------------------------------ variables

DATASOURCE = Variable("datasource", "Data source")


def job_var(anchor: str) -> Variable:
    return Variable("job", "Job", f"label_values({anchor}, job)")


RUN_ID = Variable("run_id", "Run", 'label_values(trainguard_training_step{job=~"$job"}, run_id)')
HOSTNAME = Variable("hostname", "Host", 'label_values(trainguard_agent_info{job=~"$job"}, node)')
# On the GPU dashboard hosts come from the GPU series, so it works on dcgm-exporter's data with no agent.
GPU_HOSTNAME = Variable("hostname", "Host", 'label_values(DCGM_FI_DEV_GPU_UTIL{job=~"$job"}, Hostname)')
GPU_ID = Variable("gpu", "GPU", 'label_values(DCGM_FI_DEV_GPU_UTIL{job=~"$job", Hostname=~"$hostname"}, gpu)')


# ---------------------------------------------------------------------------------------- annotations

# The events of the actions panel: those that lose steps and the restores they restart from, the cost tiers
# and the agent's requests carried out.
ACTION_EVENTS = "|".join([*(name for name, _ in actions.STEPS_LOST), event_types.CHECKPOINT_RESTORED,
                          *actions.COST_ACTIONS, event_types.ACTION])


def event_annotation(name: str, types: str, color: str, why: str = "") -> Annotation:
    expr = (f'sum by (run_id, type) (increase(trainguard_training_events_total{{job=~"$job", run_id=~"$run_id",'
            f' type=~"{types}"}}[1m])) > 0')
    return Annotation(name, expr, color, name.rstrip("s").lower() + " ({{type}})", only_when=why)


ANNOTATIONS = (
    event_annotation("Checkpoints", event_types.CHECKPOINT_SAVED, "green"),
    event_annotation("Skipped steps", actions.SKIP_STEP, "orange",
                     "only when the guard skips a bad step (the test run injects faults to cause them)"),
    event_annotation("Rollbacks", actions.ROLLBACK, "red",
                     "only when the guard or an alert rolls the run back"),
    event_annotation("Restores", f"{actions.RESTORE}|checkpoint_restored", "blue",
                     "only when ranks restart from a checkpoint or a rollback restores one"),
    Annotation("Alerts", 'ALERTS{alertstate="firing", job=~"$job"}', "purple", "{{alertname}}",
               only_when="ALERTS exists only while an alert fires"),
)


LR_PHASES = event_annotation("LR phase changes", event_types.LR_PHASE, "yellow",
                             "only when the LR schedule changes phase (after warm-up at the earliest)")


def dynamics_panels(policy: Policy) -> list:
    """The training-dynamics row (docs/dynamics.md): the breathing schedule's statistic and what clipping did."""
    b = policy.dynamics.breathing
    return [
        Row("Training dynamics"),
        timeseries("Gradient / parameter norm",
                   q(f"max by (run_id) ({run('trainguard_training_grad_norm')})"
                     f" / max by (run_id) ({run('trainguard_training_param_norm')} > 0)", "{{run_id}}"),
                   width=8, thresholds=(Threshold(b.pause_ratio, "green"),),
                   description=f"The breathing schedule's gradient variance. Under {b.pause_ratio:g} for "
                               f"{b.pause_window} exhale steps, it pauses (seed preset). Phase changes are the "
                               f"yellow annotations."),
        timeseries("Clip threshold", q(f"max by (run_id) ({run('trainguard_training_clip_threshold')})", "{{run_id}}"),
                   width=8, description="Fixed optim.grad_clip, or the adaptive rule's (zscore, percentile)."),
        timeseries("Clip coefficient", q(f"min by (run_id) ({run('trainguard_training_clip_coef_ratio')})",
                                         "{{run_id}}"), unit="percentunit", min=0, max=1, width=8,
                   description="The factor the gradients were scaled by; 1 = not clipped."),
    ]


# ----------------------------------------------------------------------------------------- dashboards

def training(policy: Policy) -> Board:
    a = policy.alerts
    items = [
        Row("Progress"),
        stat("Step", q(f"max({run('trainguard_training_step')})")),
        stat("Loss", q(f"max({run('trainguard_training_loss', rank='0')})"), decimals=4),
        stat("Tokens / s", q(f"sum({run('trainguard_training_tokens_per_second')})"), unit="short"),
        stat("MFU", q(f"avg({run('trainguard_training_mfu_ratio')})"), unit="percentunit", no_value="n/a",
             thresholds=(Threshold(0, RED), Threshold(0.2, YELLOW), Threshold(0.35, "green")),
             description=MFU_DESCRIPTION),
        stat("Checkpoint age", q(f"max({run('trainguard_checkpoint_age_seconds')})"), unit="s",
             thresholds=(Threshold(a.checkpoint_stale_seconds, RED),)),
        stat("Skipped steps", q(f"sum(max by (run_id) ({run('trainguard_training_events_total', type=actions.SKIP_STEP)}))"
                                f" or vector(0)"),
             thresholds=(Threshold(1, ORANGE),)),
        Row("Optimisation"),
        timeseries("Loss", q(f"max by (run_id) ({run('trainguard_training_loss')})", "{{run_id}} loss"),
                   q(f"max by (run_id) ({run('trainguard_training_val_loss')})", "{{run_id}} validation",
                     only_when="validation runs every eval_every steps; a short run may have none"),
                   width=8),
        timeseries("Gradient norm", q(f"max by (run_id) ({run('trainguard_training_grad_norm')})", "{{run_id}}"),
                   width=8, description=f"Global norm before clipping. The guard skips a step above "
                                        f"{policy.guard.grad_explode_factor:g}x its EMA."),
        timeseries("Learning rate", q(f"max by (run_id) ({run('trainguard_training_learning_rate')})",
                                      "{{run_id}}"), width=8),
        Row("Speed"),
        timeseries("Tokens per second", q(f"sum by (run_id) ({run('trainguard_training_tokens_per_second')})",
                                          "{{run_id}}"), width=8),
        timeseries("MFU", q(f"avg by (run_id) ({run('trainguard_training_mfu_ratio')})", "{{run_id}}"),
                   unit="percentunit", min=0, width=8, description=MFU_DESCRIPTION),
        timeseries("Step time by rank", q(f"max by (rank) ({run('trainguard_training_step_time_seconds')})",
                                          "rank {{rank}}"), unit="s", width=8,
                   description="A rank slower than the others is a straggler: every other rank waits for it."),
        timeseries("Step time breakdown", *[
            q(f"avg({run(f'trainguard_training_{part}_seconds')})", label)
            for part, label in (("data_wait", "data wait"), ("forward_backward", "forward + backward"),
                                ("optimizer", "optimizer"), ("comm", "communication"))],
                   unit="s", stack=True, width=12,
                   description="Mean over ranks. Communication overlaps backward, so the stack can exceed the step."),
        timeseries("Step time", q(f"avg({run('trainguard_training_step_time_seconds')})", "step"), unit="s",
                   width=12),
        timeseries("Straggler score by rank",
                   q(f"min by (rank, node) ({run('trainguard_rank_straggler_score')})", "rank {{rank}} ({{node}})"),
                   min=0, max=1, width=24,
                   thresholds=(Threshold(0, RED), Threshold(policy.diagnose.straggler_score_min, "green")),
                   description="The fastest rank's median compute time over this rank's (1 = as fast as the "
                               "fastest). Below the line for a while, TrainingStraggler fires "
                               "(docs/runbooks.md#trainingstraggler)."),
        Row("Memory"),
        timeseries("Memory by rank", *[
            q(f"max by (rank) ({run(f'trainguard_training_memory_{kind}_bytes')})", f"rank {{{{rank}}}} {kind}",
              only_when=CUDA_WHY) for kind in ("allocated", "reserved")],
                   q(f"max by (rank) ({run('trainguard_training_resident_memory_bytes')})", "rank {{rank}} resident"),
                   unit="bytes", width=12, description="Device memory the CUDA caching allocator holds (allocated) "
                                                       "and reserves, and the rank process's resident host memory."),
        timeseries("Allocated / reserved",
                   q(f"max by (rank) ({run('trainguard_training_memory_allocated_bytes')})"
                     f" / max by (rank) ({run('trainguard_training_memory_reserved_bytes')} > 0)", "rank {{rank}}",
                     only_when=CUDA_WHY),
                   unit="percentunit", min=0, max=1, width=12,
                   thresholds=(Threshold(0, RED), Threshold(a.fragmentation_min, "green"))),
    ] + dynamics_panels(policy)
    return Board("trainguard-training", "trainguard / Training",
                 "Loss, gradients, learning rate, throughput, MFU and step time of a run, with checkpoints, "
                 "guard actions and LR phase changes as annotations.",
                 [DATASOURCE, job_var("trainguard_training_step"), RUN_ID], items, ANNOTATIONS + (LR_PHASES,))


def gpu_node(policy: Policy) -> Board:
    a = policy.alerts
    temp = (Threshold(a.gpu_temp_c - 5, YELLOW), Threshold(a.gpu_temp_c, RED))
    legend = "{{Hostname}} GPU {{gpu}}"
    items = [
        Row("GPUs"),
        stat("GPUs", q(f"count({gpu('DCGM_FI_DEV_GPU_UTIL')})")),
        stat("Mean utilisation", q(f"avg({gpu('DCGM_FI_DEV_GPU_UTIL')})"), unit="percent"),
        stat("Hottest GPU", q(f"max({gpu('DCGM_FI_DEV_GPU_TEMP')})"), unit="celsius", thresholds=temp),
        stat("Power", q(f"sum({gpu('DCGM_FI_DEV_POWER_USAGE')})"), unit="watt"),
        stat("Memory used", q(f"sum({gpu('DCGM_FI_DEV_FB_USED')})"), unit="decmbytes"),
        stat("GPUs with Xid errors", q(f"count({gpu('DCGM_FI_DEV_XID_ERRORS')} > 0) or vector(0)"),
             thresholds=(Threshold(1, RED),),
             description="GPUs whose last Xid error code is not 0 (DCGM_FI_DEV_XID_ERRORS holds the last code)."),
        timeseries("GPU utilisation", q(gpu("DCGM_FI_DEV_GPU_UTIL"), legend), unit="percent", min=0, max=100),
        timeseries("GPU temperature", q(gpu("DCGM_FI_DEV_GPU_TEMP"), legend), unit="celsius", thresholds=temp),
        timeseries("Framebuffer memory used", q(gpu("DCGM_FI_DEV_FB_USED"), legend), unit="decmbytes", min=0),
        timeseries("Power draw", q(gpu("DCGM_FI_DEV_POWER_USAGE"), legend), unit="watt", min=0),
        timeseries("SM clock", q(f"{gpu('DCGM_FI_DEV_SM_CLOCK')} * 1e6", legend), unit="hertz"),
        timeseries("SM activity", q(gpu("DCGM_FI_PROF_SM_ACTIVE"), legend), unit="percentunit",
                   min=0, max=1, description="Share of cycles an SM has at least one warp assigned, averaged over "
                                             "the SMs: what GPU utilisation (any kernel running) does not say. "
                                             "From NVML GPM on Hopper and later (or dcgm-exporter's profiling "
                                             "fields); no series on older GPUs."),
        timeseries("Tensor core activity", q(gpu("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"), legend),
                   unit="percentunit", min=0, max=1,
                   description="Share of cycles the tensor (HMMA) pipe is active: the matrix math a model's MFU "
                               "is made of (NVML GPM, Hopper and later)."),
        timeseries("Xid errors", q(f"sum by (Hostname, gpu, xid, xid_class) "
                                   f"(increase(trainguard_gpu_xid_errors_total{GPU}[{RATE}]))",
                                   "{{Hostname}} GPU {{gpu}} Xid {{xid}} ({{xid_class}})"),
                   q(gpu("DCGM_FI_DEV_XID_ERRORS"), f"{legend} last Xid", only_when=XID_WHY), unit="none",
                   description="Xid errors by code and NVIDIA catalogue class (0 on a healthy node: the codes "
                               "that matter exist from the agent's start), and the last code per GPU (see the "
                               "GPUXidError runbook)."),
        Row("Node health"),
        timeseries("Node risk score", q(f"trainguard_node_risk_score{AGENT}", "{{instance}}"),
                   unit="none", min=0, max=1, thresholds=(Threshold(policy.node_risk.threshold, RED),),
                   description="The node-risk rule's score (decide/node_risk.py); at risk once it holds above "
                               "the line for node_risk.consecutive readings (NodeAtRisk: drain at the next "
                               "checkpoint)."),
        timeseries("Risk signals", q(f"trainguard_node_risk_signal{AGENT}", "{{instance}} {{signal}}"),
                   unit="none", min=0, description="Which signals weigh in each node's score, weighted."),
        timeseries("ECC errors per hour", q(f"3600 * rate(trainguard_gpu_ecc_correctable_errors_total{GPU}[{RATE}])",
                                            f"{legend} corrected"),
                   q(f"3600 * rate(trainguard_gpu_ecc_uncorrectable_errors_total{GPU}[{RATE}])",
                     f"{legend} uncorrectable"), unit="none", min=0,
                   description="Corrected and uncorrectable ECC errors per hour (volatile counts: since the "
                               "driver loaded)."),
        timeseries("Remapped rows and pending remaps", q(gpu("trainguard_gpu_remapped_rows_total"), f"{legend} rows"),
                   q(gpu("DCGM_FI_DEV_ROW_REMAP_PENDING"), f"{legend} pending"), unit="none", min=0,
                   description="Rows remapped for ECC errors; a pending remap needs a GPU reset to apply."),
        timeseries("PCIe replays per hour and link width",
                   q(f"3600 * rate(trainguard_gpu_pcie_replays_total{GPU}[{RATE}])", f"{legend} replays/h"),
                   q(f"{gpu('DCGM_FI_DEV_PCIE_LINK_WIDTH')} / {gpu('DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH')}",
                     f"{legend} width / max"), unit="none", min=0,
                   description="PCIe replays (retries) per hour, and the link width as a share of its maximum "
                               "(below 1: a downgraded link)."),
        timeseries("NVLink errors per hour",
                   q(f"3600 * (rate(trainguard_gpu_nvlink_crc_errors_total{GPU}[{RATE}]) "
                     f"+ rate(trainguard_gpu_nvlink_replay_errors_total{GPU}[{RATE}]))", legend),
                   unit="none", min=0, description="NVLink CRC and replay errors per hour, all links."),
        timeseries("Thermal and power slowdown", q(f"rate(trainguard_gpu_thermal_slowdown_seconds_total{GPU}[{RATE}])",
                                                   f"{legend} thermal"),
                   q(f"rate(trainguard_gpu_power_slowdown_seconds_total{GPU}[{RATE}])", f"{legend} power"),
                   unit="percentunit", min=0, max=1,
                   description="Share of time the clocks were held down by the thermal or the power policy."),
        timeseries("InfiniBand errors per hour",
                   q(node(f"3600 * sum by (instance) (rate(node_infiniband_symbol_error_total[{RATE}]))"),
                     "{{instance}} symbol errors", only_when=IB_WHY),
                   q(node(f"sum by (instance) (increase(node_infiniband_link_downed_total[{RATE}]))"),
                     "{{instance}} link downs", only_when=IB_WHY), unit="none", min=0,
                   description="Symbol errors per hour and link downs over the node's InfiniBand ports."),
        Row("Node"),
        timeseries("CPU busy", q(node(f'1 - avg by (instance) (rate(node_cpu_seconds_total{{mode="idle"}}'
                                      f'[{RATE}]))'), "{{instance}}"),
                   unit="percentunit", min=0, max=1, width=8),
        timeseries("Memory available", q(node('trainguard_host_memory_available_bytes{job=~"$job"}'), "{{instance}}"),
                   unit="bytes", min=0, width=8),
        timeseries("Load", q(node("node_load1"), "{{instance}} 1m"), width=8),
        timeseries("Rank processes up", q(f'sum by (instance) (trainguard_rank_process_up{AGENT})', "{{instance}}"),
                   width=12, min=0, description="Rank processes the agent finds alive (from RUN/control/ranks)."),
        timeseries("Rank resident memory", q(f"trainguard_rank_resident_memory_bytes{AGENT}", "rank {{rank}}"),
                   unit="bytes", width=12),
    ]
    return Board("trainguard-gpu-node", "trainguard / GPU and node",
                 "GPU health under DCGM's metric names (so the panels work on dcgm-exporter data too) and the "
                 "node's CPU, memory and rank processes.",
                 [DATASOURCE, job_var("DCGM_FI_DEV_GPU_UTIL"), GPU_HOSTNAME, GPU_ID], items)


def cost_goodput(policy: Policy) -> Board:
    c = policy.cost
    budget = c.budget_per_1k_steps
    tiers = (Threshold(budget * (1 + c.tiers.warn), YELLOW), Threshold(budget * (1 + c.tiers.throttle), ORANGE),
             Threshold(budget * (1 + c.tiers.stop), RED))
    overrun = (Threshold(c.tiers.warn, YELLOW), Threshold(c.tiers.throttle, ORANGE), Threshold(c.tiers.stop, RED))
    tier_names = [{"type": "value", "options": {str(v): {"text": t, "color": col, "index": v}}}
                  for v, t, col in ((0, "ok", "green"), (1, "warn", YELLOW), (2, "throttle", ORANGE), (3, "stop", RED))]
    items = [
        Row("Cost"),
        stat("Spent", q(f"max({run('trainguard_cost_usd')})"), unit="currencyUSD", width=6),
        stat("Cost per 1000 steps", q(f"max({run('trainguard_cost_per_1k_steps_usd')})"), unit="currencyUSD",
             thresholds=tiers, width=6),
        stat("Over budget", q(f"max({run('trainguard_cost_overrun_ratio')})"), unit="percentunit",
             thresholds=overrun, width=6),
        stat("Breaker", q(f"max({run('trainguard_cost_tier')})"), mappings=tier_names, width=6,
             thresholds=(Threshold(1, YELLOW), Threshold(2, ORANGE), Threshold(3, RED))),
        timeseries("Cost per 1000 steps against budget",
                   q(f"max by (run_id) ({run('trainguard_cost_per_1k_steps_usd')})", "{{run_id}} (agent meter)"),
                   q(f"max by (run_id) ({run('trainguard_cost_budget_per_1k_steps_usd')})", "budget"),
                   unit="currencyUSD", min=0, thresholds=tiers,
                   description=f"Tiers at +{c.tiers.warn:.0%} (warn), +{c.tiers.throttle:.0%} (throttle) and "
                               f"+{c.tiers.stop:.0%} (stop) over ${budget:g} per 1000 steps."),
        timeseries("Burn against budget",
                   q(f"max by (run_id) (deriv({run('trainguard_cost_usd')}[{RATE}])) * 3600", "{{run_id}} burn"),
                   q(f"max by (run_id) ({run('trainguard_cost_budget_per_1k_steps_usd')}) / 1000"
                     f" * max by (run_id) (deriv({run('trainguard_training_step')}[{RATE}])) * 3600",
                     "{{run_id}} budget at this step rate"),
                   unit="currencyUSD", min=0, description="Dollars per hour spent, and what the budget allows per "
                                                          "hour at the current step rate."),
        state_timeline("Breaker state", q(f"max by (run_id) ({run('trainguard_cost_tier')})", "{{run_id}}"),
                       mappings=tier_names, width=12, height=5,
                       thresholds=(Threshold(1, YELLOW), Threshold(2, ORANGE), Threshold(3, RED))),
        timeseries("Spend", q(f"max by (run_id) ({run('trainguard_cost_usd')})", "{{run_id}}"),
                   unit="currencyUSD", width=12, height=5),
        Row("Goodput"),
        timeseries("Goodput and badput, share of step time", *[
            q(f"avg({run(f'trainguard_training_{part}_seconds')})"
              f" / avg({run('trainguard_training_step_time_seconds')} > 0)", label)
            for part, label in (("forward_backward", "goodput: forward + backward"),
                                ("optimizer", "goodput: optimizer"), ("data_wait", "badput: data wait"),
                                ("comm", "badput: communication"))],
                   unit="percentunit", stack=True, min=0, width=12),
        timeseries("Steps lost", *[
            q(f"sum(max by (run_id) ({run('trainguard_training_events_total', type=kind)})) or vector(0)", label)
            for kind, label in actions.STEPS_LOST], width=12,
                   description="Guard and recovery events so far (counted once per run, not per rank); each "
                               "discards work already paid for."),
    ] + recovery_panels() + autopilot_panels()
    return Board("trainguard-cost-goodput", "trainguard / Cost and goodput",
                 "Spend, cost per 1000 steps against the policy's budget and tiers, the cost breaker, and "
                 "where step time goes.",
                 [DATASOURCE, job_var("trainguard_training_step"), RUN_ID], items)


def recovery_panels() -> list:
    """Goodput's in-process causes (docs/recovery.md, "The books"): what each in-process restart cost by part,
    how many, and the steps the snapshots kept; appended after the goodput panels, which stay as they were."""
    parts = ("teardown", "reform", "restore", "other")
    return [
        timeseries("In-process recovery time by part",
                   *[q(f"sum(max by (run_id) (increase({run('trainguard_recovery_in_process_seconds_total', part=part)}"
                       f"[{RATE}])))", f"in_process_{'recovery' if part == 'other' else part}") for part in parts],
                   unit="s", stack=True, min=0, width=12,
                   description="Seconds of in-process restarts, as goodput splits them: teardown (abort and the "
                               "store barrier), re-form, restore, and the rest of the recovery (in_process_recovery)."),
        stat("In-process restarts", q(f"sum(max by (run_id) ({run('trainguard_recovery_in_process_restarts_total')}))"),
             width=6, description="Failures recovered in the same processes (no new interpreter, no storage read)."),
        stat("Steps kept by snapshots",
             q(f"sum(max by (run_id) ({run('trainguard_recovery_snapshot_steps_saved_total')}))"), width=6,
             description="Steps the in-memory snapshots kept that a restore of the durable checkpoint would have "
                         "lost (goodput's snapshot_steps_saved)."),
    ]


AUTOPILOT_WHY = "the checkpoint autopilot is on (trainguard train --checkpoint-every auto, checkpoint.autopilot: on)"


def autopilot_panels() -> list:
    """The checkpoint autopilot's intervals and the energy a step costs (docs/checkpoints.md, docs/goodput.md);
    appended after the board's other panels, which stay as they were."""
    return [
        Row("Checkpoint autopilot and energy"),
        timeseries("Checkpoint interval",
                   q(f"max by (run_id) ({run('trainguard_checkpoint_interval_seconds')})", "{{run_id}} in force"),
                   q(f"max by (run_id) ({run('trainguard_checkpoint_interval_recommended_seconds')})",
                     "{{run_id}} recommended", only_when=AUTOPILOT_WHY),
                   unit="s", min=0, width=12,
                   description="The interval by time in force (the autopilot's, or checkpoint_every_seconds), and "
                               "the autopilot's latest recommendation (Daly's optimum "
                               "from the measured MTBF, save and restart costs, within the policy's bounds)."),
        timeseries("Snapshot interval",
                   q(f"max by (run_id) ({run('trainguard_snapshot_every_steps')})", "{{run_id}} in force",
                     only_when=AUTOPILOT_WHY + " with recovery.mode: in_process"),
                   unit="short", min=0, width=12,
                   description="Steps between in-memory snapshots as the autopilot applied them (its snapshot "
                               "tier, converted with the measured step time; docs/checkpoints.md)."),
        timeseries("GPU energy per step",
                   q(f"sum(rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{AGENT}[{RATE}])) / 1000"
                     f" / max(deriv({run('trainguard_training_step')}[{RATE}]))", "joules per step, all GPUs"),
                   unit="joule", min=0, width=12,
                   description="Joules drawn by the job's GPUs (NVML's total energy counter) per training step; "
                               "`trainguard goodput RUN` splits the run's energy by cause and per useful token."),
    ]


def comms_io(policy: Policy) -> Board:
    a = policy.alerts
    share = lambda part: (f"avg by (run_id) ({run(f'trainguard_training_{part}_seconds')})"
                          f" / avg by (run_id) ({run('trainguard_training_step_time_seconds')} > 0)")
    await_expr = (f'(rate(node_disk_read_time_seconds_total[{RATE}])'
                  f' + rate(node_disk_write_time_seconds_total[{RATE}]))'
                  f' / (rate(node_disk_reads_completed_total[{RATE}])'
                  f' + rate(node_disk_writes_completed_total[{RATE}]) > 0)')
    ib = lambda name: f'rate(node_infiniband_{name}_total[{RATE}])'
    items = [
        Row("Communication"),
        timeseries("Communication share of step time", q(share("comm"), "{{run_id}}"), unit="percentunit",
                   min=0, thresholds=(Threshold(a.comm_overhead_max, RED),), width=12),
        timeseries("NCCL errors and watchdog timeouts",
                   q(f'sum by (kind) (increase(trainguard_nccl_events_total{{job=~"$job",'
                     f' kind=~"error|abort|watchdog_timeout|watchdog_stuck"}}[{RATE}]))', "{{kind}}"),
                   width=12, thresholds=(Threshold(1, RED),),
                   description="NCCL errors, aborts and process-group watchdog timeouts found in the ranks' logs."),
        timeseries("InfiniBand receive", q(node(f"{ib('port_data_received_bytes')}"), "{{instance}} {{device}}:{{port}}"),
                   unit="Bps", width=8),
        timeseries("InfiniBand transmit", q(node(f"{ib('port_data_transmitted_bytes')}"),
                                            "{{instance}} {{device}}:{{port}}"), unit="Bps", width=8),
        timeseries("InfiniBand errors", q(node(f"{ib('port_errors_received')} + {ib('port_discards_received')}")
                                          + " or vector(0)", "{{instance}} {{device}}:{{port}}"), width=8),
        Row("Storage and data"),
        timeseries("Disk await", q(node(await_expr), "{{instance}} {{device}}"), unit="s",
                   thresholds=(Threshold(a.disk_await_ms / 1000, RED),), width=8),
        timeseries("Disk throughput",
                   q(node(f'rate(node_disk_read_bytes_total[{RATE}])'), "{{device}} read"),
                   q(node(f'rate(node_disk_written_bytes_total[{RATE}])'), "{{device}} write"),
                   unit="Bps", width=8),
        timeseries("Data wait share of step time", q(share("data_wait"), "{{run_id}}"), unit="percentunit",
                   min=0, thresholds=(Threshold(a.data_wait_ratio, RED),), width=8),
        timeseries("Network", q(node(f'rate(node_network_receive_bytes_total{{device!="lo"}}[{RATE}])'),
                                "{{device}} rx"),
                   q(node(f'rate(node_network_transmit_bytes_total{{device!="lo"}}[{RATE}])'),
                     "{{device}} tx"), unit="Bps", width=12),
        timeseries("Checkpoint filesystem free", q(f"trainguard_checkpoint_fs_avail_bytes{AGENT}", "{{mountpoint}}"),
                   unit="bytes", min=0, width=12),
    ]
    return Board("trainguard-comms-io", "trainguard / Comms and IO",
                 "Collective communication, NCCL health, InfiniBand, disks and data loading.",
                 [DATASOURCE, job_var("trainguard_agent_info"), HOSTNAME, RUN_ID], items)


def alerts_actions(policy: Policy) -> Board:
    items = [
        Row("Alerts"),
        stat("Firing", q('count(ALERTS{alertstate="firing", job=~"$job"}) or vector(0)'),
             thresholds=(Threshold(1, RED),), width=6),
        stat("Pending", q('count(ALERTS{alertstate="pending", job=~"$job"}) or vector(0)'),
             thresholds=(Threshold(1, YELLOW),), width=6),
        stat("Agents up", q('sum(up{job=~"$job"})'), width=6),
        stat("Collectors failing", q(f"count(trainguard_scrape_collector_success{AGENT} == 0) or vector(0)"),
             thresholds=(Threshold(1, RED),), width=6),
        table("Alerts now", q('ALERTS{job=~"$job"}', only_when="ALERTS exists only while an alert is pending or "
                                                                "firing"), width=24, height=6),
        timeseries("Alerts over time", q('count by (alertname) (ALERTS{alertstate="firing", job=~"$job"})',
                                         "{{alertname}}", only_when="ALERTS exists only while an alert fires"),
                   width=24, height=6),
        Row("Actions"),
        timeseries("Guard and recovery events", q(
            f'sum by (type) (increase(trainguard_training_events_total{{job=~"$job",'
            f' type=~"{ACTION_EVENTS}"}}[{RATE}]))',
            "{{type}}", only_when="only when the guard or an alert acts (the test run injects faults)"), width=12),
        timeseries("Actions the agent carried out",
                   q(f"sum by (action) (trainguard_actions_executed_total{AGENT}) or vector(0)", "{{action}}"),
                   width=12),
        timeseries("Alert verdicts", q(f"sum by (outcome) (trainguard_alert_verdicts_total{AGENT}) or vector(0)",
                                       "{{outcome}}"), width=12,
                   description="What the agent's ledger decided for each alert or embedded decision: act, "
                               "duplicate, coalesced, escalated ..."),
        timeseries("Webhook requests", q(f"sum by (code) (increase(trainguard_webhook_requests_total{AGENT}[{RATE}]))"
                                         f" or vector(0)", "{{code}}"), width=12),
        timeseries("Collector health", q(f"trainguard_scrape_collector_success{AGENT}", "{{instance}} {{collector}}"),
                   min=0, max=1, width=12),
        timeseries("Collector duration", q(f"trainguard_scrape_collector_duration_seconds{AGENT}",
                                           "{{instance}} {{collector}}"), unit="s", width=12),
    ]
    return Board("trainguard-alerts-actions", "trainguard / Alerts and actions",
                 "Alerts firing and pending, the actions they and the guard took, and the agent's own health.",
                 [DATASOURCE, job_var("trainguard_agent_info")], items, ANNOTATIONS[-1:])


BOARDS = {"training.json": training, "gpu-node.json": gpu_node, "cost-goodput.json": cost_goodput,
          "comms-io.json": comms_io, "alerts-actions.json": alerts_actions}


# ------------------------------------------------------------------------------------------- output

# Every board links to the others (Grafana's tag link: the five share the "trainguard" tag), keeping the
# time range and the variables they share ($job, $run_id, $hostname).
LINKS = ({"title": "trainguard", "type": "dashboards", "tags": ["trainguard"], "asDropdown": False,
          "includeVars": True, "keepTime": True, "targetBlank": False, "icon": "external link", "url": "",
          "tooltip": ""},)


def boards(policy: Policy | None = None, mixin: Mixin | None = None) -> dict[str, Board]:
    policy, mixin = policy or Policy(), mixin or Mixin()
    built = {name: make(policy) for name, make in BOARDS.items()}
    for board in built.values():
        board.links = LINKS
        board.variables = [Variable(v.name, v.label, v.query, mixin.datasource) if v.name == "datasource" else v
                           for v in board.variables]
    return built


def render(policy: Policy | None = None, mixin: Mixin | None = None) -> dict[str, str]:
    """file name -> JSON text, exactly as checked in (default policy and mixin)."""
    return {name: json.dumps(board.to_json(), indent=2, ensure_ascii=False) + "\n"
            for name, board in boards(policy, mixin).items()}


def write(out_dir: str | Path = OUT_DIR, policy: Policy | None = None, mixin: Mixin | None = None) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render(policy, mixin).items():
        (out / name).write_text(text, encoding="utf-8")
        written.append(out / name)
    return written


def queries(policy: Policy | None = None) -> Iterator[tuple[str, str, Query]]:
    """(dashboard uid, panel or annotation title, query) for every query of every dashboard."""
    for board in boards(policy).values():
        for panel in board.panels():
            for query in panel.queries:
                yield board.uid, panel.title, query
        for annotation in board.annotations:
            yield board.uid, f"annotation: {annotation.name}", Query(annotation.expr, "", annotation.only_when)


if __name__ == "__main__":
    for path in write():
        print(path)
