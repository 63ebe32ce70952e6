"""The guard rules' and the cost meter's arithmetic over numpy columns: the same IEEE operations, in the
same order, as their step loops, so a block screen (a rule's `screen` beside its `check` and `learn` in
guard.py, `CostMeter.screen` in cost.py) flags every step its loop could act on and leaves exactly the
state its loop would (the argument is at the top of trainguard/decide/batch.py: running sums as
`np.cumsum` of the loop's terms, floors under EMAs, EMAs in a tight loop). These functions compute; the
rule or the meter writes its own state. Pure: numpy only; only replay imports it (the live guard and
meter take one step at a time).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import numpy as np

from trainguard.decide.cost import gpu_cost

TINY = np.finfo(np.float64).tiny    # the smallest normal double: below it an EMA's floor is not trusted
Array = Any                         # a numpy array (numpy's own types are not worth the noise here)


def trailing_min(values: Array, first: int, count: int, span: int) -> Array:
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


def chunk_sums(values: Array, held: float, first: int, chunks: int, chunk: int) -> Array:
    """The sum of each chunk that completes in `values`, as `LossDrift.learn` adds it: the first from
    `held` over values[:first], the others from 0.0 over `chunk` values each, left to right."""
    if not chunks:
        return np.empty(0)
    out = np.empty(chunks)
    out[0] = running_sum(held, values[:first])
    if chunks > 1:
        rows = values[first:first + (chunks - 1) * chunk].reshape(chunks - 1, chunk)
        out[1:] = np.cumsum(rows, axis=1)[:, -1]    # 0.0 + v is v: the loop's first addition
    return out


def running_sum(held: float, values: Array) -> float:
    """`held` plus each of `values` in turn (np.cumsum adds left to right, as the loop does)."""
    if not len(values):
        return held
    return float(np.cumsum(np.concatenate(([held], values)))[-1])


def largest_moves(held: deque[float], means: Array) -> Array:
    """Before each of `means`: the largest move between consecutive chunk means over the means held then
    (the last `held.maxlen`) and into it, as `LossDrift.check` finds it; -inf where there is none."""
    size = held.maxlen or 0
    chain = np.concatenate((np.fromiter(held, np.float64, len(held)), means))
    moves = np.abs(np.diff(chain))                  # moves[j]: from chain[j] to chain[j + 1]
    padded = np.concatenate((np.full(size, -np.inf), moves))
    windows = np.lib.stride_tricks.sliding_window_view(padded, size)
    return windows[len(held):len(held) + len(means)].max(axis=1)     # windows[q]: the moves into chain[q]


def pair_floors(held: deque[float], means: Array) -> Array:
    """Before each of `means`: the least mean of two consecutive chunk means among the last `held.maxlen`
    (those held, then the new ones before it), as `guard.pair_floor` finds it; +inf where there is no pair.
    pairs[k] is (chain[k] + chain[k + 1]) / 2, the loop's operations; before chain[q] the window holds
    pairs[q - size : q - 1]."""
    size = held.maxlen or 0
    chain = np.concatenate((np.fromiter(held, np.float64, len(held)), means))
    pairs = (chain[:-1] + chain[1:]) / 2
    padded = np.concatenate((np.full(size, np.inf), pairs))
    windows = np.lib.stride_tricks.sliding_window_view(padded, size - 1)
    return windows[len(held):len(held) + len(means)].min(axis=1)


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


# ------------------------------------------------------------------------------------- the cost meter

def billable(seen: Array, override: int, held: int) -> Array:
    """Billable devices at each record, as `CostMeter.gpus` counts them: the override, else the last count
    seen (`held` before the block)."""
    if override:
        return np.full(len(seen), override, dtype=np.int64)
    last_seen = np.maximum.accumulate(np.where(seen != 0, np.arange(len(seen)), -1))
    return np.where(last_seen >= 0, seen[last_seen], held)


def held_samples(window: deque[tuple[float, int]]) -> tuple[Array, Array]:
    """A meter window's times and steps, as arrays."""
    return (np.fromiter((sample[0] for sample in window), np.float64, len(window)),
            np.fromiter((sample[1] for sample in window), np.int64, len(window)))


def window_starts(window: deque[tuple[float, int]], steps: Array) -> tuple[Array, Array]:
    """Each record's first window sample, as an index into `window` now followed by `steps`: its last
    restart (steps going back clear the window, as `CostMeter.take` does), or as far back as the window
    holds; and where the restarts are."""
    held, size = len(window), window.maxlen or 0
    at = np.arange(held, held + len(steps))
    restarts = np.empty(len(steps), dtype=bool)
    restarts[1:] = steps[1:] <= steps[:-1]
    restarts[0] = held > 0 and steps[0] <= window[-1][1]
    return np.maximum(np.maximum.accumulate(np.where(restarts, at, 0)), at - size + 1), restarts


def window_after(window: deque[tuple[float, int]], steps: Array, when: Array, restarts: Array) -> tuple[bool, list[Any]]:
    """Whether these records clear the window (a restart among them), and the samples it then holds of theirs:
    the last of them since the last restart, as far back as it holds."""
    cleared = np.flatnonzero(restarts)
    begin = max(int(cleared[-1]) if len(cleared) else 0, len(steps) - (window.maxlen or 0))
    return bool(len(cleared)), list(zip(when[begin:].tolist(), steps[begin:].tolist()))


def spent(cost_usd: float, last: float | None, when: Array, gpus: Array, price: float) -> tuple[float, float | None]:
    """cost_usd and the last metered time after these records, as `CostMeter._spend` leaves them: a record is
    billed the time since the last one that moved the clock forward, if it does not go back; the bills
    summed in its order."""
    count = len(when)
    with np.errstate(all="ignore"):     # a NaN last time (a NaN record once started the meter) moves never
        before = np.maximum.accumulate(np.concatenate(([-np.inf if last is None else last], when)))[:-1]
        moves = when >= before
        mover = np.maximum.accumulate(np.where(moves, np.arange(count), -1))
        previous = np.concatenate(([-1], mover[:-1]))        # the record that set the last time, before each
        since = np.where(previous >= 0, when[previous], np.nan if last is None else last)
        billed = moves & ((previous >= 0) | (last is not None))
        terms = np.empty(count + 1)
        terms[0] = cost_usd
        terms[1:] = np.where(billed, gpu_cost(when - since, gpus[:count], price), -0.0)
    return float(np.cumsum(terms)[-1]), float(when[mover[-1]]) if mover[-1] >= 0 else last


def last_where(mask: Array) -> int | None:
    """The index of the last true element, None if none is."""
    return len(mask) - 1 - int(mask[::-1].argmax()) if mask.any() else None


def metered_runs(anchor: tuple[Any, float, float] | None, timestamps: Array, codes: Array, seconds: Array,
                 nodes: Sequence[Any]) -> tuple[Array, tuple[Any, float, float] | None] | None:
    """`CostMeter.metered` over a block, as arrays: the metered times and the anchor after them; None where
    many short runs (clocks flapping) make the loop the cheaper way. A record continues the clock of the
    one before (the same source, seconds not going back) or takes its wall time; a run of continuing
    records adds the clock's differences to the time it started from, in order: `np.cumsum`, the loop's
    own additions."""
    has = codes >= 0
    if not has.any():
        return timestamps, None
    canonical = np.array([list(nodes).index(node) for node in nodes], dtype=np.int64)  # equal names: one clock
    source = np.where(has, canonical[np.where(has, codes, 0)], -1)
    goes_on = np.empty(len(codes), dtype=bool)
    goes_on[1:] = has[1:] & has[:-1] & (source[1:] == source[:-1]) & (seconds[1:] >= seconds[:-1])
    goes_on[0] = bool(has[0] and anchor is not None and anchor[0] == nodes[codes[0]] and seconds[0] >= anchor[1])
    edges = np.diff(goes_on.astype(np.int8), prepend=0, append=0)
    begins, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    if len(begins) > max(8, len(codes) // 64):
        return None
    when = timestamps.copy()
    ticks = np.empty(len(codes))
    ticks[1:] = seconds[1:] - seconds[:-1]
    ticks[0] = seconds[0] - anchor[1] if goes_on[0] and anchor is not None else np.nan
    for begin, end in zip(begins.tolist(), ends.tolist()):
        origin = when[begin - 1] if begin else anchor[2]  # type: ignore[index]
        when[begin:end] = np.cumsum(np.concatenate(([origin], ticks[begin:end])))[1:]
    last = len(codes) - 1
    return when, (nodes[codes[last]], float(seconds[last]), float(when[last])) if has[last] else None
