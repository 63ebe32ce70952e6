"""One incident's evidence from N nodes (docs/incidents.md, "The evidence budget"; docs/scale.md): the
write path of trainguard/incidents/__init__.py side by side with the one it replaced (every write stat-ed every file
of the incident's folder against a whole-incident 64 MiB), in one run:

    .venv/bin/python bench/bench_incident_writes.py [--nodes 100] [--peer 899baea~1]

Each node writes, for each of its 8 ranks, a stack (8 KiB) and a Flight Recorder dump (2 KiB), into one
incident folder in /dev/shm (tmpfs, so the disk's fsync does not hide the cost of the calls). The peer's
module is read from git at `--peer`. Measured per implementation: CPU seconds of all the writes
(time.process_time), os.stat calls per write for the first node and the last, the files refused.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainguard import incidents

RANKS, STACK_BYTES, DUMP_BYTES = 8, 8 * 1024, 2 * 1024


def peer_module(revision: str):
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:trainguard/incidents/__init__.py"],
                            capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "incidents_peer.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("incidents_peer", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def measure(module, nodes: int) -> dict:
    folder = tempfile.mkdtemp(prefix="trainguard-incident-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    stats, real = [0], os.stat

    def counting(*args, **kwargs):
        stats[0] += 1
        return real(*args, **kwargs)

    os.stat = counting
    per_node, refused, started = [], 0, time.process_time()
    try:
        for node in range(nodes):
            before = stats[0]
            for rank in range(node * RANKS, (node + 1) * RANKS):
                for name, size in ((f"rank-{rank}.stack.txt", STACK_BYTES), (f"rank-{rank}.fr.json", DUMP_BYTES)):
                    try:
                        module.write_file(folder, "20261202T020000Z-hang-0001", name, b"s" * size)
                    except module.IncidentError:
                        refused += 1
            per_node.append((stats[0] - before) / (2 * RANKS))
        cpu = time.process_time() - started
    finally:
        os.stat = real
        shutil.rmtree(folder, ignore_errors=True)
    return {"cpu_s": round(cpu, 3), "stats_per_write_first": per_node[0], "stats_per_write_last": per_node[-1],
            "refused": refused, "writes": nodes * RANKS * 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--peer", default="899baea~1", help="git revision of the write path to compare with")
    args = parser.parse_args()
    now = measure(incidents, args.nodes)
    peer = measure(peer_module(args.peer), args.nodes)
    print(f"{args.nodes} nodes, {now['writes']} writes into one incident, load average {os.getloadavg()[0]:.1f}")
    for label, result in (("this", now), (f"peer {args.peer}", peer)):
        print(f"  {label:>16}: {result['cpu_s']:8.3f} s CPU, os.stat per write {result['stats_per_write_first']:.2f} "
              f"(first node) {result['stats_per_write_last']:.2f} (last node), refused {result['refused']}")
    print(f"  ratio (peer / this, CPU): {peer['cpu_s'] / max(now['cpu_s'], 1e-9):.1f}x")


if __name__ == "__main__":
    main()
