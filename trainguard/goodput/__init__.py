"""Goodput and badput by cause, from TLS records. Pure: records in, numbers out (no files, no clocks).

In the spirit of Google's ml-goodput-measurement: the wall time of a run (first record to last) is cut
into pieces, each piece is either productive training or badput with one cause, and the pieces add up
to the whole, so ``productive + sum(badput) == total``.

- ``startup``: run start (first record) to the start of the first step.
- ``checkpoint_save``: the time saves blocked training (``blocking_seconds`` of ``checkpoint_saved``).
- ``evaluation``: validation passes (``seconds`` of ``evaluation`` events, when the trainer gives it).
- ``rollback``: steps thrown away by a rollback (those after the restored checkpoint, up to the
  rollback), plus the time from the rollback to the first step after it.
- ``stall``: a stop of progress. A hang: from the last progress (the hung process's last step) to the
  restore decision (the agent's ``action`` event, or its ``alert`` verdict to act, found among the
  records); without a decision (a crash torchrun restarted), to the last record of the dead process.
  Also a step interval of at least `stall_seconds` (the policy's ``alerts.stall_seconds``, where
  ``TrainingStalled`` fires) above `slow_factor` x the median: the part above the median.
- ``slow_steps``: the part above the median of a step interval above `slow_factor` x the median step and
  shorter than `stall_seconds`: a step that was slow (a busy host, a straggler), not stuck. Apart from
  ``stall`` so a run on a noisy machine with no hang shows no stall.
- ``restart_recovery``: from the restore decision (else the last record before the restart) to the
  start of the first step after it, plus the steps lost since the checkpoint the restarted run resumed
  from.
- ``in_process_teardown``, ``in_process_reform``, ``in_process_restore``: an in-process restart's parts
  (docs/recovery.md), from its ``in_process_restart`` event: aborting the group and meeting the other
  ranks in the store (``teardown_seconds`` + ``barrier_seconds``), forming the new group, loading the state.
- ``in_process_recovery``: the rest of an in-process restart's time (from the last step before the failure
  to the first step after it, less the three parts), plus the steps lost since the state it restored.
- ``data_wait``: ``metrics.data_wait_seconds`` of each step.
- ``skipped_steps``: steps whose update the guard skipped (``skip_step`` events).
- ``other``: what is left, such as shutdown after the last step.

Each hang (a restart) is also listed on its own (`Goodput.hangs`): its last progress, the decision,
the first step after it, and the incident (``RUN/incidents/<id>/incident.json``) it belongs to when
the caller passes the incidents in (`compute(..., incidents=...)`).

A step's interval runs from the previous step record to its own record. A restart is seen from a
``run_start`` event after steps, a ``checkpoint_restored`` event that no ``rollback`` explains, or a
step number that goes back without either. The events may come in either order before the next step
(the trainer restores, then announces ``rollback`` or ``run_start``).
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Iterable, Protocol

from trainguard import actions, event_types

CAUSES = ("startup", "checkpoint_save", "evaluation", actions.ROLLBACK, "restart_recovery", "stall", "slow_steps",
          "data_wait", "skipped_steps", "other", "in_process_teardown", "in_process_reform", "in_process_restore",
          "in_process_recovery")
# The causes that are work thrown away or stopped by a failure (rollback, restart_recovery, stall, and an
# in-process restart's): the energy report names them apart.
LOST_CAUSES = CAUSES[3:6] + CAUSES[10:]
IN_PROCESS = "in_process_recovery"
# An in_process_restart event's parts: cause -> the fields whose seconds it is.
IN_PROCESS_PARTS = {"in_process_teardown": ("teardown_seconds", "barrier_seconds"),
                    "in_process_reform": ("reform_seconds",), "in_process_restore": ("restore_seconds",)}
# Events that say how long they held training up: type -> (cause, field with the seconds). The time is
# charged to the stretch in which the event started (`started_at`, else its time minus `seconds`).
TIMED_EVENTS = {event_types.CHECKPOINT_SAVED: ("checkpoint_save", "blocking_seconds"),
                "evaluation": ("evaluation", "seconds")}
# Events a process writes before its first step. If a restart is confirmed, the previous process ended
# at the record before the first of them.
_PROCESS_START = (event_types.CHECKPOINT_INVALID, event_types.CHECKPOINT_RESTORED, event_types.RUN_START)
# An incident is matched to a hang when it was detected between the last progress and this long after
# the first step after the restart (evidence is gathered before the kill, written a moment later).
INCIDENT_SLACK_SECONDS = 5.0


@dataclass(frozen=True)
class GoodputConfig:
    # A step interval (less checkpoint and data wait) above this many times the median is slow: the part
    # above the median is badput, `slow_steps`, or `stall` when the interval lasted `stall_seconds` or more.
    slow_factor: float = 3.0
    stall_seconds: float = 60.0       # the policy's alerts.stall_seconds: no progress this long is a stall


@dataclass(frozen=True)
class Hang:
    """One restart, split: `stall` (hung: last progress -> restore decision) and `restart_recovery`
    (decision -> the first step after the restart). `decided_at` is None when nobody decided (a crash)."""

    last_progress: float
    decided_at: float | None
    resumed_at: float
    stall_seconds: float
    restart_recovery_seconds: float
    decided_by: str | None = None      # the action's id (e.g. restore-...), or the alert that decided
    incident: str | None = None        # RUN/incidents/<id>, when one matches


@dataclass(frozen=True)
class Incident:
    """What goodput needs of an incident.json: its id and when it was detected (Unix seconds)."""

    id: str
    detected_at: float


class EnergyCurve(Protocol):
    """Joules the job's GPUs drew between two times (trainguard/energy.py builds one from NVML's counter)."""

    def joules(self, start: float, end: float) -> float: ...


PRODUCTIVE = "productive"


@dataclass(frozen=True)
class Goodput:
    total_seconds: float
    productive_seconds: float
    goodput_ratio: float
    badput_seconds: dict[str, float]
    productive_steps: int
    restarts: int
    rollbacks: int
    median_step_seconds: float | None
    first_timestamp: float | None
    last_timestamp: float | None
    hangs: tuple[Hang, ...] = ()
    in_process_restarts: int = 0
    # Steps an in-process restart kept because it restored a snapshot newer than the durable checkpoint.
    snapshot_steps_saved: int = 0
    # Tokens of every step the job ran (thrown away or not), and of the productive ones: the useful tokens.
    tokens: float = 0.0
    useful_tokens: float = 0.0
    gpu_count: int = 0                              # the most the records named (system.gpu_count)
    # With an energy curve: joules by "productive" and by badput cause (time's split, drawn as it was), and the
    # median joules per GPU of one step.
    energy_joules: dict[str, float] | None = None
    energy_per_step_joules: float | None = None

    @property
    def badput_ratio(self) -> dict[str, float]:
        total = self.total_seconds
        return {cause: (seconds / total if total > 0 else 0.0) for cause, seconds in self.badput_seconds.items()}

    def to_dict(self) -> dict:
        return {**asdict(self), "hangs": [asdict(hang) for hang in self.hangs], "badput_ratio": self.badput_ratio}


@dataclass
class _Segment:
    """A stretch of wall time with one meaning; timed events found inside (saves) are taken out first."""

    start: float
    end: float
    kind: str                      # "step", or a badput cause for the whole stretch
    step: int | None = None
    data_wait: float = 0.0
    tokens: float = 0.0            # the job's tokens in this step (tokens/s x step time x world size)
    wasted: str | None = None      # "rollback" / "restart_recovery" / IN_PROCESS: the step was thrown away later
    skipped: bool = False
    timed: list[tuple[str, float]] = field(default_factory=list)   # (cause, seconds) that started here


@dataclass
class _Timeline:
    """Pass one: records (in time order) into segments, with rollbacks, restarts and skips marked."""

    segments: list[_Segment] = field(default_factory=list)
    timed: list[tuple[float, str, float]] = field(default_factory=list)   # (start, cause, seconds)
    cursor: float | None = None       # wall time attributed so far
    last_ts: float | None = None
    last_step: int | None = None
    lead_in: str | None = "startup"   # cause of the time before the next step, when it is not a step
    rollback_pending: bool = False    # a rollback was announced; resolved at the next step
    restored: int | None = None       # step of a checkpoint restored since the last step
    boundary: float | None = None     # last record before the first process-start event since the last step
    pending_skips: set[int] = field(default_factory=set)
    restarts: int = 0
    rollbacks: int = 0
    decision: tuple[float, str] | None = None         # (when, by what) the agent decided to restore
    hang: tuple | None = None        # (last progress, decided at, by, stall end): a restart before its first step
    hangs: list[Hang] = field(default_factory=list)
    in_process_pending: bool = False  # an in-process restart since the last step (no new process)
    in_process_restarts: int = 0
    snapshot_steps_saved: int = 0
    gpu_count: int = 0

    def feed(self, record: dict) -> None:
        ts = float(record["timestamp"])
        event = record.get("event")
        if isinstance(event, dict) and event.get("type") in (event_types.ALERT, event_types.ACTION):
            self._note_decision(event, ts)   # a decision (often the agent's): it says when, it is not the run's time
            return
        if self.cursor is None:
            self.cursor = ts
        event = record.get("event")
        if isinstance(event, dict):
            self._event(event, record, ts)
        elif isinstance(record.get("metrics"), dict) and isinstance(record.get("step"), int):
            self._step(record, ts)
        self.last_ts = ts

    def _event(self, event: dict, record: dict, ts: float) -> None:
        kind, step = event.get("type"), event.get("step", record.get("step"))
        if kind in _PROCESS_START and self.boundary is None:
            self.boundary = self.last_ts if self.last_ts is not None else ts
        if kind == event_types.RUN_START and self.lead_in is None:
            self._restart()
        elif kind == actions.ROLLBACK:
            self.rollbacks += 1
            self.rollback_pending = True
            if isinstance(event.get("restored_step"), int):
                self.restored = event["restored_step"]
        elif kind == event_types.CHECKPOINT_RESTORED and isinstance(step, int):
            self.restored = step
        elif kind == event_types.SNAPSHOT_RESTORED and isinstance(event.get("restored_step"), int):
            self.restored = event["restored_step"]   # after the checkpoint: a fresher in-memory state
        elif kind == actions.SKIP_STEP and isinstance(step, int):
            if not self._mark_skipped(step):
                self.pending_skips.add(step)
        elif kind in TIMED_EVENTS:
            self._timed(TIMED_EVENTS[kind], event, ts)
        elif kind == event_types.IN_PROCESS_RESTART and isinstance(event.get("restored_step"), int):
            self._in_process(event, ts)

    def _in_process(self, event: dict, ts: float) -> None:
        """An in-process restart: the same processes went back to `restored_step`; its parts are timed."""
        self.in_process_pending, self.restored = True, event["restored_step"]
        self.in_process_restarts += 1
        durable = event.get("durable_step")
        if event.get("source") in ("snapshot", "peer") and isinstance(durable, int):   # memory, own or a peer's
            self.snapshot_steps_saved += max(0, event["restored_step"] - durable)
        started = ts - _number(event.get("recovery_seconds"))    # the event is written when it ends
        for cause, names in IN_PROCESS_PARTS.items():
            seconds = sum(_number(event.get(name)) for name in names)
            if seconds > 0:
                self.timed.append((started, cause, seconds))

    def _note_decision(self, event: dict, ts: float) -> None:
        """The agent's restore decision: its `action` event (issued_at), or its verdict to act on an alert."""
        if event.get("action") != actions.RESTORE or event.get("type") == event_types.ALERT and event.get("outcome") != "act":
            return
        when = event.get("issued_at", event.get("decided_at"))
        when = float(when) if isinstance(when, (int, float)) and not isinstance(when, bool) else ts
        if self.cursor is not None and when < self.cursor:
            return
        # The action's id names the decision best; the alert verdict (written a moment before) gives its time.
        name = event.get("id") or event.get("request_id") if event.get("type") == event_types.ACTION else None
        if self.decision is None:
            self.decision = (when, str(name or event.get("request_id") or event.get("alertname") or actions.RESTORE))
        elif name:
            self.decision = (min(when, self.decision[0]), str(name))

    def _timed(self, charge: tuple[str, str], event: dict, ts: float) -> None:
        cause, name = charge
        seconds = _number(event.get(name))
        if seconds > 0:
            started = event.get("started_at")
            if not isinstance(started, (int, float)):
                started = ts - _number(event.get("seconds"))  # the event is written when it ends
            self.timed.append((float(started), cause, seconds))

    def _step(self, record: dict, ts: float) -> None:
        step, metrics = record["step"], record["metrics"]
        self._resolve(step)
        start = self.cursor
        if self.lead_in is not None:
            # The step itself took step_time_seconds (when given); the time before it is the lead-in.
            start = max(self.cursor, ts - _number(metrics.get("step_time_seconds")))
            self._add(self.cursor, start, self.lead_in)
            self._end_hang(start)
            self.lead_in = None
        system = record.get("system") if isinstance(record.get("system"), dict) else {}
        gpus = system.get("gpu_count")
        if isinstance(gpus, int) and not isinstance(gpus, bool) and gpus > self.gpu_count:
            self.gpu_count = gpus
        world = system.get("world_size")
        world = world if isinstance(world, int) and not isinstance(world, bool) and world > 0 else 1
        tokens = _number(metrics.get("tokens_per_second")) * _number(metrics.get("step_time_seconds")) * world
        segment = _Segment(start, ts, "step", step, data_wait=_number(metrics.get("data_wait_seconds")),
                           tokens=tokens)
        self.segments.append(segment)
        if step in self.pending_skips:
            self.pending_skips.discard(step)
            segment.skipped = True
        self.cursor, self.last_step = ts, step

    def _resolve(self, step: int) -> None:
        """Before a step: what the rollback, restore or restart since the previous step threw away."""
        if self.in_process_pending:
            self._throw_away_after(self.restored if self.restored is not None else step - 1, IN_PROCESS)
            self.lead_in, self.in_process_pending = IN_PROCESS, False
        elif self.rollback_pending:
            kept = self.restored if self.restored is not None else step - 1
            self._throw_away_after(kept, actions.ROLLBACK)     # the badput cause named after the action
            self.lead_in = actions.ROLLBACK
        elif self.restored is not None:
            if self.lead_in is None:   # restored with no rollback in a process that had stepped: a new one
                self._restart()
            self._throw_away_after(self.restored, "restart_recovery")
        elif self.last_step is not None and step <= self.last_step:
            if self.lead_in is None:   # the step count went back and nobody said why: a restart
                self._restart()
            self._throw_away_after(step - 1, "restart_recovery")  # started over without a checkpoint
        self.rollback_pending, self.restored, self.boundary, self.decision = False, None, None, None

    def _restart(self) -> None:
        """A new process: its predecessor's time after its last step was a hang until the restore was
        decided (or, with no decision, until its last record: a crash, or its shutdown)."""
        self.restarts += 1
        last_progress = self.cursor
        decided_at, decided_by = self.decision if self.decision is not None else (None, None)
        end = decided_at if decided_at is not None else (
            self.boundary if self.boundary is not None else self.last_ts)
        self._add(self.cursor, end, "stall")
        self.hang = (last_progress, decided_at, decided_by, self.cursor)
        self.lead_in, self.rollback_pending, self.decision = "restart_recovery", False, None

    def _end_hang(self, resumed_at: float) -> None:
        if self.hang is None or self.lead_in != "restart_recovery":
            return
        last_progress, decided_at, decided_by, split = self.hang
        self.hangs.append(Hang(last_progress, decided_at, resumed_at, max(0.0, split - last_progress),
                               max(0.0, resumed_at - split), decided_by))
        self.hang = None

    def _throw_away_after(self, kept_step: int, cause: str) -> None:
        for segment in reversed(self.segments):
            if segment.kind != "step" or segment.wasted:
                continue
            if segment.step <= kept_step:
                break
            segment.wasted = cause
        self.pending_skips = {s for s in self.pending_skips if s <= kept_step}
        self.last_step = kept_step

    def _mark_skipped(self, step: int) -> bool:
        for segment in reversed(self.segments[-8:]):  # the step's own record is at most a few records back
            if segment.kind == "step" and segment.step == step and not segment.wasted:
                segment.skipped = True
                return True
        return False

    def _add(self, start: float, end: float, kind: str) -> None:
        if end > start:
            self.segments.append(_Segment(start, end, kind))
            self.cursor = end

    def finish(self) -> None:
        if self.last_ts is not None:
            self._add(self.cursor, self.last_ts, "other")


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else 0.0


def _attribute_timed(segments: list[_Segment], timed: list[tuple[float, str, float]]) -> None:
    """Each timed event belongs to the segment in which it started."""
    starts = [segment.start for segment in segments]
    for started, cause, seconds in timed:
        if segments:
            segments[max(0, bisect.bisect_right(starts, started) - 1)].timed.append((cause, seconds))


def _with_incident(hang: Hang, incidents: Iterable[Incident]) -> Hang:
    """The hang with the incident detected during it (the one nearest the decision, if several)."""
    anchor = hang.decided_at if hang.decided_at is not None else hang.last_progress
    during = [i for i in incidents
              if hang.last_progress <= i.detected_at <= hang.resumed_at + INCIDENT_SLACK_SECONDS]
    if not during:
        return hang
    return replace(hang, incident=min(during, key=lambda i: abs(i.detected_at - anchor)).id)


def compute(records: Iterable[dict], config: GoodputConfig = GoodputConfig(),
            incidents: Iterable[Incident] = (), energy: EnergyCurve | None = None) -> Goodput:
    """Goodput of a run from its TLS records (one rank's log is enough; order is restored by time).

    Give the agent's records too (its `alert` and `action` events) so a hang is split at the restore
    decision, and the run's incidents so each hang names the one it belongs to. With `energy` (the GPUs'
    energy counter), each piece of time is charged the joules drawn during it, the same split as time."""
    incidents = list(incidents)
    timeline = _Timeline()
    for record in sorted(records, key=lambda r: float(r["timestamp"])):
        timeline.feed(record)
    timeline.finish()
    segments = timeline.segments
    _attribute_timed(segments, timeline.timed)

    badput = dict.fromkeys(CAUSES, 0.0)
    joules = dict.fromkeys((PRODUCTIVE, *CAUSES), 0.0)
    step_joules: list[float] = []
    # step segments with their time left after timed events and data, and the joules per second they drew
    work: list[tuple[_Segment, float, float]] = []
    for segment in segments:
        left = length = segment.end - segment.start
        drawn = energy.joules(segment.start, segment.end) if energy is not None else 0.0
        rate = drawn / length if length > 0 else 0.0
        for cause, seconds in segment.timed:
            taken = min(seconds, left)
            badput[cause] += taken
            joules[cause] += taken * rate
            left -= taken
        if segment.kind != "step":
            badput[segment.kind] += left
            joules[segment.kind] += left * rate
            continue
        if energy is not None and length > 0:
            step_joules.append(drawn)
        waited = min(segment.data_wait, left)
        badput["data_wait"] += waited
        joules["data_wait"] += waited * rate
        work.append((segment, left - waited, rate))

    # A first step without step_time_seconds has no length of its own; it says nothing about step time.
    lengths = [seconds for _, seconds, _ in work if seconds > 0]
    median = statistics.median(lengths) if lengths else None
    productive, productive_steps = 0.0, 0
    tokens = useful_tokens = 0.0
    for segment, seconds, rate in work:
        tokens += segment.tokens
        if median is not None and seconds > config.slow_factor * median:
            cause = "stall" if seconds >= config.stall_seconds else "slow_steps"
            badput[cause] += seconds - median
            joules[cause] += (seconds - median) * rate
            seconds = median
        cause = segment.wasted or ("skipped_steps" if segment.skipped else None)
        if cause is not None:
            badput[cause] += seconds
            joules[cause] += seconds * rate
        else:
            productive += seconds
            joules[PRODUCTIVE] += seconds * rate
            productive_steps += 1
            useful_tokens += segment.tokens

    first, last = (segments[0].start, segments[-1].end) if segments else (timeline.cursor, timeline.last_ts)
    total = (last - first) if first is not None and last is not None else 0.0
    per_step = None
    if step_joules and timeline.gpu_count:
        per_step = statistics.median(step_joules) / timeline.gpu_count
    return Goodput(
        total_seconds=total, productive_seconds=productive,
        goodput_ratio=productive / total if total > 0 else 0.0,
        badput_seconds=badput, productive_steps=productive_steps, restarts=timeline.restarts,
        rollbacks=timeline.rollbacks, median_step_seconds=median, first_timestamp=first, last_timestamp=last,
        hangs=tuple(_with_incident(hang, incidents) for hang in timeline.hangs), tokens=tokens,
        useful_tokens=useful_tokens, gpu_count=timeline.gpu_count,
        energy_joules=joules if energy is not None else None, energy_per_step_joules=per_step,
        in_process_restarts=timeline.in_process_restarts, snapshot_steps_saved=timeline.snapshot_steps_saved)
