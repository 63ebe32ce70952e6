"""The gradient-health guard: one step's global loss and gradient norms in, one decision out.

It runs on the host after the trainer's single device-to-host sync of the step, before the optimizer
step, and in `trainguard replay` over recorded records. Pure: no torch, no I/O, no clock (time comes
from the step's timestamp), so both paths make identical decisions.

Checks, in order:
- a non-finite loss or gradient norm: ``skip_step`` (reason ``nan``);
- a loss spike: above mean + ``spike_sigma`` standard deviations of the last ``spike_window`` good
  losses, once ``spike_min_steps`` have been seen (as OLMo-core's stability monitor);
- a gradient explosion: the global norm, or any layer's, above a factor of its own EMA;
then escalation: ``rollback_after`` bad steps within ``rollback_window`` steps ask for a ``rollback``,
and more than ``max_rollbacks_per_hour`` rollbacks ask to ``stop`` rather than loop.

Bad steps never enter the statistics, so one spike does not raise the bar for the next.
"""

from __future__ import annotations

import math
from collections import deque
from math import isfinite
from typing import Mapping, NamedTuple

from trainguard.actions import ROLLBACK, SKIP_STEP
from trainguard.decide.decision import CARRY_ON, Decision
from trainguard.policy import GuardPolicy

STOP = "stop"
HOUR = 3600.0
NO_DETAIL: dict = {}


class StepStats(NamedTuple):
    step: int
    loss: float
    grad_norm: float
    layer_grad_norms: Mapping[str, float] | None = None
    timestamp: float = 0.0


class _RollingStats:
    """Mean and standard deviation of the last `size` values in O(1) per value."""

    __slots__ = ("values", "total", "total_sq")

    def __init__(self, size: int, values: list[float] = ()):
        self.values: deque[float] = deque(maxlen=size)
        self.total = self.total_sq = 0.0
        for value in values:
            self.push(value)

    def push(self, value: float) -> None:
        if len(self.values) == self.values.maxlen:
            old = self.values[0]
            self.total -= old
            self.total_sq -= old * old
        self.values.append(value)
        self.total += value
        self.total_sq += value * value

    def __len__(self) -> int:
        return len(self.values)

    def _mean_variance(self) -> tuple[float, float]:
        n = len(self.values)
        mean = self.total / n
        # A floor on the spread: a loss that has been flat for a while must not turn noise into spikes.
        floor = max(1e-3 * abs(mean), 1e-8)
        return mean, max(self.total_sq / n - mean * mean, floor * floor)

    def threshold(self, sigma: float) -> float:
        mean, variance = self._mean_variance()
        return mean + sigma * math.sqrt(variance)

    def exceeds(self, value: float, sigma: float) -> bool:
        """value > threshold(sigma), without the square root."""
        mean, variance = self._mean_variance()
        excess = value - mean
        return excess > 0 and excess * excess > sigma * sigma * variance


class Guard:
    def __init__(self, policy: GuardPolicy | None = None):
        self.policy = policy or GuardPolicy()
        self.losses = _RollingStats(self.policy.spike_window)
        self.grad_ema: float | None = None
        self.good_grad_steps = 0
        self.layer_ema: dict[str, float] = {}
        self.observed = 0                       # steps seen, good or bad (step numbers can go back)
        self.bad: deque[int] = deque()          # `observed` index of each recent bad step
        self.rollbacks: deque[float] = deque()  # timestamps of recent rollbacks
        self.stopped = False

    # ------------------------------------------------------------------------------------- decide
    def observe(self, stats: StepStats) -> Decision:
        return self.check(stats.step, stats.loss, stats.grad_norm, stats.layer_grad_norms, stats.timestamp)

    def check(self, step: int, loss: float, grad_norm: float,
              layer_grad_norms: Mapping[str, float] | None = None, timestamp: float = 0.0) -> Decision:
        """The decision for one step (the fast path `observe` and replay call)."""
        self.observed += 1
        if self.stopped:
            return Decision(STOP, "rollback_limit", step, timestamp)
        reason, detail = self._classify(loss, grad_norm, layer_grad_norms)
        if reason is None:
            self._learn(loss, grad_norm, layer_grad_norms)
            return CARRY_ON
        return self._escalate(step, timestamp, reason, detail)

    def _classify(self, loss: float, grad_norm: float,
                  layers: Mapping[str, float] | None) -> tuple[str | None, dict]:
        # This runs for every step of every replayed log: the common case (a healthy step) takes the
        # cheapest comparisons first and computes no square root.
        policy = self.policy
        if not (isfinite(loss) and isfinite(grad_norm)):
            return "nan", {"loss": loss, "grad_norm": grad_norm}
        losses = self.losses
        if len(losses.values) >= policy.spike_min_steps and losses.exceeds(loss, policy.spike_sigma):
            return "loss_spike", {"loss": loss, "threshold": losses.threshold(policy.spike_sigma)}
        if self.good_grad_steps >= policy.grad_min_steps:
            limit = policy.grad_explode_factor * self.grad_ema
            if grad_norm > limit:
                return "grad_explosion", {"grad_norm": grad_norm, "threshold": limit}
            if layers:
                for name, norm in layers.items():
                    ema = self.layer_ema.get(name)
                    if ema is not None and norm > policy.layer_explode_factor * ema:
                        return "grad_explosion", {"layer": name, "grad_norm": norm,
                                                  "threshold": policy.layer_explode_factor * ema}
        return None, NO_DETAIL

    def _learn(self, loss: float, grad_norm: float, layers: Mapping[str, float] | None) -> None:
        self.losses.push(loss)
        beta = self.policy.grad_ema_beta
        ema = self.grad_ema
        self.grad_ema = grad_norm if ema is None else ema + (1 - beta) * (grad_norm - ema)
        self.good_grad_steps += 1
        if layers:
            emas = self.layer_ema
            for name, norm in layers.items():
                if math.isfinite(norm):
                    ema = emas.get(name)
                    emas[name] = norm if ema is None else ema + (1 - beta) * (norm - ema)

    def _escalate(self, step: int, timestamp: float, reason: str, detail: dict) -> Decision:
        policy = self.policy
        self.bad.append(self.observed)
        while self.bad and self.bad[0] <= self.observed - policy.rollback_window:
            self.bad.popleft()
        if len(self.bad) < policy.rollback_after:
            return Decision(SKIP_STEP, reason, step, timestamp, detail)
        self.bad.clear()
        while self.rollbacks and self.rollbacks[0] <= timestamp - HOUR:
            self.rollbacks.popleft()
        if len(self.rollbacks) >= policy.max_rollbacks_per_hour:
            self.stopped = True
            return Decision(STOP, "rollback_limit", step, timestamp,
                            {"rollbacks_last_hour": len(self.rollbacks), "last_reason": reason})
        self.rollbacks.append(timestamp)
        return Decision(ROLLBACK, f"repeated_{reason}", step, timestamp,
                        {**detail, "bad_steps": policy.rollback_after, "window": policy.rollback_window})

    # -------------------------------------------------------------------------------- persistence
    def state_dict(self) -> dict:
        """Plain data, so a checkpoint (or a resumed replay) carries the guard's memory."""
        return {
            "losses": list(self.losses.values), "loss_sums": [self.losses.total, self.losses.total_sq],
            "grad_ema": self.grad_ema,
            "good_grad_steps": self.good_grad_steps, "layer_ema": dict(self.layer_ema),
            "rollbacks": list(self.rollbacks), "stopped": self.stopped,
        }

    def load_state_dict(self, state: dict) -> None:
        self.losses = _RollingStats(self.policy.spike_window, state.get("losses", []))
        if "loss_sums" in state:  # the running sums as they were, so resumed decisions match to the bit
            self.losses.total, self.losses.total_sq = state["loss_sums"]
        self.grad_ema = state.get("grad_ema")
        self.good_grad_steps = int(state.get("good_grad_steps", 0))
        self.layer_ema = dict(state.get("layer_ema", {}))
        self.rollbacks = deque(state.get("rollbacks", []))
        self.stopped = bool(state.get("stopped", False))
        self.bad.clear()
