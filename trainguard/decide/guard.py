"""The gradient-health guard: one step's global loss and gradient norms in, one decision out.

It runs on the host after the trainer's single device-to-host sync of the step, before the optimizer
step, and in `trainguard replay` over recorded records. Pure: no torch, no I/O, no clock (time comes
from the step's timestamp), so both paths make identical decisions.

Checks, in order:
- a non-finite loss or gradient norm: ``skip_step`` (reason ``nan``);
- a loss spike: above mean + ``spike_sigma`` standard deviations of the last ``spike_window`` good
  losses, once ``spike_min_steps`` have been seen (as OLMo-core's stability monitor);
- a gradient explosion: the global norm, or any layer's, above a factor of its own EMA (the detail
  names the global norm, else the layer furthest over its threshold);
then escalation: ``rollback_after`` bad steps within ``rollback_window`` steps ask for a ``rollback``,
and more than ``max_rollbacks_per_hour`` rollbacks ask to ``stop`` rather than loop.

Bad steps never enter the statistics, so one spike does not raise the bar for the next.

Replay decides its blocks of recorded steps as arrays (`Guard.check_columns`): healthy stretches are
proven healthy with numpy and taken in bulk, to the bit what the step-by-step loop would leave.
"""

from __future__ import annotations

import math
from collections import deque
from itertools import repeat
from math import isfinite
from operator import itemgetter
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from trainguard.actions import ROLLBACK, SKIP_STEP
from trainguard.decide import screen
from trainguard.decide.decision import CARRY_ON, Decision
from trainguard.decide.screen import MIN_SCREENED, decide_screened
from trainguard.policy import GuardPolicy

STOP = "stop"
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


def worst_layer(layers: Mapping[str, float], emas: Mapping[str, float], factor: float) -> dict | None:
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


class _Columns:
    """A block of steps as arrays (see `Guard.check_columns`); its gradient norms as rows of one array, the
    global one first, then each layer's, so the explosion screen is a few operations for all of them."""

    def __init__(self, steps, losses, grad_norms, timestamps, layer_names, layer_norms):
        self.steps = np.ascontiguousarray(steps, dtype=np.int64)
        self.losses, self.timestamps = (
            np.ascontiguousarray(column, dtype=np.float64) for column in (losses, timestamps))
        self.names = tuple(layer_names or ())
        self.norms = np.asarray(layer_norms, dtype=np.float64) if self.names else np.empty((len(self.steps), 0))
        self.norm_rows = np.empty((1 + len(self.names), len(self.steps)))
        self.norm_rows[0], self.norm_rows[1:] = grad_norms, self.norms.T
        self.grad_norms = self.norm_rows[0]

    def __len__(self) -> int:
        return len(self.steps)

    def rows(self, start: int, end: int) -> list[dict[str, float]] | None:
        """Steps [start, end)'s layer norms as `check_many` takes them."""
        if not self.names:
            return None
        names = self.names
        return [dict(zip(names, row)) for row in self.norms[start:end].tolist()]


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

    def check_columns(self, steps, losses, grad_norms, timestamps, layer_names: Sequence[str] | None = None,
                      layer_norms=None) -> list[tuple[int, Decision]]:
        """`check_many` over a block of steps given as columns: int64 `steps`, float64 `losses`,
        `grad_norms` and `timestamps`, and for `layer_names` a float64 `layer_norms` of shape
        (steps, layers), NaN where a step has no norm for a layer. The same decisions and the same state
        as ``check_many(steps, losses, grad_norms, timestamps, [{name: norm, ...}, ...])``.

        Replay hands over ~25,000 steps at a time, nearly all healthy. A screen (`_advance_columns`)
        proves with array arithmetic that a stretch of them is healthy, and the state then takes the whole
        stretch at once; the first step it cannot clear, and a few after it, go through `_check_steps`.
        Why the bulk state is the step-by-step state, to the bit:
        - the loss window's sums: step by step each healthy step adds ``-old`` (once the window is full)
          and ``loss`` to the running totals. ``np.cumsum`` adds left to right, one element at a time, so
          over those terms interleaved (-0.0 where nothing leaves: it adds nothing, to any double) it
          gives every total the loop had, and the spike test on them is the same IEEE operations in the
          same order, elementwise: it is exact, not a bound;
        - the EMAs are a plain loop over the stretch's norms (an EMA has no exact array form);
        - an explosion is screened with a floor under each EMA instead: an EMA moves to a weighted mean of
          itself and a norm, and for 0 < keep < 1 the rounded update never falls below the smaller of the
          two, so before step i the EMA is at least the least of its value at the start and the finite
          norms of the earlier steps (a running minimum; first tried as one floor for the whole stretch).
          A norm at or under the factor times that floor (less 1e-9 for rounding) cannot explode.
        Every step before the first one screened out is therefore healthy, which is all the bulk update
        assumes; what the screen finds is decided step by step, from the state the loop would have had.
        A policy the argument does not cover (`_screenable`) is decided step by step throughout."""
        block = _Columns(steps, losses, grad_norms, timestamps, layer_names, layer_norms)
        if not self._screenable(block):
            return self._check_columns_exactly(block, 0, len(block))
        return decide_screened(len(block), lambda start, end: self._advance_columns(block, start, end),
                               lambda start, end: self._check_columns_exactly(block, start, end))

    def _screenable(self, block: _Columns) -> bool:
        """Whether the screens' arithmetic holds for this policy and these layers (else: step by step)."""
        policy, keep = self.policy, 1 - self.policy.grad_ema_beta
        return (0 < keep <= 1 - 2 ** -50 and policy.spike_window >= 1 and policy.spike_min_steps >= 1
                and policy.grad_explode_factor >= 0 and policy.layer_explode_factor >= 0
                and len(set(block.names)) == len(block.names))

    def _check_columns_exactly(self, block: _Columns, start: int, end: int) -> list[tuple[int, Decision]]:
        """`check_many` over steps [start, end) of the block, as Python numbers (the decisions carry them):
        on the global numbers, the layers' EMAs learning a column at a time, when no layer can explode in
        the stretch (`_layer_rows`; a stopped guard reads no layers); else with every step's layers."""
        steps, losses, grad_norms, timestamps = (column[start:end].tolist() for column in (
            block.steps, block.losses, block.grad_norms, block.timestamps))
        if not block.names or self.stopped:
            found = self._check_steps(steps, losses, grad_norms, timestamps, None)
        elif (columns := self._layer_rows(block, start, end)) is not None:
            found = self._check_steps(steps, losses, grad_norms, timestamps, None)
            self._learn_layer_columns(columns, {i for i, _ in found})
        else:
            found = self._check_steps(steps, losses, grad_norms, timestamps, block.rows(start, end))
        return [(start + i, decision) for i, decision in found]

    def _layer_rows(self, block: _Columns, start: int, end: int) -> list[tuple[str, list]] | None:
        """`_layer_columns` on the block's rows: each layer's norms over [start, end), when none can explode
        there whichever steps are healthy (all of them have EMAs, and stay under the factor times the least
        of the EMA and the norms); else None. A NaN norm fails it."""
        if not all(name in self.layer_ema for name in block.names):
            return None
        norms = block.norm_rows[1:, start:end]
        emas = np.array([self.layer_ema[name] for name in block.names])
        if not screen.none_can_explode(norms, emas, self.policy.layer_explode_factor):
            return None
        return list(zip(block.names, norms.tolist()))

    def _advance_columns(self, block: _Columns, start: int, end: int) -> int:
        """Screens steps [start, end), takes the ones before the first it cannot prove healthy into the state,
        and returns where they end."""
        if self.stopped:
            return start
        losses, grad_norms = block.losses[start:end], block.grad_norms[start:end]
        values, policy = self.losses.values, self.policy
        totals, squares = screen.window_sums(losses, values, self.losses.total, self.losses.total_sq)
        held = np.minimum(np.arange(len(values), len(values) + len(losses)), values.maxlen)  # the window, at each
        doubtful = ~(np.isfinite(losses) & np.isfinite(grad_norms))
        doubtful |= (held >= policy.spike_min_steps) & screen.spikes(
            losses, held, totals[:-1:2], squares[:-1:2], policy.spike_sigma)
        doubtful |= self._explosions(block, start, end)
        healthy = int(doubtful.argmax()) if doubtful.any() else len(losses)
        if healthy:
            self._learn_healthy(block, start, healthy, totals, squares)
        return start + healthy

    def _explosions(self, block: _Columns, start: int, end: int):
        """Where a step of [start, end) might explode (the global norm or a layer's), were the steps before
        it healthy; or False where none can. First one floor for the whole stretch (two reductions a row);
        where that does not clear it, a floor for each step (`screen.ema_floors`)."""
        policy, norms = self.policy, block.norm_rows[:, start:end]
        emas = np.array([self.grad_ema, *map(self.layer_ema.get, block.names)], dtype=np.float64)  # None: NaN
        factors = np.array([policy.grad_explode_factor] + [policy.layer_explode_factor] * len(block.names))
        if screen.none_can_explode(norms, emas, factors):
            return False
        armed = np.arange(self.good_grad_steps, self.good_grad_steps + end - start) >= policy.grad_min_steps
        floors = screen.ema_floors(emas, norms)
        # A norm with no EMA yet (a layer's first): step by step, so the EMAs are made in the loop's order.
        unsure = ~np.isnan(norms) & ((armed & ~screen.under(norms, floors, factors[:, None])) | np.isnan(floors))
        return unsure.any(axis=0)

    def _learn_healthy(self, block: _Columns, start: int, count: int, totals, squares) -> None:
        """The state after `count` healthy steps from `start`: what `_check_steps` leaves after them."""
        window, keep = self.losses, 1 - self.policy.grad_ema_beta
        window.values.extend(block.losses[max(start, start + count - window.values.maxlen):start + count].tolist())
        window.total, window.total_sq = float(totals[2 * count]), float(squares[2 * count])
        self.grad_ema = screen.ema(self.grad_ema, block.grad_norms[start:start + count], keep)
        layers = block.norm_rows[1:, start:start + count]
        for name, norms, clean in zip(block.names, layers, np.isfinite(layers).all(axis=1).tolist()):
            if not clean:
                norms = np.ascontiguousarray(norms[np.isfinite(norms)])   # a missing (NaN) norm teaches nothing
            if len(norms):                  # a layer with a norm here has an EMA already (see the screen)
                self.layer_ema[name] = screen.ema(self.layer_ema[name], norms, keep)
        self.good_grad_steps += count
        self.observed += count

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
        """The layer furthest above its factor of its own EMA (ties: the first name in sorted order), if
        any: the one to look at first, and the same whatever order the record lists its layers in."""
        return worst_layer(layers, self.layer_ema, self.policy.layer_explode_factor)

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
