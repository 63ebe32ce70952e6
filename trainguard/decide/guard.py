"""The gradient-health guard: one step's global loss and gradient norms in, one decision out.

It runs on the host after the trainer's single device-to-host sync of the step, before the optimizer
step, and in `trainguard replay` over recorded records. Pure: no torch, no I/O, no clock (time comes
from the step's timestamp), so both paths make identical decisions.

The guard is an ordered tuple of rules (`RULES`), each a small object with its own state:
``check(stats)`` says whether this step is bad (the decision's detail) or not (None), ``learn(stats)``
takes a healthy step into the rule's statistics. The first rule that finds a step bad names the reason;
only a step that no rule finds bad is learned, by every rule, so one spike does not raise the bar for
the next. Then the escalation: ``rollback_after`` bad steps within ``rollback_window`` steps ask for a
``rollback`` (a rule with ``rolls_back`` asks at once), and more than ``max_rollbacks_per_hour`` rollbacks
ask to ``stop`` rather than loop.

Healthy shapes that look bad step by step are the escalation's to tell apart (docs/trainer.md):
- a non-finite gradient norm beside a finite loss is the fp16/bf16 loss scaler's overflow: skipped, and
  counted toward a rollback only from the ``overflow_burst``-th in a row;
- a loss above its band, but within ``shift_loss_factor`` of its mean, while the gradient norm stays
  normal may be a level shift (a data-mix change, an annealing phase) or a hard batch: not counted, and
  after ``shift_steps`` such steps in a row the band starts again from the new level (`Guard.notices`
  says so, for the human);
- a loss above its band, but within ``hard_batch_loss_factor`` of its mean, whose gradient norm is logged
  and normal is not skipped: the step's update is an ordinary one, so skipping it protects nothing (a
  healthy run's hard data: a tiny model reading text files in order meets a file that doubles its loss
  for a dozen steps, the norm unmoved). It is not learned nor counted. Without a norm (a loss-only log)
  the loss alone decides: such a step is skipped, as a possible level shift or a spike;
- a rollback that could not be carried out is taken back (`Guard.rollback_not_done`), so it never counts
  toward the limit that stops the run.

Replay decides blocks of recorded steps with each rule's own array screen (`screen`, beside `check` and
`learn`: see `Screened`), driven by `trainguard.decide.batch`; a rule without one is decided there by
`Guard.observe` itself, so it is correct the moment it exists.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, NamedTuple, Protocol

from trainguard import event_types
from trainguard.actions import ROLLBACK, SKIP_STEP, STOP
from trainguard.config import WINDOW, above, at_least, between, key
from trainguard.decide.decision import CARRY_ON, Decision
from trainguard.decide.replica import ReplicaCheckConfig

if TYPE_CHECKING:       # a block's columns, as replay hands them to the screens (batch.py imports this module)
    from trainguard.decide.batch import Rows

HOUR = 3600.0
Detail = dict[str, Any]
Array = Any                     # a numpy array (the screens': numpy is imported by replay only)
Learn = Callable[[int], None]   # takes the first `count` steps of a screened stretch into the rule


class StepStats(NamedTuple):
    """One step as the rules read it. `grad_norm` None: the log has a loss but no gradient norm for the
    step (DeepSpeed's `grad norm: 0.000` placeholder, MoE logs, a loss-scale search interval): the loss
    rules judge it, the gradient rules pass it and learn nothing from it."""

    step: int
    loss: float
    grad_norm: float | None
    layer_grad_norms: Mapping[str, float] | None = None
    timestamp: float = 0.0


class Rule(Protocol):
    """One check of the guard. `state_dict` keys are the rule's own; the guard's state is their union."""

    reason: str

    def check(self, stats: StepStats) -> Detail | None: ...

    def learn(self, stats: StepStats) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class Screened(Rule, Protocol):
    """A rule replay can decide in blocks (trainguard/decide/batch.py): beside `check` and `learn`, its own
    screen, so the rule's state is written by the rule alone. Without these two a rule is decided there
    step by step through `Guard.observe`: correct the moment it exists, fast once it has a screen.

    ``screens(rows)``: whether the screen's argument holds for this rule's parameters and this block.
    ``screen(rows, start, end)``: where in steps [start, end) `check` might find a step bad, were the steps
    before it healthy (a bool array, or False for nowhere; it may flag more than `check` would, never
    fewer), and how the rule then learns a healthy prefix of the stretch, leaving the very state `learn`
    would have, to the bit (trainguard/decide/arrays.py holds the elementwise arithmetic)."""

    def screens(self, rows: Rows) -> bool: ...

    def screen(self, rows: Rows, start: int, end: int) -> tuple[Array, Learn]: ...


def _learns_nothing(count: int) -> None:
    pass


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
        """value > threshold(sigma), without the square root (arrays.spikes is this, elementwise). The spread
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

    def take(self, values: list[float], total: float, total_sq: float) -> None:
        """These values pushed in bulk, with the running sums their pushes make (a screen computes them in
        the loop's order: `arrays.window_sums`)."""
        self.values.extend(values)
        self.total, self.total_sq = total, total_sq

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
    """A NaN or infinite loss or global gradient norm: always bad, from the first step (a missing norm
    is not a non-finite one: a NaN loss without a norm is bad, a finite one is not)."""

    reason = "nan"

    def check(self, stats: StepStats) -> Detail | None:
        if math.isfinite(stats.loss) and (stats.grad_norm is None or math.isfinite(stats.grad_norm)):
            return None
        return {"loss": stats.loss, "grad_norm": stats.grad_norm}

    def learn(self, stats: StepStats) -> None:
        pass

    def screens(self, rows: Rows) -> bool:
        return True

    def screen(self, rows: Rows, start: int, end: int) -> tuple[Array, Learn]:
        import numpy as np      # replay's: the live guard judges one step at a time and starts without numpy

        finite = np.isfinite(rows.losses[start:end]) & np.isfinite(rows.grad_norms[start:end])
        return ~finite, _learns_nothing

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

    def value(self, stats: StepStats) -> float | None:
        raise NotImplementedError

    def check(self, stats: StepStats) -> Detail | None:
        window, value = self.window, self.value(stats)
        if value is None or len(window) < max(self.min_steps, 1) or len(self.recent) < self.sustain - 1:
            return None
        least = min([value, *itertools.islice(self.recent, len(self.recent) - self.sustain + 1, None)])
        if not window.exceeds(least, self.sigma, self.FLOOR_RATIO):
            return None
        return self.detail(value, window.threshold(self.sigma, self.FLOOR_RATIO))

    def detail(self, value: float, threshold: float) -> Detail:
        return {"value": value, "threshold": threshold}

    def learn(self, stats: StepStats) -> None:
        value = self.value(stats)
        if value is None:           # a step without the value (no gradient norm) teaches nothing
            return
        self.recent.append(value)
        if len(self.recent) > self.lag:
            self.window.push(self.recent.popleft())

    def screens(self, rows: Rows) -> bool:
        return (self.window.values.maxlen or 0) >= 1 and self.min_steps >= 1

    def screen(self, rows: Rows, start: int, end: int) -> tuple[Array, Learn]:
        """`check` over the stretch: the window's running sums as `learn` keeps them, each step's least of
        its last `sustain` values, the test elementwise (`arrays.spikes` is `RollingWindow.exceeds`)."""
        import numpy as np      # replay's: the live guard judges one step at a time and starts without numpy

        from trainguard.decide.arrays import spikes, trailing_min, window_sums

        values, window, lag, count = getattr(rows, self.column)[start:end], self.window, self.lag, end - start
        held, waiting = window.values, len(self.recent)
        # What enters the window, in order, were every step healthy: the values held back, then the block's;
        # before step i, `pushed[i]` of them have entered (none while `lag` or fewer are held back).
        entering = np.concatenate((np.fromiter(self.recent, np.float64, waiting), values))
        pushed = np.maximum(np.arange(waiting, waiting + count) - lag, 0)
        last = max(waiting + count - lag, 0)
        totals, squares = window_sums(entering[:last], held, window.total, window.total_sq)
        size = np.minimum(len(held) + pushed, held.maxlen or 0)
        least = trailing_min(entering, waiting, count, self.sustain)
        flagged = (size >= self.min_steps) & spikes(least, size, totals[2 * pushed], squares[2 * pushed], self.sigma,
                                                    self.FLOOR_RATIO)

        def learn(healthy: int) -> None:
            enter = int(max(waiting + healthy - lag, 0))
            if enter:
                window.take(entering[max(0, enter - (held.maxlen or 0)):enter].tolist(), float(totals[2 * enter]),
                            float(squares[2 * enter]))
            self.recent = deque(entering[enter:waiting + healthy].tolist())

        return flagged, learn

    def state_dict(self) -> dict[str, Any]:
        values, sums = self.window.state()
        state: dict[str, Any] = {self.keys[0]: values, self.keys[1]: sums}
        if self.lag:
            state[self.keys[0] + "_recent"] = list(self.recent)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.window.load(state.get(self.keys[0], []), state.get(self.keys[1]))
        self.recent = deque(state.get(self.keys[0] + "_recent", []))


@dataclass(frozen=True)
class LossSpikeConfig:
    """`LossSpike`, as OLMo-core's stability monitor: above mean + sigma * std of the last `window` losses,
    once `min_steps` have been seen. The `LossSpike` alert uses the same sigma over its robust spread."""

    spike_sigma: float = key(6.0, above(0), "a loss above mean + this many standard deviations of the band is a "
                             "spike (the LossSpike alert's sigma too)", alias="alerts.loss_spike_sigma")
    spike_window: int = key(128, at_least(2, 10**6), "healthy losses the spike band holds")
    spike_min_steps: int = key(64, at_least(2, 10**6), "losses the band needs before it judges (the warm-up rule "
                               "watches until then)")

    def cross_check(self, where: str) -> str | None:
        if self.spike_min_steps > self.spike_window:
            return (f"{where}.spike_min_steps: {self.spike_min_steps} is more than {where}.spike_window "
                    f"({self.spike_window}) holds")
        return None


class LossSpike(WindowRule):
    """A loss above the band of the recent healthy losses (as OLMo-core's stability monitor)."""

    reason, column, keys = "loss_spike", "losses", ("losses", "loss_sums")

    def value(self, stats: StepStats) -> float:
        return stats.loss

    def detail(self, value: float, threshold: float) -> Detail:
        return {"loss": value, "threshold": threshold}

    def accept_level(self, losses: Iterable[float]) -> None:
        """The loss has moved to a new level for good (a data-mix change): the band starts again from these
        losses, and is silent until it holds `min_steps` again (the warm-up rule watches meanwhile)."""
        self.window.load(losses, None)
        self.recent.clear()


@dataclass(frozen=True)
class GradExplosionConfig:
    """`GradExplosion`: the global (and per-layer) norm above `factor` times its EMA."""

    grad_ema_beta: float = key(0.98, between(0, 1, high_open=True), "weight of the old EMA at each healthy step")
    grad_explode_factor: float = key(10.0, above(1), "a global gradient norm above this many times its EMA explodes "
                                     "(the GradNormExplosion alert's factor too, over its median)",
                                     alias="alerts.grad_explode_factor")
    layer_explode_factor: float = key(25.0, above(1), "a layer's gradient norm above this many times its own EMA "
                                      "explodes")
    grad_min_steps: int = key(20, WINDOW, "healthy norms the EMA needs before it judges")


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
        if stats.grad_norm is not None and stats.grad_norm > limit:
            return {"grad_norm": stats.grad_norm, "threshold": limit}
        return worst_layer(stats.layer_grad_norms, self.layer_ema, self.layer_factor) \
            if stats.layer_grad_norms else None

    def learn(self, stats: StepStats) -> None:
        if stats.grad_norm is not None:     # `good` counts the norms the EMA holds
            self.ema = ema_step(self.ema, stats.grad_norm, self.keep)
            self.good += 1
        for name, norm in (stats.layer_grad_norms or {}).items():
            if math.isfinite(norm):
                self.layer_ema[name] = ema_step(self.layer_ema.get(name), norm, self.keep)

    def screens(self, rows: Rows) -> bool:
        return (0 < self.keep <= 1 - 2 ** -50 and self.factor >= 0 and self.layer_factor >= 0
                and len(set(rows.names)) == len(rows.names))

    def screen(self, rows: Rows, start: int, end: int) -> tuple[Array, Learn]:
        """Where a step might explode (the global norm or a layer's), were the steps before it healthy; or
        False where none can. First one floor for the whole stretch (two reductions a row); where that does
        not clear it, a floor for each step (`arrays.ema_floors`: trainguard/decide/batch.py says why a floor
        under each EMA is exact)."""
        import numpy as np      # replay's: the live guard judges one step at a time and starts without numpy

        from trainguard.decide.arrays import ema_floors, none_can_explode, under

        learn: Learn = functools.partial(self._learn_block, rows, start)
        norms = rows.norm_rows[:, start:end]
        emas = np.array([self.ema, *map(self.layer_ema.get, rows.names)], dtype=np.float64)  # None: NaN
        factors = np.array([self.factor] + [self.layer_factor] * len(rows.names))
        if none_can_explode(norms, emas, factors):
            return False, learn
        armed = np.arange(self.good, self.good + end - start) >= self.min_steps
        floors = ema_floors(emas, norms)
        # A norm with no EMA yet (a layer's first): step by step, so the EMAs are made in the loop's order.
        unsure = ~np.isnan(norms) & ((armed & ~under(norms, floors, factors[:, None])) | np.isnan(floors))
        return unsure.any(axis=0), learn

    def _learn_block(self, rows: Rows, start: int, count: int) -> None:
        """`learn` over the first `count` steps from `start`: each EMA in a tight loop (`arrays.ema`)."""
        import numpy as np

        from trainguard.decide.arrays import ema

        self.ema = ema(self.ema, rows.grad_norms[start:start + count], self.keep)
        layers = rows.norm_rows[1:, start:start + count]
        finite_rows: Array = np.isfinite(layers).all(axis=1)
        for name, norms, clean in zip(rows.names, layers, finite_rows.tolist()):
            if not clean:
                norms = np.ascontiguousarray(norms[np.isfinite(norms)])   # a missing (NaN) norm teaches nothing
            learned = ema(self.layer_ema.get(name), norms, self.keep)
            if learned is not None:         # a layer with a norm here has an EMA already (see the screen)
                self.layer_ema[name] = learned
        self.good += count

    def state_dict(self) -> dict[str, Any]:
        return {"grad_ema": self.ema, "good_grad_steps": self.good, "layer_ema": dict(self.layer_ema)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.ema = state.get("grad_ema")
        self.good = int(state.get("good_grad_steps", 0))
        self.layer_ema = dict(state.get("layer_ema", {}))


@dataclass(frozen=True)
class GradClimbConfig:
    """`GradClimb`: the global norm above mean + sigma * std of the last `window` healthy norms (once
    `min_steps` are seen) for `steps` steps in a row, against norms at least `lag` steps old."""

    grad_climb_sigma: float = key(6.0, above(0), "standard deviations above the norms' band that count as climbing")
    grad_climb_window: int = key(128, at_least(2, 10**6), "healthy gradient norms the band holds")
    grad_climb_min_steps: int = key(64, at_least(2, 10**6), "norms the band needs before it judges")
    grad_climb_steps: int = key(6, at_least(1, 10**4), "steps in a row above the band that make a climb")
    grad_climb_lag: int = key(32, at_least(0, 10**6), "steps a healthy norm waits before it joins the band")


class GradClimb(WindowRule):
    """The global gradient norm above mean + `sigma` standard deviations of the recent healthy norms for
    `sustain` steps in a row, against norms at least `lag` steps old: a norm that climbs smoothly (0.8 to
    12.7 in 30 steps) drags its EMA along and never reaches `GradExplosion`'s factor, but it leaves the
    band of the norms before the climb. One healthy spike, or a burst of a few steps, does not count."""

    reason, column, keys = "grad_climb", "grad_norms", ("grad_norms", "grad_norm_sums")
    FLOOR_RATIO = 0.1       # noisy norms: the band is at least sigma tenths of the mean wide

    def value(self, stats: StepStats) -> float | None:
        return stats.grad_norm

    def detail(self, value: float, threshold: float) -> Detail:
        return {"grad_norm": value, "threshold": threshold, "steps": self.sustain}


@dataclass(frozen=True)
class WarmupSpikeConfig:
    """`WarmupSpike`: before the spike band has `spike_min_steps` losses (one real run jumps x3.6 at
    iteration 3)."""

    warmup_spike_factor: float = key(1.8, above(1), "before the band is armed, a loss above this many times the "
                                     "highest healthy loss so far is a spike")


class WarmupSpike:
    """Before the spike band is armed (`until` healthy losses): a loss above `factor` times the highest
    healthy loss so far. Early losses fall from about ln(vocabulary) and a healthy warm-up wobbles up by
    at most ~1.4x (a real torchtitan launch: 10.86 to 15.20); the real spikes seen with only a few steps
    before them are x2.2 and more (12.4 to 44.2 at iteration 3, 3.68 to 7.27 in a 104B excerpt). Says
    what it can from one healthy step on; it also watches a log that starts mid-run, or a restart."""

    reason = "warmup_spike"

    def __init__(self, factor: float, until: int):
        self.factor, self.until = factor, until
        self.seen = 0
        self.peak = -math.inf

    def check(self, stats: StepStats) -> Detail | None:
        if self.seen < 1 or self.seen >= self.until:
            return None
        if stats.loss > self.factor * self.peak and self.peak > 0:
            return {"loss": stats.loss, "threshold": self.factor * self.peak, "healthy_steps": self.seen}
        return None

    def learn(self, stats: StepStats) -> None:
        if self.seen < self.until:
            self.seen += 1
            self.peak = max(self.peak, stats.loss)

    def screens(self, rows: Rows) -> bool:
        return True

    def screen(self, rows: Rows, start: int, end: int) -> tuple[Array, Learn]:
        """`check` over the stretch: the count of healthy losses and their running maximum (exact), the test
        elementwise. Asleep once the count reaches `until`: nothing to screen, only the count."""
        import numpy as np      # replay's: the live guard judges one step at a time and starts without numpy

        awake = max(0, min(end - start, self.until - self.seen))     # steps the rule still learns
        losses = rows.losses[start:start + awake]

        def learn(count: int) -> None:
            taken = min(count, awake)
            if taken:
                self.seen += taken
                self.peak = max(self.peak, float(losses[:taken].max()))

        if not awake:
            return False, learn
        flagged = np.zeros(end - start, dtype=bool)
        with np.errstate(all="ignore"):
            peaks = np.maximum.accumulate(np.concatenate(([self.peak], losses)))[:-1]
            seen = np.arange(self.seen, self.seen + awake)
            flagged[:awake] = (seen >= 1) & (losses > self.factor * peaks) & (peaks > 0)
        return flagged, learn

    def restart(self, losses: Iterable[float]) -> None:
        """Watch again from these losses (the spike band starts again from a new level)."""
        self.seen, self.peak = 0, -math.inf
        for loss in losses:
            self.learn(StepStats(0, loss, 0.0))

    def state_dict(self) -> dict[str, Any]:
        return {"warmup_seen": self.seen, "warmup_peak": self.peak}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # A checkpoint from before this rule was written after its warm-up: the rule stays asleep.
        self.seen = int(state.get("warmup_seen", self.until))
        self.peak = float(state.get("warmup_peak", -math.inf))


@dataclass(frozen=True)
class LossDriftConfig:
    """`LossDrift`: a slow divergence, judged on the means of chunks of healthy steps."""

    drift_chunk: int = key(32, at_least(1, 10**6), "healthy steps whose mean loss and gradient norm make one chunk")
    drift_chunks: int = key(16, at_least(2, 10**6), "chunk means held: the floor is the least mean of two "
                            "consecutive ones among them")
    drift_min_chunks: int = key(4, at_least(2, 10**6), "chunk means needed before the rule judges")
    drift_loss_ratio: float = key(0.04, above(0), "a chunk's mean loss this far (relative) above the floor ...")
    drift_grad_ratio: float = key(0.10, above(0), "... while its mean gradient norm is this far above its own floor ...")
    drift_steadiness: float = key(2.5, above(0), "... the loss's rise more than this many times the largest move "
                                  "between two chunk means ...")
    drift_grad_steadiness: float = key(2.0, above(0), "... and the gradient norm's rise more than this many times the "
                                       "largest move of its own: two chunks in a row so make a drift, a rollback "
                                       "at once")

    def cross_check(self, where: str) -> str | None:
        if self.drift_min_chunks > self.drift_chunks:
            return (f"{where}.drift_min_chunks: {self.drift_min_chunks} is more than {where}.drift_chunks "
                    f"({self.drift_chunks}) holds")
        return None


def pair_floor(means: Iterable[float]) -> float:
    """The least mean of two consecutive chunk means (arrays.pair_floors is this, over a block): one chunk
    lower than its neighbours by chance does not set the floor."""
    return min((before + after) / 2 for before, after in itertools.pairwise(means))


def largest_move(means: Iterable[float], last: float) -> float:
    """The largest move from one chunk mean to the next over `means`, then `last` (arrays.largest_moves)."""
    held = list(means)
    largest = abs(last - held[-1])
    for before, after in itertools.pairwise(held):
        largest = max(largest, abs(after - before))
    return largest


class LossDrift:
    """A slow divergence: the loss climbing by tens of percent over hundreds of steps and the gradient norm
    climbing with it, no single step outside any band. Healthy steps are taken in chunks of `chunk`; a chunk
    climbs when, against the last `chunks` chunk means (once `min_chunks` are held):
    - its mean loss is more than `loss_ratio` above the floor, and its mean gradient norm more than
      `grad_ratio` above the gradient's floor; a floor is the least mean of two consecutive chunk means,
      so one chunk that is low by chance (a noisy run's least of 16 is far below its level) does not set it;
    - the loss's rise is more than `steadiness` times the largest move from one chunk mean to the next in
      that span, and the gradient norm's rise more than `grad_steadiness` times its own: a climb made of
      small steps by both, where the run's own wander, one sudden step, or a loss that climbs while the
      gradient norm only wanders (a run of harder data) is not.
    Two chunks in a row that climb are a drift: one chunk can climb by chance where the data wanders
    (a tiny model on text files read in order: its chunk means move by 10-20% and back), two seldom do, and
    judging the second chunk also makes the verdict depend less on where the chunks start. At the defaults
    it acts while the loss's trend is 8-25% above its floor (median 13%; before 20% in 36 of 39 of the
    efficacy corpus's slow divergences: docs/benchmarks.md, "LossDrift and hard batches on healthy
    runs"). A level shift (data mix) has normal gradients and is left to the
    escalation; a healthy run's loss falls, so its floor is its latest. It asks for a rollback at once
    (`rolls_back`) and starts again after one.

    A step without a gradient norm is neither judged nor learned here: without the gradient's witness a
    steady climb of the loss cannot be told from a healthy run's wander or a planned change, so on a
    loss-only log a slow divergence is left to the loss band (`LossSpike`) and the warm-up rule; the
    chunks are made of the steps that have both numbers."""

    reason = "loss_drift"
    rolls_back = True

    def __init__(self, chunk: int, chunks: int, min_chunks: int, loss_ratio: float, grad_ratio: float,
                 steadiness: float, grad_steadiness: float):
        self.chunk, self.min_chunks, self.loss_ratio, self.grad_ratio = chunk, min_chunks, loss_ratio, grad_ratio
        self.steadiness, self.grad_steadiness = steadiness, grad_steadiness
        self.loss_sum = self.grad_sum = 0.0
        self.count = 0
        self.loss_means: deque[float] = deque(maxlen=chunks)
        self.grad_means: deque[float] = deque(maxlen=chunks)
        self.climbing = False       # the last chunk completed climbed (a drift needs two in a row)

    def climbs(self, loss: float, grad: float) -> Detail | None:
        """Whether a chunk of these means climbs against the chunk means held (the detail of it), else None."""
        if len(self.loss_means) < max(self.min_chunks, 2):
            return None
        loss_floor, grad_floor = pair_floor(self.loss_means), pair_floor(self.grad_means)
        rise, grad_rise = loss - loss_floor, grad - grad_floor
        if not (rise > self.loss_ratio * abs(loss_floor) and grad_rise > self.grad_ratio * abs(grad_floor)):
            return None
        if not (rise > self.steadiness * largest_move(self.loss_means, loss)
                and grad_rise > self.grad_steadiness * largest_move(self.grad_means, grad)):
            return None
        return {"loss_mean": loss, "loss_floor": loss_floor, "grad_norm_mean": grad, "grad_norm_floor": grad_floor,
                "steps": 2 * self.chunk}

    def check(self, stats: StepStats) -> Detail | None:
        if stats.grad_norm is None or self.count != self.chunk - 1 or not self.climbing:
            return None
        return self.climbs((self.loss_sum + stats.loss) / self.chunk, (self.grad_sum + stats.grad_norm) / self.chunk)

    def learn(self, stats: StepStats) -> None:
        if stats.grad_norm is None:
            return
        self.loss_sum += stats.loss
        self.grad_sum += stats.grad_norm
        self.count += 1
        if self.count == self.chunk:
            loss, grad = self.loss_sum / self.chunk, self.grad_sum / self.chunk
            self.climbing = self.climbs(loss, grad) is not None
            self.loss_means.append(loss)
            self.grad_means.append(grad)
            self.loss_sum = self.grad_sum = 0.0
            self.count = 0

    def screens(self, rows: Rows) -> bool:
        return self.chunk >= 1 and (self.loss_means.maxlen or 0) >= 2 and 0 <= self.count < self.chunk

    def screen(self, rows: Rows, start: int, end: int) -> tuple[Array, Learn]:
        """`check` at every step that would complete a chunk: each chunk's sums as `learn` adds them
        (`np.cumsum` along the chunk, from the sums held for the first), its means, the floors and the
        largest moves over the chunk means held before it (sliding windows), whether each chunk climbs,
        elementwise, and a drift where a chunk climbs after one that did."""
        import numpy as np      # replay's: the live guard judges one step at a time and starts without numpy

        from trainguard.decide.arrays import chunk_sums, largest_moves, pair_floors, running_sum

        chunk, count = self.chunk, end - start
        first = chunk - self.count                      # steps to the end of the chunk being filled
        ends = np.arange(first - 1, count, chunk)       # positions that complete a chunk
        columns = (rows.losses[start:end], rows.grad_norms[start:end])
        climbs = np.zeros(len(ends), dtype=bool)
        with np.errstate(all="ignore"):
            sums = [chunk_sums(column, held, first, len(ends), chunk)
                    for column, held in zip(columns, (self.loss_sum, self.grad_sum))]
            means = [total / chunk for total in sums]
            flagged = np.zeros(count, dtype=bool)
            if len(ends):
                held = len(self.loss_means)
                loss_floor, grad_floor = pair_floors(self.loss_means, means[0]), pair_floors(self.grad_means, means[1])
                size = np.minimum(np.arange(held, held + len(ends)), self.loss_means.maxlen or 0)
                rise, grad_rise = means[0] - loss_floor, means[1] - grad_floor
                climbs = ((size >= max(self.min_chunks, 2))
                          & (rise > self.loss_ratio * np.abs(loss_floor))
                          & (grad_rise > self.grad_ratio * np.abs(grad_floor))
                          & (rise > self.steadiness * largest_moves(self.loss_means, means[0]))
                          & (grad_rise > self.grad_steadiness * largest_moves(self.grad_means, means[1])))
                after = np.concatenate(([self.climbing], climbs[:-1]))   # the chunk before each climbed
                flagged[ends] = climbs & after

        def learn(healthy: int) -> None:
            done = int(np.searchsorted(ends, healthy))    # chunks completed within the healthy prefix
            self.loss_means.extend(means[0][:done].tolist())
            self.grad_means.extend(means[1][:done].tolist())
            begin = int(ends[done - 1]) + 1 if done else 0
            held_loss, held_grad = (self.loss_sum, self.grad_sum) if not done else (0.0, 0.0)
            self.count = (self.count if not done else 0) + healthy - begin
            self.loss_sum = running_sum(held_loss, columns[0][begin:healthy])
            self.grad_sum = running_sum(held_grad, columns[1][begin:healthy])
            if done:
                self.climbing = bool(climbs[done - 1])

        return flagged, learn

    def rolled_back(self) -> None:
        """The run went back to an earlier state: the floor is measured again from there."""
        self.loss_sum = self.grad_sum = 0.0
        self.count = 0
        self.loss_means.clear()
        self.grad_means.clear()
        self.climbing = False

    def state_dict(self) -> dict[str, Any]:
        return {"drift_sums": [self.loss_sum, self.grad_sum, self.count],
                "drift_loss_means": list(self.loss_means), "drift_grad_means": list(self.grad_means),
                "drift_climbing": self.climbing}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        loss_sum, grad_sum, count = state.get("drift_sums", [0.0, 0.0, 0])
        self.loss_sum, self.grad_sum, self.count = float(loss_sum), float(grad_sum), int(count)
        self.loss_means = deque(state.get("drift_loss_means", []), maxlen=self.loss_means.maxlen)
        self.grad_means = deque(state.get("drift_grad_means", []), maxlen=self.grad_means.maxlen)
        self.climbing = bool(state.get("drift_climbing", False))


@dataclass(frozen=True)
class EscalationConfig:
    """The guard's escalation (`Guard._escalate`): bad steps to a rollback, rollbacks to a stop, and the
    healthy shapes that are skipped without counting (see the module's docstring)."""

    rollback_after: int = key(3, WINDOW, "bad (skipped) steps within rollback_window that ask for a rollback")
    rollback_window: int = key(50, WINDOW, "steps over which bad steps are counted")
    max_rollbacks_per_hour: int = key(3, at_least(0, 10**6), "rollbacks an hour beyond which the run is stopped "
                                      "(the webhook's ledger holds the alerts' rollbacks to it too)")
    overflow_burst: int = key(8, at_least(1, 10**6), "loss-scaler overflows in a row (non-finite norm, finite loss) "
                              "before they count toward a rollback")
    shift_steps: int = key(8, at_least(1, 10**6), "losses above the band in a row, gradients normal, that make a "
                           "new level (the band starts again from it)")
    shift_grad_factor: float = key(2.0, above(1), "gradients are normal while the norm is under this many times "
                                   "its EMA")
    shift_loss_factor: float = key(2.0, above(1), "a new level is at most this many times the band's mean loss")
    hard_batch_loss_factor: float = key(3.0, above(1), "a loss above its band beside a logged, normal gradient norm "
                                        "is a hard batch (neither skipped nor counted) up to this many times the "
                                        "band's mean loss")

    def cross_check(self, where: str) -> str | None:
        if self.rollback_after > self.rollback_window:
            return (f"{where}.rollback_after: {self.rollback_after} bad steps can never fit in "
                    f"{where}.rollback_window ({self.rollback_window})")
        return None


@dataclass(frozen=True)
class RollbackResponseConfig:
    """What a rollback does to the learning rate in the trainer (protect/protector.py carries it out)."""

    rollback_lr_factor: float = key(0.5, between(0, 1, low_open=True), "the LR is multiplied by this at a rollback")
    rewarmup_steps: int = key(20, at_least(0, 10**7), "steps over which the lowered LR warms up again")


# The `guard` section of the policy file: every rule's keys, the escalation's and the replica check's.
# dataclasses collect fields from the last base first, so the file lists them from LossSpikeConfig down.
@dataclass(frozen=True)
class GuardPolicy(ReplicaCheckConfig, LossDriftConfig, WarmupSpikeConfig, RollbackResponseConfig, GradClimbConfig,
                  EscalationConfig, GradExplosionConfig, LossSpikeConfig):
    """The gradient-health guard's thresholds and its escalation (each rule's own config, assembled)."""


def rules(policy: GuardPolicy) -> tuple[Rule, ...]:
    """The guard's rules, in the order they are asked: the first that finds a step bad names it."""
    return (
        NonFinite(),
        LossSpike(policy.spike_sigma, policy.spike_window, policy.spike_min_steps),
        GradExplosion(policy.grad_ema_beta, policy.grad_explode_factor, policy.layer_explode_factor,
                      policy.grad_min_steps),
        WarmupSpike(policy.warmup_spike_factor, policy.spike_min_steps),
        GradClimb(policy.grad_climb_sigma, policy.grad_climb_window, policy.grad_climb_min_steps,
                  policy.grad_climb_steps, policy.grad_climb_lag),
        LossDrift(policy.drift_chunk, policy.drift_chunks, policy.drift_min_chunks, policy.drift_loss_ratio,
                  policy.drift_grad_ratio, policy.drift_steadiness, policy.drift_grad_steadiness),
    )


# ------------------------------------------------------------------------------------------- guard

class Run:
    """Bad steps of one kind in a row, by the guard's `observed` index (so a stretch of healthy steps taken
    in bulk, which only advances `observed`, ends a run as the loop would)."""

    __slots__ = ("last", "values")

    def __init__(self) -> None:
        self.last = -1
        self.values: list[float] = []

    def extend(self, observed: int, value: float) -> int:
        if observed != self.last + 1:
            self.values.clear()
        self.last = observed
        self.values.append(value)
        return len(self.values)

    def clear(self) -> None:
        self.last = -1
        self.values.clear()


class Guard:
    def __init__(self, policy: GuardPolicy | None = None):
        self.policy = policy or GuardPolicy()
        self.rules = rules(self.policy)
        self.observed = 0                       # steps seen, good or bad (step numbers can go back)
        self.bad: deque[int] = deque()          # `observed` index of each recent bad step
        self.rollbacks: deque[float] = deque()  # timestamps of recent rollbacks
        self.stopped = False
        self.overflows = Run()                  # non-finite gradient norms beside a finite loss, in a row
        self.shift = Run()                      # losses above the band with normal gradients, in a row
        self.recent_spikes: deque[float] = deque(maxlen=self.policy.shift_steps)   # losses of counted spikes
        self.last_step: int | None = None       # the step of the last step observed
        self.rewinding = False                  # a rollback was decided: the steps going back are its own
        # What the human should hear that is no action (a level shift accepted), for the caller to log.
        self.notices: list[Detail] = []

    def rule(self, reason: str) -> Rule:
        return next(rule for rule in self.rules if rule.reason == reason)

    def _rule_of(self, kind: type) -> Any:
        return next((rule for rule in self.rules if isinstance(rule, kind)), None)

    def observe(self, stats: StepStats) -> Decision:
        """The decision for one step. A stopped guard answers ``stop`` to every step."""
        self.observed += 1
        if self.stopped:
            return Decision(STOP, "rollback_limit", stats.step, stats.timestamp)
        if self.last_step is not None and stats.step <= self.last_step:
            self._went_back()
        self.last_step = stats.step
        for rule in self.rules:
            detail = rule.check(stats)
            if detail is not None:
                return self._escalate(stats, rule, detail)
        self._learn(stats)
        return CARRY_ON

    def _went_back(self) -> None:
        """The step went back. After a rollback the guard decided, that is the rollback (its memory carries
        on, as the trainer keeps it). Otherwise the run was restarted from an earlier checkpoint and appended
        to the same log: the statistics of the steps since that checkpoint are not the resumed run's, so
        the rules start afresh (the warm-up rule watches while they fill); the rollback budget carries on."""
        if self.rewinding:
            self.rewinding = False
            return
        fresh = {type(rule): rule for rule in rules(self.policy)}
        for rule in self.rules:
            if type(rule) in fresh:
                rule.load_state_dict(fresh[type(rule)].state_dict())
        self.bad.clear()
        self.overflows.clear()
        self.shift.clear()
        self.recent_spikes.clear()

    def _learn(self, stats: StepStats) -> None:
        for rule in self.rules:
            rule.learn(stats)

    def learned_in_bulk(self, count: int, last_step: int) -> None:
        """`count` healthy steps, the last of them `last_step`, were taken into every rule by its screen
        (replay's blocks, trainguard/decide/batch.py): the guard's own count moves as `observe` would move it."""
        self.observed += count
        self.last_step = last_step

    def _escalate(self, stats: StepStats, rule: Rule, detail: Detail) -> Decision:
        """A bad step: skip it; too many in a window: roll back; too many rollbacks an hour: stop. Loss-scaler
        overflows are skipped without counting, level shifts are not counted (nor skipped beside a normal
        norm), hard batches are neither (see the module's docstring)."""
        policy, step, timestamp, reason = self.policy, stats.step, stats.timestamp, rule.reason
        # A loss above its band beside a gradient norm that is logged and normal: the update is an ordinary
        # one, so skipping it protects nothing (a hard batch, a new level): neither skipped nor learned.
        hard_batch = (isinstance(rule, LossSpike) and stats.grad_norm is not None and self._gradients_normal(stats)
                      and self._within_a_shift(stats, rule, policy.hard_batch_loss_factor))
        if isinstance(rule, NonFinite) and math.isfinite(stats.loss) and stats.grad_norm is not None:
            run = self.overflows.extend(self.observed, stats.grad_norm)
            if run < policy.overflow_burst:
                return Decision(SKIP_STEP, reason, step, timestamp, {**detail, "overflow": run})
        elif isinstance(rule, LossSpike) and self._gradients_normal(stats) and self._within_a_shift(
                stats, rule, policy.shift_loss_factor):
            if self.shift.extend(self.observed, stats.loss) < policy.shift_steps:
                return Decision(None if hard_batch else SKIP_STEP, reason, step, timestamp,
                                {**detail, "level_shift": len(self.shift.values)})
            return self._accept_shift(stats, rule)
        elif hard_batch:        # over a level shift's factor, under the hard batch's: not counted either
            return Decision(None, reason, step, timestamp, {**detail, "hard_batch": True})
        if isinstance(rule, (LossSpike, WarmupSpike)):
            self.recent_spikes.append(stats.loss)
        self.bad.append(self.observed)
        while self.bad and self.bad[0] <= self.observed - policy.rollback_window:
            self.bad.popleft()
        if len(self.bad) < policy.rollback_after and not getattr(rule, "rolls_back", False):
            return Decision(SKIP_STEP, reason, step, timestamp, detail)
        self.bad.clear()
        while self.rollbacks and self.rollbacks[0] <= timestamp - HOUR:
            self.rollbacks.popleft()
        if len(self.rollbacks) >= policy.max_rollbacks_per_hour:
            self.stopped = True
            return Decision(STOP, "rollback_limit", step, timestamp,
                            {"rollbacks_last_hour": len(self.rollbacks), "last_reason": reason})
        self.rollbacks.append(timestamp)
        self.rewinding = True
        for each in self.rules:
            if hasattr(each, "rolled_back"):
                each.rolled_back()
        if getattr(rule, "rolls_back", False):
            return Decision(ROLLBACK, reason, step, timestamp, detail)
        return Decision(ROLLBACK, f"repeated_{reason}", step, timestamp,
                        {**detail, "bad_steps": policy.rollback_after, "window": policy.rollback_window})

    def _gradients_normal(self, stats: StepStats) -> bool:
        """Whether the gradient norm is within `shift_grad_factor` of its EMA (known only once armed). A step
        without a norm has no gradient evidence against a shift: the loss alone decides (a jump beyond
        `shift_loss_factor` still counts; a new level is accepted after `shift_steps`, as with norms)."""
        if stats.grad_norm is None:
            return True
        explosion = self._rule_of(GradExplosion)
        if explosion is None or explosion.ema is None or explosion.good < explosion.min_steps:
            return False
        return (stats.grad_norm is not None and math.isfinite(stats.grad_norm)
                and stats.grad_norm <= self.policy.shift_grad_factor * explosion.ema)

    def _within_a_shift(self, stats: StepStats, spike: LossSpike, factor: float) -> bool:
        """Whether the loss is at most `factor` times the band's mean: a new data mix moves the loss by tens of
        percent (`shift_loss_factor`), a hard batch beside a normal gradient norm by up to about twice
        (`hard_batch_loss_factor`); a jump beyond is a spike whatever the gradients say."""
        window = spike.window
        return bool(len(window)) and abs(stats.loss) <= factor * abs(window.total / len(window))

    def _accept_shift(self, stats: StepStats, spike: LossSpike) -> Decision:
        """`shift_steps` losses above the band in a row, the gradients normal: the loss has a new level.
        The band starts again from these losses; this step is healthy; the human is told."""
        losses = list(self.shift.values)
        before = spike.window.total / len(spike.window) if len(spike.window) else math.nan
        self.shift.clear()
        spike.accept_level(losses[:-1])
        warmup = self._rule_of(WarmupSpike)
        if warmup is not None:
            warmup.restart(losses[:-1])
        self.notices.append({"type": event_types.LOSS_LEVEL_SHIFT, "step": stats.step, "timestamp": stats.timestamp,
                             "loss_before": before, "loss_after": sum(losses) / len(losses), "steps": len(losses)})
        self._learn(stats)
        return CARRY_ON

    def accept_loss_level(self, step: int, timestamp: float = 0.0) -> None:
        """The caller found the loss at a new level that a rollback reproduced at the same data position
        (the data, not an instability): the band starts again from the last counted spikes' losses."""
        losses = list(self.recent_spikes)
        spike, warmup = self._rule_of(LossSpike), self._rule_of(WarmupSpike)
        if spike is not None:
            spike.accept_level(losses)
        if warmup is not None:
            warmup.restart(losses)
        self.recent_spikes.clear()
        self.bad.clear()
        self.notices.append({"type": event_types.LOSS_LEVEL_SHIFT, "step": step, "timestamp": timestamp,
                             "loss_after": sum(losses) / len(losses) if losses else math.nan,
                             "steps": len(losses), "source": "rollback_retry"})

    def rollback_not_done(self, timestamp: float) -> None:
        """The rollback decided at `timestamp` could not be carried out (no stable checkpoint): it does not
        count toward `max_rollbacks_per_hour`, so impossible rollbacks never stop a run."""
        if timestamp in self.rollbacks:
            self.rollbacks.remove(timestamp)

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
