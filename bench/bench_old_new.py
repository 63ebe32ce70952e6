"""Replay's speed, old code against this tree's, side by side in one run (the same benches, alternated).

    .venv/bin/python bench/bench_old_new.py --old b9dd748                        # 2 rounds
    .venv/bin/python bench/bench_old_new.py --old main --rounds 3 --records 200000

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
    args = parser.parse_args()
    replay_args = ["--records", str(args.records), "--decide-records", str(args.decide_records), "--repeat", "2",
                   "--shapes", args.shapes]
    column_args = ["--steps", str(args.steps), "--repeat", "3"]
    with tempfile.TemporaryDirectory(prefix="bench-old-") as folder:
        sides = {"old": unpack(args.old, Path(folder)), "new": ROOT}
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
