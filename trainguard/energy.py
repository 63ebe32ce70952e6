"""Energy from NVML's total energy counter: joules per GPU between any two times, for goodput's split.

The agent writes each GPU's counter (`nvmlDeviceGetTotalEnergyConsumption`, mJ since the driver loaded) into
its TLS records as `hardware.gpus[].energy_joules`. Between two samples the energy is taken to grow
linearly (the counter's own resolution is the sampling interval); a counter that goes back (a driver
reload, a reset GPU) starts a new stretch rather than a negative draw; outside the sampled span nothing is
counted (no guess). `counter_difference` is the counter's own difference over the span, which
`Curve.joules` over the whole span equals by construction; over a run's span (first record to last) the
two differ only by the run's ends falling between samples (bench/bench_autopilot.py measures it).

Pure: records in, joules out.
"""

from __future__ import annotations

import bisect
import math
from typing import Iterable


def samples_of(records: Iterable[dict], scale: float = 1.0) -> dict[str, list[tuple[float, float]]]:
    """(time, joules) per GPU (`node/uuid`) from the agent's records' `hardware.gpus[].energy_joules`, or
    per rank (`node/rank-R`) from the trainer's step records' `hardware.energy_joules` (its own GPU), times
    `scale` (a rank's GPU standing for the job's: the GPU count), in time order."""
    series: dict[str, list[tuple[float, float]]] = {}
    for record in records:
        hardware = record.get("hardware")
        own = hardware.get("energy_joules") if isinstance(hardware, dict) else None
        if isinstance(own, (int, float)) and not isinstance(own, bool) and math.isfinite(own):
            key = f"{record.get('node', '')}/rank-{record.get('rank', 0)}"
            series.setdefault(key, []).append((float(record["timestamp"]), float(own) * scale))
        gpus = hardware.get("gpus") if isinstance(hardware, dict) else None
        if not isinstance(gpus, list):
            continue
        when = float(record["timestamp"])
        for gpu in gpus:
            value = gpu.get("energy_joules") if isinstance(gpu, dict) else None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            key = f"{record.get('node', '')}/{gpu.get('uuid') or gpu.get('gpu')}"
            series.setdefault(key, []).append((when, float(value) * scale))
    for points in series.values():
        points.sort()
    return series


class Curve:
    """The accumulated joules of every GPU as a function of time (piecewise linear between samples)."""

    def __init__(self, series: dict[str, list[tuple[float, float]]]):
        self.gpus = []
        for points in series.values():
            times, accumulated, total, previous = [], [], 0.0, None
            for when, value in points:
                if previous is not None:
                    total += value - previous if value >= previous else 0.0   # a reset: a new stretch
                times.append(when)
                accumulated.append(total)
                previous = value
            if times:
                self.gpus.append((times, accumulated))

    def __len__(self) -> int:
        return len(self.gpus)

    def joules(self, start: float, end: float) -> float:
        return sum(_at(times, acc, end) - _at(times, acc, start) for times, acc in self.gpus) if end > start else 0.0

    def span(self) -> tuple[float, float] | None:
        if not self.gpus:
            return None
        return min(t[0] for t, _ in self.gpus), max(t[-1] for t, _ in self.gpus)


def _at(times: list[float], accumulated: list[float], when: float) -> float:
    if when <= times[0]:
        return accumulated[0]
    if when >= times[-1]:
        return accumulated[-1]
    index = bisect.bisect_right(times, when)
    t0, t1, a0, a1 = times[index - 1], times[index], accumulated[index - 1], accumulated[index]
    return a0 + (a1 - a0) * (when - t0) / (t1 - t0) if t1 > t0 else a1


def counter_difference(series: dict[str, list[tuple[float, float]]], start: float, end: float) -> float:
    """The counters' own difference: per GPU, its last sample at or before `end` minus its first at or
    after `start` (resets skipped), summed."""
    total = 0.0
    for points in series.values():
        inside = [value for when, value in points if start <= when <= end]
        total += sum(b - a for a, b in zip(inside, inside[1:]) if b >= a)
    return total
