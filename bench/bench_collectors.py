"""CPU per collection of the io and ib collectors beside node_exporter's diskstats, netdev and infiniband
collectors, on the same roots in one run; and the gpu and nccl collectors' own cost.

    .venv/bin/python bench/bench_collectors.py [--iterations 300] [--write-docs]

- ours: `update()` plus rendering the families as /metrics does (prometheus_client text format), in this
  process; CPU from time.process_time().
- node_exporter: `prometheus-node-exporter --collector.disable-defaults --collector.diskstats
  --collector.netdev --collector.infiniband`, scraped back to back; CPU of its process from /proc/<pid>/stat.
  The same binary with no collector at all gives the cost of serving a scrape, which is subtracted.
- gpu: 8 H100s through the fake NVML (so this is the collector's Python plus the fake's, not NVML's C calls;
  `pcie_throughput` off, since on real NVML each of those calls waits 20 ms of wall time).
- nccl: one update over 2 rank logs with nothing new (steady state), and the cost per log line read.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.agent.exposition import render  # noqa: E402
from tests.fakes.fake_nvml import FakeNVML  # noqa: E402
from tests.servers import start_node_exporter  # noqa: E402
from trainguard.agent.collector import Context  # noqa: E402
from trainguard.agent.collectors.gpu import GPUCollector  # noqa: E402
from trainguard.agent.collectors.ib import InfiniBandCollector  # noqa: E402
from trainguard.agent.collectors.io import DISK_EXCLUDE_DEFAULT, IOCollector  # noqa: E402
from trainguard.agent.collectors.nccl import NCCLCollector  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
CLK_TCK = os.sysconf("SC_CLK_TCK")
SECTION = "## Collectors: gpu, io, ib, nccl"


def process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def per_call(function, iterations: int) -> float:
    function()                       # warm: imports, first-read caches
    start = time.process_time()
    for _ in range(iterations):
        function()
    return (time.process_time() - start) / iterations


def node_exporter_per_scrape(tmp: Path, args: list[str], iterations: int) -> float:
    with start_node_exporter(tmp, args) as url:
        urllib.request.urlopen(url + "/metrics").read()
        before = process_cpu(url.process.pid)
        for _ in range(iterations):
            urllib.request.urlopen(url + "/metrics").read()
        return (process_cpu(url.process.pid) - before) / iterations


def host_io(tmp: Path, procfs: Path, sysfs: Path, iterations: int) -> dict:
    ctx = Context(procfs=procfs, sysfs=sysfs)
    io, ib = IOCollector(ctx), InfiniBandCollector(ctx)
    ours = per_call(lambda: render(io.update().families + ib.update().families), iterations)
    roots = [f"--path.procfs={procfs}", f"--path.sysfs={sysfs}", "--collector.disable-defaults"]
    wanted = ["--collector.diskstats", "--collector.netdev", "--collector.infiniband",
              "--no-collector.netdev.netlink", f"--collector.diskstats.device-exclude={DISK_EXCLUDE_DEFAULT}"]
    full = node_exporter_per_scrape(tmp, roots + wanted, iterations)
    empty = node_exporter_per_scrape(tmp, roots, iterations)
    return {"ours": ours, "node_exporter": full, "node_exporter_serving": empty}


def gpu_cost(tmp: Path, iterations: int) -> float:
    (tmp / "dev").mkdir(exist_ok=True)
    gpu = GPUCollector(Context(devfs=tmp / "dev", options={"nvml_module": FakeNVML("h100x8"),
                                                           "pcie_throughput": False}))
    return per_call(lambda: render(gpu.update().families), iterations)


def nccl_cost(tmp: Path, iterations: int) -> tuple[float, float]:
    run = tmp / "run"
    nccl = NCCLCollector(Context(procfs=FIXTURES / "proc", run_dir=run))
    shutil.copytree(FIXTURES / "logs" / "nccl", run / "logs")
    nccl.update()
    steady = per_call(lambda: render(nccl.update().families), iterations)
    lines = (FIXTURES / "logs" / "nccl" / "rank-0.log").read_bytes()
    count = lines.count(b"\n") * 2000
    with open(run / "logs" / "rank-0.log", "ab") as log:
        log.write(lines * 2000)
    start = time.process_time()
    while nccl.logs.files and any(nccl.update().families) and _unread(run, nccl):
        pass
    return steady, (time.process_time() - start) / count


def _unread(run: Path, nccl: NCCLCollector) -> bool:
    size = (run / "logs" / "rank-0.log").stat().st_size
    return any(pos.offset < size for f in nccl.logs.followers.values()
               for name, pos in f.positions.items() if name == "rank-0.log")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--write-docs", action="store_true", help="replace this section of docs/benchmarks.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        fixture = host_io(tmp, FIXTURES / "proc", FIXTURES / "sys", args.iterations)
        live = host_io(tmp, Path("/proc"), Path("/sys"), args.iterations)
        gpu = gpu_cost(tmp, args.iterations)
        nccl_steady, nccl_line = nccl_cost(tmp, args.iterations)

    def row(label: str, r: dict) -> str:
        collect = r["node_exporter"] - r["node_exporter_serving"]
        return (f"| {label} | {r['ours'] * 1e3:.2f} | {r['node_exporter'] * 1e3:.2f} | {collect * 1e3:.2f} | "
                f"{r['ours'] / r['node_exporter']:.2f} | {r['ours'] / collect if collect > 0 else float('nan'):.2f} |")

    text = "\n".join([
        SECTION, "",
        f"`.venv/bin/python bench/bench_collectors.py --iterations {args.iterations}` on {os.cpu_count()} shared "
        f"cores, {time.strftime('%Y-%m-%d')}. CPU milliseconds per collection; node_exporter "
        "(`prometheus-node-exporter` with only diskstats, netdev and infiniband) measured per scrape, and minus "
        "the CPU of serving a scrape with no collector.", "",
        "| roots | io + ib, ours (update + render) | node_exporter per scrape | node_exporter collecting only | "
        "ratio ours / scrape | ratio ours / collecting |",
        "|---|---|---|---|---|---|",
        row("fixtures (6 disks, 5 NICs, 2 HCAs)", fixture),
        row("live /proc, /sys of this machine", live), "",
        f"- gpu, 8 H100s through the fake NVML (its Python included), update + render: {gpu * 1e3:.2f} ms CPU",
        f"- nccl, steady update over 2 rank logs: {nccl_steady * 1e3:.3f} ms CPU; reading new log lines: "
        f"{nccl_line * 1e6:.2f} µs CPU per line", "",
    ])
    print(text)
    if args.write_docs:
        docs = ROOT / "docs" / "benchmarks.md"
        current = docs.read_text() if docs.exists() else "# Benchmarks\n\n"
        if SECTION in current:
            start = current.index(SECTION)
            end = current.find("\n## ", start + len(SECTION))
            current = current[:start] + text + (current[end + 1:] if end >= 0 else "")
        else:
            current = current.rstrip("\n") + "\n\n" + text
        docs.write_text(current)
    return 0


if __name__ == "__main__":
    sys.exit(main())
