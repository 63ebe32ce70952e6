"""The checkpoint autopilot: the goodput-optimal interval between checkpoints, from what the run measured.

The rule is Daly's higher-order estimate of the optimum (J. T. Daly, "A higher order estimate of the
optimum checkpoint interval for restart dumps", Future Generation Computer Systems 22(3), 2006, eq. 37):

    tau = sqrt(2 * delta * M) * (1 + sqrt(delta / (2 M)) / 3 + (delta / (2 M)) / 9) - delta    (delta < 2 M)
    tau = M                                                                                  (delta >= 2 M)

with `delta` the time a save blocks training, `M` the job's mean time between failures and `tau` the
training time between two saves; the interval between the starts of two checkpoints (what the trainer's
by-time checkpointing counts) is `tau + delta`, kept within the policy's bounds.

Why this one: Young's first-order sqrt(2 delta M) assumes saves are short against M and that no failure
hits a save or a restart. On a large job M is hours (Llama 3: one interruption every 3.1 h on 16k GPUs)
and a save of a big model blocks for tens of seconds to minutes, where Young's estimate is off by
several percent of the interval; Daly's estimate stays within a fraction of a percent of the exact
optimum of his model (exponential failures, failures during saves and restarts included) for every
delta < 2M, is closed-form (no solver at a checkpoint boundary), and says what to do when a save costs
more than the failures leave (checkpoint every M). The same model gives the expected goodput of an
interval (`expected_goodput`):

    goodput(tau) = tau / (M * exp(R / M) * (exp((tau + delta) / M) - 1))

`R`, the restart cost, scales every interval's expected time alike, so it moves the goodput and not the
optimum: the rule takes it as an input, records it with every change, and uses it in the predicted
goodput and in `trainguard goodput --what-if`. NVIDIA's availability-optimal variant (arXiv 2410.18124)
optimises a cluster's availability; a job's goodput is Daly's objective, so this is the rule.

Two tiers (in-memory snapshots beside durable checkpoints): a share `p` of failures is recovered from a
snapshot, the rest only from a checkpoint. Each tier is sized for the failures it alone must cover, the
usual decoupled approximation of multi-level checkpointing (Moody et al., SC 2010; Di et al., 2014):
snapshots every Daly(delta_s, M / p), checkpoints every Daly(delta_c, M / (1 - p)). The snapshot tier
is counted in steps (`recovery.snapshot_every`): its interval in seconds over the measured step time (the
median of the latest steps' `step_time_seconds`), at least one step and at most the checkpoint interval's
steps (a snapshot rarer than a checkpoint saves nothing), changed, like the checkpoint interval, only when
it moved more than `change_ratio` (and by a whole step).

The MTBF is measured over the last `window_failures` failures (so a change of the failure rate is
followed within that many failures), with a prior for a run that has not failed yet: a fleet MTBF
(GPU-hours per failure, from the policy or from the ledgers of earlier runs in the same runs root),
divided by the job's GPUs, weighted as `prior_failures` failures that fade as real ones are seen:

    M = (T + a * M0) / (n + a),   a = prior_failures * max(0, 1 - n / window_failures)

with `n` failures (at most the window) seen in the last `T` seconds. A failure is a restart of the
process: a `run_start` or `checkpoint_restored` after steps that no `rollback` explains, when the process
before did not end with `run_end`; or an in-process restart (`in_process_restart`, docs/recovery.md: the
processes lived on, the job failed all the same), whose restart cost is its `recovery_seconds`. The guard's
rollbacks are not failures of the job and do not count.

Pure: records and numbers in, numbers out. The trainer (protect/protector.py), `trainguard goodput` and
bench/bench_autopilot.py run these same functions.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

from trainguard import actions, event_types
from trainguard.config import FRACTION, Choice, above, at_least, key

# TLS event types the autopilot reads and writes (trainguard/event_types.py owns the names).
SAVE_EVENT = event_types.CHECKPOINT_SAVED          # blocking_seconds: what a durable save held training up
SNAPSHOT_EVENT = event_types.SNAPSHOT_SAVED        # the in-memory tier's save (the recovery issue), blocking_seconds
INTERVAL_EVENT = event_types.CHECKPOINT_INTERVAL   # the autopilot applied a new interval; its inputs beside it
IN_PROCESS_RESTART = event_types.IN_PROCESS_RESTART  # a failure recovered in the same processes (recovery_seconds)
RUN_START, RUN_END, ROLLBACK = event_types.RUN_START, event_types.RUN_END, actions.ROLLBACK
PROCESS_START = (event_types.CHECKPOINT_INVALID, event_types.CHECKPOINT_RESTORED, RUN_START)
SAVE_SAMPLES = 8                         # the save cost is the median of this many latest saves
STEP_SAMPLES = 32                        # the step time is the median of this many latest steps
SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class CheckpointPolicy:
    """The policy's `checkpoint` section: the autopilot's bounds, prior and two tiers (docs/checkpoints.md)."""

    autopilot: str = key("off", Choice(("off", "on")), "on: as trainguard train --checkpoint-every auto (the "
                         "library's checkpoint_every=\"auto\")")
    min_interval_seconds: float = key(60.0, above(0, 10**7), "the autopilot's interval is at least this")
    max_interval_seconds: float = key(21600.0, above(0, 10**8), "the autopilot's interval is at most this")
    # Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 GPUs (arXiv 2407.21783).
    fleet_mtbf_gpu_hours: float = key(54 * 24 * 16384 / 419, above(0, 10**9), "the prior for a run that has not "
                                      "failed: GPU-hours per failure of the fleet (default: Llama 3's rate)")
    prior_failures: float = key(1.0, at_least(0, 10**4), "the prior's weight, in failures; it fades as failures "
                                "are seen (0: no prior)")
    window_failures: int = key(5, at_least(1, 10**4), "the MTBF is measured over the last this many failures")
    change_ratio: float = key(0.10, at_least(0, 10), "a recommendation this far from the interval in force is "
                              "applied")
    history_runs: int = key(20, at_least(0, 10**4), "earlier runs of the runs root read for the prior (0: none)")
    snapshot_recoverable_share: float = key(0.9, FRACTION, "two tiers: the share of failures an in-memory "
                                            "snapshot recovers (an assumption: set your fleet's)")
    snapshot_min_interval_seconds: float = key(1.0, above(0, 10**7), "the snapshot tier's interval is at least "
                                               "this")

    def cross_check(self, where: str) -> str | None:
        if self.min_interval_seconds > self.max_interval_seconds:
            return f"{where}.min_interval_seconds: must not exceed {where}.max_interval_seconds"
        return None


def young_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Young's first-order optimum of the training time between saves (for comparison only)."""
    return math.sqrt(2.0 * save_seconds * mtbf_seconds)


def daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Daly's higher-order optimum of the training time between two saves (the module docstring)."""
    if not math.isfinite(mtbf_seconds):
        return math.inf
    if save_seconds >= 2.0 * mtbf_seconds:
        return mtbf_seconds
    ratio = save_seconds / (2.0 * mtbf_seconds)
    return math.sqrt(2.0 * save_seconds * mtbf_seconds) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - save_seconds


def expected_goodput(compute_seconds: float, save_seconds: float, restart_seconds: float,
                     mtbf_seconds: float) -> float:
    """Daly's model: the share of wall time that is kept training, saving every `compute_seconds`."""
    if compute_seconds <= 0:
        return 0.0
    if not math.isfinite(mtbf_seconds):
        return compute_seconds / (compute_seconds + save_seconds)
    m = mtbf_seconds
    try:
        return compute_seconds / (m * math.exp(restart_seconds / m) * math.expm1((compute_seconds + save_seconds) / m))
    except OverflowError:
        return 0.0


def estimate_mtbf(failures: Sequence[float], start: float, now: float, prior_mtbf: float,
                  prior_failures: float, window: int) -> tuple[float, int, float]:
    """(MTBF, failures counted, seconds observed): the last `window` failures (at their times `failures`,
    ascending) over the time since the one before them (or `start`), with the fading prior."""
    seen = len(failures)
    counted = min(seen, window)
    since = failures[seen - window - 1] if seen > window else start
    observed = max(0.0, now - since)
    weight = prior_failures * max(0.0, 1.0 - seen / window)
    prior_time = weight * prior_mtbf if math.isfinite(prior_mtbf) else math.inf
    if counted + weight <= 0:
        return math.inf, counted, observed
    return (observed + prior_time) / (counted + weight), counted, observed


@dataclass(frozen=True)
class Measured:
    """The rule's inputs as the run measured them (None: not measured yet)."""

    mtbf_seconds: float
    mtbf_source: str                      # "measured" | "prior:policy" | "prior:history" | "measured+prior:..."
    failures: int                         # failures counted in the MTBF's window
    observed_seconds: float
    save_seconds: float | None
    restart_seconds: float | None
    snapshot_seconds: float | None = None
    snapshot_share: float = 0.0


@dataclass(frozen=True)
class Recommendation:
    """The interval to apply (wall seconds between the starts of two checkpoints) and why."""

    interval_seconds: float
    compute_seconds: float                # Daly's tau before the bounds
    bound: str | None                     # "min" | "max" when a policy bound decided
    expected_goodput: float               # Daly's model at the applied interval (restart cost 0 if unmeasured)
    measured: Measured
    snapshot_interval_seconds: float | None = None

    def inputs(self) -> dict[str, Any]:
        """The fields of a `checkpoint_interval` event: the recommendation and every input it came from."""
        out = {"recommended_seconds": round(self.interval_seconds, 3),
               "daly_compute_seconds": _rounded(self.compute_seconds), "bound": self.bound,
               "expected_goodput": round(self.expected_goodput, 6),
               **{key: _rounded(value) for key, value in asdict(self.measured).items()}}
        if self.snapshot_interval_seconds is not None:
            out["snapshot_interval_seconds"] = round(self.snapshot_interval_seconds, 3)
        return out


def _rounded(value: Any) -> Any:
    """An input as the event records it: to the microsecond, so the rule gives the applied interval again
    from the event alone (to the millisecond, a save of 15 ms read back as 0.015 moved it 1.3%)."""
    if isinstance(value, float):
        return round(value, 6) if math.isfinite(value) else None
    return value


def recommend(measured: Measured, policy: CheckpointPolicy) -> Recommendation | None:
    """The interval for `measured`; None before any save was measured (nothing to weigh failures against)."""
    if measured.save_seconds is None:
        return None
    save, mtbf, share = measured.save_seconds, measured.mtbf_seconds, 0.0
    snapshot_interval = None
    if measured.snapshot_seconds is not None:
        share = measured.snapshot_share
        snap = measured.snapshot_seconds
        snap_mtbf = mtbf / share if share > 0 else math.inf
        snapshot_interval = _clamp(daly_interval(snap, snap_mtbf) + snap, policy.snapshot_min_interval_seconds,
                                   policy.max_interval_seconds)[0]
    durable_mtbf = mtbf / (1.0 - share) if share < 1 else math.inf
    tau = daly_interval(save, durable_mtbf)
    interval, bound = _clamp(tau + save, policy.min_interval_seconds, policy.max_interval_seconds)
    restart = measured.restart_seconds or 0.0
    goodput = expected_goodput(max(interval - save, 0.0), save, restart, durable_mtbf)
    return Recommendation(interval, tau, bound, goodput, measured, snapshot_interval)


def _clamp(value: float, low: float, high: float) -> tuple[float, str | None]:
    if value < low:
        return low, "min"
    if value > high:
        return high, "max"
    return value, None


def snapshot_every_steps(interval_seconds: float, step_seconds: float | None,
                         checkpoint_seconds: float) -> int | None:
    """The snapshot tier's interval in steps: `interval_seconds` over the step time, rounded, at least one
    step and at most the checkpoint interval's steps; None without a measured step time."""
    if step_seconds is None or not step_seconds > 0 or not math.isfinite(interval_seconds):
        return None
    most = max(1, int(checkpoint_seconds / step_seconds)) if math.isfinite(checkpoint_seconds) else 10**7
    return max(1, min(round(interval_seconds / step_seconds), most))


def prior_mtbf_seconds(policy: CheckpointPolicy, gpus: int, history: "History | None" = None) -> tuple[float, str]:
    """The job's MTBF before it failed: earlier runs' GPU-hours per failure when they failed, else the
    policy's fleet figure; divided by the job's GPUs (a CPU run counts as one device)."""
    devices = max(int(gpus or 0), 1)
    if history is not None and history.failures > 0:
        return history.gpu_seconds / history.failures / devices, "prior:history"
    return policy.fleet_mtbf_gpu_hours * SECONDS_PER_HOUR / devices, "prior:policy"


@dataclass(frozen=True)
class History:
    """What earlier runs of the same runs root say: their failures and the GPU-seconds they ran."""

    runs: int = 0
    failures: int = 0
    gpu_seconds: float = 0.0


# ----------------------------------------------------------------------------------- the measurements

@dataclass
class FailureLog:
    """The rule's measurements, folded from a run's TLS records in time order (rank 0's log is enough):
    failure times, restart costs, save and snapshot costs, the interval last applied."""

    first_ts: float | None = None
    last_ts: float | None = None
    failures: list[float] = field(default_factory=list)
    restart_costs: list[float] = field(default_factory=list)      # every restart's, in order
    saves: deque[float] = field(default_factory=lambda: deque(maxlen=SAVE_SAMPLES))
    snapshots: deque[float] = field(default_factory=lambda: deque(maxlen=SAVE_SAMPLES))
    applied: float | None = None          # the latest `checkpoint_interval` event's, if any
    applied_snapshot_every: int | None = None   # ... and its `snapshot_every`, if it carried one
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=STEP_SAMPLES))
    gpu_count: int = 0
    stepped: bool = False                 # a step was seen
    ended: bool = False                   # the process before wrote `run_end` (a planned stop, no failure)
    boundary: float | None = None         # the last record before a new process's first start event

    def observe(self, record: dict[str, Any]) -> None:
        ts = float(record["timestamp"])
        if self.first_ts is None:
            self.first_ts = ts
        system = record.get("system")
        if isinstance(system, dict) and isinstance(system.get("gpu_count"), int) and system["gpu_count"] > 0:
            self.gpu_count = system["gpu_count"]
        event = record.get("event")
        if isinstance(event, dict):
            self._event(event, ts)
        elif isinstance(record.get("metrics"), dict) and isinstance(record.get("step"), int):
            self._step(record["metrics"], ts)
        self.last_ts = max(ts, self.last_ts) if self.last_ts is not None else ts

    def _event(self, event: dict[str, Any], ts: float) -> None:
        kind = event.get("type")
        if kind in PROCESS_START and self.stepped and self.boundary is None:
            self.boundary = self.last_ts if self.last_ts is not None else ts
        elif kind == ROLLBACK:
            self.boundary = None        # the restore was the guard's rollback, in the same process
        elif kind == RUN_END:
            self.ended = True
        elif kind == SAVE_EVENT:
            _sample(self.saves, event.get("blocking_seconds"))
        elif kind == SNAPSHOT_EVENT:
            _sample(self.snapshots, event.get("blocking_seconds"))
        elif kind == INTERVAL_EVENT and _number(event.get("applied_seconds")):
            self.applied = float(event["applied_seconds"])
            if _number(event.get("snapshot_every")):
                self.applied_snapshot_every = int(event["snapshot_every"])
        elif kind == IN_PROCESS_RESTART and (cost := _number(event.get("recovery_seconds"))) is not None:
            self.failures.append(ts - cost)
            self.restart_costs.append(cost)
            self.boundary = None        # its restore (a `checkpoint_restored` on the fallback) is this failure's

    def _step(self, metrics: dict[str, Any], ts: float) -> None:
        """A step after a new process started (not a rollback): a failure at the last record of the one
        before, unless that one ended cleanly; its restart cost runs to this step's start."""
        _sample(self.step_times, metrics.get("step_time_seconds"))
        if self.boundary is not None:
            if not self.ended:
                began = ts - (_number(metrics.get("step_time_seconds")) or 0.0)
                self.failures.append(self.boundary)
                self.restart_costs.append(max(0.0, began - self.boundary))
            self.boundary = None
        self.stepped, self.ended = True, False

    def step_seconds(self) -> float | None:
        """The median of the latest steps' times (None before a step)."""
        return _median(self.step_times)

    def measured(self, now: float, policy: CheckpointPolicy, history: History | None = None,
                 gpus: int | None = None) -> Measured:
        prior, source = prior_mtbf_seconds(policy, gpus or self.gpu_count, history)
        start = self.first_ts if self.first_ts is not None else now
        mtbf, counted, observed = estimate_mtbf(self.failures, start, now, prior, policy.prior_failures,
                                                policy.window_failures)
        if len(self.failures) >= policy.window_failures or policy.prior_failures == 0:
            source = "measured"
        elif self.failures:
            source = f"measured+{source}"
        return Measured(mtbf, source, counted, observed, _median(self.saves), _median(self.restart_costs[-SAVE_SAMPLES:]),
                        _median(self.snapshots), policy.snapshot_recoverable_share if self.snapshots else 0.0)


def _sample(samples: deque[float], value: Any) -> None:
    number = _number(value)
    if number is not None:
        samples.append(number)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def _median(samples: Iterable[float]) -> float | None:
    values = list(samples)
    return statistics.median(values) if values else None


def history_of(logs: Iterable[Iterable[dict[str, Any]]]) -> History:
    """Earlier runs' failures and GPU-seconds (each a run's records), for the prior."""
    runs = failures = 0
    gpu_seconds = 0.0
    for records in logs:
        log = FailureLog()
        for record in records:
            log.observe(record)
        if log.first_ts is None or log.last_ts is None:
            continue
        runs += 1
        failures += len(log.failures)
        gpu_seconds += (log.last_ts - log.first_ts) * max(log.gpu_count, 1)
    return History(runs, failures, gpu_seconds)


# ------------------------------------------------------------------------------------- the autopilot

@dataclass
class Autopilot:
    """Applies the rule at checkpoint boundaries: `consider(now)` after each save returns the fields of a
    `checkpoint_interval` event when the recommendation moved more than `change_ratio` from the interval
    applied (the first recommendation is always applied), else None. With `snapshot_every` (the in-memory
    tier's interval in steps in force; 0: no snapshot tier to steer) it steers that tier too: the event then
    carries `snapshot_every` and `previous_snapshot_every`, and comes when either tier moved."""

    policy: CheckpointPolicy
    applied: float                         # the interval in force (the configured one until the first change)
    gpus: int = 0
    history: History | None = None
    log: FailureLog = field(default_factory=FailureLog)
    recommended: float | None = None
    changes: int = 0
    snapshot_every: int = 0

    def observe(self, record: dict[str, Any]) -> None:
        self.log.observe(record)

    def resume(self) -> None:
        """After reading the run's earlier records: go on with the interval the run last applied."""
        if self.log.applied is not None:
            self.applied = self.log.applied
            self.changes = 1
        if self.snapshot_every and self.log.applied_snapshot_every:
            self.snapshot_every = self.log.applied_snapshot_every

    def consider(self, now: float) -> dict[str, Any] | None:
        measured = self.log.measured(now, self.policy, self.history, self.gpus)
        recommendation = recommend(measured, self.policy)
        if recommendation is None:
            return self._measure_first(measured)
        self.recommended = recommendation.interval_seconds
        moved = abs(recommendation.interval_seconds - self.applied) / self.applied if self.applied > 0 else math.inf
        interval_moves = not self.changes or moved > self.policy.change_ratio
        interval = round(recommendation.interval_seconds, 3) if interval_moves else self.applied
        every = self._snapshot_every(recommendation, interval)
        if not interval_moves and every is None:
            return None
        previous, self.applied = self.applied, interval
        self.changes += 1
        change = {"applied_seconds": self.applied, "previous_seconds": round(previous, 3), **recommendation.inputs()}
        if self._steers_snapshots():
            change.update(snapshot_every=every or self.snapshot_every, previous_snapshot_every=self.snapshot_every,
                          step_seconds=_rounded(self.log.step_seconds()))
            self.snapshot_every = every or self.snapshot_every
        return change

    def _steers_snapshots(self) -> bool:
        """A snapshot tier to steer, and snapshots taken (a loop may be configured for them and take none)."""
        return bool(self.snapshot_every and self.log.snapshots)

    def _snapshot_every(self, recommendation: Recommendation, interval: float) -> int | None:
        """The snapshot tier's new interval in steps when it moved more than `change_ratio`, else None."""
        if not self._steers_snapshots() or recommendation.snapshot_interval_seconds is None:
            return None
        every = snapshot_every_steps(recommendation.snapshot_interval_seconds, self.log.step_seconds(), interval)
        if every is None or every == self.snapshot_every:
            return None
        return every if abs(every - self.snapshot_every) / self.snapshot_every > self.policy.change_ratio else None

    def _measure_first(self, measured: Measured) -> dict[str, Any] | None:
        """No save measured yet: the first checkpoint comes at the lower bound, so the rule has its cost
        (and the run something to resume from) early."""
        low = self.policy.min_interval_seconds
        if self.changes or self.applied <= low:
            return None
        previous, self.applied = self.applied, low
        self.changes += 1
        return {"applied_seconds": low, "previous_seconds": round(previous, 3), "recommended_seconds": None,
                "bound": "min", "reason": "no save measured yet",
                **{key: _rounded(value) for key, value in asdict(measured).items()}}

    def metrics(self) -> dict[str, float]:
        """The step record's autopilot metrics: the applied and the latest recommended interval, and the
        snapshot tier's interval in steps when it is steered."""
        out = {"checkpoint_interval_seconds": self.applied}
        if self.recommended is not None:
            out["checkpoint_interval_recommended_seconds"] = self.recommended
        if self._steers_snapshots():
            out["snapshot_every_steps"] = float(self.snapshot_every)
        return out


# --------------------------------------------------------------------------- replaying failure traces

@dataclass(frozen=True)
class TraceResult:
    """A failure trace replayed under one interval (`replay_trace`)."""

    interval_seconds: float
    goodput: float
    useful_seconds: float
    saves: int
    save_seconds: float
    lost_seconds: float                   # training thrown away by failures (since the last save)
    restart_seconds: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


Steer = Callable[[str, float, float], float]     # (what happened, when it began, when it ended) -> interval


def replay_trace(failures: Sequence[float], restarts: Sequence[float], total_seconds: float,
                 interval: float, save_seconds: float, steer: Steer | None = None) -> TraceResult:
    """What a run of `total_seconds` (wall) would have kept, saving every `interval` seconds (between the
    starts of two saves, each blocking `save_seconds`), when its failures struck at `failures` (seconds
    from the start, ascending) and the i-th restart took `restarts[i]` seconds. A failure during a save
    loses that save; a failure during a restart starts the restart again. The failures are the ones the
    run recorded, at the times they happened: a failure rate does not depend on the interval.

    `steer`: an interval that changes as the run goes (the autopilot): called after each save
    ("save", its start, its end) and each restart ("restart", the failure, the first step after it),
    it returns the interval from then on."""
    clock, since_save, useful = 0.0, 0.0, 0.0
    saves, saved_time, lost, restart_time = 0, 0.0, 0.0, 0.0
    index, count = 0, len(failures)
    first = interval

    def fail(at: float, work: float) -> None:
        nonlocal clock, index, lost, restart_time, since_save, interval
        lost += work
        clock = _restart(at, restarts, index, total_seconds)
        restart_time += clock - at
        index = _next_failure(failures, index + 1, clock)
        since_save = 0.0
        if steer is not None and clock < total_seconds:
            interval = steer("restart", at, clock)

    while clock < total_seconds:
        compute = max(interval - save_seconds, 1e-9)
        next_failure = failures[index] if index < count else math.inf
        work_end = min(clock + max(compute - since_save, 0.0), total_seconds)
        if next_failure < work_end:                       # fails while training: the work since the save is lost
            fail(next_failure, since_save + (next_failure - clock))
            continue
        since_save += work_end - clock
        clock = work_end
        if clock >= total_seconds:
            break
        save_end = clock + save_seconds
        if next_failure < min(save_end, total_seconds):    # fails while saving: that save never happened
            saved_time += next_failure - clock
            fail(next_failure, since_save)
            continue
        saved_time += min(save_end, total_seconds) - clock
        began, clock = clock, save_end
        if clock <= total_seconds:
            useful += since_save
            saves += 1
            since_save = 0.0
            if steer is not None:
                interval = steer("save", began, clock)
    useful += since_save        # the run's end: what was trained since the last save is kept (a final save)
    return TraceResult(first, useful / total_seconds if total_seconds > 0 else 0.0, useful, saves,
                       saved_time, lost, restart_time)


def autopilot_steer(pilot: "Autopilot", save_seconds: float) -> Steer:
    """A `replay_trace` steer that drives `pilot` with the records a live run would have written: a step
    at each save and at each failure (the dead process's last record), a `checkpoint_saved` with the
    save's blocking time, a `run_start` and a first step after each restart."""
    pilot.observe({"timestamp": 0.0, "event": {"type": RUN_START}})
    pilot.observe({"timestamp": 0.0, "step": 0, "metrics": {}})

    def steer(kind: str, began: float, ended: float) -> float:
        if kind == "save":
            pilot.observe({"timestamp": began, "step": 0, "metrics": {}})
            pilot.observe({"timestamp": ended, "event": {"type": SAVE_EVENT, "blocking_seconds": save_seconds}})
        else:
            pilot.observe({"timestamp": began, "step": 0, "metrics": {}})
            pilot.observe({"timestamp": ended, "event": {"type": RUN_START}})
            pilot.observe({"timestamp": ended, "step": 0, "metrics": {}})
        pilot.consider(ended)
        return pilot.applied

    return steer


def _restart(at: float, restarts: Sequence[float], index: int, total: float) -> float:
    cost = restarts[index] if index < len(restarts) else (restarts[-1] if restarts else 0.0)
    return min(at + cost, total)


def _next_failure(failures: Sequence[float], index: int, clock: float) -> int:
    """Failures that struck during a restart restart it (already counted in its measured cost)."""
    while index < len(failures) and failures[index] < clock:
        index += 1
    return index
