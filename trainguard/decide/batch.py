"""Deciding a block of steps fast: array screens beside the guard's rules and the cost meter's loop.

The rules are the product (guard.py, cost.py); this module only makes them fast over a block of recorded
steps, and never decides differently. One entry point each: `guard_block(guard, block)` and
`meter_block(meter, block)`, both returning (index, decision) for each step of the block that acts.

How: a screen proves with numpy that a stretch of steps holds no event, and the state then takes the
stretch in bulk; the first step a screen cannot clear, and a short stretch after it, go through the
rules' own step loop (`Guard.observe`, `CostMeter.take`). A guard rule has a screen here when its type is
in `GUARD_SCREENS`; a rule without one makes the whole block go step by step: correct the moment the rule
exists, fast once it gets a screen.

Why the bulk state is the step-by-step state, to the bit:
- running sums (a rolling window's, the meter's spend and metered times) are `np.cumsum` of the very
  terms the loop adds, in its order: cumsum adds left to right, one element at a time, so it gives every
  total the loop had (with -0.0 where the loop adds nothing: it changes no double), and a test on them is
  the same IEEE operations in the same order, elementwise: exact, not a bound;
- an EMA has no exact array form: it learns in a tight loop over the stretch (`ema`);
- an explosion is screened with a floor under each EMA instead: an EMA moves to a weighted mean of itself
  and a norm, and for 0 < keep < 1 the rounded update never falls below the smaller of the two, so before
  step i the EMA is at least the least of its value at the start and the finite norms before i (a running
  minimum). A norm at or under the factor times that floor (less 1e-9 for rounding) cannot explode.
Every step before the first one screened out is therefore healthy, which is all the bulk update assumes.
Pure: numpy only, no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from trainguard.decide.cost import CostMeter, cost_per_1k_steps, gpu_cost
from trainguard.decide.decision import Decision
from trainguard.decide.guard import GradExplosion, Guard, LossDrift, NonFinite, Rule, StepStats, WarmupSpike, WindowRule

MIN_SCREENED = 32     # steps decided one by one after a screen stops (doubled while events come thick)
SCREEN_LEAST = 4 * MIN_SCREENED    # steps a screen must cover to cost less than the loop over them
TINY = np.finfo(np.float64).tiny    # the smallest normal double: below it an EMA's floor is not trusted
Found = list[tuple[int, Decision]]
Array = Any                         # a numpy array (numpy's own types are not worth the noise here)


@dataclass
class Block:
    """Consecutive training steps as columns, in order (replay's columns.py builds these)."""

    steps: Array                    # int64
    losses: Array                   # float64
    grad_norms: Array
    timestamps: Array
    gpus: Array                     # int64; 0: no GPU count seen
    clock_codes: Array              # int64 index into clock_nodes; -1: no monotonic clock
    clock_seconds: Array            # float64 system.monotonic_seconds (NaN without one)
    clock_nodes: Sequence[Any]
    layer_names: tuple[str, ...] | None = None    # every step carries these layer groups, in this order ...
    layer_norms: Array | None = None              # ... with these norms, shape (steps, layers), NaN for null
    layers: list[Any] | None = None               # else each step's own dict (or None)
    no_grad_norm: Array | None = None             # bool: the step has a loss but no gradient norm (its
                                                  # grad_norms entry is NaN); None: every step has one

    def __len__(self) -> int:
        return len(self.steps)


def decide_screened(count: int, advance: Callable[[int, int], int], exactly: Callable[[int, int], Found]) -> Found:
    """Decide `count` steps with a screen: ``advance(start, end)`` takes the steps of [start, end) it can
    prove uneventful into the state in bulk and returns where they end; ``exactly(start, end)`` decides
    steps one by one.

    A screen has a fixed cost (tens of array operations) that the loop matches over ~`SCREEN_LEAST` steps,
    so stretches shorter than that are not screened. After a screen stops at a step, a stretch from it
    goes step by step: MIN_SCREENED steps, doubled each time the screen before cleared fewer than
    `SCREEN_LEAST` (events come thick: the loop is the cheaper way through them). The next screen is
    about twice as long as the last healthy stretch was; a clean one doubles it."""
    found: Found = []
    start, span, run = 0, count, 0         # run: the last stretch decided step by step, since a clean screen
    while start < count:
        end = min(count, start + span)
        if end - start < SCREEN_LEAST:
            found += exactly(start, end)
            start = end
            continue
        healthy = advance(start, end)
        if healthy == end:
            start, span, run = end, 2 * span, 0
            continue
        run = max(MIN_SCREENED, 2 * run) if healthy - start < SCREEN_LEAST else MIN_SCREENED
        stop = min(count, healthy + run)
        found += exactly(healthy, stop)
        start, span = stop, max(SCREEN_LEAST, 2 * (healthy - start))
    return found


# ============================================================================================ guard

class Rows:
    """A block's guard columns: the gradient norms as rows of one array, the global one first, then each
    layer's, so the explosion screen is a few operations for all of them."""

    def __init__(self, block: Block):
        n = len(block)
        self.steps = np.ascontiguousarray(block.steps, dtype=np.int64)
        self.losses = np.ascontiguousarray(block.losses, dtype=np.float64)
        self.timestamps = np.ascontiguousarray(block.timestamps, dtype=np.float64)
        self.names: tuple[str, ...] = tuple(block.layer_names or ())
        self.norm_rows = np.empty((1 + len(self.names), n))
        self.norm_rows[0] = block.grad_norms
        if self.names:
            self.norm_rows[1:] = np.asarray(block.layer_norms, dtype=np.float64).T
        self.grad_norms = self.norm_rows[0]
        self.layers = block.layers
        self.no_grad_norm = block.no_grad_norm

    def stats(self, start: int, end: int) -> list[StepStats]:
        """Steps [start, end) as the guard's rules read them (Python numbers: the decisions carry them)."""
        steps, losses, grads, times = (column[start:end].tolist() for column in (
            self.steps, self.losses, self.grad_norms, self.timestamps))
        if self.no_grad_norm is not None:       # a missing norm is None to the rules, not a NaN one
            grads = [None if absent else norm for norm, absent in zip(grads, self.no_grad_norm[start:end].tolist())]
        if self.layers is not None:
            layers: Any = self.layers[start:end]
        elif self.names:
            layers = [dict(zip(self.names, row)) for row in self.norm_rows[1:, start:end].T.tolist()]
        else:
            layers = repeat(None)
        return [StepStats(*fields) for fields in zip(steps, losses, grads, layers, times)]


Learn = Callable[[int], None]        # takes the first `count` steps of the screened stretch into the rule


class Screen(Protocol):
    def covers(self, rule: Any, rows: Rows) -> bool:
        """Whether the screen's argument holds for this rule's parameters and these columns."""

    def __call__(self, rule: Any, rows: Rows, start: int, end: int) -> tuple[Array, Learn]:
        """Where in [start, end) the rule might find a step bad, were the steps before it healthy (a bool
        array, or False for nowhere); and how the rule learns a healthy prefix of the stretch."""


def guard_block(guard: Guard, block: Block) -> Found:
    """`Guard.observe` over every step of the block, in order: the same decisions, the same state."""
    rows = Rows(block)
    screens = [screen_of(rule) for rule in guard.rules]
    # The screens read a NaN norm as non-finite; a block with loss-only steps (few, short real logs) goes
    # step by step, where the rules see the missing norm as None.
    if block.layers is not None or (block.no_grad_norm is not None and block.no_grad_norm.any()) or not all(
            screen is not None and screen.covers(rule, rows) for screen, rule in zip(screens, guard.rules)):
        return observe(guard, rows, 0, len(block))       # a rule without a screen: step by step, correct
    fitted = list(zip(guard.rules, screens))
    return decide_screened(len(block), lambda start, end: _advance(guard, fitted, rows, start, end),
                           lambda start, end: observe(guard, rows, start, end))


def screen_of(rule: Rule) -> Screen | None:
    """The screen for a rule: its class's, or the nearest base class's that has one."""
    return next((GUARD_SCREENS[kind] for kind in type(rule).__mro__ if kind in GUARD_SCREENS), None)


def observe(guard: Guard, rows: Rows, start: int, end: int) -> Found:
    """The rules' own step loop over steps [start, end)."""
    found: Found = []
    for i, stats in enumerate(rows.stats(start, end), start):
        decision = guard.observe(stats)
        if decision:
            found.append((i, decision))
    return found


def _advance(guard: Guard, fitted: list[tuple[Rule, Any]], rows: Rows, start: int, end: int) -> int:
    """Screens steps [start, end) with every rule's screen, takes the steps before the first any of them
    cannot clear into every rule, and returns where they end."""
    if guard.stopped:
        return start
    # A step that goes back is the guard's to judge (a rollback's rewind, or a restart: `Guard._went_back`).
    steps = rows.steps[start:end]
    doubtful = np.empty(end - start, dtype=bool)
    doubtful[1:] = steps[1:] <= steps[:-1]
    doubtful[0] = guard.last_step is not None and steps[0] <= guard.last_step
    learners = []
    for rule, screen in fitted:
        flagged, learn = screen(rule, rows, start, end)
        doubtful |= flagged
        learners.append(learn)
    healthy = int(doubtful.argmax()) if doubtful.any() else end - start
    if healthy:
        for learn in learners:
            learn(healthy)
        guard.observed += healthy
        guard.last_step = int(steps[healthy - 1])
    return start + healthy


class NonFiniteScreen:
    def covers(self, rule: NonFinite, rows: Rows) -> bool:
        return True

    def __call__(self, rule: NonFinite, rows: Rows, start: int, end: int) -> tuple[Array, Learn]:
        finite = np.isfinite(rows.losses[start:end]) & np.isfinite(rows.grad_norms[start:end])
        return ~finite, lambda count: None


class WindowScreen:
    """`WindowRule.check` over the stretch: the window's running sums as the loop keeps them, each step's
    least of its last `sustain` values, the test elementwise."""

    def covers(self, rule: WindowRule, rows: Rows) -> bool:
        return (rule.window.values.maxlen or 0) >= 1 and rule.min_steps >= 1

    def __call__(self, rule: WindowRule, rows: Rows, start: int, end: int) -> tuple[Array, Learn]:
        values, window, lag, count = getattr(rows, rule.column)[start:end], rule.window, rule.lag, end - start
        held = window.values
        # What enters the window, in order, were every step healthy: the values held back, then the block's;
        # before step i, `pushed[i]` of them have entered (none while `lag` or fewer are held back).
        entering = np.concatenate((np.fromiter(rule.recent, np.float64, len(rule.recent)), values))
        pushed = np.maximum(np.arange(len(rule.recent), len(rule.recent) + count) - lag, 0)
        last = max(len(rule.recent) + count - lag, 0)
        totals, squares = window_sums(entering[:last], held, window.total, window.total_sq)
        size = np.minimum(len(held) + pushed, held.maxlen or 0)
        least = _trailing_min(entering, len(rule.recent), count, rule.sustain)
        flagged = (size >= rule.min_steps) & spikes(least, size, totals[2 * pushed], squares[2 * pushed], rule.sigma,
                                                    rule.FLOOR_RATIO)

        def learn(healthy: int) -> None:
            enter = int(max(len(rule.recent) + healthy - lag, 0))
            held.extend(entering[max(0, enter - (held.maxlen or 0)):enter].tolist())
            if enter:
                window.total, window.total_sq = float(totals[2 * enter]), float(squares[2 * enter])
            rule.recent = deque(entering[enter:len(rule.recent) + healthy].tolist())

        return flagged, learn


def _trailing_min(values: Array, first: int, count: int, span: int) -> Array:
    """For i in [0, count): the least of values[first + i - span + 1 : first + i + 1]; NaN where fewer
    than `span` values lead up to it (so no test on it can hold)."""
    least = values[first:first + count].copy()
    with np.errstate(all="ignore"):
        for back in range(1, span):
            shifted = np.full(count, np.nan)
            begin = max(back - first, 0)        # steps whose value `back` before exists
            shifted[begin:] = values[first + begin - back:first + count - back]
            least = np.minimum(least, shifted)  # NaN (nothing there) stays NaN
    return least


class GradExplosionScreen:
    def covers(self, rule: GradExplosion, rows: Rows) -> bool:
        return (0 < rule.keep <= 1 - 2 ** -50 and rule.factor >= 0 and rule.layer_factor >= 0
                and len(set(rows.names)) == len(rows.names))

    def __call__(self, rule: GradExplosion, rows: Rows, start: int, end: int) -> tuple[Array, Learn]:
        return self._explosions(rule, rows, start, end), lambda count: self._learn(rule, rows, start, count)

    @staticmethod
    def _explosions(rule: GradExplosion, rows: Rows, start: int, end: int) -> Array:
        """Where a step might explode (the global norm or a layer's), were the steps before it healthy; or
        False where none can. First one floor for the whole stretch (two reductions a row); where that does
        not clear it, a floor for each step (`ema_floors`)."""
        norms = rows.norm_rows[:, start:end]
        emas = np.array([rule.ema, *map(rule.layer_ema.get, rows.names)], dtype=np.float64)  # None: NaN
        factors = np.array([rule.factor] + [rule.layer_factor] * len(rows.names))
        if none_can_explode(norms, emas, factors):
            return False
        armed = np.arange(rule.good, rule.good + end - start) >= rule.min_steps
        floors = ema_floors(emas, norms)
        # A norm with no EMA yet (a layer's first): step by step, so the EMAs are made in the loop's order.
        unsure = ~np.isnan(norms) & ((armed & ~under(norms, floors, factors[:, None])) | np.isnan(floors))
        return unsure.any(axis=0)

    @staticmethod
    def _learn(rule: GradExplosion, rows: Rows, start: int, count: int) -> None:
        rule.ema = ema(rule.ema, rows.grad_norms[start:start + count], rule.keep)
        layers = rows.norm_rows[1:, start:start + count]
        finite_rows: Array = np.isfinite(layers).all(axis=1)
        for name, norms, clean in zip(rows.names, layers, finite_rows.tolist()):
            if not clean:
                norms = np.ascontiguousarray(norms[np.isfinite(norms)])   # a missing (NaN) norm teaches nothing
            learned = ema(rule.layer_ema.get(name), norms, rule.keep)
            if learned is not None:         # a layer with a norm here has an EMA already (see the screen)
                rule.layer_ema[name] = learned
        rule.good += count


class WarmupScreen:
    """`WarmupSpike.check` over the stretch: the count of healthy losses and their running maximum (exact),
    the test elementwise. Asleep once the count reaches `until`: nothing to screen, only the count."""

    def covers(self, rule: WarmupSpike, rows: Rows) -> bool:
        return True

    def __call__(self, rule: WarmupSpike, rows: Rows, start: int, end: int) -> tuple[Array, Learn]:
        awake = max(0, min(end - start, rule.until - rule.seen))     # steps the rule still learns
        losses = rows.losses[start:start + awake]

        def learn(count: int) -> None:
            taken = min(count, awake)
            if taken:
                rule.seen += taken
                rule.peak = max(rule.peak, float(losses[:taken].max()))

        if not awake:
            return False, learn
        flagged = np.zeros(end - start, dtype=bool)
        with np.errstate(all="ignore"):
            peaks = np.maximum.accumulate(np.concatenate(([rule.peak], losses)))[:-1]
            seen = np.arange(rule.seen, rule.seen + awake)
            flagged[:awake] = (seen >= 1) & (losses > rule.factor * peaks) & (peaks > 0)
        return flagged, learn


class DriftScreen:
    """`LossDrift.check` at every step that would complete a chunk: each chunk's sums as the loop adds them
    (`np.cumsum` along the chunk, from the sums held for the first), its means, the least of the chunk
    means held before it (a sliding minimum), the test elementwise."""

    def covers(self, rule: LossDrift, rows: Rows) -> bool:
        return rule.chunk >= 1 and (rule.loss_means.maxlen or 0) >= 1 and 0 <= rule.count < rule.chunk

    def __call__(self, rule: LossDrift, rows: Rows, start: int, end: int) -> tuple[Array, Learn]:
        chunk, count = rule.chunk, end - start
        first = chunk - rule.count                      # steps to the end of the chunk being filled
        ends = np.arange(first - 1, count, chunk)       # positions that complete a chunk
        columns = (rows.losses[start:end], rows.grad_norms[start:end])
        with np.errstate(all="ignore"):
            sums = [_chunk_sums(column, held, first, len(ends), chunk)
                    for column, held in zip(columns, (rule.loss_sum, rule.grad_sum))]
            means = [total / chunk for total in sums]
            flagged = np.zeros(count, dtype=bool)
            if len(ends):
                held = len(rule.loss_means)
                loss_floor = _sliding_min(rule.loss_means, means[0])
                grad_floor = _sliding_min(rule.grad_means, means[1])
                size = np.minimum(np.arange(held, held + len(ends)), rule.loss_means.maxlen or 0)
                rise = means[0] - loss_floor
                flagged[ends] = ((size >= rule.min_chunks)
                                 & (rise > rule.loss_ratio * np.abs(loss_floor))
                                 & (means[1] - grad_floor > rule.grad_ratio * np.abs(grad_floor))
                                 & (rise > rule.steadiness * _largest_moves(rule.loss_means, means[0])))

        def learn(healthy: int) -> None:
            done = int(np.searchsorted(ends, healthy))    # chunks completed within the healthy prefix
            rule.loss_means.extend(means[0][:done].tolist())
            rule.grad_means.extend(means[1][:done].tolist())
            begin = int(ends[done - 1]) + 1 if done else 0
            rest = healthy - begin
            held_loss, held_grad = (rule.loss_sum, rule.grad_sum) if not done else (0.0, 0.0)
            rule.count = (rule.count if not done else 0) + rest
            rule.loss_sum = _running_sum(held_loss, columns[0][begin:healthy])
            rule.grad_sum = _running_sum(held_grad, columns[1][begin:healthy])

        return flagged, learn


def _chunk_sums(values: Array, held: float, first: int, chunks: int, chunk: int) -> Array:
    """The sum of each chunk that completes in `values`, as `LossDrift.learn` adds it: the first from
    `held` over values[:first], the others from 0.0 over `chunk` values each, left to right."""
    if not chunks:
        return np.empty(0)
    out = np.empty(chunks)
    out[0] = _running_sum(held, values[:first])
    if chunks > 1:
        rows = values[first:first + (chunks - 1) * chunk].reshape(chunks - 1, chunk)
        out[1:] = np.cumsum(rows, axis=1)[:, -1]    # 0.0 + v is v: the loop's first addition
    return out


def _running_sum(held: float, values: Array) -> float:
    """`held` plus each of `values` in turn (np.cumsum adds left to right, as the loop does)."""
    if not len(values):
        return held
    return float(np.cumsum(np.concatenate(([held], values)))[-1])


def _largest_moves(held: deque[float], means: Array) -> Array:
    """Before each of `means`: the largest move between consecutive chunk means over the means held then
    (the last `held.maxlen`) and into it, as `LossDrift.check` finds it; -inf where there is none."""
    size = held.maxlen or 0
    chain = np.concatenate((np.fromiter(held, np.float64, len(held)), means))
    moves = np.abs(np.diff(chain))                  # moves[j]: from chain[j] to chain[j + 1]
    padded = np.concatenate((np.full(size, -np.inf), moves))
    windows = np.lib.stride_tricks.sliding_window_view(padded, size)
    return windows[len(held):len(held) + len(means)].max(axis=1)     # windows[q]: the moves into chain[q]


def _sliding_min(held: deque[float], means: Array) -> Array:
    """Before each of `means`: the least of the last `held.maxlen` chunk means (those held, then the new
    ones before it); +inf where none."""
    size = held.maxlen or 0
    padded = np.concatenate((np.full(size, np.inf), np.fromiter(held, np.float64, len(held)), means))
    windows = np.lib.stride_tricks.sliding_window_view(padded, size)
    return windows[len(held):len(held) + len(means)].min(axis=1)


GUARD_SCREENS: dict[type, Screen] = {
    NonFinite: NonFiniteScreen(),
    WindowRule: WindowScreen(),
    GradExplosion: GradExplosionScreen(),
    WarmupSpike: WarmupScreen(),
    LossDrift: DriftScreen(),
}


def window_sums(values: Array, held: deque[float], total: float, total_sq: float) -> tuple[Array, Array]:
    """A rolling window's running sums as `RollingWindow.push` keeps them, were every value pushed: element
    2i of each is the sum before value i, element 2i+2 the sum after it (the np.cumsum of the terms push
    adds, in its order: what leaves the window, as -old, then the new value)."""
    count, kept, size = len(values), len(held), held.maxlen or 0
    quiet = min(count, size - kept)         # values that pop nothing: the window is still filling
    first = kept + quiet - size             # what the others pop, in order, in the window then the block
    leaving = np.concatenate((np.fromiter(held, np.float64, kept), values))[first:first + count - quiet]
    terms = np.empty(2 * count + 1)
    with np.errstate(all="ignore"):     # inf and NaN make NaN sums: such steps are screened out anyway
        terms[0], terms[1:2 * quiet:2], terms[2::2] = total, -0.0, values
        np.negative(leaving, out=terms[2 * quiet + 1::2])
        totals = np.cumsum(terms)
        terms[0], terms[2::2] = total_sq, values * values
        np.negative(leaving * leaving, out=terms[2 * quiet + 1::2])
        return totals, np.cumsum(terms)


def spikes(values: Array, held: Array, totals: Array, squares: Array, sigma: float, floor_ratio: float) -> Array:
    """`RollingWindow.exceeds`, elementwise: the same operations in the same order."""
    with np.errstate(all="ignore"):
        mean = totals / held
        excess = values - mean
        floor = np.maximum(floor_ratio * np.abs(mean), 1e-8)
        variance, floor_sq = squares / held - mean * mean, floor * floor
        return (excess > 0) & (excess * excess > sigma * sigma * np.where(variance >= floor_sq, variance, floor_sq))


def ema_floors(emas: Array, norms: Array) -> Array:
    """A floor under each EMA (a row of `norms` each; NaN: none yet) before each step, were all the steps
    healthy: the least of its value now and the norms before (NaN ones skipped, as they teach nothing).
    NaN while the EMA does not exist yet. An infinite norm teaches nothing either, but is screened out
    itself (+inf explodes; -inf drags the floor below any trusted value, so the steps after it are)."""
    before = np.empty(norms.shape)
    before[:, 0] = emas
    before[:, 1:] = norms[:, :-1]
    with np.errstate(all="ignore"):
        return np.fmin.accumulate(before, axis=1, out=before)


def under(norms: Array, floor: Array, factor: Array) -> Array:
    """Where a norm cannot be above `factor` times an EMA that is at least `floor`. A floor of zero holds
    (an EMA of non-negative norms stays >= 0); a tiny positive one is not trusted."""
    with np.errstate(all="ignore"):
        return (norms <= factor * (1 - 1e-9) * floor) & ((floor >= TINY) | (floor == 0))


def none_can_explode(norms: Array, emas: Array, factors: Array) -> bool:
    """Whether no norm of a stretch (a row of `norms` per EMA in `emas`) can be above its factor times its
    EMA, whichever steps turn out healthy: one floor for the whole stretch, the least of the EMA and the
    row's norms (two reductions a row). NaN (a missing norm or EMA) fails it."""
    with np.errstate(all="ignore"):
        floors = np.minimum(emas, norms.min(axis=1))
        return bool(under(norms.max(axis=1), floors, factors).all())


def ema(value: float | None, norms: Array, keep: float) -> float | None:
    """`value` after learning each of `norms` in turn: `guard.ema_step`, in a tight loop."""
    if not len(norms):
        return value
    if value is None:
        value, norms = float(norms[0]), norms[1:]
    for norm in memoryview(norms):      # Python floats, without building a list
        value = value + keep * (norm - value)
    return value


# ============================================================================================ meter

def meter_block(meter: CostMeter, block: Block) -> Found:
    """`CostMeter.observe` over every record of the block, in order (a record without a clock: clock
    None): the same decisions and the same state.

    A screen (`_advance_meter`) proves a stretch of records crosses no tier not crossed before (tiers held
    already may be reached again: they only set the tier) and advances the meter over it in bulk; the
    first record it cannot clear (that, or one without a finite metered time), and a few after it, go
    through `CostMeter.take`. Steps or times going back, GPU counts that change, clocks that switch stay in
    bulk: every running number is built by the loop's own operations (the metered times and the spend as
    `np.cumsum` of its increments, in its order; where each window starts and which count holds as running
    maxima of indexes; everything else elementwise, with cost.py's own formula)."""
    steps = np.ascontiguousarray(block.steps, dtype=np.int64)
    timestamps = np.ascontiguousarray(block.timestamps, dtype=np.float64)
    gpus = np.ascontiguousarray(block.gpus, dtype=np.int64)
    no_clock = block.clock_codes is None
    codes = np.full(len(steps), -1, dtype=np.int64) if no_clock else np.asarray(block.clock_codes, dtype=np.int64)
    seconds = np.full(len(steps), np.nan) if no_clock else np.asarray(block.clock_seconds, dtype=np.float64)
    if len(steps) <= MIN_SCREENED or not (np.abs(steps) < 2 ** 52).all():  # steps as floats must be exact
        return _meter_records(meter, steps, timestamps, gpus, codes, seconds, block.clock_nodes)
    columns = (steps, timestamps, _metered(meter, timestamps, codes, seconds, block.clock_nodes), gpus)
    return decide_screened(len(steps), lambda start, end: _advance_meter(meter, columns, start, end),
                           lambda start, end: _take(meter, columns, start, end))


def _meter_records(meter: CostMeter, steps: Array, timestamps: Array, gpus: Array, codes: Array,
                   seconds: Array, nodes: Sequence[Any]) -> Found:
    """`CostMeter.observe`, record by record."""
    found: Found = []
    for i, (step, when, count, code, at) in enumerate(zip(
            steps.tolist(), timestamps.tolist(), gpus.tolist(), codes.tolist(), seconds.tolist())):
        found += [(i, decision) for decision in meter.observe(step, when, count, None if code < 0 else (nodes[code], at))]
    return found


def _take(meter: CostMeter, columns: tuple[Array, ...], start: int, end: int) -> Found:
    """`CostMeter.take` over records [start, end), their times metered already."""
    found: Found = []
    steps, timestamps, metered, gpus = (column[start:end].tolist() for column in columns)
    for i, (step, timestamp, when, count) in enumerate(zip(steps, timestamps, metered, gpus), start):
        found += [(i, decision) for decision in meter.take(step, timestamp, when, count)]
    return found


def _advance_meter(meter: CostMeter, columns: tuple[Array, ...], start: int, end: int) -> int:
    """Screens records [start, end), takes the ones before the first that might cross a new tier (or
    has no finite time) into the meter, and returns where they end."""
    policy = meter.policy
    steps, when = columns[0][start:end], columns[2][start:end]
    gpus = _gpus(meter, columns[3][start:end])
    first, restarts = _window_starts(meter, steps)
    held_times, held_steps = _held(meter.window)
    first_time = np.concatenate((held_times, when))[first]
    steps_in_window = steps - np.concatenate((held_steps, steps))[first]
    with np.errstate(all="ignore"):
        cost = cost_per_1k_steps(when - first_time, gpus, policy.price_per_gpu_hour, steps_in_window)
        overrun = cost / policy.budget_per_1k_steps - 1.0
    measured = (steps_in_window > 0) & (when > first_time)
    judged = measured & (steps_in_window >= meter.min_steps)
    unfired = min((threshold for action, _, threshold in meter.tiers if action not in meter.fired), default=np.inf)
    doubtful = ~np.isfinite(when) | (judged & ~(overrun < unfired))
    healthy = int(doubtful.argmax()) if doubtful.any() else len(steps)
    if healthy:
        _spend(meter, when[:healthy], gpus, healthy)
        _take_window(meter, steps[:healthy], when[:healthy], restarts[:healthy])
        _take_judgement(meter, cost[:healthy], overrun[:healthy], measured[:healthy], judged[:healthy])
        if not policy.gpu_count_override:
            meter.state.gpu_count = int(gpus[healthy - 1])
        meter.state.steps_in_window = meter.window[-1][1] - meter.window[0][1]
    return start + healthy


def _gpus(meter: CostMeter, seen: Array) -> Array:
    """Billable devices at each record, as the loop counts them: the override, else the last count seen."""
    if meter.policy.gpu_count_override:
        return np.full(len(seen), meter.policy.gpu_count_override, dtype=np.int64)
    last_seen = np.maximum.accumulate(np.where(seen != 0, np.arange(len(seen)), -1))
    return np.where(last_seen >= 0, seen[last_seen], meter.state.gpu_count)


def _window_starts(meter: CostMeter, steps: Array) -> tuple[Array, Array]:
    """Each record's first window sample, as an index into the window now followed by `steps`: its last
    restart (steps going back clear the window), or as far back as the window holds; and where the
    restarts are."""
    held, size = len(meter.window), meter.window.maxlen or 0
    at = np.arange(held, held + len(steps))
    restarts = np.empty(len(steps), dtype=bool)
    restarts[1:] = steps[1:] <= steps[:-1]
    restarts[0] = held > 0 and steps[0] <= meter.window[-1][1]
    return np.maximum(np.maximum.accumulate(np.where(restarts, at, 0)), at - size + 1), restarts


def _spend(meter: CostMeter, when: Array, gpus: Array, count: int) -> None:
    """cost_usd and the last metered time after `count` records: the loop bills a record the time since
    the last one that moved the clock forward, if it does not go back; the bills summed in its order."""
    last, price = meter.last_time, meter.policy.price_per_gpu_hour
    with np.errstate(all="ignore"):     # a NaN last time (a NaN record once started the meter) moves never
        before = np.maximum.accumulate(np.concatenate(([-np.inf if last is None else last], when)))[:-1]
        moves = when >= before
        mover = np.maximum.accumulate(np.where(moves, np.arange(count), -1))
        previous = np.concatenate(([-1], mover[:-1]))        # the record that set the last time, before each
        since = np.where(previous >= 0, when[previous], np.nan if last is None else last)
        billed = moves & ((previous >= 0) | (last is not None))
        terms = np.empty(count + 1)
        terms[0] = meter.state.cost_usd
        terms[1:] = np.where(billed, gpu_cost(when - since, gpus[:count], price), -0.0)
    meter.state.cost_usd = float(np.cumsum(terms)[-1])
    if mover[-1] >= 0:
        meter.last_time = float(when[mover[-1]])


def _take_window(meter: CostMeter, steps: Array, when: Array, restarts: Array) -> None:
    """The window after these records: the last of them since the last restart among them, if any."""
    cleared = np.flatnonzero(restarts)
    if len(cleared):
        meter.window.clear()
    begin = max(int(cleared[-1]) if len(cleared) else 0, len(steps) - (meter.window.maxlen or 0))
    meter.window.extend(zip(when[begin:].tolist(), steps[begin:].tolist()))


def _take_judgement(meter: CostMeter, cost: Array, overrun: Array, measured: Array, judged: Array) -> None:
    """cost_per_1k_steps and overrun_ratio as the last measured record left them; the tier as the last
    judged one did (none of them reached a tier not yet fired: any they reach is already held)."""
    state = meter.state
    if measured.any():
        last = len(measured) - 1 - int(measured[::-1].argmax())
        state.cost_per_1k_steps, state.overrun_ratio = float(cost[last]), float(overrun[last])
    if judged.any():
        ratio = float(overrun[len(judged) - 1 - int(judged[::-1].argmax())])
        reached = [tier for _, tier, threshold in meter.tiers if ratio >= threshold]
        if ratio < meter.tiers[0][2]:
            state.tier = "ok"
        elif reached:
            state.tier = reached[-1]


def _metered(meter: CostMeter, timestamps: Array, codes: Array, seconds: Array, nodes: Sequence[Any]) -> Array:
    """`CostMeter.metered` over the block, as arrays. A record continues the clock of the one before (the
    same source, seconds not going back) or takes its wall time; a run of continuing records adds the
    clock's differences to the time it started from, in order: `np.cumsum`, the loop's own additions. Many
    short runs (clocks flapping) are metered by `CostMeter.metered` itself."""
    has = codes >= 0
    if not has.any():
        meter.anchor = None
        return timestamps
    canonical = np.array([list(nodes).index(node) for node in nodes], dtype=np.int64)  # equal names: one clock
    source = np.where(has, canonical[np.where(has, codes, 0)], -1)
    goes_on = np.empty(len(codes), dtype=bool)
    goes_on[1:] = has[1:] & has[:-1] & (source[1:] == source[:-1]) & (seconds[1:] >= seconds[:-1])
    anchor = meter.anchor
    goes_on[0] = bool(has[0] and anchor is not None and anchor[0] == nodes[codes[0]] and seconds[0] >= anchor[1])
    edges = np.diff(goes_on.astype(np.int8), prepend=0, append=0)
    begins, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    if len(begins) > max(8, len(codes) // 64):
        return np.array([meter.metered(timestamp, None if code < 0 else (nodes[code], at)) for timestamp, code, at
                         in zip(timestamps.tolist(), codes.tolist(), seconds.tolist())])
    when = timestamps.copy()
    ticks = np.empty(len(codes))
    ticks[1:] = seconds[1:] - seconds[:-1]
    ticks[0] = seconds[0] - anchor[1] if goes_on[0] and anchor is not None else np.nan
    for begin, end in zip(begins.tolist(), ends.tolist()):
        origin = when[begin - 1] if begin else anchor[2]  # type: ignore[index]
        when[begin:end] = np.cumsum(np.concatenate(([origin], ticks[begin:end])))[1:]
    last = len(codes) - 1
    meter.anchor = (nodes[codes[last]], float(seconds[last]), float(when[last])) if has[last] else None
    return when


def _held(window: deque[tuple[float, int]]) -> tuple[Array, Array]:
    """The window's times and steps, as arrays."""
    return (np.fromiter((sample[0] for sample in window), np.float64, len(window)),
            np.fromiter((sample[1] for sample in window), np.int64, len(window)))

