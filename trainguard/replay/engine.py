"""The replay engine: the live run's own Guard and CostMeter over a recorded stream, in the log's time.

Nothing here decides anything: `trainguard.decide.guard.Guard` and `trainguard.decide.cost.CostMeter`
do, exactly as in the trainer and the agent. This module only picks which records are training steps
and feeds them in order:

- a training step is a record with a step and both ``metrics.loss`` and ``metrics.grad_norm`` (the
  guard needs both); a record with only one of them is counted in ``partial_steps`` and not decided;
- with several ranks, only the lead rank's steps are decided (loss and gradient norms are global, so
  every rank carries the same numbers); records without a rank are followed only when no input has one;
- a step number that goes back within one file is a rollback or restart and is decided again, as the
  live run did; from another file (a second node's copy of the same steps) it is a duplicate and skipped;
- the decisions the live run logged (``recorded``) are read from the same rank's events;
- after the guard says ``stop`` the live run would have ended: the guard is not asked again, the cost
  meter keeps metering so the timeline shows what the rest of the log cost.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from trainguard import actions as vocabulary
from trainguard.decide.cost import CostMeter
from trainguard.decide.decision import Decision
from trainguard.decide.guard import STOP, Guard
from trainguard.policy import Policy

# Called with every stream entry (timestamp, file index, ordinal, typed record, dict or None) in
# order, before the record is decided: the alert series (series.Exporters) are built this way.
Observer = Callable[[tuple], None]
_FIRST_SEEN = object()


@dataclass(frozen=True)
class Action:
    action: str
    step: int | None
    timestamp: float
    reason: str
    source: str                     # "guard" | "cost" (who decided), "log" (recorded by the live run)
    detail: dict = field(default_factory=dict)
    decision: Decision | None = field(default=None, repr=False, compare=False)   # as the decider made it


@dataclass
class Outcome:
    records: int = 0
    first_timestamp: float | None = None
    last_timestamp: float | None = None
    steps: int = 0                  # training steps decided
    duplicate_steps: int = 0        # other ranks' or other files' copies of decided steps
    partial_steps: int = 0          # steps lacking loss or grad_norm
    actions: list[Action] = field(default_factory=list)
    recorded: list[Action] = field(default_factory=list)   # decisions the live run wrote in the log
    cost: dict = field(default_factory=dict)


def _action(decision, source: str) -> Action:
    return Action(decision.action, decision.step, decision.timestamp, decision.reason, source,
                  dict(decision.detail), decision)


def _recorded(record, when: float) -> Action | None:
    """A decision event the live run logged (skip_step, rollback, restore, cost_*, stop)."""
    event = record.event
    if event.type not in vocabulary.ACTIONS and event.type != STOP:
        return None
    why = event.reason if isinstance(event.reason, str) else event.alertname
    return Action(event.type, record.step, when, why if isinstance(why, str) else "", "log")


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
    """The guard and the meter over picked training steps, a batch at a time (one call each per batch,
    not per step: what replay's throughput rests on), their decisions in record order."""

    def __init__(self, guard: Guard, meter: CostMeter, found: list[Action]):
        self.guard, self.meter, self.found = guard, meter, found
        self.guarding = True

    def decide(self, picked: list[tuple]) -> None:
        """`picked`: (step, loss, grad_norm, layers, timestamp, gpu_count, clock) of consecutive steps."""
        if not picked:
            return
        steps, losses, grad_norms, layers, times, gpus, clocks = zip(*picked)
        by_guard = []
        if self.guarding:
            by_guard = self.guard.check_many(steps, losses, grad_norms, times, layers if any(layers) else None)
            for position, (_, decision) in enumerate(by_guard):
                if decision.action == STOP:     # the live run ends here: the guard is not asked again
                    del by_guard[position + 1:]
                    self.guarding = False
                    break
        by_meter = self.meter.observe_many(steps, times, gpus, clocks if any(clocks) else None)
        # Record order; at one record the guard's decision comes before the meter's.
        merged = sorted([(i, 0, d) for i, d in by_guard] + [(i, 1, d) for i, d in by_meter], key=lambda x: x[:2])
        self.found.extend(_action(d, "guard" if by == 0 else "cost") for _, by, d in merged)


def replay(stream: Iterable, policy: Policy, *, observer: Observer | None = None,
           meter: CostMeter | None = None) -> Outcome:
    """Feed every training step of `stream` (a source.Stream, or its entries) to a fresh Guard and to
    `meter` (a fresh CostMeter unless given: the alert series read the same one).

    The loop below only picks steps, with local names on purpose: it runs once per record, and a
    million-record log is the case it is measured on (bench/bench_replay.py). With an `observer` every
    step is decided before the next entry is observed, since the observer reads the meter."""
    meter = meter or CostMeter(policy.cost)
    out = Outcome()
    decider = _Decider(Guard(policy.guard), meter, out.actions)
    first = last = None
    blocks = _blocks(stream)
    lead = getattr(stream, "lead_rank", _FIRST_SEEN)
    last_step, last_file, gpus = None, None, None
    records = steps = duplicates = partial = 0
    for block in blocks:
        picked: list[tuple] = []
        pick = picked.append
        records += len(block)
        if first is None and block:
            first = last = block[0][0]
        for entry in block:
            when, file_index, _, record, _ = entry
            if when > last:
                last = when
            if observer is not None:
                steps += len(picked)
                decider.decide(picked)
                picked.clear()
                observer(entry)
            system = record.system
            if system is not None and system.gpu_count:
                gpus = system.gpu_count
            elif record.hardware is not None and record.hardware.gpus:
                gpus = len(record.hardware.gpus)
            if record.event is not None and (record.rank == lead or lead is _FIRST_SEEN):
                logged = _recorded(record, when)
                if logged is not None:
                    out.recorded.append(logged)
            metrics, step = record.metrics, record.step
            if metrics is None or step is None:
                continue
            loss, grad_norm = metrics.loss, metrics.grad_norm
            if loss is None or grad_norm is None:
                if loss is not None or grad_norm is not None:
                    partial += 1
                continue
            if lead is _FIRST_SEEN:
                lead = record.rank
            if record.rank != lead or (file_index != last_file and last_step is not None and step <= last_step):
                duplicates += 1
                continue
            last_step, last_file = step, file_index
            layers = metrics.grad_norm_by_layer
            if layers and None in layers.values():
                layers = {name: math.nan if norm is None else norm for name, norm in layers.items()}
            clock = None if system is None or system.monotonic_seconds is None else (
                record.node, system.monotonic_seconds)
            pick((step, loss, grad_norm, layers, when, gpus, clock))
        steps += len(picked)
        decider.decide(picked)
    out.records, out.first_timestamp, out.last_timestamp = records, first, last
    out.steps, out.duplicate_steps, out.partial_steps = steps, duplicates, partial
    state = meter.state
    out.cost = {"cost_usd": state.cost_usd, "cost_per_1k_steps": state.cost_per_1k_steps,
                "overrun_ratio": state.overrun_ratio, "tier": state.tier, "gpu_count": state.gpu_count}
    return out


def finite_or_text(value: Any) -> Any:
    """JSON has no NaN: a non-finite float in a decision's detail is written as its name."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: finite_or_text(item) for key, item in value.items()}
    return value
