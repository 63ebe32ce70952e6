"""How often the in-memory snapshot tier may run: no more than a budget share of the training time.

A snapshot costs its rank the seconds it blocks the step (staging the state to host memory). Its writer and
its replication run beside the step (serialising, hashing, sending to the peer node): on a GPU that work
overlaps the device's compute, but where training runs on the same cores (a CPU run) it is time taken from
training too, and counts (`counts_beside`). `recovery.snapshot_every` is a number of steps, and a step
may take 0.1 s or 10 s: the same five steps that cost 0.2% of a large model's time cost 15% of a small
one's. So rank 0 measures what its snapshots cost and how long its steps take, and stretches the interval
until the snapshots take at most `budget` of the time (never below the interval it was given):

    every = max(given, ceil(cost / (budget * step_seconds))), rounded up to a multiple of given

with the medians of the latest costs and step times (one slow snapshot or step does not move it), once
`MIN_SAMPLES` of each are measured (the first steps and snapshots are the warm-up's: compiling, allocating). The
interval reaches every rank in the step's sync (protect/sync.py), so every rank snapshots the same steps,
which the restore's agreement needs. A fault then loses about half an interval of work more, which the
budget bounds too: at 2% and a fault an hour, the interval's steps are minutes of snapshots' worth, not
hours. The checkpoint autopilot (checkpoint_interval.py), when on, gives the interval this rule stretches.

Pure: fed the rank's own TLS records (observe), no I/O.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from trainguard import event_types

SAMPLES = 16          # the latest snapshots the cost's median is taken over
STEP_SAMPLES = 64     # the latest steps the step time's median is taken over (a busy host's wander is wide)
MIN_SAMPLES = 8       # how many of each before the rule moves anything
# The interval moves only when the paced one differs by more than this share: between 30 and 60 steps the
# snapshots cost 2% or 1%, and on a busy host the step time's median wanders that much within a minute.
CHANGE_RATIO = 0.5


@dataclass
class SnapshotPace:
    budget: float                         # the share of training time snapshots may take; 0: off
    counts_beside: bool = True            # the writing and replication beside the step count (a CPU run)
    costs: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES))
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_SAMPLES))
    paced: int = 0                        # the interval last applied by this rule (0: none yet)
    _replicating: int | None = None       # the step of the latest snapshot, whose replication adds to its cost

    def observe(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        if isinstance(event, dict):
            kind = event.get("type")
            if kind == event_types.SNAPSHOT_SAVED:
                cost = _seconds(event.get("blocking_seconds"))
                if self.counts_beside:
                    cost += _seconds(event.get("write_seconds"))
                self.costs.append(cost)
                step = event.get("step")
                self._replicating = step if isinstance(step, int) else None
            elif (kind == event_types.SNAPSHOT_REPLICATED and self.counts_beside and self._replicating is not None
                  and event.get("step") == self._replicating):
                self._replicating = None            # its replication: part of the latest snapshot's cost
                self.costs[-1] += _seconds(event.get("seconds"))
        elif isinstance(record.get("metrics"), dict):
            seconds = record["metrics"].get("step_time_seconds")
            if isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0:
                self.step_times.append(float(seconds))

    def every(self, given: int) -> int:
        """The interval in steps for the tier given `given` steps (the policy's or the autopilot's)."""
        if given <= 0 or self.budget <= 0 or min(len(self.costs), len(self.step_times)) < MIN_SAMPLES:
            return given
        wanted = paced_every(given, statistics.median(self.costs), statistics.median(self.step_times), self.budget)
        if self.paced and abs(wanted - self.paced) <= CHANGE_RATIO * self.paced:
            wanted = self.paced                 # no churn for a wobble of the medians
        self.paced = wanted
        return wanted

    def inputs(self) -> dict[str, float | None]:
        """What the interval came from: for the event that says it moved."""
        median = statistics.median
        return {"cost_seconds": round(median(self.costs), 6) if self.costs else None,
                "step_seconds": round(median(self.step_times), 6) if self.step_times else None,
                "budget": self.budget}


def paced_every(given: int, cost_seconds: float, step_seconds: float, budget: float) -> int:
    """At least `given`; enough steps that one snapshot's cost is at most `budget` of their time, rounded up
    to a multiple of `given` (the snapshots stay on the steps the policy names: a move from 5 to 31 would
    take one at step 31 right after the one at 30)."""
    if not (cost_seconds > 0 and step_seconds > 0 and budget > 0):
        return given
    needed = math.ceil(cost_seconds / (budget * step_seconds))
    return max(given, given * math.ceil(needed / given))


def _seconds(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else 0.0
