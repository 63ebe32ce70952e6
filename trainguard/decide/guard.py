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
from itertools import repeat
from math import isfinite
from operator import itemgetter
from typing import Mapping, NamedTuple, Sequence

from trainguard.actions import ROLLBACK, SKIP_STEP
from trainguard.decide.decision import CARRY_ON, Decision
from trainguard.policy import GuardPolicy

STOP = "stop"
MIN_SCREENED = 32     # batches of layer norms this short that fail the screen are decided step by step
HOUR = 3600.0


class StepStats(NamedTuple):
    step: int
    loss: float
    grad_norm: float
    layer_grad_norms: Mapping[str, float] | None = None
    timestamp: float = 0.0


class _RollingStats:
    """The last `size` values and their running sums, so mean and variance cost O(1) per value.

    `Guard.check_many` updates the sums inline (it runs once per replayed record); these methods are the
    same arithmetic for everything else."""

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

    def threshold(self, sigma: float) -> float:
        n = len(self.values)
        mean = self.total / n
        # A floor on the spread: a loss that has been flat for a while must not turn noise into spikes.
        floor = max(1e-3 * abs(mean), 1e-8)
        return mean + sigma * math.sqrt(max(self.total_sq / n - mean * mean, floor * floor))


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
        """The decision for one step: `check_many` over a batch of one, so the live run and a replay run
        the very same loop."""
        found = self.check_many((step,), (loss,), (grad_norm,), (timestamp,),
                                None if layer_grad_norms is None else (layer_grad_norms,))
        return found[0][1] if found else CARRY_ON

    def check_many(self, steps: Sequence[int], losses: Sequence[float], grad_norms: Sequence[float],
                   timestamps: Sequence[float], layers: Sequence[Mapping[str, float] | None] | None = None,
                   ) -> list[tuple[int, Decision]]:
        """Decide consecutive steps in order; returns (index, decision) for each step that does not
        carry on. A stopped guard answers ``stop`` to every step.

        Per-layer norms cost a loop over the layers per step. When a batch's layer norms cannot explode
        (`_layer_columns`), the steps are decided on their global numbers and each layer's EMA then
        learns over its column of norms: the same decisions and the same EMAs, with the per-layer work
        done a column at a time."""
        if not layers or not any(layers):
            return self._check_steps(steps, losses, grad_norms, timestamps, None)
        columns = self._layer_columns(layers)
        if columns is None:
            if len(losses) <= MIN_SCREENED:
                return self._check_steps(steps, losses, grad_norms, timestamps, layers)
            half = len(losses) // 2     # an early, fast-moving stretch: screen the halves apart
            found = self.check_many(steps[:half], losses[:half], grad_norms[:half], timestamps[:half], layers[:half])
            return found + [(half + i, decision) for i, decision in self.check_many(
                steps[half:], losses[half:], grad_norms[half:], timestamps[half:], layers[half:])]
        found = self._check_steps(steps, losses, grad_norms, timestamps, None)
        self._learn_layer_columns(columns, {i for i, _ in found})
        return found

    def _layer_columns(self, layers: Sequence[Mapping[str, float] | None]) -> list[tuple[str, list]] | None:
        """Each layer's norms over the batch, when no layer can explode in it; else None.

        A layer's EMA moves to a weighted mean of itself and a norm, so while it learns from this batch
        it stays at or above the smaller of its value now and the batch's smallest norm. A batch whose
        largest norm stays under the factor times that (less a margin for rounding) cannot explode,
        whichever of its steps turn out healthy. Needs every step to carry the same layers, each with
        an EMA already."""
        first, emas = layers[0], self.layer_ema
        if not first or any(name not in emas for name in first):
            return None
        width = len(first)
        if any(norms is None or len(norms) != width for norms in layers):
            return None
        factor = self.policy.layer_explode_factor * (1 - 1e-9)
        columns = []
        for name in first:
            try:
                column = list(map(itemgetter(name), layers))
            except KeyError:
                return None
            low, high = min(column), max(column)
            floor = emas[name] if emas[name] < low else low
            if not (floor >= 0 and high <= factor * floor):     # NaN fails too: decided step by step
                return None
            columns.append((name, column))
        return columns

    def _learn_layer_columns(self, columns: list[tuple[str, list]], bad: set[int]) -> None:
        """Each layer's EMA over its column, healthy steps only, finite norms only (as step by step)."""
        keep, emas, finite = 1 - self.policy.grad_ema_beta, self.layer_ema, isfinite
        for name, column in columns:
            ema = emas[name]
            if bad:
                column = [norm for i, norm in enumerate(column) if i not in bad]
            for norm in column:
                if finite(norm):
                    ema = ema + keep * (norm - ema)
            emas[name] = ema

    def _check_steps(self, steps: Sequence[int], losses: Sequence[float], grad_norms: Sequence[float],
                     timestamps: Sequence[float], layers: Sequence[Mapping[str, float] | None] | None,
                     ) -> list[tuple[int, Decision]]:
        """`check_many`, step by step.

        One loop with the state in local names, on purpose: replay runs it once per recorded step, and a
        million-step log is what it is measured on (bench/bench_replay.py). The common case, a healthy
        step, takes the cheapest comparisons first, computes no square root and calls nothing."""
        policy, window = self.policy, self.losses
        values, total, total_sq = window.values, window.total, window.total_sq
        size, n = values.maxlen, len(values)
        ema, good, seen, stopped = self.grad_ema, self.good_grad_steps, self.observed, self.stopped
        spike_min, sigma_sq = policy.spike_min_steps, policy.spike_sigma * policy.spike_sigma
        grad_min, factor, keep = policy.grad_min_steps, policy.grad_explode_factor, 1 - policy.grad_ema_beta
        layer_ema, layer_factor, finite = self.layer_ema, policy.layer_explode_factor, isfinite
        found: list[tuple[int, Decision]] = []
        for i, (loss, grad_norm, layer_norms) in enumerate(zip(losses, grad_norms, layers or repeat(None))):
            reason = None
            if stopped:
                reason = STOP
            elif not (finite(loss) and finite(grad_norm)):
                reason = "nan"
            else:
                if n >= spike_min:
                    # _RollingStats.threshold's arithmetic without the square root, and with conditional
                    # expressions in place of max() and abs() (the same values, without the calls).
                    mean = total / n
                    excess = loss - mean
                    if excess > 0:
                        floor = 1e-3 * (mean if mean >= 0 else -mean)
                        floor = floor if floor >= 1e-8 else 1e-8
                        variance = total_sq / n - mean * mean
                        floor_sq = floor * floor
                        if excess * excess > sigma_sq * (variance if variance >= floor_sq else floor_sq):
                            reason = "loss_spike"
                if reason is None and good >= grad_min:
                    if grad_norm > factor * ema:
                        reason = "grad_explosion"
                    elif layer_norms:
                        for name, norm in layer_norms.items():
                            layer = layer_ema.get(name)
                            if layer is not None and norm > layer_factor * layer:
                                reason = "grad_explosion"
                                break
            if reason is None:      # healthy: it joins the statistics
                if n == size:
                    old = values[0]
                    total -= old
                    total_sq -= old * old
                else:
                    n += 1
                values.append(loss)
                total += loss
                total_sq += loss * loss
                ema = grad_norm if ema is None else ema + keep * (grad_norm - ema)
                good += 1
                if layer_norms:
                    for name, norm in layer_norms.items():
                        if finite(norm):
                            layer = layer_ema.get(name)
                            layer_ema[name] = norm if layer is None else layer + keep * (norm - layer)
                continue
            # A bad step: the state goes back to the object, whose detail and escalation read it.
            window.total, window.total_sq = total, total_sq
            self.grad_ema, self.good_grad_steps, self.observed = ema, good, seen + i + 1
            found.append((i, self._bad_step(steps[i], timestamps[i], reason, loss, grad_norm, layer_norms)))
            stopped = self.stopped
        window.total, window.total_sq = total, total_sq
        self.grad_ema, self.good_grad_steps, self.observed = ema, good, seen + len(losses)
        return found

    def _layer_detail(self, layers: Mapping[str, float]) -> dict | None:
        """The first layer above its factor of its own EMA, if any."""
        factor = self.policy.layer_explode_factor
        for name, norm in layers.items():
            ema = self.layer_ema.get(name)
            if ema is not None and norm > factor * ema:
                return {"layer": name, "grad_norm": norm, "threshold": factor * ema}
        return None

    def _bad_step(self, step: int, timestamp: float, reason: str, loss: float, grad_norm: float,
                  layers: Mapping[str, float] | None) -> Decision:
        if reason == STOP:
            return Decision(STOP, "rollback_limit", step, timestamp)
        if reason == "nan":
            detail = {"loss": loss, "grad_norm": grad_norm}
        elif reason == "loss_spike":
            detail = {"loss": loss, "threshold": self.losses.threshold(self.policy.spike_sigma)}
        else:
            limit = self.policy.grad_explode_factor * self.grad_ema
            detail = ({"grad_norm": grad_norm, "threshold": limit} if grad_norm > limit
                      else self._layer_detail(layers))
        return self._escalate(step, timestamp, reason, detail)

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
