"""Bounded summaries of unbounded streams, so a report of a month-long log needs the memory of a short one.

`Series` keeps min/max buckets over x whose width doubles whenever there are too many: a spike
survives however coarse the buckets get (its bucket keeps its max), and a chart never gets more than
`max_points` points. `Sampled` keeps an evenly thinned subset of discrete items (event markers).
"""

from __future__ import annotations

import math
from typing import Any, Iterator

MAX_POINTS = 2000
# First bucket width in x units (seconds for time axes): finer than any two records a log can hold
# apart, so short runs keep every point; it doubles as the run grows.
FIRST_WIDTH = 1e-3
NONFINITE_KEPT = 200


class Series:
    """A numeric stream as at most `max_points` (x, y) points: each bucket keeps its min and its max."""

    __slots__ = ("max_buckets", "width", "buckets", "count", "nonfinite", "nonfinite_x", "last", "first", "total")

    def __init__(self, max_points: int = MAX_POINTS):
        self.max_buckets = max(1, max_points // 2)
        self.width = FIRST_WIDTH
        self.buckets: dict[int, list[float]] = {}   # key -> [x_of_min, min, x_of_max, max]
        self.count = 0
        self.total = 0.0
        self.nonfinite = 0
        self.nonfinite_x: list[float] = []        # where NaN/Inf appeared (first NONFINITE_KEPT)
        self.first: tuple[float, float] | None = None
        self.last: tuple[float, float] | None = None

    def add(self, x: float, y: float) -> None:
        if not math.isfinite(y):
            self.nonfinite += 1
            if len(self.nonfinite_x) < NONFINITE_KEPT:
                self.nonfinite_x.append(x)
            return
        self.count += 1
        self.total += y
        if self.last is None or x >= self.last[0]:
            self.last = (x, y)
        if self.first is None or x < self.first[0]:
            self.first = (x, y)
        key = math.floor(x / self.width)
        bucket = self.buckets.get(key)
        if bucket is None:
            self.buckets[key] = [x, y, x, y]
            if len(self.buckets) > self.max_buckets:
                self._coarsen()
            return
        if y < bucket[1]:
            bucket[0], bucket[1] = x, y
        if y > bucket[3]:
            bucket[2], bucket[3] = x, y

    def _coarsen(self) -> None:
        # floor(x / 2w) == floor(x / w) // 2, so merging neighbours by key is exact, negatives included.
        while len(self.buckets) > self.max_buckets:
            self.width *= 2
            merged: dict[int, list[float]] = {}
            for key, bucket in self.buckets.items():
                into = merged.get(key // 2)
                if into is None:
                    merged[key // 2] = bucket
                    continue
                if bucket[1] < into[1]:
                    into[0], into[1] = bucket[0], bucket[1]
                if bucket[3] > into[3]:
                    into[2], into[3] = bucket[2], bucket[3]
            self.buckets = merged

    def points(self) -> list[tuple[float, float]]:
        """The kept points in x order (a bucket's min and max in the order they happened)."""
        out: list[tuple[float, float]] = []
        for key in sorted(self.buckets):
            x_min, y_min, x_max, y_max = self.buckets[key]
            if x_min == x_max:
                out.append((x_min, y_min))
            elif x_min < x_max:
                out += [(x_min, y_min), (x_max, y_max)]
            else:
                out += [(x_max, y_max), (x_min, y_min)]
        return out

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def y_range(self) -> tuple[float, float] | None:
        if not self.buckets:
            return None
        return (min(b[1] for b in self.buckets.values()), max(b[3] for b in self.buckets.values()))

    def __bool__(self) -> bool:
        return self.count > 0


class Sampled:
    """At most `cap` items of a stream, evenly thinned: when full, every other one goes and the stride doubles."""

    __slots__ = ("cap", "stride", "seen", "items")

    def __init__(self, cap: int = 400):
        self.cap = max(2, cap)
        self.stride = 1
        self.seen = 0
        self.items: list[Any] = []

    def add(self, item: Any) -> None:
        if self.seen % self.stride == 0:
            self.items.append(item)
            if len(self.items) > self.cap:
                self.items = self.items[::2]
                self.stride *= 2
        self.seen += 1

    @property
    def thinned(self) -> bool:
        return self.stride > 1

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)
