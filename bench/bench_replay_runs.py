"""What telling runs apart costs `trainguard replay` on a folder of other tools' logs (docs/replay.md, "Several
runs in one folder"): a folder of Megatron logs of different jobs, replayed as the runs they are (each log
converted once, its losses compared, each run replayed alone) against `--one-run` (the folder read as one
run, as before), in the same process, CPU seconds of the process (the replay's worker processes included).

    .venv/bin/python bench/bench_replay_runs.py                          # 2 logs of 50,000 iterations
    .venv/bin/python bench/bench_replay_runs.py --logs 4 --iterations 20000 --repeat 3
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import resource
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.formats.helpers import megatron_line  # noqa: E402  (the tool's own format strings)
from trainguard import cli  # noqa: E402


def folder_of_jobs(folder: Path, logs: int, iterations: int) -> None:
    """`logs` SLURM outputs of different jobs: the same iterations, each job its own loss level."""
    start = datetime(2026, 5, 1)
    for job in range(logs):
        with open(folder / f"slurm-{1000 + job}.out", "w") as out:
            for i in range(1, iterations + 1):
                out.write(megatron_line(i, iterations, 3.0 + job - i * 1e-5, start + timedelta(seconds=i)) + "\n")


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(argv: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one `trainguard replay` in this process."""
    began_wall, began_cpu = time.perf_counter(), cpu_seconds()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(["replay", *argv])
    if code != 0:
        raise SystemExit(f"replay {' '.join(argv)} exited {code}")
    return time.perf_counter() - began_wall, cpu_seconds() - began_cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--logs", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-replay-runs-") as scratch:
        folder = Path(scratch)
        folder_of_jobs(folder, args.logs, args.iterations)
        size = sum(path.stat().st_size for path in folder.iterdir())
        print(f"{args.logs} Megatron logs of {args.iterations:,} iterations ({size / 1e6:.1f} MB); load average "
              f"{os.getloadavg()[0]:.1f}; best of {args.repeat}")
        for name, argv in (("runs apart (default)", [str(folder)]), ("--one-run (before)", [str(folder), "--one-run"])):
            best = min((measure(argv) for _ in range(args.repeat)), key=lambda pair: pair[1])
            print(f"  {name:22} wall {best[0]:6.2f} s   CPU {best[1]:6.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
