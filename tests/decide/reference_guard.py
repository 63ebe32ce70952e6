"""The guard as it was written step by step (before the batched fast path): the oracle the property
tests hold `trainguard.decide.guard.Guard` to. Not product code; kept deliberately plain."""
from __future__ import annotations

import math
from math import isfinite
from typing import Mapping

from trainguard.decide import guard
from trainguard.decide.decision import CARRY_ON

NO_DETAIL: dict = {}


def _exceeds(stats: guard._RollingStats, value: float, sigma: float) -> bool:
    """value > stats.threshold(sigma), without the square root (the old _RollingStats.exceeds)."""
    n = len(stats.values)
    mean = stats.total / n
    floor = max(1e-3 * abs(mean), 1e-8)
    excess = value - mean
    return excess > 0 and excess * excess > sigma * sigma * max(stats.total_sq / n - mean * mean, floor * floor)


class Guard(guard.Guard):
    """The product's guard (its state, constructor and escalation) deciding with the old per-step methods."""

    def check(self, step: int, loss: float, grad_norm: float,
              layer_grad_norms: Mapping[str, float] | None = None, timestamp: float = 0.0) -> Decision:
        """The decision for one step (the fast path `observe` and replay call)."""
        self.observed += 1
        if self.stopped:
            return guard.Decision(guard.STOP, "rollback_limit", step, timestamp)
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
        if len(losses.values) >= policy.spike_min_steps and _exceeds(losses, loss, policy.spike_sigma):
            return "loss_spike", {"loss": loss, "threshold": losses.threshold(policy.spike_sigma)}
        if self.good_grad_steps >= policy.grad_min_steps:
            limit = policy.grad_explode_factor * self.grad_ema
            if grad_norm > limit:
                return "grad_explosion", {"grad_norm": grad_norm, "threshold": limit}
            if layers:
                over = [(norm / (policy.layer_explode_factor * self.layer_ema[name])
                         if policy.layer_explode_factor * self.layer_ema[name] > 0 else math.inf, name, norm)
                        for name, norm in layers.items() if name in self.layer_ema
                        and norm > policy.layer_explode_factor * self.layer_ema[name]]
                if over:    # the layer furthest above its threshold; ties: the first name in sorted order
                    ratio, name, norm = min(over, key=lambda entry: (-entry[0], entry[1]))
                    return "grad_explosion", {"layer": name, "grad_norm": norm,
                                              "threshold": policy.layer_explode_factor * self.layer_ema[name]}
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

