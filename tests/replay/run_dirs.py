"""Run directories for the replay tests (test_parallel.py, test_stall_pass.py): rank logs beside node logs
that say other GPU counts at other times, lead steps that say no GPU count of their own (a CPU run),
rotated and compressed parts, malformed and step-less lines, files whose times go back, recorded
decisions, a hang; and the replay document made both ways (the merged stream, the parallel path)."""

from __future__ import annotations

import gzip
import json
import math
import random
from pathlib import Path

import zstandard

from trainguard import tls
from trainguard.policy import CostPolicy, CostTiers, Policy
from trainguard.replay import engine, parallel, timeline

T0 = 1_710_512_538.0
LAYERS = ("embed", "h.0", "h.1", "ln_f")
POLICY = Policy(cost=CostPolicy(budget_per_1k_steps=1.2, tiers=CostTiers(warn=0.3, throttle=0.6, stop=1.0)))


def rank_records(rank: int, steps: int, rng: random.Random, *, world: int, own_gpus: bool, start: float,
                 faults: bool, hang_at: int | None, clock_back: bool = False, gap: bool = False, samples: int = 0):
    """One rank's trainer records (the shape runtime/telemetry.py writes), with faults and events."""
    when, clock = start, 5000.0
    step = 0
    for i in range(steps):
        step += 1
        when += 0.5                               # every rank at the same times: ties across files
        if hang_at is not None and i == hang_at:
            when += 400.0                         # no step for minutes: a hang, then the run goes on
        if faults and i == steps // 2:
            step -= 7                             # a rollback: the steps go back
        if faults and rng.random() < 0.02:
            when -= 2.0                           # the wall clock stepped back
        if clock_back and rank == 1 and i == steps // 2:
            when -= 60.0                          # ... by a minute: this rank's next records wait in the merge
        loss = 3.0 + rng.gauss(0, 0.02)
        if faults and rng.random() < 0.03:
            loss = rng.choice([math.nan, 80.0])
        grad = 400.0 if faults and rng.random() < 0.01 else 0.8 + rng.random() * 0.1
        system = {"world_size": world, "monotonic_seconds": clock + i * 0.5}
        if own_gpus and (i > 3 or rank != 0 or not gap):     # gap: the first lead steps say none
            system["gpu_count"] = world
        if clock_back and rank == 1:          # told apart in the bill: before and after its clock stepped back
            system["gpu_count"] = 50 if i < steps // 2 else 70
        record = {"schema": tls.SCHEMA_ID, "timestamp": round(when, 3), "run_id": "r", "node": f"n{rank // 2}",
                  "rank": rank, "step": step,
                  "metrics": {"loss": loss, "grad_norm": grad, "learning_rate": 3e-4,
                              "grad_norm_by_layer": {name: 0.1 + rng.random() * 0.05 for name in LAYERS},
                              "step_time_seconds": 0.5, "tokens_per_second": 1000.0},
                  "hardware": {"mem_allocated_bytes": 10_000}, "system": system}
        if faults and rng.random() < 0.03:
            del record["step"]                    # the seed form: the step after the file's last
        if faults and rng.random() < 0.02:
            del record["metrics"]["grad_norm"]    # a partial step
        if samples and rank == 0 and i % samples == 0:    # the lead rank's own sample: a count, no step
            yield {"schema": tls.SCHEMA_ID, "timestamp": round(when, 3), "run_id": "r", "rank": 0,
                   "system": {"gpu_count": 1 + (i // samples) % 3}}
        yield record
        if faults and i % 37 == 11:
            yield {"schema": tls.SCHEMA_ID, "timestamp": round(when, 3), "run_id": "r", "rank": rank,
                   "step": step, "event": {"type": "skip_step", "reason": "loss_spike"}}


def node_records(node: str, steps: int, rng: random.Random, *, gpus: int, start: float, faults: bool):
    """An agent's joined node log: the latest step's metrics (no rank), the GPUs it sees, its alerts."""
    when = start - 1.0 + (0.25 if faults else 0.0)    # healthy: at the times of every third step
    for i in range(steps // 3):
        when += 1.5
        record = {"schema": tls.SCHEMA_ID, "timestamp": round(when, 3), "node": node, "run_id": "r",
                  "step": 3 * i + 1, "metrics": {"loss": 3.0, "grad_norm": 0.8},
                  "hardware": {"gpus": [{"index": g, "temp_c": 50} for g in range(gpus)]}}
        if faults and rng.random() < 0.1:
            record["system"] = {"gpu_count": gpus * 2}
        yield record
        if faults and i % 23 == 4:
            yield {"schema": tls.SCHEMA_ID, "timestamp": round(when, 3), "node": node,
                   "event": {"type": "alert", "alertname": "TrainingStalled", "status": "firing",
                             "source": "embedded", "outcome": "act", "action": "restore", "key": f"k{i}"}}
            yield {"schema": tls.SCHEMA_ID, "timestamp": round(when, 3), "node": node,
                   "event": {"type": "action", "action": "restore", "id": f"restore-{i}", "issued_at": when,
                             "alertname": "TrainingStalled", "ended": [{"rank": 0}]}}


def write_lines(path: Path, records, rng: random.Random, *, bad: float) -> None:
    lines = []
    for record in records:
        lines.append(tls.encode(record))
        if bad and rng.random() < bad:
            lines.append(rng.choice([b"{not json\n", b'{"timestamp": "yesterday", "step": 1}\n',
                                     b'{"timestamp": 1710512540.0, "metrics": {"grad_norm_by_layer": {"a": "x"}}}\n',
                                     # malformed for replay's decisions, an alert all the same for the recorded pass
                                     b'{"timestamp": 1710512541.0, "metrics": {"grad_norm_by_layer": {"a": "x"}}, '
                                     b'"event": {"type": "alert", "alertname": "Odd", "status": "firing"}}\n']))
    data = b"".join(lines)
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    elif path.name.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)


def build_run(root: Path, seed: int, *, ranks: int = 3, nodes: int = 1, steps: int = 300, rotate: int = 0,
              compress: str = ".gz", own_gpus: bool = True, faults: bool = True, bad: float = 0.01,
              hang: bool = False, start: float = T0, control: bool = True, clock_back: bool = False,
              gap: bool = True, samples: int = 0) -> Path:
    rng = random.Random(seed)
    folder = root / "tls"
    folder.mkdir(parents=True)
    hang_at = steps // 3 if hang else None
    for rank in range(ranks):
        records = list(rank_records(rank, steps, rng, world=ranks, own_gpus=own_gpus, start=start,
                                    faults=faults, hang_at=hang_at, clock_back=clock_back, gap=gap,
                                    samples=samples))
        parts = [records]
        if rank == 0 and rotate:               # rotated parts, oldest first: rank-0.jsonl.N<suffix>, .., live
            size = len(records) // (rotate + 1)
            parts = [records[i * size:(i + 1) * size] for i in range(rotate)] + [records[rotate * size:]]
        for number, part in zip(range(len(parts) - 1, -1, -1), parts):
            name = f"rank-{rank}.jsonl" + (f".{number}{compress}" if number else "")
            write_lines(folder / name, part, rng, bad=bad)
    for node in range(nodes):
        write_lines(folder / f"node-n{node}.jsonl",
                    node_records(f"n{node}", steps, rng, gpus=4 + node, start=start, faults=faults), rng, bad=bad)
    if control:
        (root / "control").mkdir()
        (root / "control" / "actions.jsonl").write_text(
            json.dumps({"id": "restore-4", "action": "restore", "issued_at": start + 9.0,
                        "alertname": "TrainingStalled"}) + "\n")
    return root


def document(inputs, *, one_process: bool, monkeypatch) -> str:
    if one_process:
        monkeypatch.setenv(parallel.ONE_PROCESS_ENV, "1")
    else:
        monkeypatch.delenv(parallel.ONE_PROCESS_ENV, raising=False)
    try:
        return json.dumps(timeline.replay_logs(inputs, POLICY).to_json(), indent=1)
    finally:
        monkeypatch.delenv(parallel.ONE_PROCESS_ENV, raising=False)


def both_ways(inputs, monkeypatch, *, side_by_side: bool = True) -> str:
    """The document both ways, equal as text; `side_by_side`: the run must not be handed to the merged stream."""
    reference = document(inputs, one_process=True, monkeypatch=monkeypatch)
    handed_over = []
    original = engine._replay_entries
    monkeypatch.setattr(engine, "_replay_entries", lambda *a: handed_over.append(1) or original(*a))
    found = document(inputs, one_process=False, monkeypatch=monkeypatch)
    monkeypatch.setattr(engine, "_replay_entries", original)
    assert found == reference
    assert bool(handed_over) is not side_by_side
    return found
