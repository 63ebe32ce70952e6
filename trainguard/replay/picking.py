"""Which recorded records are training steps to decide: one pass over stream entries, in order.

- a training step is a record with a step and ``metrics.loss``; its ``metrics.grad_norm`` may be absent
  (a log that prints none, or a placeholder the reader did not take): the guard then decides it on the
  loss alone (`trainguard.decide.guard.StepStats`). A record with a gradient norm but no loss is counted
  in ``partial`` and not decided;
- with several ranks, only the lead rank's steps are decided (loss and gradient norms are global, so
  every rank carries the same numbers); records without a rank are followed only when no input has one;
- a step number that goes back within one file is a rollback or restart and is decided again, as the
  live run did; from another file (a second node's copy of the same steps) it is a duplicate and skipped;
- the decisions the live run logged (``recorded``) are read from the same rank's events.

The engine picks this way over a merged stream, and the columnar fast path (columns.py) over each chunk
of one file in a worker process: the same rules in one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trainguard import actions as vocabulary
from trainguard.decide.decision import Decision

FIRST_SEEN = object()       # lead rank not known ahead: the first training step's rank leads

class Picked:
    """Picked training steps as lists, in order (columns.block_of makes them the arrays the deciders take).

    `clock_seconds` is a step's `system.monotonic_seconds` (None without one) and `clock_nodes` its node:
    the cost meter's clock is the pair (`clocks`)."""

    __slots__ = ("steps", "losses", "grad_norms", "layers", "timestamps", "gpus", "clock_nodes", "clock_seconds")

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.grad_norms: list[float | None] = []     # None: the step has a loss but no gradient norm
        self.layers: list[dict | None] = []
        self.timestamps: list[float] = []
        self.gpus: list[int | None] = []
        self.clock_nodes: list[str | None] = []
        self.clock_seconds: list[float | None] = []

    def __len__(self) -> int:
        return len(self.steps)

    def extend(self, other: "Picked") -> None:
        for name in self.__slots__:
            getattr(self, name).extend(getattr(other, name))

    def any_layers(self) -> list | None:
        return self.layers if any(self.layers) else None

    def clocks(self) -> list | None:
        """Each step's (node, monotonic seconds), or None where it has none; None when no step has one."""
        seconds = self.clock_seconds
        if seconds.count(None) == len(seconds):
            return None
        return [None if at is None else (node, at) for node, at in zip(self.clock_nodes, seconds)]


class Tracked:
    """Ordinals (a record's place in its stretch of a file, from 1) a tracking Picker noted."""

    __slots__ = ("steps", "gpu_ordinals", "gpu_counts", "recorded")

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.gpu_ordinals: list[int] = []
        self.gpu_counts: list[int] = []
        self.recorded: list[int] = []

    def gpu_said(self, ordinal: int, count: int) -> None:
        self.gpu_ordinals.append(ordinal)
        self.gpu_counts.append(count)


@dataclass(frozen=True)
class Action:
    action: str
    step: int | None
    timestamp: float
    reason: str
    source: str                     # "guard" | "cost" (who decided), "log" (recorded by the live run)
    detail: dict = field(default_factory=dict)
    decision: Decision | None = field(default=None, repr=False, compare=False)   # as the decider made it


def recorded(record, when: float) -> Action | None:
    """A decision event the live run logged (skip_step, rollback, restore, cost_*, stop)."""
    event = record.event
    if event.type not in vocabulary.DECISIONS:
        return None
    why = event.reason if isinstance(event.reason, str) else event.alertname
    return Action(event.type, record.step, when, why if isinstance(why, str) else "", "log")


class Picker:
    """The picking state carried from entry to entry: lead rank, last step and file, GPUs seen, counts."""

    def __init__(self, lead=FIRST_SEEN, *, track: bool = False):
        self.lead = lead
        # track: where things are, for a reader that merges files afterwards (parallel.py): the ordinal of
        # each picked step, of each record that says a GPU count (and the count), of each recorded event.
        self.tracked: Tracked | None = Tracked() if track else None
        self.last_step: int | None = None
        self.last_file: int | None = None
        self.gpus: int | None = None
        self.records = self.steps = self.duplicates = self.partial = 0
        self.first: float | None = None
        self.last: float | None = None
        self.recorded: list[Action] = []

    def absorb(self, other: "Picker") -> None:
        """Add the counts, times and recorded decisions of a picker that followed the next stretch of the
        same file (a chunk read by a worker process: columns.py)."""
        if other.first is not None:
            if self.first is None:
                self.first = self.last = other.first
            self.last = max(self.last, other.last)
        self.records += other.records
        self.steps += other.steps
        self.duplicates += other.duplicates
        self.partial += other.partial
        self.recorded += other.recorded

    def take(self, entries: list[tuple]) -> Picked:
        """The training steps among `entries` (timestamp, file index, ordinal, typed record, dict), in order.

        One loop with the state in local names, on purpose: it runs once per record, and a million-record
        log is the case it is measured on (bench/bench_replay.py)."""
        picked = Picked()
        if not entries:
            return picked
        steps, losses, grad_norms, by_layer = picked.steps, picked.losses, picked.grad_norms, picked.layers
        times, counts, nodes, clocks = picked.timestamps, picked.gpus, picked.clock_nodes, picked.clock_seconds
        lead, last_step, last_file, gpus = self.lead, self.last_step, self.last_file, self.gpus
        tracked = self.tracked
        duplicates = partial = 0
        last = entries[0][0] if self.first is None else self.last
        if self.first is None:
            self.first = last
        for when, file_index, ordinal, record, _ in entries:
            if when > last:
                last = when
            system = record.system
            if system is not None and system.gpu_count:
                gpus = system.gpu_count
                if tracked is not None:
                    tracked.gpu_said(ordinal, gpus)
            elif record.hardware is not None and record.hardware.gpus:
                gpus = len(record.hardware.gpus)
                if tracked is not None:
                    tracked.gpu_said(ordinal, gpus)
            if record.event is not None and (record.rank == lead or lead is FIRST_SEEN):
                logged = recorded(record, when)
                if logged is not None:
                    self.recorded.append(logged)
                    if tracked is not None:
                        tracked.recorded.append(ordinal)
            metrics, step = record.metrics, record.step
            if metrics is None or step is None:
                continue
            loss, grad_norm = metrics.loss, metrics.grad_norm
            if loss is None:
                if grad_norm is not None:
                    partial += 1
                continue
            if lead is FIRST_SEEN:
                lead = record.rank
            if record.rank != lead or (file_index != last_file and last_step is not None and step <= last_step):
                duplicates += 1
                continue
            last_step, last_file = step, file_index
            if tracked is not None:
                tracked.steps.append(ordinal)
            layers = metrics.grad_norm_by_layer     # a dict, or a worker's layer struct (numbers only)
            if layers.__class__ is dict and None in layers.values():
                layers = {name: math.nan if norm is None else norm for name, norm in layers.items()}
            steps.append(step)
            losses.append(loss)
            grad_norms.append(grad_norm)
            by_layer.append(layers)
            times.append(when)
            counts.append(gpus)
            nodes.append(record.node)
            clocks.append(None if system is None else system.monotonic_seconds)
        self.lead, self.last_step, self.last_file, self.gpus, self.last = lead, last_step, last_file, gpus, last
        self.records += len(entries)
        self.steps += len(steps)
        self.duplicates += duplicates
        self.partial += partial
        return picked
