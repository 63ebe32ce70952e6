"""Data layer: the input pipeline starving the step, slow disks under it, loaded tokens never trained on.

Thresholds are the alert rules' (`policy.alerts`): DataLoaderStarved, DiskAwaitHigh, LowDataUtilization.
"""

from __future__ import annotations

from trainguard.diagnose.finding import Finding, no_data, ok, problem
from trainguard.diagnose.loader import RunData
from trainguard.diagnose.stats import (MAX_RANGES, describe, finite, max_window_share, median, prometheus_duration,
                                        rounded, share, stretches, sustained, timed_rows)
from trainguard.policy import Policy

LAYER = "data"


def data_wait(run: RunData, policy: Policy) -> Finding:
    """Share of step time waiting for the next batch, over the whole run or any `min_steps` stretch."""
    check, limit, settings = "data_wait", policy.alerts.data_wait_ratio, policy.diagnose
    found = {}
    for rank, cols in sorted(run.ranks.items()):
        rows = timed_rows(cols, settings.warmup_steps, "data_wait_seconds")
        if len(rows) >= settings.min_steps:
            found[rank] = (share(cols, "data_wait_seconds", rows),
                           max_window_share(cols, "data_wait_seconds", rows, settings.min_steps), rows)
    if not found:
        return no_data(LAYER, check, f"metrics.data_wait_seconds and step_time_seconds on {settings.min_steps}+ "
                                     "steps after warm-up")
    rank = max(found, key=lambda r: (found[r][1], found[r][0]))
    whole, window, rows = found[rank]
    evidence = {"share_by_rank": {str(r): rounded(v[0]) for r, v in found.items()}, "rank": rank,
                "worst_window_share": rounded(window), "window_steps": settings.min_steps, "threshold": limit}
    if whole <= limit and window <= limit:
        return ok(LAYER, check, f"data wait is {whole:.0%} of step time (limit {limit:.0%})", **evidence)
    cols = run.ranks[rank]
    wait = cols.values["data_wait_seconds"]
    # against a typical step, so a step that also stalled elsewhere still shows its wait
    typical = median(cols.values["step_time_seconds"][i] for i in rows)
    evidence["stretches"] = stretches(cols, rows, lambda i: wait[i] > limit * typical)
    how_much = (f"{whole:.0%} of step time" if whole > limit else
                f"{window:.0%} of step time in its worst {settings.min_steps} steps ({whole:.0%} over the run)")
    others = [v[0] for r, v in found.items() if r != rank]
    # One rank starved while the others are not: they wait for it in the all-reduce instead.
    alone = bool(others) and max(others) <= limit and max(others) < whole / 2
    consequence = ("the other ranks wait for it in the all-reduce: a data straggler" if alone
                   else "the input pipeline starves training")
    evidence["straggler"] = alone
    return problem(LAYER, check, f"rank {rank} waits for data {how_much} (limit {limit:.0%}): {consequence}",
                   whole, **evidence)


def disk_await(run: RunData, policy: Policy) -> Finding:
    """Disk await from the agent's IO collector over `alerts.disk_await_ms`, sustained for the alert's `for:`."""
    check, limit = "disk_await", policy.alerts.disk_await_ms
    sustain = prometheus_duration(policy.alerts.for_short)
    worst = None
    for host, cols in sorted(run.nodes.items()):
        awaits = cols.values["disk_await_ms"]
        rows = [i for i in range(len(cols)) if finite(awaits[i])]
        if not rows:
            continue
        high = sustained(cols, rows, lambda i: awaits[i] > limit, sustain)
        above = sum(1 for i in rows if awaits[i] > limit) / len(rows)
        typical = median(awaits[i] for i in rows)
        key = (typical > limit or bool(high), above)
        if worst is None or key > worst[0]:
            worst = (key, host, rows, high, above, typical)
    if worst is None:
        return no_data(LAYER, check, "hardware.disk_await_ms in the agent's node records (RUN/tls/node-<host>.jsonl)")
    (flagged, _), host, rows, high, above, typical = worst
    cols = run.nodes[host]
    evidence = {"host": host, "median_ms": rounded(typical, 3),
                "max_ms": rounded(max(cols.values["disk_await_ms"][i] for i in rows), 3),
                "share_above": rounded(above), "threshold_ms": limit, "sustained_seconds": sustain}
    if not flagged:
        return ok(LAYER, check, f"disk await median {typical:.1f} ms on {host} (limit {limit:g} ms)", **evidence)
    evidence["stretches"] = [describe(cols, stretch) for stretch in high[:MAX_RANGES]]
    return problem(LAYER, check, f"disk await on {host} is over {limit:g} ms for {above:.0%} of samples "
                                 f"(median {typical:.1f} ms): storage is slow", above, **evidence)


def data_utilization(run: RunData, policy: Policy) -> Finding:
    """Tokens trained over tokens loaded (cumulative counters), under `alerts.data_utilization_min`."""
    check, limit = "data_utilization", policy.alerts.data_utilization_min
    ratios = {}
    for rank, cols in sorted(run.ranks.items()):
        trained, loaded = cols.values["tokens_trained"], cols.values["tokens_loaded"]
        last = next((i for i in range(len(cols) - 1, -1, -1)
                     if finite(trained[i]) and finite(loaded[i]) and loaded[i] > 0), None)
        if last is not None:
            ratios[rank] = (trained[last] / loaded[last], int(trained[last]), int(loaded[last]), cols.steps[last])
    if not ratios:
        return no_data(LAYER, check, "metrics.tokens_trained and metrics.tokens_loaded (cumulative counters)")
    rank = min(ratios, key=lambda r: ratios[r][0])
    ratio, trained, loaded, step = ratios[rank]
    evidence = {"ratio_by_rank": {str(r): rounded(v[0]) for r, v in ratios.items()}, "rank": rank,
                "tokens_trained": trained, "tokens_loaded": loaded, "at_step": step, "threshold": limit}
    if ratio >= limit:
        return ok(LAYER, check, f"{ratio:.1%} of loaded tokens were trained on (limit {limit:.0%})", **evidence)
    return problem(LAYER, check, f"rank {rank} trained on {ratio:.1%} of the tokens it loaded (limit {limit:.0%}): "
                                 "skipped or discarded batches waste input bandwidth", 1.0 - ratio, **evidence)


CHECKS = (data_wait, disk_await, data_utilization)
