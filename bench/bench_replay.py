"""Replay throughput: records per second through decoding, the guard and the cost meter.

    .venv/bin/python bench/bench_replay.py                 # million-step logs, best of 3
    .venv/bin/python bench/bench_replay.py --records 200000 --repeat 5

It writes healthy logs of `--records` steps, in three record shapes:

  layers   what `trainguard train` writes: envelope, ten training metrics, the gradient norm of each of
           the tiny model's four layer groups (`grad_norm_by_layer`), memory, gpu_count, the monotonic
           clock the cost meter bills by (`system.monotonic_seconds`)
  global   the same without `grad_norm_by_layer` and the monotonic clock (the design's example record,
           and what a trainer that logs only the global norm writes): the guard checks the global norm only
  node     the seed's joined node form: the seed example's record (RFC 3339 time, no step, loss, grad_norm,
           learning_rate, unit strings "78%" and "18GB/s") joined with a node's `hardware.gpus` readings
           for 8 GPUs (unit strings too), about 1 KB a line, as a node's log holds it

and times, for each, each the best of `--repeat` runs, in one process:

  peer    json.loads        the same lines through Python's json, one call per line (the usual way)
          msgspec untyped   msgspec's decoder without a type, the whole file in one call (dicts and lists)
  read    lines only        iterating the file's lines, nothing decoded (the floor)
  decode  one process       trainguard.replay.source.Stream: msgspec typed blocks -> entries
  pick    on every CPU      trainguard.replay.columns.read: chunks decoded and picked by worker processes
  decide  columns           the engine's decider over those chunks already in memory
          guard alone       batch.guard_block over the same chunks (what the engine calls)
          cost alone        batch.meter_block over the same chunks
  decide  lists             the general path's decider over decoded blocks (picked, made columns, decided)
  total   one process       the general path (what merged or compressed logs take), decode + decide
  total   replay LOG        engine.replay(Stream(path)): the decisions of `trainguard replay LOG`
  cli     replay_logs       timeline.replay_logs([path]): all `trainguard replay LOG` does (the decisions, the
                            recorded actions, the replica and stall passes, the LR schedule's check)

and states which of them reach the target (500,000 records/s: a million-step log in two seconds).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import msgspec
from timing import best_of
from trainguard import tls
from trainguard.decide import batch
from trainguard.decide.cost import CostMeter
from trainguard.decide.guard import Guard
from trainguard.policy import Policy
from trainguard.replay import columns, engine, source, timeline
from trainguard.replay.picking import Picker

TARGET = 500_000
START = 1_710_512_538.0


LAYERS = {"embed": 0.5, "h.0": 0.4, "h.1": 0.4, "ln_f": 0.02}   # the tiny model's layer groups, typical norms
SHAPES = ("layers", "global", "node")


def write_log(path: Path, records: int, layers: bool, seed: int = 1) -> None:
    """A healthy run: loss decaying with noise, one step every 0.25 s on 8 GPUs."""
    rng = random.Random(seed)
    with tls.Writer(path) as writer:
        for step in range(1, records + 1):
            by_layer = {"grad_norm_by_layer": {name: norm * (1 + rng.random() * 0.2) for name, norm in LAYERS.items()}}
            writer.write({
                "schema": tls.SCHEMA_ID, "timestamp": tls.format_timestamp(START + step * 0.25),
                "run_id": "bench", "node": "node-0", "rank": 0, "step": step,
                "metrics": {"loss": 3.0 * (1 + 1000 / (step + 1000)) + rng.gauss(0, 0.02),
                            "grad_norm": 0.8 + rng.random() * 0.1, "learning_rate": 3e-4,
                            **(by_layer if layers else {}),
                            "data_wait_seconds": 0.001, "forward_backward_seconds": 0.2,
                            "optimizer_seconds": 0.03, "step_time_seconds": 0.25,
                            "tokens_per_second": 32768.0, "samples_per_second": 64.0, "mfu": 0.41},
                "hardware": {"mem_allocated_bytes": 61_203_000_000, "mem_reserved_bytes": 70_000_000_000},
                "system": {"gpu_count": 8, "world_size": 8,
                           **({"monotonic_seconds": 86_400.0 + step * 0.25} if layers else {})}})


def write_node_log(path: Path, records: int, seed: int = 1) -> None:
    """The seed's joined node form, one record a second: the seed example's fields (no step: replay numbers
    the training records) and 8 GPUs' readings under `hardware.gpus`, written as a plain JSON line each."""
    rng = random.Random(seed)
    with open(path, "w") as out:
        for i in range(records):
            gpus = [{"index": g, "gpu_util": f"{rng.randrange(70, 99)}%", "mem_util": f"{rng.randrange(50, 90)}%",
                     "gpu_temp_c": rng.randrange(55, 70), "gpu_power_w": rng.randrange(500, 700)} for g in range(8)]
            out.write(json.dumps({
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(START) + i)), "node": "node-0",
                "metrics": {"loss": round(2.356 + rng.gauss(0, 0.01), 4), "grad_norm": round(0.87 + rng.random() * 0.05, 3),
                            "learning_rate": 1e-5},
                "hardware": {"gpu_util": "78%", "mem_util": "62%", "gpus": gpus},
                "system": {"last_checkpoint": "step_125000", "data_throughput": "18GB/s"}}) + "\n")


def measure(path: Path, records: int, decide_records: int, repeat: int) -> list[tuple[str, str, int, float]]:
    """(stage, what, records, seconds) for every measurement."""
    policy = Policy()

    def peer_json():
        with open(path, "rb") as handle:
            for line in handle:
                json.loads(line)

    untyped = msgspec.json.Decoder()

    def peer_msgspec():
        with open(path, "rb") as handle:
            untyped.decode_lines(handle.read())

    def read_lines():
        with open(path, "rb") as handle:
            for _ in handle:
                pass

    def decode():
        for _ in source.Stream([path]).blocks():
            pass

    def pick():
        for _ in columns.read(source.Stream([path]), Picker()):
            pass

    def total():
        outcome = engine.replay(source.Stream([path]), policy)
        assert outcome.steps == records and not outcome.actions, "the healthy bench log must decide nothing"

    def cli():
        result = timeline.replay_logs([path], policy)
        assert result.outcome.steps == records and not result.actions, "the healthy bench log must decide nothing"

    def total_one_process():
        decider = engine._Decider(Guard(policy.guard), CostMeter(policy.cost), [])
        assert engine._replay_entries(source.Stream([path]), decider, None).steps == records

    chunks, held = [], 0
    for chunk in columns.read(source.Stream([path]), Picker()):
        chunks.append(chunk)
        held += len(chunk.steps)
        if held >= decide_records:
            break
    blocks = []
    for block in source.Stream([path]).blocks():
        blocks.append(block)
        if sum(map(len, blocks)) >= held:
            break

    class InMemory:     # the decoded blocks as a stream: the general path's engine alone, without decoding
        lead_rank = 0

        def blocks(self):
            return iter(blocks)

    def decide():
        decider = engine._Decider(Guard(policy.guard), CostMeter(policy.cost), [])
        for chunk in chunks:
            decider.decide(chunk)

    def decide_lists():
        engine.replay(InMemory(), policy)

    def guard_alone():
        guard = Guard(policy.guard)
        for chunk in chunks:
            batch.guard_block(guard, chunk)

    def cost_alone():
        meter = CostMeter(policy.cost)
        for chunk in chunks:
            batch.meter_block(meter, chunk)

    return [
        ("peer", "json.loads per line", records, best_of(repeat, peer_json)),
        ("peer", "msgspec untyped, whole file", records, best_of(repeat, peer_msgspec)),
        ("read", "file lines, no decode", records, best_of(repeat, read_lines)),
        ("decode", "one process (msgspec typed)", records, best_of(repeat, decode)),
        ("pick", f"decode + pick on {columns.available_cpus()} CPUs", records, best_of(repeat, pick)),
        ("decide", "columns: guard + cost", held, best_of(repeat, decide)),
        ("", "  batch.guard_block alone", held, best_of(repeat, guard_alone)),
        ("", "  batch.meter_block alone", held, best_of(repeat, cost_alone)),
        ("decide", "lists (one-process path)", sum(map(len, blocks)), best_of(repeat, decide_lists)),
        ("total", "one process (merged, .gz)", records, best_of(repeat, total_one_process)),
        ("total", "replay LOG", records, best_of(repeat, total)),
        ("cli", "replay_logs (trainguard replay)", records, best_of(repeat, cli)),
    ]


def report(shape: str, rows: list[tuple[str, str, int, float]]) -> str:
    peer_rate = rows[0][2] / rows[0][3]
    lines = [f"shape: {shape}",
             f"{'stage':7} {'what':34} {'records':>9} {'seconds':>8} {'records/s':>11} {'us/rec':>7} "
             f"{'x json':>7} {'target':>7}"]
    for stage, what, count, seconds in rows:
        rate = count / seconds
        meets = "yes" if rate >= TARGET else "no"
        lines.append(f"{stage:7} {what:34} {count:9,d} {seconds:8.3f} {rate:11,.0f} {1e6 / rate:7.2f} "
                     f"{rate / peer_rate:7.2f} {meets:>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--decide-records", type=int, default=300_000,
                        help="steps held in memory for the decide-only measurements")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"record shapes to measure ({', '.join(SHAPES)})")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    args = parser.parse_args(argv)
    found = []
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory(prefix="bench-replay-") as folder:
            path = Path(folder) / "rank-0.jsonl"
            if shape == "node":
                path = path.with_name("node-0.jsonl")
                write_node_log(path, args.records)
            else:
                write_log(path, args.records, layers=shape == "layers")
            print(f"log ({shape}): {args.records:,} records, {path.stat().st_size / 1e6:.0f} MB; "
                  f"best of {args.repeat}; target {TARGET:,} records/s", flush=True)
            rows = measure(path, args.records, min(args.decide_records, args.records), args.repeat)
        print(report(shape, rows), flush=True)
        found += [{"shape": shape, "stage": s, "what": w, "records": n, "seconds": t} for s, w, n, t in rows]
    if args.json:
        print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
