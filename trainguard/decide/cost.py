"""The cost meter: steps and time in, budget tiers out.

Cost per 1000 steps = GPU-hours spent over the recent window x price / steps done in it x 1000. The
overrun is that over the budget, minus one; crossing a tier of the policy (warn, throttle, stop) yields
its action once. The same numbers are the recording rules behind the `CostBudget*` alerts, so
whichever path sees a tier first acts, and the executor de-duplicates the other.

Pure: time comes from the records, so a replay of a log meters exactly what the live run metered.
Replay meters its blocks of records as arrays (`CostMeter.observe_columns`), to the same bit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import repeat
from typing import Sequence

import numpy as np

from trainguard.actions import COST_STOP, COST_THROTTLE, COST_WARN
from trainguard.decide.decision import Decision
from trainguard.decide.screen import MIN_SCREENED, decide_screened
from trainguard.policy import CostPolicy

TIER_ACTIONS = ((COST_WARN, "warn"), (COST_THROTTLE, "throttle"), (COST_STOP, "stop"))
Clock = tuple  # (source, monotonic seconds) of a record: the clock is comparable within one source only


@dataclass
class CostState:
    cost_usd: float = 0.0              # spent since the meter started (all time, rollbacks included)
    cost_per_1k_steps: float = 0.0     # over the recent window
    overrun_ratio: float = 0.0         # cost_per_1k_steps / budget - 1; 0.3 means 30% over budget
    tier: str = "ok"                   # ok | warn | throttle | stop
    gpu_count: int = 0
    steps_in_window: int = 0


def clock_of(record: dict) -> Clock | None:
    """A TLS record's monotonic clock, (node, system.monotonic_seconds), when it carries one."""
    system = record.get("system")
    seconds = system.get("monotonic_seconds") if isinstance(system, dict) else None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return None
    return (record.get("node"), float(seconds))


class CostMeter:
    def __init__(self, policy: CostPolicy | None = None):
        self.policy = policy or CostPolicy()
        self.window: deque[tuple[float, int]] = deque(maxlen=max(self.policy.window_steps, 2))
        self.state = CostState()
        self.fired: set[str] = set()
        self._last_time: float | None = None
        self._anchor: tuple[str | None, float, float] | None = None   # (clock source, monotonic, metered time)
        self._usd_per_gpu_second = self.policy.price_per_gpu_hour / 3600.0
        self._min_steps = min(self.policy.min_steps, self.window.maxlen - 1)
        self._tiers = sorted(((action, tier, getattr(self.policy.tiers, tier)) for action, tier in TIER_ACTIONS),
                             key=lambda entry: entry[2])

    def gpus(self, seen: int | None) -> int:
        """Billable devices: the policy's override, else what the records say."""
        if self.policy.gpu_count_override:
            return self.policy.gpu_count_override
        if seen:
            self.state.gpu_count = int(seen)
        return self.state.gpu_count

    def observe(self, step: int, timestamp: float, gpu_count: int | None = None,
                clock: Clock | None = None) -> list[Decision]:
        """The decisions for one step record: `observe_many` over a batch of one, so the agent, the report
        and a replay run the very same loop (a record without a clock ends the one being followed there
        too: the next record with one is taken at its wall time)."""
        return [decision for _, decision in self.observe_many(
            (step,), (timestamp,), (gpu_count,), (clock,))]

    def observe_many(self, steps: Sequence[int], timestamps: Sequence[float], gpu_counts: Sequence[int | None],
                     clocks: Sequence[Clock | None] | None = None) -> list[tuple[int, Decision]]:
        """Meter consecutive step records in order; returns (index, decision) for each tier crossed.

        `clocks`: each record's monotonic clock, as (source, seconds), where it has one (the trainer writes
        `system.monotonic_seconds`; the source is the node). Time is then metered on it (`_metered`).

        One loop with the state in local names, on purpose (replay runs it once per recorded step): the
        common case, under every tier, calls nothing."""
        metered = timestamps if clocks is None else self._metered(timestamps, clocks)
        return self._meter(steps, timestamps, metered, gpu_counts)

    def _meter(self, steps: Sequence[int], timestamps: Sequence[float], metered: Sequence[float],
               gpu_counts: Sequence[int | None]) -> list[tuple[int, Decision]]:
        """`observe_many` on the records' metered times (`_metered`), step by step."""
        state, window, policy = self.state, self.window, self.policy
        override, gpu_count = policy.gpu_count_override, state.gpu_count
        usd_per_gpu_second, budget, min_steps = self._usd_per_gpu_second, policy.budget_per_1k_steps, self._min_steps
        lowest_tier = self._tiers[0][2]
        cost_usd, last, tier = state.cost_usd, self._last_time, state.tier
        cost_per_1k, overrun = state.cost_per_1k_steps, state.overrun_ratio
        previous = window[-1][1] if window else None
        found: list[tuple[int, Decision]] = []
        counts = repeat(None) if override else gpu_counts
        for i, (step, when, seen) in enumerate(zip(steps, metered, counts)):
            if seen:
                gpu_count = seen if seen.__class__ is int else int(seen)
            gpus = override or gpu_count
            if last is None or when >= last:
                if last is not None:
                    cost_usd += (when - last) * gpus * usd_per_gpu_second
                last = when
            if previous is not None and step <= previous:
                window.clear()          # a rollback or restart: steps went back, measure afresh
            previous = step
            window.append((when, step))
            first_time, first_step = window[0]
            steps_in_window = step - first_step
            if steps_in_window <= 0 or when <= first_time:
                continue
            cost_per_1k = (when - first_time) * gpus * usd_per_gpu_second / steps_in_window * 1000.0
            overrun = cost_per_1k / budget - 1.0
            if steps_in_window < min_steps:
                continue
            if overrun < lowest_tier:   # the common case: under every tier
                tier = "ok"
                continue
            state.cost_usd, state.cost_per_1k_steps = cost_usd, cost_per_1k   # the decisions' detail reads them
            tier = self._cross_tiers(step, timestamps[i], overrun, found, i) or tier
        state.cost_usd, state.cost_per_1k_steps, state.overrun_ratio, state.tier = cost_usd, cost_per_1k, overrun, tier
        state.gpu_count, self._last_time = gpu_count, last
        if window:
            state.steps_in_window = window[-1][1] - window[0][1]
        return found

    def observe_columns(self, steps, timestamps, gpu_counts, clock_codes=None, clock_seconds=None,
                        clock_nodes: Sequence[str | None] = ()) -> list[tuple[int, Decision]]:
        """`observe_many` over a block of records given as columns: int64 `steps`, float64 `timestamps`,
        int64 `gpu_counts` (0: none seen) and, where the records carry clocks, int64 `clock_codes` (an index
        into `clock_nodes`, -1 for a record without a clock) with float64 `clock_seconds`. The same
        decisions and state as ``observe_many(steps, timestamps, gpu_counts, [(clock_nodes[c], s) or None])``.

        As `Guard.check_columns`: a screen (`_advance_columns`) proves a stretch of records crosses no tier
        it has not crossed before (tiers it holds already may be reached again: they only set the tier) and
        advances the meter over it in bulk; the first record it cannot clear (that, or one without a finite
        metered time), and a few after it, go through the loop. Steps or times going back, GPU counts that
        change, clocks that switch stay in bulk: exact because every running number is built by the loop's
        own operations: the metered times and the spend as `np.cumsum` of the loop's increments, in its
        order (sequential, so the very same roundings), where each window starts and which count holds as
        running maxima of indexes, everything else elementwise."""
        steps = np.ascontiguousarray(steps, dtype=np.int64)
        timestamps = np.ascontiguousarray(timestamps, dtype=np.float64)
        gpu_counts = np.ascontiguousarray(gpu_counts, dtype=np.int64)
        if len(steps) <= MIN_SCREENED or not (np.abs(steps) < 2 ** 52).all():  # steps as floats must be exact
            return self.observe_many(steps.tolist(), timestamps.tolist(), gpu_counts.tolist(),
                                     _clock_list(clock_codes, clock_seconds, clock_nodes))
        metered = timestamps if clock_codes is None else self._metered_columns(
            timestamps, np.asarray(clock_codes, dtype=np.int64), np.asarray(clock_seconds, dtype=np.float64),
            clock_nodes)
        block = (steps, timestamps, metered, gpu_counts)
        found = decide_screened(len(steps), lambda start, end: self._advance_columns(block, start, end),
                                lambda start, end: self._meter_exactly(block, start, end))
        if self.window:
            self.state.steps_in_window = self.window[-1][1] - self.window[0][1]
        return found

    def _meter_exactly(self, block: tuple, start: int, end: int) -> list[tuple[int, Decision]]:
        """`_meter` over records [start, end) of the block, as Python numbers (the decisions carry them)."""
        steps, timestamps, metered, gpu_counts = (column[start:end].tolist() for column in block)
        return [(start + i, decision) for i, decision in self._meter(steps, timestamps, metered, gpu_counts)]

    def _advance_columns(self, block: tuple, start: int, end: int) -> int:
        """Screens records [start, end), takes the ones before the first that might cross a new tier (or
        has no finite time) into the state, and returns where they end."""
        steps, when = block[0][start:end], block[2][start:end]
        gpus = self._gpus_columns(block[3][start:end])
        first, restarts = self._window_starts(steps)
        held_times, held_steps = _held(self.window)
        first_time = np.concatenate((held_times, when))[first]
        steps_in_window = steps - np.concatenate((held_steps, steps))[first]
        with np.errstate(all="ignore"):
            cost_per_1k = (when - first_time) * gpus * self._usd_per_gpu_second / steps_in_window * 1000.0
            overrun = cost_per_1k / self.policy.budget_per_1k_steps - 1.0
        measured = (steps_in_window > 0) & (when > first_time)
        judged = measured & (steps_in_window >= self._min_steps)
        unfired = min((threshold for action, _, threshold in self._tiers if action not in self.fired),
                      default=np.inf)
        doubtful = ~np.isfinite(when) | (judged & ~(overrun < unfired))
        healthy = int(doubtful.argmax()) if doubtful.any() else len(steps)
        if healthy:
            self._spend(when[:healthy], gpus, healthy)
            self._take_window(steps[:healthy], when[:healthy], restarts[:healthy])
            self._take_judgement(cost_per_1k[:healthy], overrun[:healthy], measured[:healthy], judged[:healthy])
            if not self.policy.gpu_count_override:
                self.state.gpu_count = int(gpus[healthy - 1])
        return start + healthy

    def _gpus_columns(self, seen):
        """Billable devices at each record, as the loop counts them: the override, else the last count seen."""
        if self.policy.gpu_count_override:
            return np.full(len(seen), self.policy.gpu_count_override, dtype=np.int64)
        last_seen = np.maximum.accumulate(np.where(seen != 0, np.arange(len(seen)), -1))
        return np.where(last_seen >= 0, seen[last_seen], self.state.gpu_count)

    def _window_starts(self, steps):
        """Each record's first window sample, as an index into the window now followed by `steps`: its last
        restart (steps going back clear the window), or as far back as the window holds; and where the
        restarts are."""
        held, size = len(self.window), self.window.maxlen
        at = np.arange(held, held + len(steps))
        restarts = np.empty(len(steps), dtype=bool)
        restarts[1:] = steps[1:] <= steps[:-1]
        restarts[0] = held > 0 and steps[0] <= self.window[-1][1]
        return np.maximum(np.maximum.accumulate(np.where(restarts, at, 0)), at - size + 1), restarts

    def _spend(self, when, gpus, count: int) -> None:
        """cost_usd and the last metered time after `count` records: the loop bills a record the time since
        the last one that moved the clock forward, if it does not go back; the bills summed in its order."""
        last = self._last_time
        with np.errstate(all="ignore"):     # a NaN last time (a NaN record once started the meter) moves never
            before = np.maximum.accumulate(np.concatenate(([-np.inf if last is None else last], when)))[:-1]
            moves = when >= before
            mover = np.maximum.accumulate(np.where(moves, np.arange(count), -1))
            previous = np.concatenate(([-1], mover[:-1]))        # the record that set the last time, before each
            since = np.where(previous >= 0, when[previous], np.nan if last is None else last)
            billed = moves & ((previous >= 0) | (last is not None))
            terms = np.empty(count + 1)
            terms[0] = self.state.cost_usd
            terms[1:] = np.where(billed, (when - since) * gpus[:count] * self._usd_per_gpu_second, -0.0)
        self.state.cost_usd = float(np.cumsum(terms)[-1])
        if mover[-1] >= 0:
            self._last_time = float(when[mover[-1]])

    def _take_window(self, steps, when, restarts) -> None:
        """The window after these records: the last of them since the last restart among them, if any."""
        cleared = np.flatnonzero(restarts)
        if len(cleared):
            self.window.clear()
        begin = max(int(cleared[-1]) if len(cleared) else 0, len(steps) - self.window.maxlen)
        self.window.extend(zip(when[begin:].tolist(), steps[begin:].tolist()))

    def _take_judgement(self, cost_per_1k, overrun, measured, judged) -> None:
        """cost_per_1k_steps and overrun_ratio as the last measured record left them; the tier as the last
        judged one did (none of them reached a tier not yet fired: any they reach is already held)."""
        state = self.state
        if measured.any():
            last = len(measured) - 1 - int(measured[::-1].argmax())
            state.cost_per_1k_steps, state.overrun_ratio = float(cost_per_1k[last]), float(overrun[last])
        if judged.any():
            ratio = float(overrun[len(judged) - 1 - int(judged[::-1].argmax())])
            if ratio < self._tiers[0][2]:
                state.tier = "ok"
            else:
                state.tier = [tier for _, tier, threshold in self._tiers if ratio >= threshold][-1]

    def _metered_columns(self, timestamps, codes, seconds, nodes: Sequence[str | None]):
        """`_metered` as arrays. A record continues the clock of the one before (the same source, seconds
        not going back) or takes its wall time; a run of continuing records adds the clock's differences
        to the time it started from, in order: `np.cumsum`, the loop's own additions. Many short runs
        (clocks flapping) are metered by `_metered` itself."""
        has = codes >= 0
        if not has.any():
            self._anchor = None
            return timestamps
        canonical = np.array([list(nodes).index(node) for node in nodes], dtype=np.int64)  # equal names: one clock
        source = np.where(has, canonical[np.where(has, codes, 0)], -1)
        goes_on = np.empty(len(codes), dtype=bool)
        goes_on[1:] = has[1:] & has[:-1] & (source[1:] == source[:-1]) & (seconds[1:] >= seconds[:-1])
        anchor = self._anchor
        goes_on[0] = bool(has[0] and anchor is not None and anchor[0] == nodes[codes[0]]
                          and seconds[0] >= anchor[1])
        edges = np.diff(goes_on.astype(np.int8), prepend=0, append=0)
        begins, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        if len(begins) > max(8, len(codes) // 64):
            return np.array(self._metered(timestamps.tolist(), _clock_list(codes, seconds, nodes)))
        when = timestamps.copy()
        ticks = np.empty(len(codes))
        ticks[1:] = seconds[1:] - seconds[:-1]
        ticks[0] = seconds[0] - anchor[1] if goes_on[0] else np.nan
        for begin, end in zip(begins.tolist(), ends.tolist()):
            origin = when[begin - 1] if begin else anchor[2]
            when[begin:end] = np.cumsum(np.concatenate(([origin], ticks[begin:end])))[1:]
        last = len(codes) - 1
        self._anchor = (nodes[codes[last]], float(seconds[last]), float(when[last])) if has[last] else None
        return when

    def _metered(self, timestamps: Sequence[float], clocks: Sequence[Clock | None]) -> list[float]:
        """The records' times as the meter counts them: while records carry one monotonic clock (the same
        source, never going back), the time between two of them is the time that clock measured, so a step
        of the wall clock (NTP) is neither billed nor seen as a slowdown, and a pause of the run still is.
        A record without a clock, or with another one (another node, a reboot), is taken at its wall time."""
        anchor, out = self._anchor, []
        for timestamp, clock in zip(timestamps, clocks):
            if clock is None:
                anchor = None
                out.append(timestamp)
                continue
            source, seconds = clock
            same = anchor is not None and anchor[0] == source and seconds >= anchor[1]
            when = anchor[2] + (seconds - anchor[1]) if same else timestamp
            anchor = (source, seconds, when)
            out.append(when)
        self._anchor = anchor
        return out

    def _cross_tiers(self, step: int, timestamp: float, overrun: float,
                     found: list[tuple[int, Decision]], index: int) -> str | None:
        """The highest tier `overrun` reaches; each tier's action the first time it is reached."""
        state, policy, reached = self.state, self.policy, None
        for action, tier, threshold in self._tiers:
            if overrun >= threshold:
                reached = tier
                if action not in self.fired:
                    self.fired.add(action)
                    found.append((index, Decision(action, f"cost_overrun_{tier}", step, timestamp, {
                        "cost_per_1k_steps": round(state.cost_per_1k_steps, 4),
                        "budget_per_1k_steps": policy.budget_per_1k_steps,
                        "overrun_ratio": round(overrun, 4), "cost_usd": round(state.cost_usd, 4),
                    })))
        return reached

    def state_dict(self) -> dict:
        """Plain data, so a restarted agent meters on exactly where it stopped."""
        return {"cost_usd": self.state.cost_usd, "fired": sorted(self.fired), "tier": self.state.tier,
                "gpu_count": self.state.gpu_count, "last_time": self._last_time,
                "window": [list(sample) for sample in self.window],
                "clock_anchor": None if self._anchor is None else list(self._anchor)}

    def load_state_dict(self, state: dict) -> None:
        self.state.cost_usd = float(state.get("cost_usd", 0.0))
        self.fired = set(state.get("fired", []))
        self.state.tier = state.get("tier", "ok")
        self.state.gpu_count = int(state.get("gpu_count", 0))
        self._last_time = state.get("last_time")
        self.window.clear()
        self.window.extend((float(t), int(s)) for t, s in state.get("window", []))
        anchor = state.get("clock_anchor")
        self._anchor = None if not anchor else (anchor[0], float(anchor[1]), float(anchor[2]))


def _held(window: deque) -> tuple[np.ndarray, np.ndarray]:
    """The window's times and steps, as arrays."""
    return (np.fromiter((sample[0] for sample in window), np.float64, len(window)),
            np.fromiter((sample[1] for sample in window), np.int64, len(window)))


def _clock_list(codes, seconds, nodes: Sequence[str | None]) -> list[Clock | None] | None:
    """`observe_columns`' clock columns as `observe_many` takes them."""
    if codes is None:
        return None
    return [None if code < 0 else (nodes[code], second)
            for code, second in zip(np.asarray(codes).tolist(), np.asarray(seconds, dtype=np.float64).tolist())]
