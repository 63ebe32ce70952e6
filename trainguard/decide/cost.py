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

from trainguard.actions import COST_STOP, COST_THROTTLE, COST_WARN
from trainguard.decide.decision import Decision
from trainguard.policy import CostPolicy

TIER_ACTIONS = ((COST_WARN, "warn"), (COST_THROTTLE, "throttle"), (COST_STOP, "stop"))


@dataclass
class CostState:
    cost_usd: float = 0.0              # spent since the meter started (all time, rollbacks included)
    cost_per_1k_steps: float = 0.0     # over the recent window
    overrun_ratio: float = 0.0         # cost_per_1k_steps / budget - 1; 0.3 means 30% over budget
    tier: str = "ok"                   # ok | warn | throttle | stop
    gpu_count: int = 0
    steps_in_window: int = 0


class CostMeter:
    def __init__(self, policy: CostPolicy | None = None):
        self.policy = policy or CostPolicy()
        self.window: deque[tuple[float, int]] = deque(maxlen=max(self.policy.window_steps, 2))
        self.state = CostState()
        self.fired: set[str] = set()
        self._last_time: float | None = None
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

    def observe(self, step: int, timestamp: float, gpu_count: int | None = None) -> list[Decision]:
        state, window = self.state, self.window
        gpus = self.gpus(gpu_count)
        last = self._last_time
        if last is None or timestamp >= last:
            if last is not None:
                state.cost_usd += (timestamp - last) * gpus * self._usd_per_gpu_second
            self._last_time = timestamp
        if window and step <= window[-1][1]:
            window.clear()          # a rollback or restart: steps went back, measure afresh
        window.append((timestamp, step))
        return self._judge(step, timestamp, gpus)

    def _judge(self, step: int, timestamp: float, gpus: int) -> list[Decision]:
        state, window, policy = self.state, self.window, self.policy
        (t0, s0), (t1, s1) = window[0], window[-1]
        state.steps_in_window = s1 - s0
        if s1 <= s0 or t1 <= t0:
            return []
        state.cost_per_1k_steps = (t1 - t0) * gpus * self._usd_per_gpu_second / (s1 - s0) * 1000.0
        overrun = state.overrun_ratio = state.cost_per_1k_steps / policy.budget_per_1k_steps - 1.0
        if s1 - s0 < self._min_steps:
            return []
        tiers = self._tiers
        if overrun < tiers[0][2]:       # the common case: under every tier
            state.tier = "ok"
            return []
        decisions = []
        for action, tier, threshold in tiers:
            if overrun >= threshold:
                state.tier = tier
                if action not in self.fired:
                    self.fired.add(action)
                    decisions.append(Decision(action, f"cost_overrun_{tier}", step, timestamp, {
                        "cost_per_1k_steps": round(state.cost_per_1k_steps, 4),
                        "budget_per_1k_steps": policy.budget_per_1k_steps,
                        "overrun_ratio": round(overrun, 4), "cost_usd": round(state.cost_usd, 4),
                    }))
        return decisions

    def state_dict(self) -> dict:
        """Plain data, so a restarted agent meters on exactly where it stopped."""
        return {"cost_usd": self.state.cost_usd, "fired": sorted(self.fired), "tier": self.state.tier,
                "gpu_count": self.state.gpu_count, "last_time": self._last_time,
                "window": [list(sample) for sample in self.window]}

    def load_state_dict(self, state: dict) -> None:
        self.state.cost_usd = float(state.get("cost_usd", 0.0))
        self.fired = set(state.get("fired", []))
        self.state.tier = state.get("tier", "ok")
        self.state.gpu_count = int(state.get("gpu_count", 0))
        self._last_time = state.get("last_time")
        self.window.clear()
        self.window.extend((float(t), int(s)) for t, s in state.get("window", []))
