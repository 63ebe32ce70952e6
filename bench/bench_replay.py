"""Replay throughput: records per second through decoding, the guard and the cost meter.

    .venv/bin/python bench/bench_replay.py                 # a million-step log, best of 3
    .venv/bin/python bench/bench_replay.py --records 200000 --repeat 5

It writes a healthy trainer log of `--records` steps with trainguard's own TLS writer (the record shape
`trainguard train` writes: envelope, ten training metrics, memory, gpu_count), then times, each the
best of `--repeat` runs, in one process:

  peer   json.loads       the same lines through Python's json, one call per line (the usual way)
  read   lines only       iterating the file's lines, nothing decoded (the floor)
  decode replay source    trainguard.replay.source.Stream: msgspec typed blocks -> entries
  decide replay engine    trainguard.replay.engine.replay over entries already in memory
         guard alone      Guard.check over the same steps (trainguard.decide, the lead's code)
         cost alone       CostMeter.observe over the same steps
  total  decode + decide  engine.replay(Stream(path)): what `trainguard replay LOG` does

and states which of them reach the target (500,000 records/s: a million-step log in two seconds).
`--breakdown` also times the guard's and the cost meter's inner methods one by one (their private
names: a diagnosis for the decide code's owner, not an interface); each row includes the loop's own
call of a lambda, which the last row ("a method call that does nothing") measures alone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from trainguard import tls
from trainguard.decide.cost import CostMeter
from trainguard.decide.guard import Guard
from trainguard.policy import Policy
from trainguard.replay import engine, source

TARGET = 500_000
START = 1_710_512_538.0


def write_log(path: Path, records: int, seed: int = 1) -> None:
    """A healthy run: loss decaying with noise, one step every 0.25 s on 8 GPUs."""
    rng = random.Random(seed)
    with tls.Writer(path) as writer:
        for step in range(1, records + 1):
            writer.write({
                "schema": tls.SCHEMA_ID, "timestamp": tls.format_timestamp(START + step * 0.25),
                "run_id": "bench", "node": "node-0", "rank": 0, "step": step,
                "metrics": {"loss": 3.0 * (1 + 1000 / (step + 1000)) + rng.gauss(0, 0.02),
                            "grad_norm": 0.8 + rng.random() * 0.1, "learning_rate": 3e-4,
                            "data_wait_seconds": 0.001, "forward_backward_seconds": 0.2,
                            "optimizer_seconds": 0.03, "step_time_seconds": 0.25,
                            "tokens_per_second": 32768.0, "samples_per_second": 64.0, "mfu": 0.41},
                "hardware": {"mem_allocated_bytes": 61_203_000_000, "mem_reserved_bytes": 70_000_000_000},
                "system": {"gpu_count": 8, "world_size": 8}})


def best_of(repeat: int, run) -> float:
    best = float("inf")
    for _ in range(repeat):
        began = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - began)
    return best


def measure(path: Path, records: int, decide_records: int, repeat: int) -> list[tuple[str, str, int, float]]:
    """(stage, what, records, seconds) for every measurement."""
    policy = Policy()

    def peer_json():
        with open(path, "rb") as handle:
            for line in handle:
                json.loads(line)

    def read_lines():
        with open(path, "rb") as handle:
            for _ in handle:
                pass

    def decode():
        for _ in source.Stream([path]):
            pass

    def total():
        outcome = engine.replay(source.Stream([path]), policy)
        assert outcome.steps == records and not outcome.actions, "the healthy bench log must decide nothing"

    entries = []
    for entry in source.Stream([path]):
        entries.append(entry)
        if len(entries) == decide_records:
            break
    steps = [(record.step, record.metrics.loss, record.metrics.grad_norm, when) for when, _, _, record, _ in entries]

    def decide():
        engine.replay(entries, policy)

    def guard_alone():
        check = Guard(policy.guard).check
        for step, loss, grad_norm, when in steps:
            check(step, loss, grad_norm, None, when)

    def cost_alone():
        observe = CostMeter(policy.cost).observe
        for step, _, _, when in steps:
            observe(step, when, 8)

    return [
        ("peer", "json.loads per line", records, best_of(repeat, peer_json)),
        ("read", "file lines, no decode", records, best_of(repeat, read_lines)),
        ("decode", "replay source (msgspec typed)", records, best_of(repeat, decode)),
        ("decide", "replay engine: guard + cost", len(entries), best_of(repeat, decide)),
        ("", "  Guard.check alone", len(steps), best_of(repeat, guard_alone)),
        ("", "  CostMeter.observe alone", len(steps), best_of(repeat, cost_alone)),
        ("total", "decode + decide (replay LOG)", records, best_of(repeat, total)),
    ]


def breakdown(steps: list[tuple], repeat: int) -> list[tuple[str, str, int, float]]:
    """Each inner method of the decide code called alone over the same steps (warm state)."""
    policy = Policy()
    warm_guard, warm_meter = Guard(policy.guard), CostMeter(policy.cost)
    for step, loss, grad_norm, when in steps[:200]:
        warm_guard.check(step, loss, grad_norm, None, when)
        warm_meter.observe(step, when, 8)

    def timed(name, call):
        def run():
            for step, loss, grad_norm, when in steps:
                call(step, loss, grad_norm, when)
        return ("", name, len(steps), best_of(repeat, run))

    losses = warm_guard.losses
    sigma = policy.guard.spike_sigma
    return [
        timed("  Guard._classify", lambda s, l, g, t: warm_guard._classify(l, g, None)),
        timed("    _RollingStats.threshold", lambda s, l, g, t: losses.threshold(sigma)),
        timed("  Guard._learn", lambda s, l, g, t: warm_guard._learn(l, g, None)),
        timed("    _RollingStats.push", lambda s, l, g, t: losses.push(l)),
        timed("  CostMeter._judge", lambda s, l, g, t: warm_meter._judge(s, t, 8)),
        timed("  CostMeter.gpus", lambda s, l, g, t: warm_meter.gpus(8)),
        timed("  a method call that does nothing", lambda s, l, g, t: None),
    ]


def report(rows: list[tuple[str, str, int, float]]) -> str:
    peer_rate = rows[0][2] / rows[0][3]
    lines = [f"{'stage':7} {'what':32} {'records':>9} {'seconds':>8} {'records/s':>11} {'us/rec':>7} "
             f"{'x json':>7} {'target':>7}"]
    for stage, what, count, seconds in rows:
        rate = count / seconds
        meets = "yes" if rate >= TARGET else "no"
        lines.append(f"{stage:7} {what:32} {count:9,d} {seconds:8.3f} {rate:11,.0f} {1e6 / rate:7.2f} "
                     f"{rate / peer_rate:7.2f} {meets:>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--decide-records", type=int, default=300_000,
                        help="steps held in memory for the decide-only measurements")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    parser.add_argument("--breakdown", action="store_true", help="time the decide code's inner methods too")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as folder:
        path = Path(folder) / "rank-0.jsonl"
        write_log(path, args.records)
        print(f"log: {args.records:,} records, {path.stat().st_size / 1e6:.0f} MB; "
              f"best of {args.repeat}; target {TARGET:,} records/s", flush=True)
        rows = measure(path, args.records, min(args.decide_records, args.records), args.repeat)
        if args.breakdown:
            steps = [(r.step, r.metrics.loss, r.metrics.grad_norm, when)
                     for when, _, _, r, _ in itertools.islice(source.Stream([path]), args.decide_records)]
            rows += breakdown(steps, args.repeat)
    print(report(rows))
    if args.json:
        print(json.dumps([{"stage": s, "what": w, "records": n, "seconds": t} for s, w, n, t in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
