"""Gradient clipping thresholds that follow the gradient-norm history, instead of a fixed 1.0.

    clipper = make("zscore", policy.dynamics.clipping, fixed=1.0)
    threshold = clipper.threshold()      # known on the host BEFORE the step: no extra device sync
    ...clip the gradients to `threshold` (torch.nn.utils.clip_grads_with_norm_)...
    clipped = clipper.observe(grad_norm) # after the step's one sync: what was clipped, for TLS

- ``fixed``: optim.grad_clip, always.
- ``zscore`` (ZClip, Kumar et al. 2025, arXiv 2504.02507): EMA mean and variance of the norm (smoothing
  ``ema_alpha``), started from the plain mean and variance of the first ``warmup_steps`` norms; the
  threshold is mean + ``z_thresh`` x std, so a norm whose z-score is over ``z_thresh`` is clipped to it.
  As ZClip does, the EMAs then take the *clipped* norm, so a spike cannot drag the threshold up.
  With ``adaptive_scaling`` (ZClip's default `clip_option`, its reference zclip.py): the step's z-score
  z = (norm - mean) / (std + 1e-6); a norm with z > ``z_thresh`` is clipped to mean + z_thresh x std /
  (z / z_thresh), a lower threshold the larger the outlier (down towards the mean; at z = z_thresh it is
  mean + z_thresh x std, so the rule is continuous), and the EMAs learn that clipped value. That
  threshold depends on the step's own norm: `threshold_for(norm)` gives it; `threshold()` (known before
  the step) is only its ceiling, mean + z_thresh x std. A loop clipping to `threshold()` before it reads
  the norm does not apply adaptive scaling, so nothing builds one from the policy (`make`); a loop that
  clips on the device with the formula (or reads the norm first) constructs it with
  `ZScoreClip(..., adaptive_scaling=True)` and reports `observe(norm)`.
- ``percentile`` (AutoClip, Seetharaman et al. 2020, arXiv 2007.14469): the ``percentile``-th percentile
  of the last ``history`` norms (AutoClip keeps the whole history; a window bounds memory and checkpoint).

Until ``warmup_steps`` norms are known, both use the fixed threshold. ``max_norm`` (when not 0) caps the
adaptive threshold from above, as ZClip's `max_grad_norm`. Non-finite norms are not learned from (the
guard skips those steps). The coefficient is torch's: min(1, threshold / (norm + 1e-6)).

Pure: floats in, floats out.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

from trainguard.config import WINDOW, above, at_least, between, key

RULES = ("fixed", "zscore", "percentile")
TORCH_EPS = 1e-6      # torch.nn.utils.clip_grads_with_norm_ divides by norm + 1e-6
ZCLIP_EPS = 1e-6      # ZClip's z-score divides by std + 1e-6



@dataclass(frozen=True)
class ClippingPolicy:
    """Adaptive clipping (optim.clip_rule): `zscore` clips at the EMA mean + z_thresh x EMA std of the
    gradient norm (ZClip, arXiv 2504.02507), `percentile` at that percentile of the last `history` norms
    (AutoClip, arXiv 2007.14469). Before `warmup_steps` norms have been seen, optim.grad_clip applies."""

    warmup_steps: int = key(25, WINDOW, "norms seen before the adaptive threshold applies (optim.grad_clip until then)")
    ema_alpha: float = key(0.97, between(0, 1, low_open=True, high_open=True), "zscore: weight of the old EMA mean "
                           "and variance")
    z_thresh: float = key(2.5, above(0), "zscore: clip at the EMA mean + this many EMA standard deviations")
    percentile: float = key(10.0, between(0, 100), "percentile: clip at this percentile of the last `history` norms")
    history: int = key(1000, WINDOW, "percentile: norms held")
    max_norm: float = key(0.0, at_least(0), "a fixed ceiling on top of the adaptive threshold; 0 = none")

class Clipped(NamedTuple):
    threshold: float
    coef: float          # the factor the gradients were multiplied by (1.0: not clipped)

    @property
    def clipped(self) -> bool:
        return self.coef < 1.0

    def metrics(self) -> dict[str, Any]:
        """The step's TLS `metrics` keys for it."""
        return {"clip_threshold": self.threshold, "clip_coef": self.coef}


def coefficient(threshold: float, grad_norm: float) -> float:
    if not math.isfinite(grad_norm):
        return 1.0       # the guard skips such a step whatever the clip did
    return min(1.0, threshold / (grad_norm + TORCH_EPS))


class FixedClip:
    rule = "fixed"

    def __init__(self, fixed: float):
        self.fixed = fixed

    def threshold(self) -> float:
        return self.fixed

    def threshold_for(self, grad_norm: float) -> float:
        """The threshold this step's norm is clipped to (for most rules the one known before the step)."""
        return self.threshold()

    def observe(self, grad_norm: float) -> Clipped:
        threshold = self.threshold_for(grad_norm)
        clipped = Clipped(threshold, coefficient(threshold, grad_norm))
        if math.isfinite(grad_norm):
            self._learn(grad_norm, threshold)
        return clipped

    def _learn(self, grad_norm: float, threshold: float) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class ZScoreClip(FixedClip):
    rule = "zscore"

    def __init__(self, policy: ClippingPolicy, fixed: float, *, adaptive_scaling: bool = False):
        super().__init__(fixed)
        self.policy, self.adaptive_scaling = policy, adaptive_scaling
        self.first: list[float] = []        # norms before the EMAs start
        self.mean: float | None = None
        self.var = 0.0

    def threshold(self) -> float:
        if self.mean is None:
            return self.fixed
        return _capped(self.mean + self.policy.z_thresh * math.sqrt(self.var), self.policy.max_norm)

    def threshold_for(self, grad_norm: float) -> float:
        """ZClip's adaptive scaling: an outlier (z > z_thresh) is clipped the harder the larger it is."""
        if self.mean is None or not self.adaptive_scaling:
            return self.threshold()
        z_thresh, std = self.policy.z_thresh, math.sqrt(self.var)
        z = (grad_norm - self.mean) / (std + ZCLIP_EPS)
        if not z > z_thresh:
            return self.threshold()
        return _capped(self.mean + z_thresh * std / (z / z_thresh), self.policy.max_norm)

    def _learn(self, grad_norm: float, threshold: float) -> None:
        p = self.policy
        if self.mean is None:
            self.first.append(grad_norm)
            if len(self.first) >= max(1, p.warmup_steps):
                n = len(self.first)
                self.mean = math.fsum(self.first) / n
                self.var = math.fsum((x - self.mean) ** 2 for x in self.first) / n
                self.first = []
            return
        effective = min(grad_norm, threshold)          # ZClip: the EMAs follow the clipped norm
        a = p.ema_alpha
        self.mean = a * self.mean + (1 - a) * effective
        self.var = a * self.var + (1 - a) * (effective - self.mean) ** 2

    def state_dict(self) -> dict[str, Any]:
        return {"first": list(self.first), "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.first, self.mean, self.var = list(state["first"]), state["mean"], float(state["var"])


class PercentileClip(FixedClip):
    rule = "percentile"

    def __init__(self, policy: ClippingPolicy, fixed: float):
        super().__init__(fixed)
        self.policy = policy
        self.history: deque[float] = deque(maxlen=max(1, policy.history))

    def threshold(self) -> float:
        if len(self.history) < max(1, self.policy.warmup_steps):
            return self.fixed
        return _capped(percentile(sorted(self.history), self.policy.percentile), self.policy.max_norm)

    def _learn(self, grad_norm: float, threshold: float) -> None:
        self.history.append(grad_norm)      # AutoClip: the norms as measured, before clipping

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque(state["history"], maxlen=max(1, self.policy.history))


def percentile(ordered: list[float], q: float) -> float:
    """numpy's default (linear) percentile of sorted values, q in 0..100."""
    position = (len(ordered) - 1) * min(100.0, max(0.0, q)) / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _capped(threshold: float, max_norm: float) -> float:
    return min(threshold, max_norm) if max_norm > 0 else threshold


def make(rule: str, policy: ClippingPolicy, *, fixed: float) -> FixedClip:
    if rule == "fixed":
        return FixedClip(fixed)
    if rule == "zscore":
        return ZScoreClip(policy, fixed)
    if rule == "percentile":
        return PercentileClip(policy, fixed)
    raise ValueError(f"unknown clip rule {rule!r} (known: {', '.join(RULES)})")
