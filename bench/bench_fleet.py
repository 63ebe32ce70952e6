"""The agent's per-update cost on a shared run directory of 1 and of 1,000 nodes x 8 ranks, side by side
with following every node's files (what the agent did before it read only its own).

    .venv/bin/python bench/bench_fleet.py [--nodes 1000] [--updates 40]

Each case runs in a fresh process (so RSS is its own): a TrainingCollector for node-0000 catches up on
the synthetic run directory (tests/fleet/synthetic.py, in /dev/shm when there is one), then each round
its node's 8 ranks append one step and the collector updates. Measured: CPU time per update
(time.process_time, the median of the rounds) and the process's RSS after the rounds (VmRSS).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fleet.synthetic import append_steps, fast_dir, node_name, write_fleet  # noqa: E402

RANKS = 8


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def one_case(run_dir: Path, updates: int, every_node: bool) -> dict:
    """In this process: catch up, then `updates` rounds of 8 appended steps and one update each."""
    from trainguard.agent.collector import Context
    from trainguard.agent.collectors.training import TrainingCollector

    agent = TrainingCollector(Context(run_dir=run_dir, node=node_name(0), options={"save_every_seconds": 5.0}))
    if every_node:
        agent.follower.select = None          # the agent before issue 21: every rank file in RUN/tls
    started = time.process_time()
    agent.update()
    catch_up = time.process_time() - started
    times = []
    for round_ in range(updates):
        append_steps(run_dir, range(RANKS), node_name(0), step=1000 + round_)
        started = time.process_time()
        agent.update()
        times.append(time.process_time() - started)
    return {"catch_up_cpu_s": catch_up, "update_cpu_ms": 1000 * statistics.median(times),
            "rss_mib": rss_bytes() / 2**20, "files_followed": len(agent.follower.positions)}


def run_case(nodes: int, updates: int, every_node: bool) -> dict:
    with fast_dir(Path("/tmp")) as base:
        run_dir = base / f"run-{nodes}"
        write_fleet(run_dir, nodes=nodes, ranks_per_node=RANKS, steps=2)
        out = subprocess.run([sys.executable, __file__, "--child", str(run_dir), "--updates", str(updates)]
                             + (["--every-node"] if every_node else []),
                             check=True, capture_output=True, text=True).stdout
    return {"nodes": nodes, "follows": "every node" if every_node else "own node", **json.loads(out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--every-node", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_case(args.child, args.updates, args.every_node)))
        return
    rows = [run_case(n, args.updates, every) for n in (1, args.nodes) for every in (False, True)]
    print(f"{'nodes':>6} {'follows':>11} {'files':>6} {'update CPU ms':>14} {'catch-up CPU s':>15} {'RSS MiB':>8}")
    for row in rows:
        print(f"{row['nodes']:>6} {row['follows']:>11} {row['files_followed']:>6} {row['update_cpu_ms']:>14.2f} "
              f"{row['catch_up_cpu_s']:>15.2f} {row['rss_mib']:>8.1f}")
    own = {row["nodes"]: row for row in rows if row["follows"] == "own node"}
    print(f"own node: update CPU {args.nodes} nodes / 1 node = "
          f"{own[args.nodes]['update_cpu_ms'] / own[1]['update_cpu_ms']:.2f}x, RSS "
          f"{own[args.nodes]['rss_mib'] / own[1]['rss_mib']:.2f}x")


if __name__ == "__main__":
    main()
