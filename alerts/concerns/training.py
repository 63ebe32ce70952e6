"""Training: loss, gradients, stalls, throughput, data utilisation, checkpoints; and stragglers (fail-slow).

Rendered into training.rules.yml.
"""

from __future__ import annotations

from trainguard import actions
from trainguard.alerts.promql import BASELINE, NODE, RATE, RUN, SELF_HANDLED_SEVERITY, Alert, Group, Record, num
from trainguard.policy import Policy

# A baseline needs this many samples before a spike or an explosion can be judged against it.
BASELINE_MIN_SAMPLES = 10
STEPPING_LOSS = "trainguard:training_loss:stepping"
# A node's ranks are running (the host collector checks the pids in RUN/control/ranks): a run that ended
# or was stopped is not stalled, and its checkpoints do not go stale.
RANKS_UP = f"max by ({NODE}) (trainguard_rank_process_up) > 0"


def training(policy: Policy) -> list[Group]:
    a, guard = policy.alerts, policy.guard     # the spike sigma and the explosion factor are the guard's
    records = Group("training", "trainguard-training.records", (
        # The loss while the run steps. A stalled rank's gauge repeats its last loss at every scrape;
        # let those samples into the baseline and a long stall becomes most of it, its spread falls to
        # 0, and the steps re-done after a restore from an earlier checkpoint read as a spike. A step
        # that has not moved for stall_seconds is a stall (TrainingStalled), not training.
        Record(STEPPING_LOSS,
               f"trainguard_training_loss\n"
               f"and changes(trainguard_training_step[{num(a.stall_seconds)}s]) > 0"),
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
              SELF_HANDLED_SEVERITY, "Training loss of run {{ $labels.run_id }} is NaN or infinite on {{ $labels.instance }}",
              "The loss has stayed non-finite for " + a.for_short + ". The guard skips a non-finite step "
              "on its own; a loss that stays non-finite means the weights or optimizer state are "
              "already corrupt, so the run is rolled back to its last stable checkpoint.",
              for_=a.for_short, action=actions.ROLLBACK),
        Alert("LossSpike",
              f"trainguard_training_loss\n"
              f"> trainguard:training_loss:median{BASELINE}\n"
              f"  + {num(guard.spike_sigma)} * trainguard:training_loss:robust_stddev{BASELINE}\n"
              f"  + 0.001 * abs(trainguard:training_loss:median{BASELINE})\n"
              f"and count_over_time({STEPPING_LOSS}[{BASELINE}]) >= {BASELINE_MIN_SAMPLES}\n"
              # The guard's hard batch (decide/guard.py): a loss within hard_batch_loss_factor of its
              # baseline beside a normal gradient norm is an ordinary update on hard data, not a spike:
              # no rollback (a run without a gradient norm has no such evidence and keeps the alert)
              f"unless (trainguard_training_loss <= {num(guard.hard_batch_loss_factor)} * "
              f"trainguard:training_loss:median{BASELINE}\n"
              f"        and trainguard_training_grad_norm <= {num(guard.shift_grad_factor)} * "
              f"trainguard:training_grad_norm:median{BASELINE})",
              SELF_HANDLED_SEVERITY, "Loss spike in run {{ $labels.run_id }} on {{ $labels.instance }}: {{ $value | printf \"%.4g\" }}",
              f"The loss is more than {num(guard.spike_sigma)} robust standard deviations above its "
              f"{BASELINE} median (and, when the gradient norm is normal, more than "
              f"{num(guard.hard_batch_loss_factor)} times it: under that, a hard batch). The run is rolled "
              "back to its last stable checkpoint, the data window is skipped and the learning rate lowered.",
              action=actions.ROLLBACK),
        # An infinite norm is an fp16/bf16 loss-scaler overflow: the scaler skips the step and lowers its
        # scale; an isolated one must not roll the run back or page anyone (the guard skips it). An
        # isolated finite one (heavy-tailed healthy noise) is the guard's to skip too: the alert acts on
        # an explosion that lasts.
        Alert("GradNormExplosion",
              f"trainguard_training_grad_norm < +Inf\n"
              f"> {num(guard.grad_explode_factor)} * trainguard:training_grad_norm:median{BASELINE}\n"
              f"and count_over_time(trainguard_training_grad_norm[{BASELINE}]) >= {BASELINE_MIN_SAMPLES}",
              SELF_HANDLED_SEVERITY, "Gradient norm explosion in run {{ $labels.run_id }} on {{ $labels.instance }}: {{ $value | printf \"%.4g\" }}",
              f"The global gradient norm is more than {num(guard.grad_explode_factor)} times its {BASELINE} "
              "median (an infinite one, a loss-scaler overflow, is not) for " + a.for_short + ": the guard "
              "skips an isolated step on its own, and a heavy-tailed healthy run has those. The run is rolled "
              "back to its last stable checkpoint with a lower learning rate.",
              for_=a.for_short, action=actions.ROLLBACK),
        Alert("TrainingStalled",
              f"min by ({NODE}, run_id) (time() - trainguard_training_last_step_timestamp_seconds)\n"
              f"> {num(a.stall_seconds)}\n"
              f"and on ({NODE}) {RANKS_UP}",
              "critical", "Run {{ $labels.run_id }}: no training step for over " + num(a.stall_seconds) + "s on {{ $labels.instance }}",
              "The ranks on this node have not finished a step for " + num(a.stall_seconds) + " s and the "
              "run has not ended: a hung collective, a dead rank or a stuck data loader. The agent ends "
              "the node's ranks; torch's elastic launcher starts them again and they resume from the "
              "latest verified checkpoint.",
              for_=a.for_short, action=actions.RESTORE),
        Alert("LowEffectiveThroughput",
              f"trainguard:effective_throughput:tokens_per_second\n"
              f"< {num(a.low_throughput_ratio)} * max_over_time(trainguard:effective_throughput:tokens_per_second[{BASELINE}])",
              "warning", "Effective throughput of run {{ $labels.run_id }} is under "
              + f"{a.low_throughput_ratio:.0%} of its recent peak",
              "Tokens trained per second (skipped and rolled-back steps excluded) fell under "
              f"{a.low_throughput_ratio:.0%} of the best of the last {BASELINE}. Look at the data loader, "
              "the disks, communication overhead and stragglers.",
              for_=a.for_long),
        Alert("LowDataUtilization",
              "trainguard:data_utilization:ratio < " + num(a.data_utilization_min),
              "warning", "Run {{ $labels.run_id }}: only {{ $value | humanizePercentage }} of loaded tokens are trained",
              f"Tokens trained / tokens loaded is under {a.data_utilization_min:.0%} over {RATE}: steps are "
              "skipped or rolled back, or batches are padded. Each lost token was paid for.",
              for_=a.for_long),
        Alert("CheckpointStale",
              "time() - trainguard_checkpoint_last_timestamp_seconds > " + num(a.checkpoint_stale_seconds)
              + f"\nand on ({NODE}) {RANKS_UP}",
              "warning", "Run {{ $labels.run_id }}: no checkpoint for over {{ $value | humanizeDuration }} on {{ $labels.instance }}",
              f"The newest verified checkpoint is older than {num(a.checkpoint_stale_seconds)} s: a "
              "failure now loses that much work. Check the checkpoint directory's disk and the trainer's "
              "checkpoint events.",
              for_=a.for_short),
    ))
    return [records, alerts]


def fail_slow(policy: Policy) -> list[Group]:
    """A rank slower than the fastest for a while (trainguard/decide/straggler.py scores it in the agent).

    Every agent of a run reads the shared run directory's rank logs, so the same (rank, node) score may
    come from several instances: `min by` keeps one series per rank. It does not act: eviction of a
    persistent straggler is not built yet (`restore.evict_stragglers` accepts only off)."""
    score_min = policy.diagnose.straggler_score_min
    alerts = Group("training", "trainguard-straggler.alerts", (
        Alert("TrainingStraggler",
              f"min by (job, run_id, rank, node) (trainguard_rank_straggler_score) < {num(score_min)}",
              "warning", "Rank {{ $labels.rank }} of run {{ $labels.run_id }} on {{ $labels.node }} is a straggler: "
              "{{ $value | printf \"%.2f\" }} of the fastest rank's speed",
              f"The rank's recent compute time (step time less data wait and communication) has stayed more "
              f"than {1 / score_min:.2f} times the fastest rank's (NVRx relative score under {num(score_min)}) "
              f"for {policy.alerts.for_long}: every other rank waits for it in each all-reduce. Look at that "
              "node's GPU clocks, temperature and neighbours; `trainguard diagnose` scores it offline.",
              for_=policy.alerts.for_long),
    ))
    return [alerts]
