"""Replay of a run's LR schedule: the same state machine (trainguard/decide/schedules.py) over the
recorded steps, its phase changes set beside the ``lr_phase`` events the live run wrote.

    found = replay_phases(files)      # None when no log of them has an lr_phase start event
    found.match, found.replayed, found.recorded

The run's opening ``lr_phase`` event names the schedule and carries every parameter, so the machine is
rebuilt from the log alone. Then one rank's log is walked in order, step record by step record, and each
step is treated as the live trainer treated it, from what its log says followed it:
- a ``skip_step``, ``stop`` or guard ``rollback`` of that step: no update was applied, not observed;
- a ``rollback`` (guard or control) that restored step N: the machine takes the state it had at N (its
  state is snapshotted at every ``checkpoint_saved``), as the live trainer took it from the checkpoint;
- otherwise observed; when the machine asks for a validation loss, the ``evaluation`` event of purpose
  ``lr_phase`` after that step gives it;
- a ``run_start`` resumed from N (a restart): the state at N again.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path

from trainguard import event_types, tls
from trainguard.actions import ROLLBACK, SKIP_STEP, STOP
from trainguard.decide import schedules
from trainguard.decide.schedules import StepSignals

HEAD_LINES = 64        # the opening lr_phase event is among a log's first records (after run_start)
NOT_APPLIED = (SKIP_STEP, STOP)


@dataclass
class PhaseReplay:
    file: str
    schedule: str
    recorded: list[tuple] = field(default_factory=list)   # (step, from, phase, reason) the live run wrote
    replayed: list[tuple] = field(default_factory=list)   # ... the machine made over the same steps
    missing_snapshots: int = 0                            # restores to a step with no checkpoint seen

    @property
    def match(self) -> bool:
        return self.recorded == self.replayed

    def to_json(self) -> dict:
        keys = ("step", "from", "phase", "reason")
        return {"file": self.file, "schedule": self.schedule, "match": self.match,
                "recorded": [dict(zip(keys, change)) for change in self.recorded],
                "replayed": [dict(zip(keys, change)) for change in self.replayed],
                "missing_snapshots": self.missing_snapshots}


def _opening_event(path: Path) -> dict | None:
    for index, line in enumerate(tls.iter_lines(path)):
        if index >= HEAD_LINES:
            return None
        event = (line.record or {}).get("event")
        if event and event.get("type") == event_types.LR_PHASE and event.get("from") is None:
            return event
    return None


def replay_phases(files: list[Path]) -> PhaseReplay | None:
    """Replay the schedule of the first log (in the order given) that opens with an lr_phase event."""
    for path in files:
        opening = _opening_event(path)
        if opening is not None:
            return _Walk(path, opening).run()
    return None


class _Walk:
    def __init__(self, path: Path, opening: dict):
        self.path, self.opening = path, opening
        self.machine = schedules.from_event(opening)
        self.out = PhaseReplay(str(path), str(opening.get("schedule")))
        self.snapshots: dict[int, dict] = {}
        self.pending: dict | None = None      # the latest step record, waiting for what follows it
        self.tail: list[dict] = []            # the events after it

    def run(self) -> PhaseReplay:
        for line in tls.iter_lines(self.path):
            record = line.record
            if record is None:
                continue
            event = record.get("event")
            if event is not None:
                self._event(event, record)
            elif record.get("step") is not None and "loss" in (record.get("metrics") or {}):
                self._finish()
                self.pending = record
        self._finish()
        return self.out

    def _event(self, event: dict, record: dict) -> None:
        if event.get("type") == event_types.LR_PHASE and event.get("from") is not None:
            self.out.recorded.append(_key(event, record))
        if self.pending is not None:
            self.tail.append(event)

    def _finish(self) -> None:
        """Decide the pending step as the live trainer did, from the events that followed it."""
        if self.pending is None:
            return
        record, tail, self.pending, self.tail = self.pending, self.tail, None, []
        step, metrics = int(record["step"]), record["metrics"]
        ours = [e for e in tail if e.get("step", step) == step]
        rollback = next((e for e in ours if e.get("type") == ROLLBACK and e.get("restored_step") is not None), None)
        decided = any(e.get("type") in NOT_APPLIED or e.get("type") == ROLLBACK and e.get("source") == "guard"
                      for e in ours)
        changes = []
        if rollback is not None:
            changes += self._restore(int(rollback["restored_step"]), step, ROLLBACK)
        elif not decided:
            signals = StepSignals(step, _number(metrics.get("loss")), _number(metrics.get("grad_norm")),
                                  _number(metrics.get("param_norm")))
            changes += self.machine.observe(signals)
            if self.machine.waiting:
                changes += self.machine.evaluated(step, _evaluation(ours))
        self.out.replayed += [(c.step, c.previous, c.phase, c.reason) for c in changes]
        for event in tail:
            if event.get("type") == event_types.CHECKPOINT_SAVED and event.get("step") == step:
                self.snapshots[step] = copy.deepcopy(self.machine.state_dict())
            elif event.get("type") == event_types.RUN_START and event.get("resumed_from") is not None:
                self._restore(int(event["resumed_from"]), step, "resume")   # the live run writes no change

    def _restore(self, to_step: int, step: int, reason: str) -> list:
        state = self.snapshots.get(to_step)
        if state is None:
            self.out.missing_snapshots += 1
            return []
        change = self.machine.restore(copy.deepcopy(state), step, reason)
        return [change] if change is not None and reason == ROLLBACK else []


def _key(event: dict, record: dict) -> tuple:
    return (event.get("step", record.get("step")), event.get("from"), event.get("phase"), event.get("reason"))


def _evaluation(events: list[dict]) -> float:
    found = next((e for e in events if e.get("type") == event_types.EVALUATION and e.get("purpose") == event_types.LR_PHASE), None)
    return _number(found.get("val_loss")) if found else math.nan


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def render_lines(found: PhaseReplay | None) -> list[str]:
    """The human form's section (trainguard replay without --json)."""
    if found is None:
        return []
    verdict = "the same as the log" if found.match else "NOT the same as the log"
    lines = ["", f"LR phases ({found.schedule} schedule, replayed over {found.file}): {len(found.replayed)} "
                 f"changes, {verdict} ({len(found.recorded)} recorded)"]
    lines += [f"  step {step:>8}  {previous} -> {phase}  ({reason})" for step, previous, phase, reason in found.replayed]
    if not found.match:
        lines += ["  recorded:"] + [f"  step {s:>8}  {p} -> {ph}  ({r})" for s, p, ph, r in found.recorded]
    return lines


def json_part(found: PhaseReplay | None) -> dict:
    """The replay --json document's ``lr_phases`` entry, when the logs had a schedule to replay."""
    return {} if found is None else {"lr_phases": found.to_json()}
