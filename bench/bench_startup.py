"""Start-up of the read-only commands: a fresh `trainguard` process on a tiny input, beside the floors.

    .venv/bin/python bench/bench_startup.py                 # best of 7
    .venv/bin/python bench/bench_startup.py --repeat 15
    .venv/bin/python bench/bench_startup.py --instructions --only replay status   # + valgrind's count

A command on a tiny input is nearly all start-up (the interpreter, its imports, the parser), so this is what
a user waits for on `trainguard status RUN` and what `trainguard replay RUN` pays before its first record.

First it precompiles the tree (`python -m compileall -q` over the installed packages' folders): installed
trainguard has its .pyc files, while this sandbox sets PYTHONDONTWRITEBYTECODE=1, under which every start
would compile ~30 modules again (~0.14 s) that no user's start compiles.

Each command then runs as a user runs it, the `trainguard` console script beside this interpreter, on inputs
written here: a 3-record TLS log, a run directory holding it as `tls/rank-0.jsonl`, a 3-entry Hugging Face
`trainer_state.json` (for convert). Timed per command, best of `--repeat` each (the least disturbed by a
shared machine): wall (around the child) and CPU (the child's user + system time). Beside them, in the same
run, the floors:

  python -c pass                          the interpreter and site: every command pays this
  python -c "import numpy, msgspec"      replay's floor: it cannot decode or decide without these two

and each command as a ratio of both. `modules` is the length of sys.modules when the command returns
(a second, untimed run through a wrapper that calls trainguard.cli.main).

`--instructions` adds the instructions each run executes, counted by valgrind (cachegrind, `I refs`):
the same on a busy machine as on a quiet one, where times are not (a run under valgrind takes ~50x as
long, so `--only` picks the commands).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from trainguard import tls

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_FOLDERS = ("trainguard", "agent", "trainer", "protect", "preflight", "alerts", "dashboards")
T0 = 1_710_512_538.0
PASS, FLOOR = "python -c pass", 'python -c "import numpy, msgspec"'
# Runs trainguard.cli.main as the console script does, then writes how many modules it left loaded.
COUNT_MODULES = ("import sys\nfrom trainguard.cli import main\ntry:\n    main(sys.argv[2:])\n"
                 "except SystemExit:\n    pass\nopen(sys.argv[1], 'w').write(str(len(sys.modules)))\n")


def write_inputs(folder: Path) -> dict[str, Path]:
    log = folder / "tiny.jsonl"
    with tls.Writer(log) as writer:
        for i in range(3):
            writer.write({"timestamp": tls.format_timestamp(T0 + 5 * i), "node": "node-a", "rank": 0, "step": i,
                          "metrics": {"loss": 2.0, "grad_norm": 1.0}})
    run = folder / "run"
    (run / "tls").mkdir(parents=True)
    (run / "tls" / "rank-0.jsonl").write_bytes(log.read_bytes())
    state = folder / "trainer_state.json"
    state.write_text(json.dumps({"log_history": [{"step": s, "loss": 2.0, "grad_norm": 1.0} for s in (1, 2, 3)]},
                                indent=2))
    return {"log": log, "run": run, "state": state, "out": folder / "out"}


def commands(inputs: dict[str, Path]) -> dict[str, list[str]]:
    log, run, out = str(inputs["log"]), str(inputs["run"]), inputs["out"]
    return {
        "replay LOG --json": ["replay", log, "--json"],
        "replay RUN": ["replay", run],
        "status RUN": ["status", run],
        "incidents RUN": ["incidents", run],
        "report RUN -o FILE": ["report", run, "-o", str(out / "report.html")],
        "diagnose RUN": ["diagnose", run],
        "convert STATE -o FILE": ["convert", str(inputs["state"]), "-o", str(out / "converted.jsonl")],
        "--help": ["--help"],
    }


def entry_point() -> list[str]:
    script = Path(sys.executable).with_name("trainguard")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from trainguard.cli import main; sys.exit(main())"]


def timed(argv: list[str], repeat: int) -> tuple[float, float]:
    """(best wall, best CPU) seconds of `repeat` runs of `argv` as a child process."""
    best_wall = best_cpu = float("inf")
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        began = time.perf_counter()
        done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
        wall = time.perf_counter() - began
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode not in (0, 1):
            raise SystemExit(f"{' '.join(argv)}: exit {done.returncode}\n{done.stderr.decode(errors='replace')}")
        best_wall = min(best_wall, wall)
        best_cpu = min(best_cpu, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return best_wall, best_cpu


def instructions(argv: list[str]) -> int:
    """Instructions executed by `argv` as valgrind's cachegrind counts them (`I refs`)."""
    done = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
                           *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    match = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if match is None:
        raise SystemExit(f"valgrind counted nothing for {' '.join(argv)}:\n{done.stderr[-2000:]}")
    return int(match.group(1).replace(",", ""))


def modules_loaded(args: list[str], folder: Path) -> int:
    count = folder / "modules"
    subprocess.run([sys.executable, "-c", COUNT_MODULES, str(count), *args],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, check=False)
    return int(count.read_text())


def precompile() -> None:
    for name in PACKAGE_FOLDERS:
        compileall.compile_dir(str(ROOT / name), quiet=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=7, help="runs per command; the best is kept")
    parser.add_argument("--only", nargs="+", metavar="WORD", help="only the commands whose name holds a WORD")
    parser.add_argument("--instructions", action="store_true", help="also count instructions with valgrind")
    args = parser.parse_args()
    if args.instructions and shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (Debian package 'valgrind')")
    precompile()
    floors = {PASS: [sys.executable, "-c", "pass"], FLOOR: [sys.executable, "-c", "import numpy, msgspec"]}
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        folder = Path(tmp)
        inputs = write_inputs(folder)
        inputs["out"].mkdir()
        chosen = {name: [*entry_point(), *argv] for name, argv in commands(inputs).items()
                  if not args.only or any(word in name for word in args.only)}
        rows = {}
        for name, argv in {**floors, **chosen}.items():
            wall, cpu = timed(argv, args.repeat)
            modules = modules_loaded(argv[len(entry_point()):], folder) if name in chosen else None
            rows[name] = Row(wall, cpu, modules, instructions(argv) if args.instructions else None)
    print_table(rows, args.repeat)


class Row(NamedTuple):
    wall: float
    cpu: float
    modules: int | None         # None for the floors
    instructions: int | None    # None without --instructions


def print_table(rows: dict[str, Row], repeat: int) -> None:
    """Ratios of wall to wall, CPU to CPU (steadier on a busy machine) and instructions to instructions."""
    base, floor = rows[PASS], rows[FLOOR]
    print(f"start-up, best of {repeat} (after compileall), Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}")
    counted = floor.instructions is not None
    print(f"{'command':34} {'wall s':>7} {'cpu s':>7} {'modules':>8}  {'wall x pass':>11} {'x floor':>7}  "
          f"{'cpu x pass':>10} {'x floor':>7}" + (f"  {'instructions':>14} {'x floor':>7}" if counted else ""))
    for name, row in rows.items():
        line = (f"{name:34} {row.wall:7.3f} {row.cpu:7.3f} {row.modules if row.modules is not None else '':>8}  "
                f"{row.wall / base.wall:11.2f} {row.wall / floor.wall:7.2f}  "
                f"{row.cpu / base.cpu:10.2f} {row.cpu / floor.cpu:7.2f}")
        if counted and row.instructions is not None and floor.instructions:
            line += f"  {row.instructions:14,} {row.instructions / floor.instructions:7.2f}"
        print(line)


if __name__ == "__main__":
    main()
