"""Worst cases of the health_reports collector's update against its 10 s timeout: a full 16 MiB read of a kernel
log in an XID storm, a large NCCL RAS answer, a large dcgmi diag document, and the same update with nothing new.

    .venv/bin/python bench/bench_health_reports.py [--repeat 3]

- kernel log: 16 MiB of new lines, one NVRM Xid line in ten (the rest ordinary kernel lines), all complete:
  the most one update reads; 64 of its Xid lines become timeline events, the rest one `more_findings` count.
- RAS: an `ncclras -v` answer of a 1,024-node, 8,192-GPU job where one communicator lists every one of its
  8,192 ranks missing (verbose output lifts the per-group limit), built from tests/fixtures/health/
  ncclras-verbose.txt's lines.
- diag: a `dcgmi diag -j` document of 8 GPUs whose every result failed, its tests repeated to ~4 MB (a real one
  is ~30 KB).
- steady: the next update with none of the files changed (what runs every 30 s).
Wall and CPU seconds (time.process_time) of `update()`, the best of --repeat runs, each on a fresh collector.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainguard.agent.collector import Context  # noqa: E402
from trainguard.agent.collectors.health_reports import READ_BYTES, HealthReportsCollector  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "health"
OTHER = "May 18 19:02:39 gpu-node-3 kernel: [12345.678901] mlx5_core 0000:3b:00.0: link up, 400Gbps, full duplex\n"
XID = "May 18 19:02:39 gpu-node-3 kernel: NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.\n"


def big_ras(path: Path) -> None:
    text = (FIXTURES / "ncclras-verbose.txt").read_text()
    one = "  Rank 22 -- GPU 6 managed by process 3487985 on node 172.16.64.213\n"
    ranks = "".join(f"  Rank {i} -- GPU {i % 8} managed by process {100000 + i} on node 10.0.{i // 256}.{i % 256}\n"
                    for i in range(8192))
    path.write_text(text.replace(one, ranks))


def big_diag(path: Path) -> None:
    document = json.loads((FIXTURES / "dcgmi-diag.json").read_text())
    failing = [{"entity_group": "GPU", "entity_group_id": 1, "entity_id": gpu, "status": "Fail",
                "warnings": [{"error_id": 83, "error_category": 3, "error_severity": 2, "warning": "x" * 200}]}
               for gpu in range(8)]
    tests = [{"name": f"test{i}", "results": failing, "test_summary": {"status": "Fail"}} for i in range(2000)]
    document["DCGM Diagnostic"]["test_categories"] = [{"category": "Hardware", "tests": tests}]
    path.write_text(json.dumps(document))


def timed(collector: HealthReportsCollector) -> tuple[float, float, int]:
    wall, cpu = time.perf_counter(), time.process_time()
    sample = collector.update()
    return time.perf_counter() - wall, time.process_time() - cpu, len(sample.tls.get("events", ()))


def run(case: str, root: Path) -> tuple[tuple[float, float, int], tuple[float, float, int], int]:
    root.mkdir(parents=True)
    report = root / "report"
    options = {"addresses": ["172.16.64.213"]}
    if case == "kernel":
        report.write_text("")
        options["kernel_log"] = str(report)
    elif case == "ras":
        big_ras(report)
        options["nccl_ras"] = str(report)
    else:
        big_diag(report)
        options["dcgm_diag"] = str(report)
    old = time.time() - 120
    os.utime(report, (old, old))
    collector = HealthReportsCollector(Context(procfs=root, sysfs=root, devfs=root, node="gpu-node-3",
                                               run_dir=root / "run", options=options))
    if case == "kernel":
        collector.update()                          # the file's first sight: from here on lines are news
        block = OTHER * 9 + XID
        report.write_text(block * (READ_BYTES // len(block)))
    first = timed(collector)
    steady = timed(collector)
    return first, steady, report.stat().st_size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print("| report | size | update with it new: wall s | CPU s | events | next update (nothing new): wall ms |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for case, label in (("kernel", "kernel log, 16 MiB of new lines (1 Xid in 10)"),
                            ("ras", "ncclras -v, 8,192 ranks listed missing"),
                            ("diag", "dcgmi diag -j, 16,000 failed results")):
            runs = [run(case, Path(tmp) / f"{case}{i}") for i in range(args.repeat)]
            (wall, cpu, events), steady, size = min(runs, key=lambda r: r[0][0])
            best_steady = min(r[1][0] for r in runs)
            print(f"| {label} | {size / 2**20:.1f} MiB | {wall:.2f} | {cpu:.2f} | {events} | "
                  f"{best_steady * 1e3:.2f} |")
    print(f"\nload average {os.getloadavg()[0]:.1f} as it ended")
    return 0


if __name__ == "__main__":
    sys.exit(main())
