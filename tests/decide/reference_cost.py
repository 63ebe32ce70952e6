"""The cost meter as it was written step by step (before the batched fast path): the oracle the
property tests hold `trainguard.decide.cost.CostMeter` to. Not product code; kept deliberately plain."""
from __future__ import annotations

from trainguard.decide import cost
from trainguard.decide.decision import Decision


class CostMeter(cost.CostMeter):
    """The product's meter (its state and constructor) deciding with the old per-step methods."""

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
