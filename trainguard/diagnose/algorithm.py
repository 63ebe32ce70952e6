"""Algorithm layer: what the model and its settings do to the run — allocator fragmentation, a loss that
stopped improving, gradient norms drifting up toward instability."""

from __future__ import annotations

from trainguard import actions
from trainguard.diagnose.finding import Finding, no_data, ok, problem
from trainguard.diagnose.loader import Columns, RunData
from trainguard.diagnose.stats import median, rounded, rows_with, stretches
from trainguard.policy import Policy

LAYER = "algorithm"


def fragmentation(run: RunData, policy: Policy) -> Finding:
    """Allocated over reserved memory of the caching allocator under `alerts.fragmentation_min`
    (GPUMemoryFragmented): reserved memory that holds no tensor, lost to batch size or to an OOM."""
    check, limit, warmup = "fragmentation", policy.alerts.fragmentation_min, policy.diagnose.warmup_steps
    worst = None
    for rank, cols in sorted(run.ranks.items()):
        allocated, reserved = cols.values["mem_allocated_bytes"], cols.values["mem_reserved_bytes"]
        rows = [i for i in rows_with(cols, ("mem_allocated_bytes", "mem_reserved_bytes"), warmup) if reserved[i] > 0]
        if not rows:
            continue
        ratio = median(allocated[i] / reserved[i] for i in rows)
        if worst is None or ratio < worst[0]:
            worst = (ratio, rank, rows)
    if worst is None:
        return no_data(LAYER, check, "hardware.mem_allocated_bytes and mem_reserved_bytes > 0 in the rank records "
                                     "(the CUDA caching allocator; a CPU run has none)")
    ratio, rank, rows = worst
    cols = run.ranks[rank]
    allocated, reserved = cols.values["mem_allocated_bytes"], cols.values["mem_reserved_bytes"]
    evidence = {"rank": rank, "median_ratio": rounded(ratio, 3), "threshold": limit,
                "reserved_bytes_median": median(reserved[i] for i in rows),
                "allocated_bytes_median": median(allocated[i] for i in rows)}
    if ratio >= limit:
        return ok(LAYER, check, f"allocated/reserved memory is {ratio:.2f} (limit {limit})", **evidence)
    evidence["stretches"] = stretches(cols, rows, lambda i: allocated[i] < limit * reserved[i])
    return problem(LAYER, check, f"rank {rank}'s caching allocator holds {1 / ratio:.1f}x the memory its tensors use "
                                 f"(allocated/reserved {ratio:.2f} < {limit}): fragmented; try "
                                 "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                   1.0 - ratio, **evidence)


def _loss_rows(run: RunData, field: str, warmup: int) -> tuple[int, Columns, list[int]] | None:
    """The lowest rank's rows with `field` (loss and grad norm are global: every rank logs the same)."""
    for rank in sorted(run.ranks):
        cols = run.ranks[rank]
        rows = rows_with(cols, (field,), warmup)
        if rows:
            return rank, cols, rows
    return None


def loss_plateau(run: RunData, policy: Policy) -> Finding:
    """Median loss of the last window's second half against its first half: under
    `plateau_min_improvement` relative improvement, the steps buy nothing."""
    check, settings = "loss_plateau", policy.diagnose
    window = settings.plateau_window_steps
    found = _loss_rows(run, "loss", settings.warmup_steps)
    if found is None or len(found[2]) < window:
        have = 0 if found is None else len(found[2])
        return no_data(LAYER, check, f"metrics.loss on {window}+ steps after warm-up (found {have})")
    rank, cols, rows = found
    loss = cols.values["loss"]
    first, second = rows[-window:-window // 2], rows[-window // 2:]
    before, after = median(loss[i] for i in first), median(loss[i] for i in second)
    improvement = (before - after) / abs(before) if before else 0.0
    evidence = {"rank": rank, "steps": [cols.steps[first[0]], cols.steps[second[-1]]],
                "median_loss_before": rounded(before), "median_loss_after": rounded(after),
                "improvement": rounded(improvement), "threshold": settings.plateau_min_improvement}
    if improvement >= settings.plateau_min_improvement:
        return ok(LAYER, check, f"loss improved {improvement:.1%} over the last {window} steps", **evidence)
    return problem(LAYER, check, f"loss has stopped improving: {improvement:+.2%} over the last {window} steps "
                                 f"(steps {evidence['steps'][0]}-{evidence['steps'][1]}); steps spent buy nothing",
                   window / len(rows), **evidence)


def grad_norm_trend(run: RunData, policy: Policy) -> Finding:
    """Median gradient norm of the last quarter of steps over the second quarter (the first is warm-up-ish):
    a norm that keeps growing precedes loss spikes and skipped steps."""
    check, settings = "grad_norm_trend", policy.diagnose
    found = _loss_rows(run, "grad_norm", settings.warmup_steps)
    need = 4 * settings.min_steps
    if found is None or len(found[2]) < need:
        have = 0 if found is None else len(found[2])
        return no_data(LAYER, check, f"metrics.grad_norm on {need}+ steps after warm-up (found {have})")
    rank, cols, rows = found
    norm = cols.values["grad_norm"]
    quarter = len(rows) // 4
    second, last = rows[quarter:2 * quarter], rows[-quarter:]
    early, late = median(norm[i] for i in second), median(norm[i] for i in last)
    ratio = late / early if early > 0 else float("inf")
    # one rank's own events: every rank logs the same guard decision, and the agent may echo it
    guard = [e["event"]["type"] for e in run.events
             if e.get("rank") == rank and e["event"].get("type") in (actions.SKIP_STEP, actions.ROLLBACK)]
    evidence = {"rank": rank, "median_second_quarter": rounded(early), "median_last_quarter": rounded(late),
                "ratio": rounded(ratio, 3), "threshold": settings.grad_trend_max_ratio,
                "steps": [cols.steps[second[0]], cols.steps[last[-1]]],
                "skipped_steps": guard.count(actions.SKIP_STEP), "rollbacks": guard.count(actions.ROLLBACK)}
    if ratio <= settings.grad_trend_max_ratio:
        return ok(LAYER, check, f"gradient norm moved {ratio:.2f}x from the second to the last quarter", **evidence)
    return problem(LAYER, check, f"gradient norm grew {ratio:.1f}x from the second to the last quarter of the run "
                                 f"(limit {settings.grad_trend_max_ratio}x): training is drifting toward "
                                 "instability; lower the LR or check clipping", 1.0 - 1.0 / ratio, **evidence)


CHECKS = (fragmentation, loss_plateau, grad_norm_trend)
