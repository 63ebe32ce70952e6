"""The gradient-health guard: one step's global loss and gradient norms in, one decision out.

It runs on the host after the trainer's single device-to-host sync of the step, before the optimizer
step, and in `trainguard replay` over recorded records. Pure: no torch, no I/O, no clock (time comes
from the step's timestamp), so both paths make identical decisions.

The guard is an ordered tuple of rules (`RULES`), each a small object with its own state:
``check(stats)`` says whether this step is bad (the decision's detail) or not (None), ``learn(stats)``
takes a healthy step into the rule's statistics. The first rule that finds a step bad names the reason;
only a step that no rule finds bad is learned, by every rule, so one spike does not raise the bar for
the next. Then the escalation: ``rollback_after`` bad steps within ``rollback_window`` steps ask for a
``rollback``, and more than ``max_rollbacks_per_hour`` rollbacks ask to ``stop`` rather than loop.

Replay decides blocks of recorded steps with array screens beside these rules (`trainguard.decide.batch`);
a rule without a screen is decided there by `Guard.observe` itself, so it is correct the moment it exists.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from typing import Any, Iterable, Mapping, NamedTuple, Protocol

from trainguard.actions import ROLLBACK, SKIP_STEP, STOP
from trainguard.decide.decision import CARRY_ON, Decision
from trainguard.policy import GuardPolicy

HOUR = 3600.0
Detail = dict[str, Any]


class StepStats(NamedTuple):
    step: int
    loss: float
    grad_norm: float
    layer_grad_norms: Mapping[str, float] | None = None
    timestamp: float = 0.0


class Rule(Protocol):
    """One check of the guard. `state_dict` keys are the rule's own; the guard's state is their union."""

    reason: str

    def check(self, stats: StepStats) -> Detail | None: ...

    def learn(self, stats: StepStats) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


# ------------------------------------------------------------------------------------------ helpers

class RollingWindow:
    """The last `size` values and their running sums, so mean and variance cost O(1) per value.
    The sums are kept as they ran (not recomputed), so a resumed guard decides to the bit."""

    __slots__ = ("values", "total", "total_sq")

    def __init__(self, size: int, values: Iterable[float] = ()):
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

    def exceeds(self, value: float, sigma: float, floor_ratio: float) -> bool:
        """value > threshold(sigma), without the square root (batch.spikes is this, elementwise). The spread
        is floored: a series flat for a while must not turn noise into spikes."""
        mean = self.total / len(self.values)
        excess = value - mean
        if excess <= 0:
            return False
        floor = max(floor_ratio * abs(mean), 1e-8)
        variance, floor_sq = self.total_sq / len(self.values) - mean * mean, floor * floor
        return excess * excess > sigma * sigma * (variance if variance >= floor_sq else floor_sq)

    def threshold(self, sigma: float, floor_ratio: float) -> float:
        mean = self.total / len(self.values)
        floor = max(floor_ratio * abs(mean), 1e-8)
        return mean + sigma * math.sqrt(max(self.total_sq / len(self.values) - mean * mean, floor * floor))

    def state(self) -> tuple[list[float], list[float]]:
        return list(self.values), [self.total, self.total_sq]

    def load(self, values: Iterable[float], sums: list[float] | None) -> None:
        self.values.clear()
        self.total = self.total_sq = 0.0
        for value in values:
            self.push(value)
        if sums is not None:        # the running sums as they were, so resumed decisions match to the bit
            self.total, self.total_sq = float(sums[0]), float(sums[1])


def ema_step(ema: float | None, value: float, keep: float) -> float:
    """An exponential moving average after one more value (the first value starts it)."""
    return value if ema is None else ema + keep * (value - ema)


def worst_layer(layers: Mapping[str, float], emas: Mapping[str, float], factor: float) -> Detail | None:
    """Of the layers whose norm is above `factor` times their EMA, the one with the largest ratio of norm to
    that threshold (ties: the first name in sorted order), as a decision's detail; None if none is."""
    worst = None
    for name, norm in layers.items():
        ema = emas.get(name)
        if ema is not None and norm > factor * ema:
            threshold = factor * ema
            ratio = norm / threshold if threshold > 0 else math.inf
            if worst is None or (ratio, worst[1]) > (worst[0], name):
                worst = (ratio, name, norm, threshold)
    return None if worst is None else {"layer": worst[1], "grad_norm": worst[2], "threshold": worst[3]}


# ------------------------------------------------------------------------------------------- rules

class NonFinite:
    """A NaN or infinite loss or global gradient norm: always bad, from the first step."""

    reason = "nan"

    def check(self, stats: StepStats) -> Detail | None:
        if math.isfinite(stats.loss) and math.isfinite(stats.grad_norm):
            return None
        return {"loss": stats.loss, "grad_norm": stats.grad_norm}

    def learn(self, stats: StepStats) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


class WindowRule:
    """A value above mean + `sigma` standard deviations of the last `window` healthy values (the spread at
    least `FLOOR_RATIO` of the mean), once `min_steps` have been seen. With `sustain` > 1 the last
    `sustain` values must all be above it (their least is judged), and with `lag` a healthy value joins
    the window only `lag` steps later, so a climb is measured against what came before it, not against
    itself. A subclass names the value it reads. The window learns healthy steps only, so one bad value
    does not raise the bar for the next."""

    reason = ""
    column = ""             # the block column batch.py screens this rule on
    keys = ("", "")         # state_dict keys of the window's values and of its running sums
    FLOOR_RATIO = 1e-3

    def __init__(self, sigma: float, window: int, min_steps: int, sustain: int = 1, lag: int = 0):
        self.sigma, self.min_steps, self.sustain = sigma, min_steps, max(sustain, 1)
        self.lag = max(lag, self.sustain - 1)
        self.window = RollingWindow(window)
        self.recent: deque[float] = deque()     # the last `lag` healthy values, not in the window yet

    def value(self, stats: StepStats) -> float:
        raise NotImplementedError

    def check(self, stats: StepStats) -> Detail | None:
        window, value = self.window, self.value(stats)
        if len(window) < max(self.min_steps, 1) or len(self.recent) < self.sustain - 1:
            return None
        least = min([value, *itertools.islice(self.recent, len(self.recent) - self.sustain + 1, None)])
        if not window.exceeds(least, self.sigma, self.FLOOR_RATIO):
            return None
        return self.detail(value, window.threshold(self.sigma, self.FLOOR_RATIO))

    def detail(self, value: float, threshold: float) -> Detail:
        return {"value": value, "threshold": threshold}

    def learn(self, stats: StepStats) -> None:
        self.recent.append(self.value(stats))
        if len(self.recent) > self.lag:
            self.window.push(self.recent.popleft())

    def state_dict(self) -> dict[str, Any]:
        values, sums = self.window.state()
        state: dict[str, Any] = {self.keys[0]: values, self.keys[1]: sums}
        if self.lag:
            state[self.keys[0] + "_recent"] = list(self.recent)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.window.load(state.get(self.keys[0], []), state.get(self.keys[1]))
        self.recent = deque(state.get(self.keys[0] + "_recent", []))


class LossSpike(WindowRule):
    """A loss above the band of the recent healthy losses (as OLMo-core's stability monitor)."""

    reason, column, keys = "loss_spike", "losses", ("losses", "loss_sums")

    def value(self, stats: StepStats) -> float:
        return stats.loss

    def detail(self, value: float, threshold: float) -> Detail:
        return {"loss": value, "threshold": threshold}


class GradExplosion:
    """The global gradient norm above `factor` times its EMA, or a layer's above `layer_factor` times its
    own, once `min_steps` healthy steps have been seen. The detail names the global norm, else the layer
    furthest over its threshold. A missing (NaN) layer norm teaches nothing."""

    reason = "grad_explosion"

    def __init__(self, beta: float, factor: float, layer_factor: float, min_steps: int):
        self.keep, self.factor, self.layer_factor, self.min_steps = 1 - beta, factor, layer_factor, min_steps
        self.ema: float | None = None
        self.layer_ema: dict[str, float] = {}
        self.good = 0

    def check(self, stats: StepStats) -> Detail | None:
        if self.good < self.min_steps or self.ema is None:
            return None
        limit = self.factor * self.ema
        if stats.grad_norm > limit:
            return {"grad_norm": stats.grad_norm, "threshold": limit}
        return worst_layer(stats.layer_grad_norms, self.layer_ema, self.layer_factor) \
            if stats.layer_grad_norms else None

    def learn(self, stats: StepStats) -> None:
        self.ema = ema_step(self.ema, stats.grad_norm, self.keep)
        self.good += 1
        for name, norm in (stats.layer_grad_norms or {}).items():
            if math.isfinite(norm):
                self.layer_ema[name] = ema_step(self.layer_ema.get(name), norm, self.keep)

    def state_dict(self) -> dict[str, Any]:
        return {"grad_ema": self.ema, "good_grad_steps": self.good, "layer_ema": dict(self.layer_ema)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.ema = state.get("grad_ema")
        self.good = int(state.get("good_grad_steps", 0))
        self.layer_ema = dict(state.get("layer_ema", {}))


class GradClimb(WindowRule):
    """The global gradient norm above mean + `sigma` standard deviations of the recent healthy norms for
    `sustain` steps in a row, against norms at least `lag` steps old: a norm that climbs smoothly (0.8 to
    12.7 in 30 steps) drags its EMA along and never reaches `GradExplosion`'s factor, but it leaves the
    band of the norms before the climb. One healthy spike, or a burst of a few steps, does not count."""

    reason, column, keys = "grad_climb", "grad_norms", ("grad_norms", "grad_norm_sums")
    FLOOR_RATIO = 0.1       # noisy norms: the band is at least sigma tenths of the mean wide

    def value(self, stats: StepStats) -> float:
        return stats.grad_norm

    def detail(self, value: float, threshold: float) -> Detail:
        return {"grad_norm": value, "threshold": threshold, "steps": self.sustain}


def rules(policy: GuardPolicy) -> tuple[Rule, ...]:
    """The guard's rules, in the order they are asked: the first that finds a step bad names it."""
    return (
        NonFinite(),
        LossSpike(policy.spike_sigma, policy.spike_window, policy.spike_min_steps),
        GradExplosion(policy.grad_ema_beta, policy.grad_explode_factor, policy.layer_explode_factor,
                      policy.grad_min_steps),
        GradClimb(policy.grad_climb_sigma, policy.grad_climb_window, policy.grad_climb_min_steps,
                  policy.grad_climb_steps, policy.grad_climb_lag),
    )


# ------------------------------------------------------------------------------------------- guard

class Guard:
    def __init__(self, policy: GuardPolicy | None = None):
        self.policy = policy or GuardPolicy()
        self.rules = rules(self.policy)
        self.observed = 0                       # steps seen, good or bad (step numbers can go back)
        self.bad: deque[int] = deque()          # `observed` index of each recent bad step
        self.rollbacks: deque[float] = deque()  # timestamps of recent rollbacks
        self.stopped = False

    def rule(self, reason: str) -> Rule:
        return next(rule for rule in self.rules if rule.reason == reason)

    def observe(self, stats: StepStats) -> Decision:
        """The decision for one step. A stopped guard answers ``stop`` to every step."""
        self.observed += 1
        if self.stopped:
            return Decision(STOP, "rollback_limit", stats.step, stats.timestamp)
        for rule in self.rules:
            detail = rule.check(stats)
            if detail is not None:
                return self._escalate(stats.step, stats.timestamp, rule.reason, detail)
        for rule in self.rules:
            rule.learn(stats)
        return CARRY_ON

    def _escalate(self, step: int, timestamp: float, reason: str, detail: Detail) -> Decision:
        """A bad step: skip it; too many in a window: roll back; too many rollbacks an hour: stop."""
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
    def state_dict(self) -> dict[str, Any]:
        """Plain data, so a checkpoint (or a resumed replay) carries the guard's memory."""
        state: dict[str, Any] = {}
        for rule in self.rules:
            state.update(rule.state_dict())
        return {**state, "rollbacks": list(self.rollbacks), "stopped": self.stopped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for rule in self.rules:
            rule.load_state_dict(state)
        self.rollbacks = deque(state.get("rollbacks", []))
        self.stopped = bool(state.get("stopped", False))
        self.bad.clear()
