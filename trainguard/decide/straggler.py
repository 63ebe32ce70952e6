"""Fail-slow: which rank makes the others wait, scored per rank from what every rank already records.

Scores in the spirit of NVIDIA nvidia-resiliency-ext's straggler detection, from 0 (worst) to 1 (best),
a ratio of a reference time to this rank's recent time:

- **relative**: the fastest rank's recent median compute time / this rank's (0.5 = twice as slow as the
  best rank now);
- **individual**: this rank's best median compute time in its own history / its recent one (0.5 =
  twice as slow as it used to be), which sees a slowdown even when every rank slowed.

A step's compute time is its step time less its data wait and its communication time (the trainer's
`metrics.step_time_seconds`, `data_wait_seconds`, `comm_seconds`): in data-parallel training the fast
ranks wait for the slow one inside the all-reduce, so their comm time holds the wait while their
compute time does not (the same split as `trainguard diagnose`'s stragglers check).

A rank is a straggler while its relative score stays under `score_min` (NVRx's 0.75). The alert
`TrainingStraggler` fires when that persists; eviction of a persistent straggler is the culprit
machinery's, behind the policy key `restore.evict_stragglers` (only off today: not built). Pure: steps in, scores
out; no clocks, files or torch.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

WINDOW_STEPS = 16          # a rank's recent median is over its last this many steps
MIN_STEPS = 8              # steps a rank needs in its window before it is scored
WARMUP_STEPS = 5           # first steps of each process left out (compilation, caches, rendezvous)
SCORE_MIN = 0.75           # NVRx's default straggler threshold


def compute_seconds(metrics: dict[str, Any]) -> float | None:
    """Step time less data wait and communication (missing parts count as 0); None without a step time."""
    step = _finite(metrics.get("step_time_seconds"))
    if step is None or step <= 0:
        return None
    rest = step - (_finite(metrics.get("data_wait_seconds")) or 0.0) - (_finite(metrics.get("comm_seconds")) or 0.0)
    return max(rest, 0.0)


def relative_scores(medians: dict[int, float]) -> dict[int, float]:
    """NVRx's relative score: the fastest rank's median over each rank's (1.0 for the fastest)."""
    fastest = min(medians.values())
    return {rank: (fastest / value if value > 0 else 1.0) for rank, value in medians.items()}


@dataclass(frozen=True)
class Score:
    rank: int
    node: str
    relative: float
    individual: float
    median_seconds: float        # this rank's recent median compute time
    steps: int                   # compute samples in its window

    def straggling(self, score_min: float = SCORE_MIN) -> bool:
        return self.relative < score_min


@dataclass
class _Rank:
    node: str = ""
    window: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW_STEPS))
    best: float | None = None      # the rank's best (lowest) full-window median so far
    seen_in_process: int = 0
    last_step: int | None = None


class StragglerBoard:
    """Per-rank recent compute times and their scores; bounded: a window and one number per rank."""

    def __init__(self, window_steps: int = WINDOW_STEPS, min_steps: int = MIN_STEPS,
                 warmup_steps: int = WARMUP_STEPS):
        self.window_steps, self.min_steps, self.warmup_steps = window_steps, min_steps, warmup_steps
        self.ranks: dict[int, _Rank] = {}

    def observe(self, rank: int, node: str, step: int, metrics: dict[str, Any]) -> None:
        """One step record of one rank."""
        state = self.ranks.get(rank)
        if state is None:
            state = self.ranks[rank] = _Rank(window=deque(maxlen=self.window_steps))
        state.node = node or state.node
        if state.last_step is not None and step <= state.last_step:
            state.seen_in_process = 0          # a restart or rollback: warm-up again
        state.last_step = step
        state.seen_in_process += 1
        seconds = compute_seconds(metrics)
        if seconds is None or state.seen_in_process <= self.warmup_steps:
            return
        state.window.append(seconds)
        if len(state.window) == self.window_steps:
            current = statistics.median(state.window)
            if state.best is None or current < state.best:
                state.best = current

    def scores(self) -> list[Score]:
        """Scores of the ranks with enough recent steps (none with fewer than two such ranks)."""
        medians = {rank: statistics.median(s.window) for rank, s in self.ranks.items()
                   if len(s.window) >= self.min_steps}
        if len(medians) < 2:
            return []
        relative = relative_scores(medians)
        out = []
        for rank, current in sorted(medians.items()):
            state = self.ranks[rank]
            best = state.best if state.best is not None else current
            individual = min(1.0, best / current) if current > 0 else 1.0
            out.append(Score(rank, state.node, relative[rank], individual, current, len(state.window)))
        return out


def stragglers(scores: list[Score], score_min: float = SCORE_MIN) -> list[Score]:
    """The straggling ranks, slowest first."""
    return sorted((s for s in scores if s.straggling(score_min)), key=lambda s: s.relative)


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)
