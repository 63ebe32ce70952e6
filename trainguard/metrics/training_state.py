"""What the agent knows about the training run, folded from TLS records one at a time.

Pure state (no files, no clocks): the training collector feeds it decoded records, persists `to_dict()`
atomically together with the tail offsets, and builds metric families from it. Keeping the counters in
the same file as the offsets is what makes an agent restart lose or double no step: after a kill the
agent resumes from offsets and counters that were written together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainguard import actions, event_types, rundir

# What a shadow_action event of a rank can name: the guard's decisions, the agent's requests, the replica
# check's cordon (a bounded label set; anything else is "other").
SHADOWED_ACTIONS = (*actions.DECISIONS, actions.CORDON)
MAX_EVENT_TYPES = 64      # distinct event types kept per rank; any further type is counted as "other"

# TLS metric key -> (metric name, help). Values are the rank's latest step; absent keys export nothing.
STEP_GAUGES: dict[str, tuple[str, str]] = {
    "loss": ("trainguard_training_loss", "Training loss of the rank's latest step (NaN when it was NaN)."),
    "grad_norm": ("trainguard_training_grad_norm", "Global gradient norm of the latest step, before clipping."),
    "learning_rate": ("trainguard_training_learning_rate", "Learning rate of the latest step."),
    "tokens_per_second": ("trainguard_training_tokens_per_second", "Tokens per second of the rank's latest step."),
    "samples_per_second": ("trainguard_training_samples_per_second", "Samples per second of the latest step."),
    "step_time_seconds": ("trainguard_training_step_time_seconds", "Wall time of the rank's latest step."),
    "data_wait_seconds": ("trainguard_training_data_wait_seconds",
                          "Time the latest step waited for its batch (data loader)."),
    "forward_backward_seconds": ("trainguard_training_forward_backward_seconds",
                                 "Forward and backward time of the latest step."),
    "optimizer_seconds": ("trainguard_training_optimizer_seconds", "Optimizer time of the latest step."),
    "comm_seconds": ("trainguard_training_comm_seconds", "Gradient communication time of the latest step."),
    "mfu": ("trainguard_training_mfu_ratio", "Model FLOPs utilisation of the latest step (0-1)."),
    "tokens_trained": ("trainguard_training_tokens_trained",
                       "Tokens the rank has trained on so far, as the trainer counts them."),
    "tokens_loaded": ("trainguard_training_tokens_loaded",
                      "Tokens the rank's data loader has loaded so far (trained / loaded = data utilisation)."),
    "val_loss": ("trainguard_training_val_loss", "Latest validation loss."),
    "mem_allocated_bytes": ("trainguard_training_memory_allocated_bytes",
                            "Device memory held by tensors (CUDA caching allocator), latest step."),
    "mem_reserved_bytes": ("trainguard_training_memory_reserved_bytes",
                           "Device memory reserved by the CUDA caching allocator, latest step."),
    "mem_peak_bytes": ("trainguard_training_memory_peak_bytes", "Peak device memory allocated, latest step."),
    "rss_bytes": ("trainguard_training_resident_memory_bytes", "Resident memory of the rank, as it reported it."),
    # training dynamics (docs/dynamics.md)
    "param_norm": ("trainguard_training_param_norm", "Global parameter norm of the latest step, before its update."),
    "clip_threshold": ("trainguard_training_clip_threshold", "Gradient-norm threshold the latest step was clipped at."),
    "clip_coef": ("trainguard_training_clip_coef_ratio", "Factor the latest step's gradients were scaled by (1: not clipped)."),
    # the checkpoint autopilot (trainguard/decide/checkpoint_interval.py, docs/checkpoints.md)
    "checkpoint_interval_seconds": ("trainguard_checkpoint_interval_seconds",
                                    "Checkpoint interval in force (seconds between saves), as the autopilot applied it."),
    "checkpoint_interval_recommended_seconds": ("trainguard_checkpoint_interval_recommended_seconds",
                                                "The autopilot's latest recommended checkpoint interval (seconds)."),
    "snapshot_every_steps": ("trainguard_snapshot_every_steps",
                             "In-memory snapshot interval in force (steps), as the autopilot applied it (rank 0)."),
}
# An in_process_restart event's seconds (docs/recovery.md), summed by part as goodput splits them
# (trainguard/goodput: in_process_teardown, _reform, _restore, and the rest of the recovery).
IN_PROCESS_PARTS = {"teardown": ("teardown_seconds", "barrier_seconds"), "reform": ("reform_seconds",),
                    "restore": ("restore_seconds",)}
RECOVERY_PARTS = (*IN_PROCESS_PARTS, "other")
_MEMORY_KEYS = frozenset({"mem_allocated_bytes", "mem_reserved_bytes", "mem_peak_bytes", "rss_bytes"})


def _scalars(section: dict | None, keys) -> dict[str, float]:
    """The numbers among `keys` in a record section (bools and strings left out)."""
    if not section:
        return {}
    return {k: v for k, v in section.items() if k in keys and (type(v) is float or type(v) is int)}


def _seconds(value: object) -> float:
    """A non-negative finite number of seconds from an event's field; 0 for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return 0.0
    return float(value)


@dataclass
class RankState:
    run_id: str = ""
    step: int | None = None
    last_step_time: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    steps_total: int = 0
    events: dict[str, int] = field(default_factory=dict)
    gpu_count: int | None = None
    shadowed: dict[str, int] = field(default_factory=dict)    # shadow_action events, by action
    # in-process restarts: "restarts", "snapshot_steps_saved" and the seconds of each of RECOVERY_PARTS
    recovery: dict[str, float] = field(default_factory=dict)

    def count_shadowed(self, action: object) -> None:
        name = action if isinstance(action, str) and action in SHADOWED_ACTIONS else "other"
        self.shadowed[name] = self.shadowed.get(name, 0) + 1

    def count_in_process(self, event: dict) -> None:
        """An in_process_restart event: its parts' seconds, and the steps its snapshot kept that a restore
        of the durable checkpoint would have lost (goodput's snapshot_steps_saved)."""
        books, total = self.recovery, 0.0
        for part, names in IN_PROCESS_PARTS.items():
            seconds = sum(_seconds(event.get(name)) for name in names)
            books[part] = books.get(part, 0.0) + seconds
            total += seconds
        books["other"] = books.get("other", 0.0) + max(0.0, _seconds(event.get("recovery_seconds")) - total)
        books["restarts"] = books.get("restarts", 0) + 1
        restored, durable = event.get("restored_step"), event.get("durable_step")
        if event.get("source") == "snapshot" and isinstance(restored, int) and isinstance(durable, int):
            books["snapshot_steps_saved"] = books.get("snapshot_steps_saved", 0) + max(0, restored - durable)

    def count_event(self, kind: str) -> None:
        if kind not in self.events and len(self.events) >= MAX_EVENT_TYPES:
            kind = "other"
        self.events[kind] = self.events.get(kind, 0) + 1


@dataclass
class TrainingState:
    ranks: dict[int, RankState] = field(default_factory=dict)
    checkpoint_step: int | None = None
    checkpoint_time: float | None = None
    checkpoint_name: str | None = None
    run_id: str = ""
    records: dict[str, int] = field(default_factory=dict)     # file name -> records read
    malformed: dict[str, int] = field(default_factory=dict)   # file name -> malformed lines

    def apply(self, record: dict, rank: int) -> bool:
        """Fold one record in; True when it was a step record (it counts as one step)."""
        state = self.ranks.setdefault(rank, RankState())
        if record.get("run_id"):
            state.run_id = self.run_id = str(record["run_id"])
        system = record.get("system") or {}
        if isinstance(system.get("gpu_count"), int):
            state.gpu_count = system["gpu_count"]
        if isinstance(system.get("last_checkpoint"), str):
            self.checkpoint_name = system["last_checkpoint"]
        event = record.get("event")
        if event is not None:
            self._apply_event(state, event, record)
            return False
        metrics = record.get("metrics")
        if record.get("step") is None or not metrics:
            return False
        state.step = record["step"]
        state.last_step_time = record["timestamp"]
        state.metrics = {**_scalars(metrics, STEP_GAUGES),
                         **_scalars(record.get("hardware"), _MEMORY_KEYS)}
        state.steps_total += 1
        return True

    def _apply_event(self, state: RankState, event: dict, record: dict) -> None:
        kind = event["type"]
        state.count_event(kind)
        if kind == actions.SHADOW_ACTION:
            state.count_shadowed(event.get("action"))
        elif kind == event_types.IN_PROCESS_RESTART:
            state.count_in_process(event)
        if kind == event_types.CHECKPOINT_SAVED:
            step = event.get("step", record.get("step"))
            if self.checkpoint_time is None or record["timestamp"] >= self.checkpoint_time:
                self.checkpoint_time = record["timestamp"]
                self.checkpoint_step = step if isinstance(step, int) else self.checkpoint_step
                if isinstance(step, int):
                    self.checkpoint_name = rundir.step_dir_name(step)

    def count(self, table: dict[str, int], source: str) -> None:
        table[source] = table.get(source, 0) + 1

    def lead_rank(self) -> int | None:
        """The rank whose steps stand for the node (the lowest one seen)."""
        return min(self.ranks) if self.ranks else None

    # ---------------------------------------------------------------------------------- persistence

    def to_dict(self) -> dict:
        return {"ranks": {str(r): vars(s) for r, s in self.ranks.items()},
                "checkpoint": {"step": self.checkpoint_step, "time": self.checkpoint_time,
                               "name": self.checkpoint_name},
                "run_id": self.run_id, "records": self.records, "malformed": self.malformed}

    @classmethod
    def from_dict(cls, data: dict) -> "TrainingState":
        checkpoint = data.get("checkpoint") or {}
        return cls(ranks={int(r): RankState(**s) for r, s in (data.get("ranks") or {}).items()},
                   checkpoint_step=checkpoint.get("step"), checkpoint_time=checkpoint.get("time"),
                   checkpoint_name=checkpoint.get("name"), run_id=data.get("run_id", ""),
                   records=dict(data.get("records") or {}), malformed=dict(data.get("malformed") or {}))

    # ---------------------------------------------------------------------------------- node record

    def tls_fragment(self, now: float) -> dict:
        """The training part of the joined node record: the lead rank's latest step, and the run's state."""
        lead = self.lead_rank()
        fragment: dict = {}
        system: dict = {}
        if lead is not None:
            state = self.ranks[lead]
            if state.step is not None:
                fragment["step"] = state.step
                fragment["metrics"] = {k: v for k, v in state.metrics.items() if k not in _MEMORY_KEYS}
            if state.run_id:
                fragment["run_id"] = state.run_id
            if state.gpu_count is not None:
                system["gpu_count"] = state.gpu_count
        if self.checkpoint_name:
            system["last_checkpoint"] = self.checkpoint_name
        if self.checkpoint_time is not None:
            system["checkpoint_age_seconds"] = round(max(0.0, now - self.checkpoint_time), 3)
        if system:
            fragment["system"] = system
        return fragment
