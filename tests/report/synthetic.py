"""A synthetic run directory written through the TLS writer, for report and status tests.

Not a fake of any component: it is a log, shaped as the TLS v1 contract says the trainer and the agent
write one, with the events a guarded run produces (checkpoints, a spike, a skip, an alert, a rollback).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from trainguard.tls import Writer, event, make_record

T0 = 1_710_512_538.0   # 2024-03-15T14:22:18Z


def loss_at(step: int) -> float:
    return 4.0 * math.exp(-step / 60) + 1.5 + 0.03 * math.sin(step)


def write_run(root: Path, steps: int = 120, ranks: int = 2, gpus: int = 2, spike_at: int | None = 80,
              step_seconds: float = 0.5, malformed: int = 1, node: bool = True) -> Path:
    tls = root / "tls"
    writers = [Writer(tls / f"rank-{r}.jsonl") for r in range(ranks)]
    for step in range(1, steps + 1):
        ts = T0 + step * step_seconds
        loss = loss_at(step) * (8.0 if step == spike_at else 1.0)
        for rank, writer in enumerate(writers):
            writer.write(make_record(step=step, timestamp=ts, run_id="synthetic", rank=rank, metrics={
                "loss": loss, "grad_norm": 0.9 + 0.1 * math.cos(step), "learning_rate": 3e-4 * min(1, step / 20),
                "tokens_per_second": 12000 + 200 * math.sin(step / 5), "mfu": 0.41, "step_time_seconds": 0.34,
                "data_wait_seconds": 0.02, "forward_backward_seconds": 0.25, "optimizer_seconds": 0.03,
                "comm_seconds": 0.04, "tokens_trained": step * 4096},
                system={"gpu_count": gpus * 1, "last_checkpoint": f"step_{step // 20 * 20}"}))
            if step == spike_at:
                writer.write(event("fault_injected", step=step, timestamp=ts, fault="spike", rank=rank))
                writer.write(event("skip_step", step=step, timestamp=ts + 0.01, reason="loss_spike", rank=rank))
            if step % 20 == 0:
                writer.write(event("checkpoint_saved", step=step, timestamp=ts + 0.05, path=f"step_{step}",
                                   rank=rank))
            if spike_at and step == spike_at + 10:
                writer.write(event("rollback", step=step, timestamp=ts, reason="repeated_bad_steps",
                                   to_checkpoint="step_80", rank=rank))
    for writer in writers:
        writer.close()
    if node:
        with Writer(tls / "node-host-a.jsonl") as writer:
            for i in range(int(steps * step_seconds) + 1):
                ts = T0 + i
                writer.write(make_record(timestamp=ts, node="host-a", run_id="synthetic", hardware={
                    "disk_await_ms": 2.0 + (i % 7), "gpus": [
                        {"index": g, "name": "NVIDIA H100 80GB HBM3", "gpu_util": 90 - 5 * g + (i % 5),
                         "mem_util": 40.0, "mem_used_bytes": (30 + g) * 2**30, "gpu_temp_c": 60 + g + i / 20,
                         "gpu_power_w": 500 + 10 * g} for g in range(gpus)]},
                    system={"data_throughput": 2e9, "gpu_count": gpus,
                            "nccl_events": {"error": 0, "watchdog_timeout": 0, "init": ranks}}))
            if spike_at:
                ts = T0 + spike_at * step_seconds + 3
                writer.write(event("alert", timestamp=ts, node="host-a", alertname="LossSpike", status="firing",
                                   severity="critical", action="rollback"))
                writer.write(event("alert", timestamp=ts + 30, node="host-a", alertname="LossSpike",
                                   status="resolved"))
    if malformed:
        with open(tls / "rank-0.jsonl", "ab") as handle:
            for _ in range(malformed):
                handle.write(b'{"timestamp": "not a time", "metrics": {}}\n')
    for step in range(20, steps + 1, 20):
        ckpt = root / "checkpoints" / f"step_{step}"
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / "manifest.json").write_text(json.dumps({"format": "trainguard-checkpoint/2", "step": step, "files": {},
                                                        "signature": {"value": "0" * 64}}))
    return root
