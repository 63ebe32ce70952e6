"""Diagnose throughput: how much a diagnosis costs over merely decoding the same logs.

    .venv/bin/python bench/bench_diagnose.py                     # 2 ranks x 100,000 steps, best of 3
    .venv/bin/python bench/bench_diagnose.py --steps 500000 --repeat 1

Writes a 2-rank run (the record shape `trainguard train` writes, a straggler on rank 1 so the checks
find something) plus a node log of GPU samples, then times, each the best of `--repeat` runs:

  peer    json.loads        every line through Python's json (the usual way to read JSON lines)
  decode  tls.iter_lines    trainguard's TLS reader: decode, validate, normalise units (the floor for diagnose)
  load    diagnose.load_run the reader plus the columns the checks read
  checks  diagnose(run)     every check over the loaded columns
  total   diagnose_run      what `trainguard diagnose RUN` does

and reports total / decode (the price of the checks over reading) and total / peer, and peak memory.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import tempfile
from pathlib import Path

from timing import best_of
from trainguard import tls
from trainguard.diagnose import diagnose, diagnose_run, load_run

START = 1_710_512_538.0


def write_run(run_dir: Path, steps: int, seed: int = 1) -> int:
    rng = random.Random(seed)
    for rank in (0, 1):
        with tls.Writer(run_dir / "tls" / f"rank-{rank}.jsonl") as writer:
            for step in range(1, steps + 1):
                compute = (0.30 if rank else 0.20) * (1 + rng.uniform(-0.02, 0.02))
                comm = 0.02 + (0.10 if rank == 0 else 0.0)
                writer.write({
                    "schema": tls.SCHEMA_ID, "timestamp": tls.format_timestamp(START + step * 0.33),
                    "run_id": "bench", "node": "node-0", "rank": rank, "step": step,
                    "metrics": {"loss": 3.0 * (1 + 1000 / (step + 1000)) + rng.gauss(0, 0.02),
                                "grad_norm": 0.8 + rng.random() * 0.1, "learning_rate": 3e-4,
                                "data_wait_seconds": 0.002, "comm_seconds": comm,
                                "forward_backward_seconds": compute * 0.8 + comm, "optimizer_seconds": compute * 0.2,
                                "step_time_seconds": compute + comm + 0.002, "tokens_per_second": 32768.0,
                                "tokens_trained": step * 8192, "tokens_loaded": step * 8192},
                    "hardware": {"mem_allocated_bytes": 61_203_000_000, "mem_reserved_bytes": 70_000_000_000},
                    "system": {"gpu_count": 8, "world_size": 2}})
    samples = int(steps * 0.33 / 5)
    with tls.Writer(run_dir / "tls" / "node-node-0.jsonl") as writer:
        for n in range(samples):
            gpus = [{"gpu": g, "gpu_util": 99, "gpu_temp_c": 60 + g, "sm_clock_mhz": 1980, "mem_used_bytes": 7e10,
                     "mem_total_bytes": 8.5e10, "xid_errors": 0} for g in range(8)]
            writer.write({"timestamp": START + n * 5, "node": "node-0",
                          "hardware": {"gpus": gpus, "disk_await_ms": 1.5 + rng.random()}})
    return 2 * steps + samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100_000, help="steps per rank")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        records = write_run(run_dir, args.steps)
        files = sorted((run_dir / "tls").iterdir())

        def peer():
            for path in files:
                with open(path, "rb") as handle:
                    for line in handle:
                        json.loads(line)

        def decode():
            for path in files:
                for _ in tls.iter_lines(path):
                    pass

        loaded = load_run(run_dir)
        times = {"peer json.loads": best_of(args.repeat, peer), "decode tls.iter_lines": best_of(args.repeat, decode),
                 "load diagnose.load_run": best_of(args.repeat, lambda: load_run(run_dir)),
                 "checks diagnose(run)": best_of(args.repeat, lambda: diagnose(loaded)),
                 "total diagnose_run": best_of(args.repeat, lambda: diagnose_run(run_dir))}
        first = diagnose(loaded)[0]
    print(f"{records:,} records (2 ranks x {args.steps:,} steps + node samples), best of {args.repeat}")
    for name, seconds in times.items():
        print(f"  {name:<24} {seconds:8.3f} s  {records / seconds:>12,.0f} records/s")
    total = times["total diagnose_run"]
    print(f"  total / decode = {total / times['decode tls.iter_lines']:.2f}   "
          f"total / peer = {total / times['peer json.loads']:.2f}")
    print(f"  peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; "
          f"first finding: [{first.layer}] {first.check} {first.status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
