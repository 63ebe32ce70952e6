"""Write the incidents that a CPU-only machine cannot record: cost tiers, overheating, IO stall, fragmentation.

    .venv/bin/python tests/incidents/synthesize.py            # all of them
    .venv/bin/python tests/incidents/synthesize.py io-stall   # one

Each is a TLS log written with trainguard's own writer, in the shape the trainer (rank-0.jsonl) or the
agent (node-<host>.jsonl) writes, with timestamps and readings chosen so the incident is unambiguous:
the cost tiers by the pace of steps on 8 GPUs against the default policy, the hardware incidents by
node-log readings every 5 s. The values are deterministic (a seeded generator), so a rerun writes the
same bytes; expect.yml beside each log is written by hand and never generated.
"""

from __future__ import annotations

import gzip
import io
import math
import random
import sys
from pathlib import Path

from trainguard import tls

HERE = Path(__file__).resolve().parent
T0 = 1_710_512_538.0            # 2024-03-15T14:22:18Z
GPUS = 8
NODE = "gpu-node-1"


def training_record(step: int, when: float, rng: random.Random, *, rank: int = 0, **hardware) -> dict:
    loss = 2.2 + 1.5 * math.exp(-step / 150) + rng.gauss(0, 0.01)
    return {"schema": tls.SCHEMA_ID, "timestamp": tls.format_timestamp(when), "run_id": "synthetic",
            "node": NODE, "rank": rank, "step": step,
            "metrics": {"loss": loss, "grad_norm": 0.9 + rng.random() * 0.1, "learning_rate": 3e-4,
                        "step_time_seconds": 0.0, "tokens_per_second": 0.0},
            "hardware": hardware, "system": {"gpu_count": GPUS, "world_size": GPUS}}


def cost_log(slow_seconds: float) -> list[dict]:
    """100 steps at 25 s (8 GPUs x $2/h: $111 per 1000 steps, under the $120 budget), then 200 at `slow_seconds`."""
    rng = random.Random(7)
    records, when = [], T0
    for step in range(1, 301):
        when += 25.0 if step <= 100 else slow_seconds
        record = training_record(step, when, rng)
        record["metrics"]["step_time_seconds"] = 25.0 if step <= 100 else slow_seconds
        records.append(record)
    return records


def node_record(when: float, gpus: list[dict], **hardware) -> dict:
    return {"schema": tls.SCHEMA_ID, "timestamp": tls.format_timestamp(when), "node": NODE,
            "hardware": {"gpus": gpus, **hardware}, "system": {"gpu_count": len(gpus)}}


def gpu(index: int, temp: float, rng: random.Random) -> dict:
    return {"gpu": index, "uuid": f"GPU-00000000-0000-0000-0000-00000000000{index}", "lost": False,
            "gpu_util": 97.0 + rng.random(), "gpu_temp_c": round(temp + rng.gauss(0, 0.3), 1),
            "gpu_power_w": 650.0 + rng.random() * 20}


def overheating() -> list[dict]:
    """GPU 3 climbs from 72 to 91 degC from +4m, holds 91 to +12m, cools by +14m; 20 minutes every 5 s."""
    rng = random.Random(3)
    records = []
    for tick in range(240):
        seconds = tick * 5.0
        hot = 72.0 + 19.0 * min(1.0, max(0.0, (seconds - 240) / 120)) if seconds < 720 else \
            max(72.0, 91.0 - 19.0 * (seconds - 720) / 120)
        records.append(node_record(T0 + seconds, [gpu(i, hot if i == 3 else 70.0, rng) for i in range(GPUS)]))
    return records


def io_stall() -> list[dict]:
    """Disk await 1.5 ms, 40 ms from +5m to +12m (a stalled dataset disk), then 1.5 ms; 20 minutes every 5 s."""
    rng = random.Random(5)
    records = []
    for tick in range(240):
        seconds = tick * 5.0
        await_ms = 40.0 if 300 <= seconds < 720 else 1.5
        records.append(node_record(T0 + seconds, [gpu(i, 70.0, rng) for i in range(GPUS)],
                                   disk_await_ms=round(await_ms + rng.random() * 0.5, 3)))
    return records


def fragmentation() -> list[dict]:
    """A GPU trainer's steps every 2 s; allocated/reserved falls from 0.92 to 0.55 at +6m, back at +14m."""
    rng = random.Random(11)
    reserved = 70_000_000_000
    records = []
    for step in range(1, 601):
        seconds = step * 2.0
        ratio = 0.55 if 360 <= seconds < 840 else 0.92
        allocated = int(reserved * (ratio + rng.gauss(0, 0.005)))
        records.append(training_record(step, T0 + seconds, rng, mem_allocated_bytes=allocated,
                                       mem_reserved_bytes=reserved, mem_peak_bytes=reserved))
    return records


INCIDENTS = {
    "cost-warn": ("rank-0.jsonl.gz", lambda: cost_log(36.5)),       # +35% over budget
    "cost-throttle": ("rank-0.jsonl.gz", lambda: cost_log(45.0)),   # +67%
    "cost-stop": ("rank-0.jsonl.gz", lambda: cost_log(58.0)),       # +115%
    "overheating": (f"node-{NODE}.jsonl.gz", overheating),
    "io-stall": (f"node-{NODE}.jsonl.gz", io_stall),
    "memory-fragmentation": ("rank-0.jsonl.gz", fragmentation),
}


def write(name: str) -> Path:
    filename, make = INCIDENTS[name]
    buffer = io.BytesIO()
    for record in make():
        buffer.write(tls.encode(record))
    path = HERE / name / filename
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(gzip.compress(buffer.getvalue(), compresslevel=9, mtime=0))
    return path


def main(argv: list[str]) -> int:
    names = argv or list(INCIDENTS)
    unknown = [name for name in names if name not in INCIDENTS]
    if unknown:
        print(f"unknown incident(s) {unknown}; known: {', '.join(INCIDENTS)}", file=sys.stderr)
        return 2
    for name in names:
        path = write(name)
        print(f"{path.relative_to(HERE)}  {path.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
