"""Small pure helpers the checks share: row selection, robust statistics, evidence ranges."""

from __future__ import annotations

import math
import re
from typing import Callable, Iterable, Sequence

from trainguard.diagnose.loader import Columns
from trainguard.tls import format_timestamp

MAX_RANGES = 5     # evidence lists the longest few stretches, not every one


finite = math.isfinite     # every column value is a float (NaN where missing)


def median(values: Iterable[float]) -> float:
    ordered = sorted(v for v in values if finite(v))
    if not ordered:
        return math.nan
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def quantile(values: Iterable[float], q: float) -> float:
    ordered = sorted(v for v in values if finite(v))
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rows_with(cols: Columns, fields: Sequence[str], skip: int = 0) -> list[int]:
    """Row indices from `skip` on where every field is finite."""
    rows = range(skip, len(cols))
    for name in fields:   # one pass per field: much cheaper than a generator per row
        column = cols.values[name]
        rows = [i for i in rows if finite(column[i])]
    return list(rows)


def timed_rows(cols: Columns, warmup: int, *fields: str) -> list[int]:
    """Steps after warm-up with a positive step time and every field in `fields`."""
    step_time = cols.values["step_time_seconds"]
    return [i for i in rows_with(cols, ("step_time_seconds", *fields), warmup) if step_time[i] > 0]


def share(cols: Columns, field: str, rows: Sequence[int]) -> float:
    """Sum of `field` over sum of step time on `rows`."""
    total = sum(cols.values["step_time_seconds"][i] for i in rows)
    return sum(cols.values[field][i] for i in rows) / total if total > 0 else math.nan


def max_window_share(cols: Columns, field: str, rows: Sequence[int], window: int) -> float:
    """The largest share of `field` in step time over `window` consecutive rows (a sustained stretch)."""
    if len(rows) < window:
        return math.nan
    part = [cols.values[field][i] for i in rows]
    whole = [cols.values["step_time_seconds"][i] for i in rows]
    part_sum, whole_sum = sum(part[:window]), sum(whole[:window])
    best = part_sum / whole_sum
    for k in range(window, len(rows)):
        part_sum += part[k] - part[k - window]
        whole_sum += whole[k] - whole[k - window]
        best = max(best, part_sum / whole_sum if whole_sum > 0 else 0.0)
    return best


def flagged_runs(rows: Sequence[int], flagged: Callable[[int], bool]) -> list[list[int]]:
    """Contiguous runs of `rows` (consecutive in `rows`) where `flagged(i)` holds, longest first."""
    runs: list[list[int]] = []
    previous = None
    for i in rows:
        if flagged(i):
            if runs and runs[-1][-1] == previous:
                runs[-1].append(i)
            else:
                runs.append([i])
        previous = i
    return sorted(runs, key=len, reverse=True)


def describe(cols: Columns, run: Sequence[int]) -> dict:
    """A run of rows as evidence: ``{"steps": [first, last], "from", "to", "seconds", "rows"}``."""
    first, last = run[0], run[-1]
    item = {"from": format_timestamp(cols.timestamps[first]), "to": format_timestamp(cols.timestamps[last]),
            "seconds": round(cols.timestamps[last] - cols.timestamps[first], 3), "rows": len(run)}
    if cols.steps[first] >= 0:
        item = {"steps": [cols.steps[first], cols.steps[last]], **item}
    return item


def stretches(cols: Columns, rows: Sequence[int], flagged: Callable[[int], bool]) -> list[dict]:
    """The longest few stretches of `rows` where `flagged(i)` holds, described as evidence."""
    return [describe(cols, run) for run in flagged_runs(rows, flagged)[:MAX_RANGES]]


def sustained(cols: Columns, rows: Sequence[int], flagged: Callable[[int], bool], seconds: float) -> list[list[int]]:
    """Runs of flagged rows lasting at least `seconds` (as an alert's `for:` would need), longest first."""
    return [run for run in flagged_runs(rows, flagged)
            if cols.timestamps[run[-1]] - cols.timestamps[run[0]] >= seconds]


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNIT_SECONDS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def prometheus_duration(text: str) -> float:
    """A Prometheus duration (``30s``, ``2m``, ``1h30m``) in seconds, as the alert rules' `for:` uses."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text.strip():
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)


def rounded(value: float, digits: int = 4) -> float | None:
    return round(value, digits) if finite(value) else None
