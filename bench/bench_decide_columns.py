"""The guard and the cost meter on a block of steps: their own step loops vs `trainguard.decide.batch`.

    .venv/bin/python bench/bench_decide_columns.py                  # 300,000 steps, best of 5
    .venv/bin/python bench/bench_decide_columns.py --steps 1000000 --repeat 3

A healthy run (loss ~3 with noise, global gradient norm 0.8-0.9, four layer groups at their own levels,
a step every 0.25 s on 8 GPUs, one node's monotonic clock), in blocks of `--block` steps as replay hands
them over, each already in memory in both shapes. Times, each the best of `--repeat` runs over the whole
run with a fresh guard and meter:

  guard   Guard.observe per step (dicts of layer norms)  vs  batch.guard_block (an (n, 4) array, screened)
  meter   CostMeter.observe per record ((node, seconds))  vs  batch.meter_block (codes, seconds, screened)

and checks that both shapes decide the same (nothing, on a healthy run) and leave the same state.
Targets: the columnar guard <= 0.3 us/step, the columnar meter <= 0.1 us/step.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from timing import best_of

from trainguard.decide import batch
from trainguard.decide.cost import CostMeter
from trainguard.decide.guard import Guard, StepStats

NAMES = ("embed", "h.0", "h.1", "ln_f")
LEVELS = np.array([0.5, 0.4, 0.6, 0.02])      # typical norms of the tiny model's layer groups
NODES = ("node-0",)
TARGETS = {"guard": 0.3, "meter": 0.1}


def healthy_run(count: int, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "steps": np.arange(1, count + 1, dtype=np.int64),
        "losses": 3.0 * (1 + 1000 / (np.arange(count) + 1000)) + rng.normal(0, 0.02, count),
        "grad_norms": rng.uniform(0.8, 0.9, count),
        "timestamps": 1_710_512_538.0 + 0.25 * np.arange(1, count + 1),
        "layer_norms": LEVELS * rng.uniform(1.0, 1.2, (count, len(NAMES))),
        "gpu_counts": np.full(count, 8, dtype=np.int64),
        "clock_codes": np.zeros(count, dtype=np.int64),
        "clock_seconds": 5_000.0 + 0.25 * np.arange(1, count + 1) + rng.uniform(0, 1e-3, count),
    }


def as_lists(block: dict) -> dict:
    """The block as the step loops read it: one StepStats per step, one (node, seconds) clock per record."""
    return {
        "steps": block["steps"].tolist(), "losses": block["losses"].tolist(),
        "grad_norms": block["grad_norms"].tolist(), "timestamps": block["timestamps"].tolist(),
        "stats": [StepStats(*fields) for fields in zip(
            block["steps"].tolist(), block["losses"].tolist(), block["grad_norms"].tolist(),
            [dict(zip(NAMES, row)) for row in block["layer_norms"].tolist()], block["timestamps"].tolist())],
        "gpu_counts": block["gpu_counts"].tolist(),
        "clocks": [(NODES[code], s) for code, s in zip(block["clock_codes"].tolist(), block["clock_seconds"].tolist())],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300_000)
    parser.add_argument("--block", type=int, default=25_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the times (us per step) as JSON too")
    args = parser.parse_args()
    run = healthy_run(args.steps)
    blocks = [{key: column[a:a + args.block] for key, column in run.items()} for a in range(0, args.steps, args.block)]
    lists = [as_lists(block) for block in blocks]
    columns = [batch.Block(block["steps"], block["losses"], block["grad_norms"], block["timestamps"],
                           block["gpu_counts"], block["clock_codes"], block["clock_seconds"], NODES, NAMES,
                           block["layer_norms"]) for block in blocks]
    made = {}

    def guard_lists():
        guard = made["guard_lists"] = Guard()
        for block in lists:
            for stats in block["stats"]:
                guard.observe(stats)

    def guard_columns():
        guard = made["guard_columns"] = Guard()
        for block in columns:
            batch.guard_block(guard, block)

    def meter_lists():
        meter = made["meter_lists"] = CostMeter()
        for block in lists:
            for step, when, gpus, clock in zip(block["steps"], block["timestamps"], block["gpu_counts"], block["clocks"]):
                meter.observe(step, when, gpus, clock)

    def meter_columns():
        meter = made["meter_columns"] = CostMeter()
        for block in columns:
            batch.meter_block(meter, block)

    print(f"{args.steps:,} healthy steps, 4 layers, blocks of {args.block:,}, best of {args.repeat}")
    print(f"{'':8}{'step loop':>14}{'batch':>14}{'speed-up':>10}{'target':>10}")
    ok, found = True, {}
    for name, by_lists, by_columns in (("guard", guard_lists, guard_columns), ("meter", meter_lists, meter_columns)):
        lists_us = best_of(args.repeat, by_lists) / args.steps * 1e6
        columns_us = best_of(args.repeat, by_columns) / args.steps * 1e6
        met = columns_us <= TARGETS[name]
        found[name] = {"step loop": lists_us, "batch": columns_us}
        ok &= met
        print(f"{name:8}{lists_us:>9.3f} us/st{columns_us:>9.3f} us/st{lists_us / columns_us:>9.1f}x"
              f"{'<= ' + str(TARGETS[name]):>8} {'met' if met else 'MISSED'}")
    same_guard = (repr(made["guard_lists"].state_dict()), made["guard_lists"].observed) == (
        repr(made["guard_columns"].state_dict()), made["guard_columns"].observed)
    same_meter = repr((made["meter_lists"].state, made["meter_lists"].state_dict())) == repr(
        (made["meter_columns"].state, made["meter_columns"].state_dict()))
    print(f"same state: guard {same_guard}, meter {same_meter}")
    if args.json:
        print(json.dumps(found))
    return 0 if ok and same_guard and same_meter else 1


if __name__ == "__main__":
    raise SystemExit(main())
