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
from typing import Any

from trainguard.policy import PlateauPolicy, StabilityPolicy


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
