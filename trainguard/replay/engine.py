"""The replay engine: the live run's own Guard and CostMeter over a recorded stream, in the log's time.

Nothing here decides anything: `trainguard.decide.guard.Guard` and `trainguard.decide.cost.CostMeter`
do, exactly as in the trainer and the agent. This module feeds them the training steps of the stream
in order (picking.py says which records those are), a block of columns at a time, one way
(`trainguard.decide.batch.guard_block` and `meter_block`):

- one plain log file, without an observer, is read the columnar way (columns.py): worker processes decode
  and pick its chunks side by side, each chunk a block;
- several files (a run directory) or a compressed log, without an observer, are read side by side in
  worker processes and put together in merged order (parallel.py), falling back to the merged stream for
  what only it can decide (parallel.NotExact);
- the alert-rule path's observer, and `parallel.ONE_PROCESS_ENV` set (the reference), read the merged
  stream's blocks here, each made a block by `columns.block_of`.

All ways make the same decisions and leave the same state (tests/replay/test_columns.py, test_parallel.py).
After the guard says ``stop`` the live run would have ended: the guard is not asked again, the cost
meter keeps metering so the timeline shows what the rest of the log cost.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from trainguard.actions import STOP
from trainguard.decide import batch
from trainguard.decide.batch import Block
from trainguard.decide.cost import CostMeter
from trainguard.decide.guard import Guard
from trainguard.policy import Policy
from trainguard.replay import columns, parallel
from trainguard.replay.picking import FIRST_SEEN, Action, Picked, Picker

__all__ = ["Action", "ReplayOutcome", "replay", "finite_or_text"]

# Called with every stream entry (timestamp, file index, ordinal, typed record, dict or None) in
# order, before the record is decided: the alert series (series.Exporters) are built this way.
Observer = Callable[[tuple], None]


@dataclass
class ReplayOutcome:
    records: int = 0
    first_timestamp: float | None = None
    last_timestamp: float | None = None
    steps: int = 0                  # training steps decided
    duplicate_steps: int = 0        # other ranks' or other files' copies of decided steps
    partial_steps: int = 0          # steps with a grad_norm but no loss (not decided)
    actions: list[Action] = field(default_factory=list)
    recorded: list[Action] = field(default_factory=list)   # decisions the live run wrote in the log
    cost: dict = field(default_factory=dict)
    progress: "Progress" = field(default_factory=lambda: Progress())
    # each file's lines naming a source.MARKS event, found while decoding (columns.py, parallel.py) (None: not looked for)
    event_lines: dict[str, list] | None = None

    def may_have_stalled(self, stall_seconds: float) -> bool:
        """Whether the lead rank's steps leave room for a stall (the screen of `trainguard.decide.stall`)."""
        return self.progress.longest_pause(self.last_timestamp) > stall_seconds


@dataclass
class Progress:
    """The lead rank's step advances, screened a block at a time: the longest time without a new step.

    A stall (trainguard.decide.stall) is a span with no step advance on any rank; the lead rank's
    advances are some of those, so its longest pause bounds every stall from above. Replay runs the
    exact rule over the records only where this bound exceeds stall_seconds, so a healthy log costs one
    `numpy.diff` per block and no second pass."""

    newest_step: float = -math.inf
    advanced_at: float | None = None
    longest: float = 0.0

    def observe(self, steps, timestamps) -> None:
        import numpy as np

        if not len(steps):
            return
        steps = np.asarray(steps, dtype=np.float64)
        before = np.maximum.accumulate(np.concatenate(([self.newest_step], steps)))[:-1]
        advancing = steps > before
        if not advancing.any():
            return
        times = np.asarray(timestamps, dtype=np.float64)[advancing]
        if self.advanced_at is not None:
            times = np.concatenate(([self.advanced_at], times))
        if len(times) > 1:
            self.longest = max(self.longest, float(np.max(np.diff(times))))
        self.newest_step = max(self.newest_step, float(steps.max()))
        self.advanced_at = float(times[-1])

    def longest_pause(self, last_timestamp: float | None) -> float:
        if self.advanced_at is None:
            return math.inf if last_timestamp is not None else 0.0   # records but no step: look closer
        tail = (last_timestamp - self.advanced_at) if last_timestamp is not None else 0.0
        return max(self.longest, tail)


def _action(decision, source: str) -> Action:
    return Action(decision.action, decision.step, decision.timestamp, decision.reason, source,
                  dict(decision.detail), decision)


BATCH = 1024      # entries picked per call of the guard and the meter when the input is not in blocks


def _blocks(stream: Iterable) -> Iterator[list]:
    """The stream's entries a list at a time: its own blocks where it has them (source.Stream, opened
    here, so its lead rank is known once this returns)."""
    blocks = getattr(stream, "blocks", None)
    if blocks is not None:
        return blocks()
    entries = iter(stream)
    return iter(lambda: list(itertools.islice(entries, BATCH)), [])


class _Decider:
    """The guard and the meter over picked training steps, a block at a time (one call each per block,
    not per step: what replay's throughput rests on), their decisions in record order."""

    def __init__(self, guard: Guard, meter: CostMeter, found: list[Action], progress: Progress | None = None):
        self.guard, self.meter, self.found = guard, meter, found
        self.progress = progress if progress is not None else Progress()
        self.guarding = True

    def decide(self, block: Block) -> None:
        """Consecutive picked steps as columns (`trainguard.decide.batch`: the one way replay decides)."""
        if not len(block):
            return
        self.progress.observe(block.steps, block.timestamps)
        by_guard = batch.guard_block(self.guard, block) if self.guarding else []
        self._merge(by_guard, batch.meter_block(self.meter, block))

    def _merge(self, by_guard: list, by_meter: list) -> None:
        for position, (_, decision) in enumerate(by_guard):
            if decision.action == STOP:         # the live run ends here: the guard is not asked again
                del by_guard[position + 1:]
                self.guarding = False
                break
        # Record order; at one record the guard's decision comes before the meter's.
        merged = sorted([(i, 0, d) for i, d in by_guard] + [(i, 1, d) for i, d in by_meter], key=lambda x: x[:2])
        self.found.extend(_action(d, "guard" if by == 0 else "cost") for _, by, d in merged)


def replay(stream: Iterable, policy: Policy, *, observer: Observer | None = None,
           meter: CostMeter | None = None) -> ReplayOutcome:
    """Feed every training step of `stream` (a source.Stream, or its entries) to a fresh Guard and to
    `meter` (a fresh CostMeter unless given: the alert series read the same one). With an `observer`
    every step is decided before the next entry is observed, since the observer reads the meter."""
    meter = meter or CostMeter(policy.cost)
    out = ReplayOutcome()
    decider = _Decider(Guard(policy.guard), meter, out.actions, out.progress)
    if observer is None and columns.fits(stream):
        out.event_lines = {}
        picker = _replay_columns(stream, decider, out.event_lines)
    elif observer is None and parallel.fits(stream):
        try:
            picker, out.event_lines = _replay_parallel(stream, decider)
        except parallel.NotExact:         # only the merged stream can: start again there, afresh
            stream.reread()
            meter, out = CostMeter(policy.cost), ReplayOutcome()
            decider = _Decider(Guard(policy.guard), meter, out.actions, out.progress)
            picker = _replay_entries(stream, decider, None)
    else:
        picker = _replay_entries(stream, decider, observer)
    out.records, out.first_timestamp, out.last_timestamp = picker.records, picker.first, picker.last
    out.steps, out.duplicate_steps, out.partial_steps = picker.steps, picker.duplicates, picker.partial
    out.recorded = picker.recorded
    state = meter.state
    out.cost = {"cost_usd": state.cost_usd, "cost_per_1k_steps": state.cost_per_1k_steps,
                "overrun_ratio": state.overrun_ratio, "tier": state.tier, "gpu_count": state.gpu_count}
    return out


DECIDED_TOGETHER = 16_384     # picked steps gathered before they are decided as one block (no observer)


def _replay_entries(stream: Iterable, decider: _Decider, observer: Observer | None) -> Picker:
    """Without an observer nothing reads the deciders mid-stream, so the steps of many decoded blocks are
    decided together: long blocks are what the screens clear in bulk. With one, each step is decided
    before the next entry is observed."""
    blocks = _blocks(stream)
    picker = Picker(getattr(stream, "lead_rank", FIRST_SEEN))     # known once the stream is opened
    gathered = Picked()
    for block in blocks:
        if observer is None:
            gathered.extend(picker.take(block))
            if len(gathered) >= DECIDED_TOGETHER:
                decider.decide(columns.block_of(gathered))
                gathered = Picked()
            continue
        for entry in block:
            observer(entry)
            decider.decide(columns.block_of(picker.take([entry])))
    decider.decide(columns.block_of(gathered))
    return picker


def _replay_parallel(stream, decider: _Decider) -> tuple[Picker, dict[str, list]]:
    totals = Picker()
    event_lines = parallel.replay(stream, totals, decider.decide)
    return totals, event_lines


def _replay_columns(stream, decider: _Decider, event_lines: dict[str, list]) -> Picker:
    totals = Picker()
    for chunk in columns.read(stream, totals, event_lines=event_lines):
        decider.decide(chunk)
    return totals


def finite_or_text(value: Any) -> Any:
    """JSON has no NaN: a non-finite float in a decision's detail is written as its name."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: finite_or_text(item) for key, item in value.items()}
    return value
