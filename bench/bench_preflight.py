"""Preflight: how long each check takes, and whether its write-speed probe agrees with dd.

    .venv/bin/python bench/bench_preflight.py                       # in a temp dir, 3 rounds
    .venv/bin/python bench/bench_preflight.py --dir /mnt/ckpt --rounds 5

The storage check judges a checkpoint directory by the speed of an fsynced probe file. Its peer is
`dd if=<random file> of=<dir>/x bs=4M conv=fsync`, the usual hand measurement, run on the same
directory in alternation with the probe (same size, same data source: random bytes), and reported as
a ratio (probe speed / dd speed; 1.0 = they agree). Then one full `run_preflight` is timed per check.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from trainguard.preflight import run_preflight
from trainguard.preflight.storage import measure_write

SIZE = 64 << 20


def dd_speed(directory: Path, source: Path) -> float:
    """dd's own figure: bytes over the seconds it reports (its start-up not counted)."""
    target = directory / "dd-probe"
    done = subprocess.run(["dd", f"if={source}", f"of={target}", "bs=4M", "conv=fsync"], check=True,
                          capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
    target.unlink()
    seconds = float(re.search(r"copied, ([0-9.e-]+) s", done.stderr).group(1))
    return SIZE / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, help="directory to measure (default: a temp dir)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if shutil.which("dd") is None:
        print("dd is not installed: no peer to compare with", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        source = directory / "random.bin"
        source.write_bytes(os.urandom(SIZE))
        ours, peer = [], []
        for _ in range(args.rounds):   # alternate, so a neighbour's burst hits both
            ours.append(measure_write(directory, SIZE))
            peer.append(dd_speed(directory, source))
        source.unlink()
        report = run_preflight(run_dir=directory / "run")
    med_ours, med_peer = statistics.median(ours), statistics.median(peer)
    print(f"write speed of {args.dir or 'a temp dir'}, {SIZE >> 20} MiB fsynced, median of {args.rounds}:")
    print(f"  preflight probe {med_ours / 1e6:8.0f} MB/s   dd conv=fsync {med_peer / 1e6:8.0f} MB/s   "
          f"ratio {med_ours / med_peer:.2f}")
    print(f"run_preflight: {'passed' if report.passed else 'FAILED'} in {sum(c.seconds for c in report.checks):.1f} s")
    for check in report.checks:
        message = " ".join(check.message.split())
        print(f"  {check.name:<17} {check.status:<5} {check.seconds:6.2f} s  {message[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
