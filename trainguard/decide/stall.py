"""Is the run stalled? The rule, pure: live (agent/actions_embedded.py) and replayed alike.

A node's ranks are stalled when **no rank's step has advanced for ``stall_seconds``** while the run has
not ended: a hung collective, a dead rank, a stuck data loader. Records that keep coming without a new
step (the agent's node log samples the hardware every few seconds, a rank may still write events) are
no progress; that is exactly how a hang looks from outside. Ranks that have not reached a step since
they started are starting (imports, rendezvous, resume) until ``startup_grace_seconds`` have passed.

``TrainingStalled`` (alerts/rules.py) is the same condition in PromQL: ``time() -`` the newest
``trainguard_training_last_step_timestamp_seconds`` of the node ``> stall_seconds``.

Two entry points, one rule:
- ``decide(ranks, now, ...)``: the live check over each rank's progress (the agent knows the ranks);
- ``StallTracker``: a record stream (rank logs, node logs) in the log's own time, for ``replay``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from trainguard import actions, event_types
from trainguard.config import above, key


# A rank whose log ends with one of these has finished (or was stopped) and is leaving: never a stall.
# `run_summary` is the closing numbers a Hugging Face Trainer or its TensorBoard file logs when `train()`
# returns (train_runtime, train_loss): such a log logs a step only every `logging_steps`, so the last
# stretch (the steps after the last logged one, the final save) reads as silence up to it, and the
# summary says the run finished rather than hung (the T5 run of ../shared/real-logs: 55 min).
ENDED_EVENTS = (event_types.RUN_END, actions.STOP, event_types.RUN_SUMMARY)
# A log with one of these went back to an earlier step on purpose (a new attempt, the guard's rollback, a
# restore from a checkpoint or an in-memory snapshot): the steps after it count from where it went back to.
STARTED_EVENTS = (event_types.RUN_START, actions.ROLLBACK, event_types.CHECKPOINT_RESTORED,
                  event_types.SNAPSHOT_RESTORED, event_types.IN_PROCESS_RESTART)


@dataclass(frozen=True)
class StallConfig:
    """The stall rule's keys, in the policy's `alerts` section (TrainingStalled renders the same number)."""

    stall_seconds: float = key(60.0, above(0, 10**7), "no rank's step advanced for this long: the ranks are "
                               "stalled (TrainingStalled; the agent's watchdog)")
    # Start-up (imports, rendezvous, resume) takes minutes on big models.
    startup_grace_seconds: float = key(900.0, above(0, 10**7), "ranks that started this long ago and reached no "
                                       "step since are stalled too")


@dataclass(frozen=True)
class RankProgress:
    """One rank's progress as the stall check sees it: its newest step and when it got there."""

    rank: int
    step: int | None               # the newest step the rank has reached (None: none since it started)
    advanced_at: float | None      # when it reached it (the same clock as `now`)
    started_at: float              # when the rank (this attempt of it) started


@dataclass(frozen=True)
class Stall:
    """A stall found: the restore it asks for, why, and since when the ranks made no progress."""

    action: str                    # always actions.RESTORE
    reason: str
    key: str                       # one per stall: the same stall is not acted on twice
    since: float                   # the moment progress stopped (or the ranks started)
    step: int | None               # the last step reached


def decide(ranks: list[RankProgress], now: float, stall_seconds: float,
           startup_grace_seconds: float) -> Stall | None:
    """restore when the newest step advance of `ranks` is older than `stall_seconds`, else None."""
    if not ranks:
        return None
    started = max(r.started_at for r in ranks)
    advanced = [r for r in ranks if r.advanced_at is not None and r.advanced_at >= started]
    if not advanced:
        waiting = now - started
        if waiting <= startup_grace_seconds:
            return None
        return Stall(actions.RESTORE, f"the ranks started {waiting:.0f}s ago and have reached no step since",
                     f"startup@{started:.3f}", started, None)
    stamped = [(r.advanced_at, r) for r in advanced if r.advanced_at is not None]
    advanced_at, newest = max(stamped, key=lambda pair: pair[0])     # ties: the first, never compared
    idle = now - advanced_at
    if idle <= stall_seconds:
        return None
    return Stall(actions.RESTORE, f"no training step for {idle:.0f}s (last step {newest.step})",
                 f"stall@{advanced_at:.3f}", advanced_at, newest.step)


@dataclass
class StallTracker:
    """The rule over a record stream: each record moves the clock, a record with a new step is progress.

    Feed records in time order (`observe`); a stall is returned once, when first seen. A step beyond the
    newest seen is progress; a ``run_start`` (a new attempt, resuming from a checkpoint's earlier step), a
    rollback or a restore (`STARTED_EVENTS`) starts the count again. Replay marks a restart appended to a log by a launcher that writes no
    ``run_start`` as one (trainguard/replay/stall_pass.py: a file's step going back after a silence). After a ``run_end`` nothing is a stall until the next ``run_start``: logs of
    several sources interleave, and a node log a second behind still reaches the last step after it.
    """

    stall_seconds: float
    step: int | None = None
    advanced_at: float | None = None
    ended: bool = False
    fired: set[str] = field(default_factory=set)

    def observe(self, timestamp: float, step: int | None, ended: bool = False, started: bool = False) -> Stall | None:
        if started:
            self.step, self.ended = None, False
        if ended:
            self.ended = True
            return None
        if step is not None and (self.step is None or step > self.step):
            self.step, self.advanced_at = step, timestamp
            return None
        if self.advanced_at is None or self.ended:
            return None
        progress = RankProgress(0, self.step, self.advanced_at, self.advanced_at)
        stall = decide([progress], timestamp, self.stall_seconds, startup_grace_seconds=float("inf"))
        if stall is None or stall.key in self.fired:
            return None
        self.fired.add(stall.key)
        return stall


def replay(records: Iterable[tuple[float, int | None, bool, bool]], stall_seconds: float) -> list[Stall]:
    """Every stall of a recorded stream of (timestamp, step, ended, started) in time order: what the live
    agent would have decided. The replay engine's hook (trainguard/replay) calls this with the log's records."""
    tracker = StallTracker(stall_seconds)
    return [stall for timestamp, step, ended, started in records
            if (stall := tracker.observe(timestamp, step, ended, started)) is not None]
