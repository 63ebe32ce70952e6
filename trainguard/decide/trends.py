"""The two measured statistics the LR schedules act on, as rolling windows over applied steps.

- gradient stability: the coefficient of variation (std / mean) of the global gradient norm over the
  last `window` steps. Stable at or under ``cv_max``; unstable over ``cv_max * unstable_margin``; in
  between it is neither (hysteresis). Unknown (None) until the window is full.
- loss plateau: the relative improvement of the median training loss of the window's second half over
  its first half, ``(before - after) / |before|``; a plateau under ``min_improvement``. This is the
  statistic `trainguard diagnose` judges a plateau by (diagnose/algorithm.py: loss_plateau).

Pure: numbers in, numbers out. Non-finite values never enter a window (the guard skips those steps).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from trainguard.config import above, at_least, between, key


@dataclass(frozen=True)
class StabilityPolicy:
    """Gradient stability: the coefficient of variation (std / mean) of the global gradient norm over the
    last `window` applied steps. At or under `cv_max` the gradients are stable; over `cv_max *
    unstable_margin` they are unstable again (the margin keeps a phase from flapping at the border)."""

    window: int = key(200, at_least(2, 10**6), "applied steps whose gradient norms the stability is measured over")
    cv_max: float = key(0.25, above(0), "std / mean of the norms at or under which the gradients are stable")
    unstable_margin: float = key(1.5, at_least(1), "unstable again over cv_max x this (no flapping at the border)")


@dataclass(frozen=True)
class PlateauPolicy:
    """Loss plateau: the median training loss of the second half of the last `window` applied steps
    improves on the first half's by less than `min_improvement` (relative), as `trainguard diagnose`
    judges a plateau (its own window, diagnose.plateau_window_steps, is over a finished log's last steps)."""

    window: int = key(1000, at_least(2, 10**6), "applied steps whose two halves' median losses are compared")
    min_improvement: float = key(0.01, between(-1, 1), "relative loss improvement under which the loss has a "
                                 "plateau")


class GradientStability:
    def __init__(self, policy: StabilityPolicy):
        self.policy = policy
        self.norms: deque[float] = deque(maxlen=policy.window)

    def push(self, grad_norm: float) -> None:
        if math.isfinite(grad_norm):
            self.norms.append(grad_norm)

    def cv(self) -> float | None:
        """std / mean of the window's norms; None until it is full."""
        n = len(self.norms)
        if n < self.policy.window or n < 2:
            return None
        mean = math.fsum(self.norms) / n
        if mean <= 0:
            return None
        variance = math.fsum((x - mean) ** 2 for x in self.norms) / n
        return math.sqrt(variance) / mean

    def stable(self) -> bool:
        cv = self.cv()
        return cv is not None and cv <= self.policy.cv_max

    def unstable(self) -> bool:
        cv = self.cv()
        return cv is not None and cv > self.policy.cv_max * self.policy.unstable_margin

    def state_dict(self) -> dict[str, Any]:
        return {"norms": list(self.norms)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.norms = deque(state.get("norms", []), maxlen=self.policy.window)


class LossPlateau:
    def __init__(self, policy: PlateauPolicy):
        self.policy = policy
        self.losses: deque[float] = deque(maxlen=policy.window)

    def push(self, loss: float) -> None:
        if math.isfinite(loss):
            self.losses.append(loss)

    def improvement(self) -> float | None:
        """(median of the first half - median of the second) / |first|; None until the window is full."""
        from statistics import median   # only the phase schedule measures a plateau: most commands never import statistics

        window = self.policy.window
        if len(self.losses) < window or window < 2:
            return None
        values = list(self.losses)
        before, after = median(values[:window // 2]), median(values[window // 2:])
        return (before - after) / abs(before) if before else 0.0

    def plateau(self) -> bool:
        improvement = self.improvement()
        return improvement is not None and improvement < self.policy.min_improvement

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses = deque(state.get("losses", []), maxlen=self.policy.window)


def grad_param_ratio(grad_norm: float, param_norm: float) -> float:
    """The seed's "gradient variance": the global gradient norm over the global parameter norm."""
    if not (math.isfinite(grad_norm) and math.isfinite(param_norm)) or param_norm <= 0:
        return math.inf
    return grad_norm / param_norm
