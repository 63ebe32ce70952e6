"""Recorded-run builders for the diagnose tests: TLS files with one known cause each.

Each scenario writes what the trainer (rank files) and the agent (node files) write, through
`trainguard.tls.Writer`, with deterministic noise so the healthy parts look like a real run rather
than flat lines. The numbers mirror the bundled trainer's: slow IO is `trainer/faults.py`'s SLOWIO
(0.5 s per batch for 5 steps); a straggler's peers wait for it inside the all-reduce, as DDP does.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from trainguard import tls

START = 1_700_000_000.0
STEPS = 60


@dataclass
class Step:
    """One rank's step; times in seconds, memory in bytes."""

    compute: float = 0.100      # forward + backward + optimizer, without waits
    data_wait: float = 0.004
    comm: float = 0.008
    loss: float = 0.0
    grad_norm: float = 1.0
    allocated: float = 0.0      # 0: a CPU run, no caching allocator
    reserved: float = 0.0
    extra: dict = field(default_factory=dict)


def healthy(step: int, rank: int, rng: random.Random) -> Step:
    jitter = 1.0 + rng.uniform(-0.03, 0.03)
    return Step(compute=0.100 * jitter, data_wait=0.004 * jitter, comm=0.008 * jitter,
                loss=4.0 * math.exp(-step / 40) + 1.5 + rng.uniform(-0.01, 0.01),
                grad_norm=1.0 + rng.uniform(-0.05, 0.05),
                allocated=30e9 * jitter, reserved=34e9)


def write_ranks(run_dir: Path, steps: dict[int, list[Step]], node: str = "node-a") -> None:
    """rank-<r>.jsonl from per-rank step lists; each rank's clock advances by its own step times."""
    for rank, rows in steps.items():
        now = START
        with tls.Writer(run_dir / "tls" / f"rank-{rank}.jsonl") as writer:
            for number, s in enumerate(rows, 1):
                step_time = s.compute + s.data_wait + s.comm
                now += step_time
                metrics = {"loss": s.loss, "grad_norm": s.grad_norm, "step_time_seconds": step_time,
                           "data_wait_seconds": s.data_wait, "comm_seconds": s.comm,
                           "forward_backward_seconds": s.compute * 0.8 + s.comm,
                           "optimizer_seconds": s.compute * 0.2,
                           "tokens_trained": number * 512, "tokens_loaded": number * 512, **s.extra}
                hardware = {"mem_allocated_bytes": s.allocated, "mem_reserved_bytes": s.reserved} \
                    if s.reserved else {"rss_bytes": 900e6}
                writer.write({"timestamp": now, "run_id": "t", "node": node, "rank": rank, "step": number,
                              "metrics": metrics, "hardware": hardware})


def run_of(make, ranks: int = 2, steps: int = STEPS, seed: int = 7) -> dict[int, list[Step]]:
    rng = random.Random(seed)
    return {rank: [make(step, rank, rng) for step in range(1, steps + 1)] for rank in range(ranks)}


def write_nodes(run_dir: Path, samples: list[dict], host: str = "node-a", interval: float = 5.0) -> None:
    """node-<host>.jsonl: one joined agent record per interval, `hardware` given per sample."""
    with tls.Writer(run_dir / "tls" / f"node-{host}.jsonl") as writer:
        for n, hardware in enumerate(samples):
            writer.write({"timestamp": START + n * interval, "node": host, "hardware": hardware})


# ---------------------------------------------------------------------------------------- scenarios

def slow_io(step: int, rank: int, rng: random.Random) -> Step:
    s = healthy(step, rank, rng)
    if 20 <= step < 25:        # slowio@20: 0.5 s per batch for 5 steps, every rank
        s.data_wait += 0.5
    return s


def straggler(step: int, rank: int, rng: random.Random) -> Step:
    """Rank 1 computes 2.2x slower; rank 0 waits for it in the all-reduce, so its comm time grows."""
    s = healthy(step, rank, rng)
    slow = s.compute * 2.2
    if rank == 1:
        s.compute = slow
    else:
        s.comm += slow - s.compute
    return s


def fragmented(step: int, rank: int, rng: random.Random) -> Step:
    s = healthy(step, rank, rng)
    s.reserved = 62e9          # 30 GB of tensors in 62 GB of allocator segments
    return s


def comm_heavy(step: int, rank: int, rng: random.Random) -> Step:
    """A small model over a slow interconnect: the all-reduce is 40% of every rank's step."""
    s = healthy(step, rank, rng)
    s.comm = 0.075 * (1.0 + rng.uniform(-0.03, 0.03))
    return s
