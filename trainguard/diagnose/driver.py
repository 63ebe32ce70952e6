"""Driver layer: device memory the driver hands out growing while the training process's own allocator
does not — a leak below PyTorch (driver, CUDA context, NCCL buffers, another process on the GPU)."""

from __future__ import annotations

from trainguard.diagnose.finding import Finding, no_data, ok, problem
from trainguard.diagnose.loader import Columns, RunData
from trainguard.diagnose.stats import median
from trainguard.tls import format_timestamp

LAYER = "driver"
EDGE = 0.1     # the first and last tenth of the common time span are compared, medians against noise


def _edges(cols: Columns, name: str, start: float, end: float) -> tuple[float, float] | None:
    """Median of `name` over the first and the last tenth of [start, end] (at least the one sample
    nearest each end, for sparse series such as the agent's 5 s samples)."""
    edge = (end - start) * EDGE
    ts, values = cols.timestamps, cols.values[name]
    inside = [i for i in range(len(cols)) if start <= ts[i] <= end and values[i] == values[i]]
    if len(inside) < 2:
        return None
    early = [values[i] for i in inside if ts[i] <= start + edge] or [values[inside[0]]]
    late = [values[i] for i in inside if ts[i] >= end - edge] or [values[inside[-1]]]
    return median(early), median(late)


def memory_growth(run: RunData, policy) -> Finding:
    """Per host: growth of NVML's device memory used (all its GPUs) minus growth of the allocator's
    reserved memory (all its ranks), over the span both were sampled; over `diagnose.leak_min_bytes`."""
    check, limit = "memory_growth", policy.diagnose.leak_min_bytes
    worst = None
    for host in sorted({h for h, _ in run.gpus}):
        gpus = [cols for (h, _), cols in run.gpus.items() if h == host and cols.has("mem_used_bytes")]
        ranks = [cols for r, cols in run.ranks.items() if run.rank_nodes.get(r, host) == host
                 and cols.has("mem_reserved_bytes")]
        if not gpus or not ranks:
            continue
        start = max(min(c.timestamps) for c in gpus + ranks)
        end = min(max(c.timestamps) for c in gpus + ranks)
        if end <= start:
            continue
        used = [_edges(c, "mem_used_bytes", start, end) for c in gpus]
        reserved = [_edges(c, "mem_reserved_bytes", start, end) for c in ranks]
        if None in used or None in reserved:
            continue
        device_growth = sum(b - a for a, b in used)
        own_growth = sum(b - a for a, b in reserved)
        unexplained = device_growth - own_growth
        if worst is None or unexplained > worst[0]:
            total = sum(median(c.values["mem_total_bytes"]) for c in gpus)
            worst = (unexplained, host, device_growth, own_growth, start, end, total if total == total else 0.0)
    if worst is None:
        return no_data(LAYER, check, "device memory used (hardware.gpus[].mem_used_bytes from the agent) and the "
                                     "allocator's reserved memory (hardware.mem_reserved_bytes from the ranks) "
                                     "over the same time span")
    unexplained, host, device_growth, own_growth, start, end, total = worst
    evidence = {"host": host, "device_used_growth_bytes": round(device_growth),
                "allocator_reserved_growth_bytes": round(own_growth), "unexplained_bytes": round(unexplained),
                "threshold_bytes": limit, "from": format_timestamp(start), "to": format_timestamp(end)}
    if unexplained <= limit:
        return ok(LAYER, check, f"device memory on {host} grew {device_growth / 2**20:.0f} MiB, matched by the "
                                "allocator", **evidence)
    share = unexplained / total if total else unexplained / max(device_growth, 1.0)
    return problem(LAYER, check, f"device memory used on {host} grew {unexplained / 2**30:.2f} GiB more than the "
                                 "training processes reserved: memory is leaking below PyTorch (driver, NCCL, "
                                 "another process)", share, **evidence)


CHECKS = (memory_growth,)
