"""Framework layer: what the training framework's own scheduling costs — collectives, stragglers, jitter.

Time is split so that no cause is counted twice: a step's *compute* is its step time less its data
wait (the data layer's) and its gradient all-reduce time (`comm_seconds`, this layer's comm check).
In data parallel training the fast ranks wait for the slow one inside the all-reduce, so their comm
time holds that wait while their compute time does not — which is what lets the straggler check see
the slow rank and the comm check see only what the collective itself costs.
"""

from __future__ import annotations

import math

from trainguard.decide import straggler
from trainguard.diagnose.finding import Finding, no_data, ok, problem
from trainguard.diagnose.loader import Columns, RunData
from trainguard.diagnose.stats import median, quantile, rounded, share, stretches, timed_rows
from trainguard.policy import Policy

LAYER = "framework"


def compute_seconds(cols: Columns, rows: list[int]) -> list[float]:
    """Step time less data wait and comm on each of `rows` (a wait the record lacks counts as 0)."""
    step_time, wait, comm = (cols.values[name] for name in ("step_time_seconds", "data_wait_seconds", "comm_seconds"))
    out = []
    for i in rows:
        rest = step_time[i] - (wait[i] if wait[i] == wait[i] else 0.0) - (comm[i] if comm[i] == comm[i] else 0.0)
        out.append(rest if rest > 0.0 else 0.0)
    return out


def comm_share(run: RunData, policy: Policy) -> Finding:
    """Share of step time in gradient all-reduce, over `alerts.comm_overhead_max` (CommOverheadHigh)."""
    check, limit, settings = "comm_share", policy.alerts.comm_overhead_max, policy.diagnose
    shares, rows_of = {}, {}
    for rank, cols in sorted(run.ranks.items()):
        rows = timed_rows(cols, settings.warmup_steps, "comm_seconds")
        if len(rows) >= settings.min_steps:
            shares[rank], rows_of[rank] = share(cols, "comm_seconds", rows), rows
    if not shares:
        return no_data(LAYER, check, f"metrics.comm_seconds and step_time_seconds on {settings.min_steps}+ "
                                     "steps after warm-up (the trainer's DDP comm timer)")
    # The rank that waits least for its peers pays only for the collective itself.
    rank = min(shares, key=shares.get)
    evidence = {"share_by_rank": {str(r): rounded(v) for r, v in shares.items()}, "threshold": limit,
                "rank": rank}
    if shares[rank] <= limit:
        return ok(LAYER, check, f"all-reduce takes {shares[rank]:.0%} of step time (limit {limit:.0%})", **evidence)
    cols = run.ranks[rank]
    comm = cols.values["comm_seconds"]
    typical = median(cols.values["step_time_seconds"][i] for i in rows_of[rank])
    evidence["stretches"] = stretches(cols, rows_of[rank], lambda i: comm[i] > limit * typical)
    return problem(LAYER, check, f"gradient all-reduce takes {shares[rank]:.0%} of step time even on the rank "
                                 f"that waits least (rank {rank}; limit {limit:.0%}): communication-bound",
                   shares[rank], **evidence)


def stragglers(run: RunData, policy: Policy) -> Finding:
    """Ranks slower than the fastest, scored as NVRx does: fastest rank's median / this rank's median.

    NVRx (nvidia-resiliency-ext straggler detection) calls this the relative performance score, 1.0 for
    the fastest rank, 0.5 for one twice as slow, and reports ranks under 0.75 as stragglers. Sections
    here are the per-step compute time and, when logged, the optimizer step.
    """
    check, settings = "stragglers", policy.diagnose
    sections: dict[str, dict[int, float]] = {"compute_seconds": {}, "optimizer_seconds": {}}
    step_medians: dict[int, float] = {}
    for rank, cols in sorted(run.ranks.items()):
        rows = timed_rows(cols, settings.warmup_steps)
        if len(rows) < settings.min_steps:
            continue
        step_medians[rank] = median(cols.values["step_time_seconds"][i] for i in rows)
        sections["compute_seconds"][rank] = median(compute_seconds(cols, rows))
        optimizer = median(cols.values["optimizer_seconds"][i] for i in rows)
        if not math.isnan(optimizer):
            sections["optimizer_seconds"][rank] = optimizer
    if len(step_medians) < 2:
        return no_data(LAYER, check, f"step records of 2 or more ranks with {settings.min_steps}+ steps after "
                                     f"warm-up (found {len(step_medians)})")
    scores = {name: straggler.relative_scores(medians) for name, medians in sections.items() if len(medians) >= 2}
    section, rank = min(((s, r) for s in scores for r in scores[s]), key=lambda sr: scores[sr[0]][sr[1]])
    worst = scores[section][rank]
    evidence = {"scores": {s: {str(r): rounded(v, 3) for r, v in by_rank.items()} for s, by_rank in scores.items()},
                "median_seconds": {s: {str(r): rounded(v, 6) for r, v in sections[s].items()} for s in scores},
                "threshold": settings.straggler_score_min}
    if worst >= settings.straggler_score_min:
        return ok(LAYER, check, f"every rank scores {worst:.2f} or better against the fastest", **evidence)
    slow = sorted({r for s in scores for r, v in scores[s].items() if v < settings.straggler_score_min})
    medians = sections[section]
    lost = (medians[rank] - min(medians.values())) / step_medians[rank]
    evidence.update(stragglers=slow, section=section, node=run.rank_nodes.get(rank))
    return problem(LAYER, check, f"rank {rank} is a straggler: its median {section.removesuffix('_seconds')} time "
                                 f"is {1 / worst:.1f}x the fastest rank's (NVRx score {worst:.2f} < "
                                 f"{settings.straggler_score_min}); every rank waits for it",
                   lost, rank=rank, **evidence)


def straggler_windows(run: RunData, policy: Policy) -> Finding:
    """The agent's live straggler score (trainguard/decide/straggler.py: `trainguard_rank_straggler_score`,
    which `TrainingStraggler` alerts on) replayed over the run: a rank under the threshold for at least a
    window of steps straggled then, even when it was fast enough over the whole run for `stragglers`."""
    check, score_min = "straggler_windows", policy.diagnose.straggler_score_min
    board = straggler.StragglerBoard()
    lead = min(run.ranks) if run.ranks else None
    # rank -> its longest stretch of consecutive lead-rank steps scored under the threshold. Consecutive: a
    # rank that dips under it for a few steps now and then (a busy machine's jitter) did not straggle for
    # a stretch, however many such steps add up to (without it, rank 0 was named beside the injected rank 1).
    low: dict[int, list[int]] = {}
    streak: dict[int, list[int]] = {}
    worst: dict[int, straggler.Score] = {}
    rows = _rows_in_time_order(run)
    for rank, i in rows:
        cols = run.ranks[rank]
        step = cols.steps[i]
        board.observe(rank, run.rank_nodes.get(rank, ""), step, {k: cols.values[k][i] for k in _TIMED})
        if rank != lead:
            continue
        scores = board.scores()
        for score in scores:
            if score.rank not in worst or score.relative < worst[score.rank].relative:
                worst[score.rank] = score
        straggling = {score.rank for score in scores if score.straggling(score_min)}
        for other in list(streak):
            if other not in straggling:
                del streak[other]
        for other in straggling:
            streak.setdefault(other, []).append(step)
            if len(streak[other]) > len(low.get(other, ())):
                low[other] = list(streak[other])
    if len(worst) < 2:
        return no_data(LAYER, check, f"step timings of 2 or more ranks with {board.min_steps}+ steps after warm-up")
    evidence = {"lowest_score": {str(r): rounded(s.relative, 3) for r, s in sorted(worst.items())},
                "threshold": score_min, "window_steps": board.window_steps}
    lasting = {rank: steps for rank, steps in low.items() if len(steps) >= board.window_steps}
    whole_run = set(stragglers(run, policy).evidence.get("stragglers", ()))
    if lasting and set(lasting) <= whole_run:    # slow all along: the stragglers check says it already
        return ok(LAYER, check, f"rank(s) {', '.join(map(str, sorted(lasting)))} straggled over the whole run "
                                "(see stragglers), no other rank for a stretch", **evidence)
    lasting = {rank: steps for rank, steps in lasting.items() if rank not in whole_run}
    if not lasting:
        return ok(LAYER, check, f"no rank scored under {score_min} for {board.window_steps}+ steps", **evidence)
    rank = min(lasting, key=lambda r: worst[r].relative)
    steps, slowest = lasting[rank], worst[rank]
    lead_steps = max(1, sum(1 for r, _ in rows if r == lead))
    evidence.update(rank=rank, node=slowest.node or None, steps=[steps[0], steps[-1]], straggling_steps=len(steps),
                    stragglers=sorted(lasting))
    return problem(LAYER, check, f"rank {rank}{' on ' + slowest.node if slowest.node else ''} straggled for "
                                 f"{len(steps)} steps ({steps[0]}–{steps[-1]}): its live score fell to "
                                 f"{slowest.relative:.2f} of the fastest rank's speed (TrainingStraggler "
                                 f"under {score_min})", len(steps) / lead_steps * (1 - slowest.relative), **evidence)


_TIMED = ("step_time_seconds", "data_wait_seconds", "comm_seconds")


def _rows_in_time_order(run: RunData) -> list[tuple[int, int]]:
    """(rank, row) of every step row of every rank, in time order, as the agent reads them live."""
    rows = [(cols.timestamps[i], rank, i) for rank, cols in run.ranks.items() for i in range(len(cols))
            if cols.steps[i] >= 0]
    return [(rank, i) for _, rank, i in sorted(rows)]


def step_jitter(run: RunData, policy: Policy) -> Finding:
    """Time lost to compute steps slower than `slow_step_factor` x the median (GC pauses, recompiles, noisy
    neighbours), as a share of all step time; data waits and comm are other checks' and left out."""
    check, settings = "step_jitter", policy.diagnose
    worst: tuple[float, int, list[int], float] | None = None
    for rank, cols in sorted(run.ranks.items()):
        rows = timed_rows(cols, settings.warmup_steps)
        if len(rows) < settings.min_steps:
            continue
        compute = dict(zip(rows, compute_seconds(cols, rows)))
        typical = median(compute.values())
        slow = [i for i in rows if compute[i] > settings.slow_step_factor * typical]
        total = sum(cols.values["step_time_seconds"][i] for i in rows)
        lost = sum(compute[i] - typical for i in slow) / total if total > 0 else 0.0
        if worst is None or lost > worst[0]:
            worst = (lost, rank, slow, typical)
    if worst is None:
        return no_data(LAYER, check, f"metrics.step_time_seconds on {settings.min_steps}+ steps after warm-up")
    lost, rank, slow, typical = worst
    cols = run.ranks[rank]
    rows = timed_rows(cols, settings.warmup_steps)
    compute = compute_seconds(cols, rows)
    evidence = {"rank": rank, "median_compute_seconds": rounded(typical, 6),
                "p90_compute_seconds": rounded(quantile(compute, 0.9), 6), "slow_steps": len(slow),
                "steps": len(rows), "threshold": settings.jitter_max}
    if lost <= settings.jitter_max:
        return ok(LAYER, check, f"slow steps cost {lost:.0%} of step time (limit {settings.jitter_max:.0%})",
                  **evidence)
    slow_set = set(slow)
    evidence["stretches"] = stretches(cols, rows, lambda i: i in slow_set)
    return problem(LAYER, check, f"{len(slow)} steps on rank {rank} took over {settings.slow_step_factor}x the "
                                 f"median compute time, costing {lost:.0%} of step time", lost, **evidence)


CHECKS = (comm_share, stragglers, step_jitter, straggler_windows)
