"""The cost meter: steps and time in, budget tiers out.

Cost per 1000 steps = GPU-hours spent over the recent window x price / steps done in it x 1000. The
overrun is that over the budget, minus one; crossing a tier of the policy (warn, throttle, stop) yields
its action once. The same numbers are the recording rules behind the `CostBudget*` alerts, so
whichever path sees a tier first acts, and the executor de-duplicates the other.

Pure: time comes from the records, so a replay of a log meters exactly what the live run metered.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import repeat
from typing import Sequence

from trainguard.actions import COST_STOP, COST_THROTTLE, COST_WARN
from trainguard.decide.decision import Decision
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
        and a replay run the very same loop."""
        return [decision for _, decision in self.observe_many(
            (step,), (timestamp,), (gpu_count,), None if clock is None else (clock,))]

    def observe_many(self, steps: Sequence[int], timestamps: Sequence[float], gpu_counts: Sequence[int | None],
                     clocks: Sequence[Clock | None] | None = None) -> list[tuple[int, Decision]]:
        """Meter consecutive step records in order; returns (index, decision) for each tier crossed.

        `clocks`: each record's monotonic clock, as (source, seconds), where it has one (the trainer writes
        `system.monotonic_seconds`; the source is the node). Time is then metered on it (`_metered`).

        One loop with the state in local names, on purpose (replay runs it once per recorded step): the
        common case, under every tier, calls nothing."""
        metered = timestamps if clocks is None else self._metered(timestamps, clocks)
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
