"""The training families: the ranks' step telemetry, the TLS files, the checkpoint, the run's cost and its
stragglers as Prometheus families. Pure: `families(state, now, ...)` renders what the agent's training
collector (agent/collectors/training.py) and replay's series (trainguard/replay/series.py) hold.

Labels are `run_id` and `rank` (bounded by the world size); never step or pid.
"""

from __future__ import annotations

from trainguard import actions, event_types
from trainguard.decide.cost import CostMeter
from trainguard.decide.straggler import StragglerBoard
from trainguard.metrics.families import LabelCache, Spec
from trainguard.metrics.training_state import RECOVERY_PARTS, STEP_GAUGES, TrainingState

TIER_VALUES = {"ok": 0, "warn": 1, "throttle": 2, "stop": 3}
# Guard and recovery events exported at 0 until they happen (see `families`); replica_mismatch is silent
# corruption (trainer/replica_check.py): the ReplicaMismatch alert.
WATCHED_EVENTS = (actions.SKIP_STEP, actions.ROLLBACK, actions.RESTORE, event_types.ACTION, event_types.CHECKPOINT_SAVED, event_types.FAULT_INJECTED,
                  actions.STOP, event_types.REPLICA_MISMATCH)


def families(state: TrainingState, now: float, *, meter: CostMeter | None = None,
             stragglers: StragglerBoard | None = None, per_rank: bool = True) -> list:
    """Every training family of `state` at `now`: the steps (every rank, or the lead rank only), the files,
    the checkpoint, the cost (when `meter` meters the run) and the straggler scores (when given)."""
    return (step_families(state, per_rank) + file_families(state) + checkpoint_families(state, now)
            + recovery_families(state)
            + ([] if meter is None else cost_families(state, meter))
            + ([] if stragglers is None else straggler_families(state, stragglers)))


def step_families(state: TrainingState, per_rank: bool = True) -> list:
    samples: dict[str, list] = {key: [] for key in STEP_SPECS}
    step, last, steps, events = [], [], [], []
    ranks = sorted(state.ranks.items())
    for rank, rs in (ranks if per_rank else ranks[:1]):
        labels = _RUN_RANK.get(rs.run_id, str(rank))
        for key, value in rs.metrics.items():
            samples[key].append((labels, value))
        if rs.step is not None:
            step.append((labels, rs.step))
            last.append((labels, rs.last_step_time))
        steps.append((labels, rs.steps_total))
        # The event types alerts and annotations look for exist from the start at 0: Prometheus sees
        # no increase in a series' first sample, so a first rollback would otherwise go unseen.
        events += [(_RUN_RANK_TYPE.get(rs.run_id, str(rank), kind), count)
                   for kind, count in sorted({**_WATCHED_AT_ZERO, **rs.events}.items())]
    families = [spec.family(samples[key]) for key, spec in STEP_SPECS.items()]
    return families + [STEP.family(step), LAST_STEP.family(last), STEPS.family(steps), EVENTS.family(events),
                       SHADOWED.family(shadowed_actions(state))]


def shadowed_actions(state: TrainingState) -> list:
    """The lead rank's shadow actions (every rank decides the same, so one rank's count is the run's); no
    series at all until shadow mode has recorded one, so a run that acts for real exports none."""
    lead = state.lead_rank()
    if lead is None:
        return []
    rs = state.ranks[lead]
    return [(_RUN_ACTION.get(rs.run_id, action), count) for action, count in sorted(rs.shadowed.items())]


def file_families(state: TrainingState) -> list:
    names = sorted(set(state.records) | set(state.malformed))
    return [RECORDS.family((_FILE.get(name), state.records.get(name, 0)) for name in names),
            MALFORMED.family((_FILE.get(name), state.malformed.get(name, 0)) for name in names)]


def checkpoint_families(state: TrainingState, now: float) -> list:
    if state.checkpoint_time is None:
        return []
    run = _RUN.get(state.run_id)
    families = [CHECKPOINT_AGE.family([(run, max(0.0, now - state.checkpoint_time))]),
                CHECKPOINT_TIME.family([(run, state.checkpoint_time)])]
    if state.checkpoint_step is not None:
        families.append(CHECKPOINT_STEP.family([(run, state.checkpoint_step)]))
    return families


def recovery_families(state: TrainingState) -> list:
    """The lead rank's in-process restarts (every rank recovers together, so one rank's books are the node's),
    at 0 from the start: Prometheus sees no increase in a series' first sample."""
    lead = state.lead_rank()
    if lead is None:
        return []
    rs = state.ranks[lead]
    run, books = _RUN.get(rs.run_id), rs.recovery
    return [IN_PROCESS_RESTARTS.family([(run, books.get("restarts", 0))]),
            IN_PROCESS_SECONDS.family((_RUN_PART.get(rs.run_id, part), books.get(part, 0.0)) for part in RECOVERY_PARTS),
            SNAPSHOT_STEPS_SAVED.family([(run, books.get("snapshot_steps_saved", 0))])]


def cost_families(state: TrainingState, meter: CostMeter) -> list:
    cost, run = meter.state, _RUN.get(state.run_id)
    values = (cost.cost_usd, cost.cost_per_1k_steps, cost.overrun_ratio, TIER_VALUES.get(cost.tier, 0),
              meter.policy.budget_per_1k_steps, meter.gpus(None))
    return [spec.family([(run, value)]) for spec, value in zip(COST_SPECS, values)]


def straggler_families(state: TrainingState, stragglers: StragglerBoard) -> list:
    scores = stragglers.scores()
    run_id = state.run_id
    return [STRAGGLER_SCORE.family((_RUN_RANK_NODE.get(run_id, str(s.rank), s.node), s.relative) for s in scores),
            STRAGGLER_INDIVIDUAL.family((_RUN_RANK_NODE.get(run_id, str(s.rank), s.node), s.individual)
                                        for s in scores)]


# Families, their names checked once; label sets made once per run and rank.
_RUN_RANK = LabelCache(["run_id", "rank"])
_RUN_RANK_TYPE = LabelCache(["run_id", "rank", "type"])
_RUN_ACTION = LabelCache(["run_id", "action"])
_RUN = LabelCache(["run_id"])
_RUN_PART = LabelCache(["run_id", "part"])
_FILE = LabelCache(["file"])
_RUN_RANK_NODE = LabelCache(["run_id", "rank", "node"])
_WATCHED_AT_ZERO = dict.fromkeys(WATCHED_EVENTS, 0)
STEP_SPECS = {key: Spec("gauge", name, text, ["run_id", "rank"]) for key, (name, text) in STEP_GAUGES.items()}
STEP = Spec("gauge", "trainguard_training_step", "Latest step the rank finished.", ["run_id", "rank"])
LAST_STEP = Spec("gauge", "trainguard_training_last_step_timestamp_seconds",
                 "Unix time of the rank's latest step record.", ["run_id", "rank"])
STEPS = Spec("counter", "trainguard_training_steps", "Step records read from the rank's TLS log.", ["run_id", "rank"])
EVENTS = Spec("counter", "trainguard_training_events", "Events in the rank's TLS log, by type (guard decisions, "
              "checkpoints, actions ...).", ["run_id", "rank", "type"])
SHADOWED = Spec("counter", "trainguard_training_shadow_actions", "Shadow mode: actions the trainer decided (or "
                "was asked for) and recorded as shadow_action events without carrying them out, by action (the "
                "lead rank's).", ["run_id", "action"])
RECORDS = Spec("counter", "trainguard_tls_records", "TLS records read, by file.", ["file"])
MALFORMED = Spec("counter", "trainguard_tls_malformed_lines",
                 "TLS lines that could not be read (logged with file:line), by file.", ["file"])
CHECKPOINT_AGE = Spec("gauge", "trainguard_checkpoint_age_seconds", "Seconds since the latest checkpoint was saved.",
                      ["run_id"])
CHECKPOINT_TIME = Spec("gauge", "trainguard_checkpoint_last_timestamp_seconds",
                       "Unix time the latest checkpoint was saved.", ["run_id"])
CHECKPOINT_STEP = Spec("gauge", "trainguard_checkpoint_last_step", "Step of the latest checkpoint.", ["run_id"])
STRAGGLER_SCORE = Spec("gauge", "trainguard_rank_straggler_score",
                       "NVRx relative score of the rank's recent compute time: the fastest rank's median over this "
                       "rank's (1 = fastest, 0.5 = twice as slow).", ["run_id", "rank", "node"])
STRAGGLER_INDIVIDUAL = Spec("gauge", "trainguard_rank_straggler_individual_score",
                            "NVRx individual score: the rank's best median compute time in its history over its "
                            "recent one (0.5 = twice as slow as it was).", ["run_id", "rank", "node"])
IN_PROCESS_RESTARTS = Spec("counter", "trainguard_recovery_in_process_restarts", "Failures recovered in-process "
                           "(the group re-formed in the same processes, docs/recovery.md), the lead rank's.",
                           ["run_id"])
IN_PROCESS_SECONDS = Spec("counter", "trainguard_recovery_in_process_seconds", "Seconds of in-process restarts "
                          "by part: teardown (abort and the store barrier), reform, restore, other (the rest of "
                          "the recovery); the lead rank's.", ["run_id", "part"])
SNAPSHOT_STEPS_SAVED = Spec("counter", "trainguard_recovery_snapshot_steps_saved", "Steps in-process restarts "
                            "kept by restoring an in-memory snapshot that a restore of the durable checkpoint "
                            "would have lost; the lead rank's.", ["run_id"])
COST_SPECS = [Spec("gauge", name, text, ["run_id"]) for name, text in (
    ("trainguard_cost_usd", "Cost of the run metered so far (GPU-hours x price)."),
    ("trainguard_cost_per_1k_steps_usd", "Cost per 1000 steps over the recent window."),
    ("trainguard_cost_overrun_ratio", "Cost per 1000 steps over budget, minus 1 (0.3 = 30% over)."),
    ("trainguard_cost_tier", "Budget tier reached: 0 ok, 1 warn, 2 throttle, 3 stop."),
    ("trainguard_cost_budget_per_1k_steps_usd", "Budget per 1000 steps from the policy."),
    ("trainguard_cost_billable_gpus", "GPUs the run is billed for (policy override, else the records)."))]
