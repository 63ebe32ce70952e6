"""Replay's speed, old code against this tree's, side by side in one run (the same benches, alternated).

    .venv/bin/python bench/bench_old_new.py --old b9dd748                        # 2 rounds
    .venv/bin/python bench/bench_old_new.py --old main --rounds 3 --records 200000
    .venv/bin/python bench/bench_old_new.py --old b9dd748 --instructions     # valgrind's counts instead

With `--instructions` it counts, instead of timing, the instructions each side executes (valgrind's
cachegrind, `I refs`: the same on a loaded machine as on a quiet one, where times scatter by 2x) for
`trainguard replay LOG --json` on a healthy log of `--records` records with layer norms (bench_replay.py's
`layers` shape), and for `batch.guard_block` + `batch.meter_block` over `--steps` healthy steps in blocks
(bench_decide_columns.py's run); each less the same program on a tiny input (start-up and imports), so what
is left is the work per record. numpy's and msgspec's own instructions are in both.

The old side is `git archive OLD` unpacked in a temporary folder and imported first (`PYTHONPATH`); both
sides run this tree's bench scripts (bench_replay.py and bench_decide_columns.py: they call only the public
entry points, `trainguard replay`'s engine, `batch.guard_block`, `batch.meter_block`), in separate
processes, old then new in each round, so the machine's load falls on both alike. It prints, per stage,
every round's time of each side, and new / old of the best of each side (under 1: the new is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def unpack(rev: str, into: Path) -> Path:
    """The tree at `rev`, unpacked under `into` (git archive: no worktree, nothing written to the repository)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    with tempfile.TemporaryFile() as raw:
        raw.write(archive)
        raw.seek(0)
        with tarfile.open(fileobj=raw) as tar:
            tar.extractall(into, filter="data")
    return into


def run(script: str, args: list[str], tree: Path) -> dict:
    """One bench script of this tree over the code of `tree`: its JSON line, parsed."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, str(BENCH / script), *args, "--json"], cwd=BENCH, env=env,
                          capture_output=True, text=True, check=False)
    if not done.stdout.strip():
        raise SystemExit(f"{script} on {tree}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


DECIDE = """
import sys
sys.path.insert(0, {bench!r})
from bench_decide_columns import NAMES, NODES, healthy_run
from trainguard.decide import batch
from trainguard.decide.cost import CostMeter
from trainguard.decide.guard import Guard
steps, size = int(sys.argv[1]), 25_000
run = healthy_run(steps)
guard, meter = Guard(), CostMeter()
for a in range(0, steps, size):
    b = {{key: column[a:a + size] for key, column in run.items()}}
    block = batch.Block(b["steps"], b["losses"], b["grad_norms"], b["timestamps"], b["gpu_counts"],
                        b["clock_codes"], b["clock_seconds"], NODES, NAMES, b["layer_norms"])
    assert not batch.guard_block(guard, block) and not batch.meter_block(meter, block)
"""
REPLAY = "import sys; from trainguard.cli import main; sys.exit(main())"


def compiled(tree: Path, cache: Path) -> dict[str, str]:
    """The environment that runs `tree`'s code from .pyc files, as an installed tree runs (this sandbox sets
    PYTHONDONTWRITEBYTECODE=1, under which a lazily imported module would be compiled inside the count)."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPATH": str(tree), "PYTHONPYCACHEPREFIX": str(cache)}


def instructions(argv: list[str], tree: Path, cache: Path) -> int:
    """Instructions `argv` executes (every process it starts), as valgrind's cachegrind counts them, after
    one run without valgrind that leaves every module it imports compiled."""
    env = compiled(tree, cache)
    subprocess.run(argv, env=env, cwd=BENCH, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    done = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
                           "--trace-children=yes", *argv], env=env, cwd=BENCH, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, check=False)
    counts = [int(found.replace(",", "")) for found in re.findall(r"I\s+refs:\s+([\d,]+)", done.stderr)]
    if done.returncode != 0 or not counts:
        raise SystemExit(f"valgrind on {' '.join(argv)}: {done.stderr[-2000:]}")
    return sum(counts)


def count_instructions(sides: dict[str, Path], records: int, steps: int, folder: Path) -> None:
    sys.path.insert(0, str(BENCH))
    from bench_replay import write_log

    logs = {}
    for size in (10, records):
        logs[size] = folder / f"log-{size}" / "rank-0.jsonl"
        logs[size].parent.mkdir()
        write_log(logs[size], size, layers=True)
    decide = DECIDE.format(bench=str(BENCH))
    programs = {f"trainguard replay LOG ({records:,} records)": lambda n: [sys.executable, "-c", REPLAY, "replay",
                                                                          str(logs[n]), "--json"],
                f"guard_block + meter_block ({steps:,} steps)": lambda n: [sys.executable, "-c", decide, str(n)]}
    sizes = {0: (10, 10), 1: (records, steps)}
    print(f"old = {sides['old']}, new = this tree; instructions (valgrind I refs), less the same on a tiny input")
    print("| what | old | new | new / old |\n|---|---|---|---|")
    for index, (what, argv) in enumerate(programs.items()):
        counted = {}
        for side, tree in sides.items():
            small, large = (sizes[0][index], sizes[1][index])
            print(f"{what}: {side}", file=sys.stderr, flush=True)
            cache = folder / f"pyc-{side}"
            counted[side] = instructions(argv(large), tree, cache) - instructions(argv(small), tree, cache)
        print(f"| {what} | {counted['old']:,} | {counted['new']:,} | {counted['new'] / counted['old']:.3f} |")


def stages(replay: list[dict], columns: dict) -> dict[str, float]:
    """Seconds by stage name, from bench_replay's rows and bench_decide_columns' us per step."""
    found = {f"{row['shape']}: {row['stage']} {row['what']}": row["seconds"] for row in replay}
    found.update({f"columns: {name} {how} (us/step)": us for name, times in columns.items() for how, us in times.items()})
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", required=True, help="the revision to compare with (a commit, a branch)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--decide-records", type=int, default=50_000)
    parser.add_argument("--steps", type=int, default=50_000, help="bench_decide_columns.py's steps")
    parser.add_argument("--shapes", default="layers,global")
    parser.add_argument("--instructions", action="store_true", help="count instructions (valgrind), not time")
    args = parser.parse_args()
    replay_args = ["--records", str(args.records), "--decide-records", str(args.decide_records), "--repeat", "2",
                   "--shapes", args.shapes]
    column_args = ["--steps", str(args.steps), "--repeat", "3"]
    with tempfile.TemporaryDirectory(prefix="bench-old-") as folder:
        sides = {"old": unpack(args.old, Path(folder) / "old"), "new": ROOT}
        if args.instructions:
            count_instructions(sides, args.records, args.steps, Path(folder))
            return 0
        times: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
        for round_ in range(args.rounds):
            for side, tree in sides.items():
                print(f"round {round_ + 1}: {side} ({tree})", file=sys.stderr, flush=True)
                found = stages(run("bench_replay.py", replay_args, tree), run("bench_decide_columns.py", column_args, tree))
                for stage, seconds in found.items():
                    times[side].setdefault(stage, []).append(seconds)
    print(f"old = {args.old}, new = this tree; {args.rounds} rounds alternated; seconds (us/step where named)")
    print("| stage | old (each round) | new (each round) | new / old (best of each) |\n|---|---|---|---|")
    for stage, old in times["old"].items():
        new = times["new"].get(stage)
        if not new:
            continue
        ratio = min(new) / min(old) if min(old) > 0 else float("nan")
        print(f"| {stage} | {' / '.join(f'{t:.3f}' for t in old)} | {' / '.join(f'{t:.3f}' for t in new)} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
