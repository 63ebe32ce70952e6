"""A run directory as chart-ready data: one streaming pass over its TLS logs, memory flat however long.

Training metrics come from one rank (rank 0, else the lowest present), since every rank logs the same
global loss; hardware comes from the agent's node logs (per host, per GPU), falling back to the ranks'
own `hardware` sections when no agent ran. Malformed lines are counted and the first few kept with
their file and line, never dropped silently. Cost is metered by the very `CostMeter` the agent runs.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from trainguard import actions, event_types, paths, rundir
from trainguard import policy as policy_mod
from trainguard.progress import Progress
from trainguard.decide.cost import CostMeter, clock_of, usage_of
from trainguard.report.charts import GAP_FACTOR, Span, event_detail
from trainguard.report.downsample import MAX_POINTS, Sampled, Series
from trainguard.report.files import Checkpoint, host_of, log_files, rank_of, read_checkpoints
from trainguard.tls import iter_lines

ERRORS_KEPT = 20
RECENT_EVENTS = 200
# Copies of one event (every rank acknowledging an action, the agent echoing the trainer) land within
# seconds of each other; the same event again later is a new occurrence.
DUPLICATE_WINDOW_S = 30.0
# Series per source are created on demand for every numeric key; this bounds a log that invents keys.
MAX_KEYS = 64

# Chart markers: event types (or the `action` of an `action` event) by the kind of mark they get.
# `checkpoint_restored` gets none: it is a part of a rollback or of a restart, which have their own.
MARKER_KINDS = {
    event_types.CHECKPOINT_SAVED: "checkpoint",
    actions.SKIP_STEP: "skip",
    actions.ROLLBACK: "rollback",
    actions.RESTORE: "restore",
    event_types.ALERT: "alert",
    event_types.FAULT_INJECTED: "fault",
    event_types.LR_PHASE: "phase",          # LR schedule phase changes (docs/dynamics.md)
}


def marker_kind(kind: str, event: dict) -> str | None:
    if kind == event_types.ACTION:
        kind = str(event.get("action"))
    if kind == event_types.RUN_START:   # a process that resumed from a checkpoint: a restart, the end of a restore
        return MARKER_KINDS[actions.RESTORE] if event.get("resumed_from") is not None else None
    if kind == event_types.ALERT and event.get("status") == "resolved":
        return None
    return MARKER_KINDS.get(kind)

GOODPUT_METRICS = ("data_wait_seconds", "step_time_seconds")
# A rollback or restart makes steps repeat: each run of rising steps is a pass, drawn on its own on the
# step axis. Beyond this many, later steps join the last pass (a run that rolls back all day).
MAX_PASSES = 32
# The widest intervals between the charted rank's steps kept while reading, to find gaps (no records).
GAPS_KEPT = 64


@dataclass
class Pass:
    """One run of rising steps of the charted rank; a later pass that starts lower discards its tail."""

    start_step: int
    timestamp: float
    cause: str                      # "start" | "rollback" | "restart" | "in-process restart"
    series: dict[str, Series] = field(default_factory=dict)      # metrics.<key> by step
    discarded_from: int | None = None   # steps from here on were thrown away (set after loading)



@dataclass
class Marker:
    timestamp: float
    kind: str            # checkpoint | skip | rollback | restore | alert | fault
    label: str
    step: int | None = None


@dataclass
class EventRow:
    timestamp: float
    type: str
    step: int | None
    detail: str
    source: str


@dataclass
class Run:
    run_dir: Path
    run_id: str | None = None
    files: list[str] = field(default_factory=list)
    records: int = 0
    malformed: int = 0
    errors: list[str] = field(default_factory=list)
    start: float | None = None
    end: float | None = None
    primary_rank: int | None = None
    ranks: set[int] = field(default_factory=set)
    hosts: set[str] = field(default_factory=set)
    first_step: int | None = None
    last_step: int | None = None
    step_records: int = 0
    training: dict[str, Series] = field(default_factory=dict)          # metrics.<key>
    hardware: dict[str, dict[str, Series]] = field(default_factory=dict)  # host -> hardware/system key
    gpus: dict[tuple[str, str], dict[str, Series]] = field(default_factory=dict)  # (host, gpu) -> key
    gpu_names: dict[tuple[str, str], str] = field(default_factory=dict)
    cost: dict[str, Series] = field(default_factory=dict)
    shares: dict[str, Series] = field(default_factory=dict)           # data_wait / comm share of a step
    nccl: dict[str, dict[str, int]] = field(default_factory=dict)     # host -> the agent's NCCL event counts
    cost_state: Any = None
    gpu_count: int = 0
    event_counts: Counter = field(default_factory=Counter)
    markers: dict[str, Sampled] = field(default_factory=dict)
    events: Sampled = field(default_factory=lambda: Sampled(RECENT_EVENTS))
    health: Sampled = field(default_factory=lambda: Sampled(RECENT_EVENTS))   # health_check events, by host
    alerts: Counter = field(default_factory=Counter)
    actions: Counter = field(default_factory=Counter)
    shadowed: Counter = field(default_factory=Counter)    # shadow mode: actions decided, not carried out
    shadow_mode: bool = False                             # a run_start said actions_mode: shadow
    mfu_unavailable: str = ""                             # a run_start's reason for recording no MFU
    faults: list[str] = field(default_factory=list)
    restarts: int = 0
    checkpoints: list[Checkpoint] = field(default_factory=list)
    last_checkpoint: str | None = None
    goodput: Any = None
    goodput_error: str | None = None
    policy: Any = None

    last_step_seen: int | None = None
    train_start: float | None = None     # first and last record of the rank the charts follow
    train_end: float | None = None
    passes: list[Pass] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)   # stalled, restarting, no records (time axis)

    @property
    def span(self) -> tuple[float, float] | None:
        """The run's time: its training rank's first to last record (the agent watches before and after)."""
        if self.train_start is not None and self.train_end is not None:
            return self.train_start, self.train_end
        if self.start is not None and self.end is not None:
            return self.start, self.end
        return None

    @property
    def duration(self) -> float:
        span = self.span
        return span[1] - span[0] if span else 0.0


# ------------------------------------------------------------------------------------------ loading

class _Loader:
    def __init__(self, run: Run, max_points: int, with_goodput: bool):
        self.run = run
        self.max_points = max_points
        self.progress = Progress("report", enabled=False)      # load_run shows it on a terminal
        self.meter = CostMeter(run.policy.cost)
        self.seen_events: OrderedDict[tuple, float] = OrderedDict()
        self.gpus_by_host: dict[str, int] = {}
        self.rank_gpu_count = 0
        self.checkpoint_ts = float("-inf")
        # Goodput needs the whole step sequence (median step, steps a rollback threw away): only the
        # fields it reads are kept, one small record per step of the primary rank.
        self.goodput_records: list[dict] | None = [] if with_goodput else None
        self.pass_cause = "start"          # why the next pass starts (the charted rank's own events)
        self.last_step_ts: float | None = None
        self.intervals = Sampled(4000)     # step-to-step intervals (evenly thinned), for their median
        self.widest: list[tuple[float, float, float]] = []   # heap of (interval, from, to)

    def series(self, table: dict, key: str) -> Series | None:
        found = table.get(key)
        if found is None and len(table) < MAX_KEYS:
            found = table[key] = Series(self.max_points)
        return found

    def add_numbers(self, table: dict, section: Any, ts: float, skip: Iterable[str] = ()) -> None:
        if not isinstance(section, dict):
            return
        for key, value in section.items():
            if key in skip or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            series = self.series(table, key)
            if series is not None:
                series.add(ts, float(value))

    def read(self, path: Path, handle) -> None:
        run = self.run
        run.files.append(str(path))
        for line in self.progress.counted(iter_lines(path)):
            if line.error is not None:
                run.malformed += 1
                if len(run.errors) < ERRORS_KEPT:
                    run.errors.append(str(line.error))
                continue
            record = line.record
            run.records += 1
            ts = record["timestamp"]
            run.start = ts if run.start is None else min(run.start, ts)
            run.end = ts if run.end is None else max(run.end, ts)
            run.run_id = run.run_id or record.get("run_id")
            handle(record, ts)

    # A node record: hardware per host and per GPU; training too when no rank logs exist.
    def node_record(self, host: str, with_training: bool):
        def handle(record: dict, ts: float) -> None:
            host_name = record.get("node") or host
            self.run.hosts.add(host_name)
            table = self.run.hardware.setdefault(host_name, {})
            hardware = record.get("hardware") or {}
            self.add_numbers(table, hardware, ts, skip=("gpus",))
            self.add_numbers(table, record.get("system"), ts)
            nccl = (record.get("system") or {}).get("nccl_events")
            if isinstance(nccl, dict):
                self.run.nccl[host_name] = {str(k): v for k, v in nccl.items() if isinstance(v, int)}
            gpus = hardware.get("gpus")
            if isinstance(gpus, list):
                self.gpus_by_host[host_name] = max(self.gpus_by_host.get(host_name, 0), len(gpus))
                for i, gpu in enumerate(gpus):
                    if isinstance(gpu, dict):
                        self.gpu_record(host_name, i, gpu, ts)
            if with_training:
                self.note_pass_cause(record)
                self.training_record(record, ts)
                self.keep_for_goodput(record, ts)
            elif (record.get("event") or {}).get("type") in (event_types.ALERT, event_types.ACTION):
                self.keep_for_goodput(record, ts)    # the agent's restore decision splits a hang
            self.event(record, ts, source=host_name)
        return handle

    def gpu_record(self, host: str, position: int, gpu: dict, ts: float) -> None:
        ident = str(next((gpu[k] for k in ("gpu", "index", "minor_number") if gpu.get(k) is not None), position))
        key = (host, ident)
        if key not in self.run.gpus and len(self.run.gpus) >= MAX_KEYS:
            return
        self.add_numbers(self.run.gpus.setdefault(key, {}), gpu, ts)
        name = gpu.get("name") or gpu.get("modelName")
        if name:
            self.run.gpu_names[key] = str(name)

    def rank_record(self, rank: int | None, primary: bool):
        def handle(record: dict, ts: float) -> None:
            run = self.run
            rank_id = record.get("rank", rank)
            if rank_id is not None:
                run.ranks.add(rank_id)
            count = (record.get("system") or {}).get("gpu_count")
            if isinstance(count, int) and count > 0:
                self.rank_gpu_count = max(self.rank_gpu_count, count)
            if primary:
                self.note_pass_cause(record)
                self.training_record(record, ts)
                self.keep_for_goodput(record, ts)
                if not run.hosts:   # no agent: the trainer's own hardware section is all there is
                    self.add_numbers(run.hardware.setdefault(record.get("node") or f"rank {rank_id}", {}),
                                     record.get("hardware"), ts, skip=("gpus",))
            self.event(record, ts, source=f"rank {rank_id}" if rank_id is not None else "trainer")
        return handle

    def note_checkpoint(self, name: str, ts: float) -> None:
        """The latest checkpoint by time, from records' `last_checkpoint` and `checkpoint_saved` events."""
        if ts >= self.checkpoint_ts:
            self.run.last_checkpoint, self.checkpoint_ts = name, ts

    def keep_for_goodput(self, record: dict, ts: float) -> None:
        if self.goodput_records is None:
            return
        slim: dict[str, Any] = {"timestamp": ts}
        if record.get("step") is not None:
            slim["step"] = record["step"]
        if isinstance(record.get("event"), dict):
            slim["event"] = record["event"]
        elif isinstance(record.get("metrics"), dict):
            metrics = record["metrics"]
            slim["metrics"] = {k: metrics[k] for k in GOODPUT_METRICS if k in metrics}
        else:
            return
        self.goodput_records.append(slim)

    def note_pass_cause(self, record: dict) -> None:
        event = record.get("event")
        if not isinstance(event, dict):
            return
        if event.get("type") == "rollback":
            self.pass_cause = "rollback"
        elif event.get("type") == event_types.RUN_START and event.get("resumed_from") is not None:
            self.pass_cause = "restart"
        elif event.get("type") == event_types.IN_PROCESS_RESTART:
            self.pass_cause = "in-process restart"      # the same processes went back to a snapshot

    def step_pass(self, step: int, ts: float) -> Pass:
        """The pass this step belongs to: a new one when the step does not rise (rollback, restart)."""
        passes, last = self.run.passes, self.run.last_step_seen
        if not passes or (last is not None and step <= last and len(passes) < MAX_PASSES):
            passes.append(Pass(step, ts, self.pass_cause if passes else "start"))
            self.pass_cause = "restart"     # steps that go back with no event: a restart nobody announced
        self.run.last_step_seen = step
        return passes[-1]

    def note_interval(self, ts: float) -> None:
        if self.last_step_ts is not None and ts > self.last_step_ts:
            interval = ts - self.last_step_ts
            self.intervals.add(interval)
            entry = (interval, self.last_step_ts, ts)
            if len(self.widest) < GAPS_KEPT:
                heapq.heappush(self.widest, entry)
            elif interval > self.widest[0][0]:
                heapq.heapreplace(self.widest, entry)
        self.last_step_ts = ts

    def training_record(self, record: dict, ts: float) -> None:
        run, metrics = self.run, record.get("metrics")
        run.train_start = ts if run.train_start is None else min(run.train_start, ts)
        run.train_end = ts if run.train_end is None else max(run.train_end, ts)
        self.add_numbers(run.training, metrics, ts, skip=("grad_norm_by_layer",))
        last = (record.get("system") or {}).get("last_checkpoint")
        if isinstance(last, str):
            self.note_checkpoint(last, ts)
        step = record.get("step")
        if not isinstance(metrics, dict) or step is None:
            return
        step_time = metrics.get("step_time_seconds")
        if isinstance(step_time, (int, float)) and step_time > 0:
            for part in ("data_wait", "comm"):
                value = metrics.get(f"{part}_seconds")
                if isinstance(value, (int, float)):
                    self.series(run.shares, part).add(ts, value / step_time)
        self.add_numbers(self.step_pass(step, ts).series, metrics, float(step), skip=("grad_norm_by_layer",))
        self.note_interval(ts)
        run.step_records += 1
        run.first_step = step if run.first_step is None else min(run.first_step, step)
        run.last_step = step if run.last_step is None else max(run.last_step, step)
        gpus = self.rank_gpu_count or sum(self.gpus_by_host.values())
        for _decision in self.meter.observe(step, ts, gpus or None, clock_of(record),
                                            usage_of(record, self.meter.gpus(gpus or None))):
            run.cost_state = self.meter.state
        state = self.meter.state
        for key in ("cost_usd", "cost_per_1k_steps"):
            self.series(run.cost, key).add(ts, getattr(state, key))

    def event(self, record: dict, ts: float, source: str) -> None:
        event = record.get("event")
        if not isinstance(event, dict):
            return
        kind = event["type"]
        step = event.get("step", record.get("step"))
        identity = (kind, step, event.get("id"), event.get("alertname"), event.get("action"),
                    event.get("reason"), event.get("status"))
        previous = self.seen_events.get(identity)
        if previous is not None and abs(ts - previous) <= DUPLICATE_WINDOW_S:
            return
        self.seen_events[identity] = ts
        self.seen_events.move_to_end(identity)
        while len(self.seen_events) > 4096:
            self.seen_events.popitem(last=False)
        self.count_event(kind, event, step, ts, source)

    def count_event(self, kind: str, event: dict, step: int | None, ts: float, source: str) -> None:
        run = self.run
        run.event_counts[kind] += 1
        if kind == event_types.CHECKPOINT_SAVED and step is not None:
            self.note_checkpoint(rundir.step_dir_name(step), ts)
        if kind == event_types.ALERT and event.get("status", "firing") == "firing":
            run.alerts[str(event.get("alertname", "?"))] += 1
        if kind == event_types.ACTION or kind in actions.DECISIONS:
            run.actions[str(event.get("action", kind))] += 1
        if kind == actions.SHADOW_ACTION:
            run.shadowed[str(event.get("action"))] += 1
        if kind == event_types.RUN_START and event.get("actions_mode") == actions.SHADOW_MODE:
            run.shadow_mode = True
        if kind == event_types.RUN_START and isinstance(event.get("mfu_unavailable"), str):
            run.mfu_unavailable = event["mfu_unavailable"][:200]
        if kind == event_types.FAULT_INJECTED and len(run.faults) < ERRORS_KEPT:
            name = str(event.get("fault") or event.get("kind") or "?")
            run.faults.append(name if "@" in name else f"{name}@{step}")
        if kind == event_types.RUN_START and event.get("resumed_from") is not None:
            run.restarts += 1
        marker = marker_kind(kind, event)
        if marker:
            label = event_label(kind, event, step)
            run.markers.setdefault(marker, Sampled(400)).add(Marker(ts, marker, label, step))
        run.events.add(EventRow(ts, kind, step, event_detail(event), source))
        if kind == event_types.HEALTH_CHECK:     # other tools' findings, kept apart for the node section
            run.health.add(EventRow(ts, f"{event.get('tool', '?')} {event.get('test', '')}".strip(), None,
                                    event_detail({k: v for k, v in event.items() if k not in ("tool", "test", "id")}),
                                    source))


def event_label(kind: str, event: dict, step: int | None) -> str:
    name = event.get("alertname") or event.get("action") or ""
    reason = event.get("reason") or event.get("kind") or ""
    parts = [kind] + [p for p in (name, reason) if p and p != kind]
    text = " ".join(str(p) for p in parts) + (f" @ step {step}" if step is not None else "")
    restored = event.get("restored_step", event.get("resumed_from"))
    return text + (f" → back to {restored}" if restored is not None else "")


def load_run(run_dir: str | Path, policy=None, max_points: int = MAX_POINTS, goodput: bool = True) -> Run:
    """Read a run directory (RUN/tls/*.jsonl, RUN/checkpoints/) into a `Run`; raises FileNotFoundError.

    Memory is bounded by `max_points` per series, except the goodput breakdown (`goodput=True`), which
    keeps a few numbers per step of the primary rank.
    """
    root = paths.run_dir(run_dir)
    run = Run(run_dir=root, policy=policy or policy_mod.load(None))
    loader = _Loader(run, max_points, goodput)
    node_files, rank_files = log_files(root)
    if not node_files and not rank_files:
        # a report of nothing ("rank None", no steps) would read as a run that did nothing
        raise FileNotFoundError(f"{root}: no logs to report (no tls/rank-N.jsonl or tls/node-HOST.jsonl, and "
                                f"no TensorBoard, trainer_state.json, Megatron or torchtitan log)")
    ranks = sorted({r for r in map(rank_of, rank_files) if r is not None})
    run.primary_rank = ranks[0] if ranks else None
    with Progress("report", unit="logs") as loader.progress:
        for index, path in enumerate(node_files):
            loader.progress.file(path, index, len(node_files) + len(rank_files))
            loader.read(path, loader.node_record(host_of(path), with_training=not rank_files))
        for index, path in enumerate(rank_files, len(node_files)):
            loader.progress.file(path, index, len(node_files) + len(rank_files))
            loader.read(path, loader.rank_record(rank_of(path), primary=rank_of(path) == run.primary_rank))
    run.gpu_count = loader.meter.state.gpu_count
    run.cost_state = loader.meter.state
    run.checkpoints = read_checkpoints(root)
    if run.checkpoints and not run.last_checkpoint:
        run.last_checkpoint = run.checkpoints[-1].name
    if loader.goodput_records:
        _add_goodput(run, loader.goodput_records)
    elif not goodput:
        run.goodput_error = "left out on request (--no-goodput)"
    _mark_discarded(run.passes)
    run.spans = _hang_spans(run)
    run.spans += _gap_spans(loader, run.spans)
    return run


def _mark_discarded(passes: list[Pass]) -> None:
    """A pass's steps from where any later pass starts again were thrown away (rolled back, restarted)."""
    for i, done in enumerate(passes):
        later = [p.start_step for p in passes[i + 1:]]
        done.discarded_from = min(later) if later else None


def _hang_spans(run: Run) -> list[Span]:
    """Each hang's stall (last step -> restore decided) and restart (-> first step again), from goodput."""
    spans = []
    for hang in getattr(run.goodput, "hangs", ()):
        split = hang.decided_at if hang.decided_at is not None else hang.last_progress + hang.stall_seconds
        incident = f", incident {hang.incident}" if hang.incident else ""
        decided = f"until the restore was decided ({hang.decided_by})" if hang.decided_at is not None else \
            "until the process died (no restore decision recorded)"
        spans.append(Span(hang.last_progress, split, "stall",
                          f"stalled {hang.stall_seconds:.1f}s: no step {decided}{incident}"))
        spans.append(Span(split, hang.resumed_at, "restart",
                          f"restarting {hang.restart_recovery_seconds:.1f}s: from the decision to the first step "
                          f"of the restarted run{incident}"))
    return spans


def _gap_spans(loader: _Loader, known: list[Span]) -> list[Span]:
    """Intervals between the charted rank's steps over GAP_FACTOR x their median that no hang explains."""
    intervals = sorted(loader.intervals)
    if not intervals:
        return []
    limit = GAP_FACTOR * intervals[len(intervals) // 2]
    gaps = []
    for interval, start, end in sorted(loader.widest, key=lambda g: g[1]):
        explained = any(span.start < end and span.end > start for span in known)
        if interval > limit and not explained:
            gaps.append(Span(start, end, "gap", f"no training records for {interval:.1f}s"))
    return gaps


def _add_goodput(run: Run, records: list[dict]) -> None:
    """Goodput and badput by cause, by trainguard.goodput (the same numbers `trainguard goodput` prints)."""
    from trainguard import goodput

    from trainguard.goodput.cli import read_incidents

    try:
        config = goodput.GoodputConfig(stall_seconds=run.policy.alerts.stall_seconds)
        run.goodput = goodput.compute(records, config, incidents=read_incidents(run.run_dir, run.errors))
    except Exception as exc:  # the report still renders without this section, and says why
        run.goodput_error = f"goodput could not be computed ({type(exc).__name__}: {exc})"


def final(series: Series | None) -> float | None:
    return series.last[1] if series and series.last else None

