"""Deciding a block of steps fast: the rules' and the cost meter's own screens, driven over a block.

The rules are the product (guard.py, cost.py), and each carries its own screen beside `check` and `learn`
(`guard.Screened`; `CostMeter.screen`), so a rule's state is written by the rule alone; this module only
drives them over a block of recorded steps, and never decides differently. One entry point each:
`guard_block(guard, block)` and `meter_block(meter, block)`, both returning (index, decision) for each
step of the block that acts.

How: a screen proves with numpy that a stretch of steps holds no event, and the state then takes the
stretch in bulk; the first step a screen cannot clear, and a short stretch after it, go through the
rules' own step loop (`Guard.observe`, `CostMeter.take`). A guard rule without a screen makes the whole
block go step by step: correct the moment the rule exists, fast once it gets a screen. The elementwise
arithmetic the screens share is trainguard/decide/arrays.py.

Why the bulk state is the step-by-step state, to the bit:
- running sums (a rolling window's, the meter's spend and metered times) are `np.cumsum` of the very
  terms the loop adds, in its order: cumsum adds left to right, one element at a time, so it gives every
  total the loop had (with -0.0 where the loop adds nothing: it changes no double), and a test on them is
  the same IEEE operations in the same order, elementwise: exact, not a bound;
- an EMA has no exact array form: it learns in a tight loop over the stretch (`arrays.ema`);
- an explosion is screened with a floor under each EMA instead: an EMA moves to a weighted mean of itself
  and a norm, and for 0 < keep < 1 the rounded update never falls below the smaller of the two, so before
  step i the EMA is at least the least of its value at the start and the finite norms before i (a running
  minimum). A norm at or under the factor times that floor (less 1e-9 for rounding) cannot explode.
Every step before the first one screened out is therefore healthy, which is all the bulk update assumes.
Pure: numpy only, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import Any, Callable, Sequence, cast

import numpy as np

from trainguard.decide.cost import CostMeter
from trainguard.decide.decision import Decision
from trainguard.decide.guard import Guard, Screened, StepStats

MIN_SCREENED = 32     # steps decided one by one after a screen stops (doubled while events come thick)
SCREEN_LEAST = 4 * MIN_SCREENED    # steps a screen must cover to cost less than the loop over them
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


def guard_block(guard: Guard, block: Block) -> Found:
    """`Guard.observe` over every step of the block, in order: the same decisions, the same state."""
    rows = Rows(block)
    screened = [rule for rule in guard.rules if callable(getattr(rule, "screen", None))]
    # The screens read a NaN norm as non-finite; a block with loss-only steps (few, short real logs) goes
    # step by step, where the rules see the missing norm as None.
    if block.layers is not None or (block.no_grad_norm is not None and block.no_grad_norm.any()) or not (
            len(screened) == len(guard.rules) and all(cast(Screened, rule).screens(rows) for rule in screened)):
        return observe(guard, rows, 0, len(block))       # a rule without a screen: step by step, correct
    rules = cast(list[Screened], screened)
    return decide_screened(len(block), lambda start, end: _advance(guard, rules, rows, start, end),
                           lambda start, end: observe(guard, rows, start, end))


def observe(guard: Guard, rows: Rows, start: int, end: int) -> Found:
    """The rules' own step loop over steps [start, end)."""
    found: Found = []
    for i, stats in enumerate(rows.stats(start, end), start):
        decision = guard.observe(stats)
        if decision:
            found.append((i, decision))
    return found


def _advance(guard: Guard, rules: list[Screened], rows: Rows, start: int, end: int) -> int:
    """Screens steps [start, end) with every rule's screen, has every rule learn the steps before the first
    any of them cannot clear, and returns where they end."""
    if guard.stopped:
        return start
    # A step that goes back is the guard's to judge (a rollback's rewind, or a restart: `Guard._went_back`).
    steps = rows.steps[start:end]
    doubtful = np.empty(end - start, dtype=bool)
    doubtful[1:] = steps[1:] <= steps[:-1]
    doubtful[0] = guard.last_step is not None and steps[0] <= guard.last_step
    learners = []
    for rule in rules:
        flagged, learn = rule.screen(rows, start, end)
        doubtful |= flagged
        learners.append(learn)
    healthy = int(doubtful.argmax()) if doubtful.any() else end - start
    if healthy:
        for learn in learners:
            learn(healthy)
        guard.learned_in_bulk(healthy, int(steps[healthy - 1]))
    return start + healthy


# ============================================================================================ meter

def meter_block(meter: CostMeter, block: Block) -> Found:
    """`CostMeter.observe` over every record of the block, in order (a record without a clock: clock
    None): the same decisions and the same state.

    The meter's screen (`CostMeter.screen`) proves a stretch of records crosses no tier not crossed before (tiers held
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
    columns = (steps, timestamps, meter.metered_block(timestamps, codes, seconds, block.clock_nodes), gpus)
    return decide_screened(len(steps), lambda start, end: meter.screen(columns, start, end),
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
