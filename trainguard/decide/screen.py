"""Deciding a block of steps with array screens: what `Guard.check_columns` and
`CostMeter.observe_columns` share.

A screen proves with numpy that a stretch of steps holds no event and the state takes the stretch in
bulk; the first step it cannot clear, and a short stretch after it, go through the step-by-step loop
(`decide_screened`). The array helpers below repeat the loop's own arithmetic, in its order, so the bulk
state is the loop's state to the bit (the docstring of `Guard.check_columns` gives the argument).
Pure: numpy only, no I/O.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import numpy as np

from trainguard.decide.decision import Decision

MIN_SCREENED = 32     # batches of layer norms this short that fail the screen are decided step by step
SCREEN_LEAST = 4 * MIN_SCREENED    # steps a columnar screen must cover to cost less than the loop over them
TINY = np.finfo(np.float64).tiny    # the smallest normal double: below it an EMA's floor is not trusted


def decide_screened(count: int, advance: Callable[[int, int], int],
                    exactly: Callable[[int, int], list]) -> list[tuple[int, Decision]]:
    """Decide `count` steps with a screen: ``advance(start, end)`` takes the steps of [start, end) it can
    prove uneventful into the state in bulk and returns where they end; ``exactly(start, end)`` decides
    steps one by one and returns (index, decision) pairs.

    A screen has a fixed cost (tens of array operations) that the loop matches over ~`SCREEN_LEAST` steps,
    so stretches shorter than that are not screened. After a screen stops at a step, a stretch from it
    goes step by step: MIN_SCREENED steps, doubled each time the screen before cleared fewer than
    `SCREEN_LEAST` (events come thick: the loop is the cheaper way through them). The next screen is
    about twice as long as the last healthy stretch was; a clean one doubles it."""
    found: list[tuple[int, Decision]] = []
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


def window_sums(losses, values: deque, total: float, total_sq: float):
    """The loss window's running sums as `_check_steps` keeps them, were every loss healthy: element 2i of
    each is the sum before step i, element 2i+2 the sum after it (the np.cumsum of the terms the loop adds,
    in its order: what leaves the window, as -old, then the new loss)."""
    count, held, size = len(losses), len(values), values.maxlen
    quiet = min(count, size - held)         # steps that pop nothing: the window is still filling
    first = held + quiet - size             # what the others pop, in order, in the window then the block
    leaving = np.concatenate((np.fromiter(values, np.float64, held), losses))[first:first + count - quiet]
    terms = np.empty(2 * count + 1)
    with np.errstate(all="ignore"):     # inf and NaN losses make NaN sums: such steps are screened out anyway
        terms[0], terms[1:2 * quiet:2], terms[2::2] = total, -0.0, losses
        np.negative(leaving, out=terms[2 * quiet + 1::2])
        totals = np.cumsum(terms)
        terms[0], terms[2::2] = total_sq, losses * losses
        np.negative(leaving * leaving, out=terms[2 * quiet + 1::2])
        return totals, np.cumsum(terms)


def spikes(losses, held, totals, squares, sigma: float):
    """`_check_steps`' loss-spike test, elementwise: the same operations in the same order."""
    with np.errstate(all="ignore"):
        mean = totals / held
        excess = losses - mean
        floor = 1e-3 * np.where(mean >= 0, mean, -mean)
        floor = np.where(floor >= 1e-8, floor, 1e-8)
        variance = squares / held - mean * mean
        floor_sq = floor * floor
        return (excess > 0) & (excess * excess > sigma * sigma * np.where(variance >= floor_sq, variance, floor_sq))


def ema_floors(emas, norms):
    """A floor under each EMA (a row of `norms` each; NaN: none yet) before each step, were all the steps
    healthy: the least of its value now and the norms before (NaN ones skipped, as they teach nothing).
    NaN while the EMA does not exist yet. An infinite norm teaches nothing either, but is screened out
    itself (+inf explodes; -inf drags the floor below any trusted value, so the steps after it are)."""
    before = np.empty(norms.shape)
    before[:, 0] = emas
    before[:, 1:] = norms[:, :-1]
    with np.errstate(all="ignore"):
        return np.fmin.accumulate(before, axis=1, out=before)


def under(norms, floor, factor):
    """Where a norm cannot be above `factor` times an EMA that is at least `floor`. A floor of zero holds
    (an EMA of non-negative norms stays >= 0); a tiny positive one is not trusted."""
    with np.errstate(all="ignore"):
        return (norms <= factor * (1 - 1e-9) * floor) & ((floor >= TINY) | (floor == 0))


def none_can_explode(norms, emas, factors) -> bool:
    """Whether no norm of a stretch (a row of `norms` per EMA in `emas`) can be above its factor times its
    EMA, whichever steps turn out healthy: one floor for the whole stretch, the least of the EMA and the
    row's norms (two reductions a row). NaN (a missing norm or EMA) fails it."""
    with np.errstate(all="ignore"):
        floors = np.minimum(emas, norms.min(axis=1))
        return bool(under(norms.max(axis=1), floors, factors).all())


def ema(ema: float | None, norms, keep: float) -> float | None:
    """`ema` after learning each of `norms` in turn: `_check_steps`' own update, in a tight loop."""
    if not len(norms):
        return ema
    if ema is None:
        ema, norms = float(norms[0]), norms[1:]
    for norm in memoryview(norms):      # Python floats, without building a list
        ema = ema + keep * (norm - ema)
    return ema
