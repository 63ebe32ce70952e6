"""Fleet scale, measured on this machine (docs/scale.md).

1. The agent's per-update cost on a shared run directory of 1 and of 1,000 nodes x 8 ranks, side by side
   with following every node's files (what the agent did before it read only its own):

    .venv/bin/python bench/bench_fleet.py [--nodes 1000] [--updates 40]

2. `--simulate N`: N real agents (8 fake GPUs, 8 HCAs, 8 ranks appending a step every 2 s each) scraped
   by one real Prometheus that evaluates every generated node-tier rule and the fleet-shard records;
   after a warm-up, Prometheus's own /metrics give scrape duration, samples ingested per second, rule
   evaluation time, head series and RSS, and the per-node figures docs/scale.md sizes shards from:

    .venv/bin/python bench/bench_fleet.py --simulate 8 [--seconds 90] [--scrape-interval 5s]

3. `--nccl-logs`: the nccl collector of one node on 1 and 1,000 nodes' torchrun logs in a shared RUN/logs,
   every rank registered, node 0's ranks real processes writing into theirs (docs/scale.md, "What else
   an agent lists"):

    .venv/bin/python bench/bench_fleet.py --nccl-logs [--nodes 1000] [--updates 20]

Each case runs in a fresh process (so RSS is its own): a TrainingCollector for node-0000 catches up on
the synthetic run directory (tests/fleet/synthetic.py, in /dev/shm when there is one; written, then left
past the follower's 2 s racy window, as a running cluster's is), then each round its node's 8 ranks
append one step and the collector updates; then, for a third as many rounds, another node's file appears
in RUN/tls first (a node log rotated), so the update lists the directory again. Measured: CPU time per
update (time.process_time, the median of the rounds, and of the rounds after a change of RUN/tls), the
catch-up's, and the process's RSS after the rounds (VmRSS) and at its peak (VmHWM).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fleet.synthetic import append_steps, fast_dir, node_name, write_fleet

RANKS = 8


def memory_bytes(field: str = "VmRSS") -> int:
    """VmRSS (resident now) or VmHWM (the peak) of this process."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def timed_update(agent) -> float:
    started = time.process_time()
    agent.update()
    return time.process_time() - started


def one_case(run_dir: Path, updates: int, every_node: bool) -> dict:
    """In this process: catch up, then `updates` rounds of 8 appended steps and one update each."""
    from trainguard.agent.collector import Context
    from trainguard.agent.collectors.training import TrainingCollector

    agent = TrainingCollector(Context(run_dir=run_dir, node=node_name(0), options={"save_every_seconds": 5.0}))
    if every_node:
        agent.follower.select = None          # the agent before it followed only its node's: every rank file in RUN/tls
    catch_up = timed_update(agent)
    times, after_change = [], []
    for round_ in range(updates):
        append_steps(run_dir, range(RANKS), node_name(0), step=1000 + round_)
        times.append(timed_update(agent))
    for round_ in range(max(1, updates // 3)):
        (run_dir / "tls" / f"node-{node_name(1)}.jsonl.{round_ + 1}.gz").write_bytes(b"")   # a rotation elsewhere
        append_steps(run_dir, range(RANKS), node_name(0), step=2000 + round_)
        after_change.append(timed_update(agent))
    return {"catch_up_cpu_s": catch_up, "update_cpu_ms": 1000 * statistics.median(times),
            "relist_cpu_ms": 1000 * statistics.median(after_change),
            "rss_mib": memory_bytes() / 2**20, "peak_rss_mib": memory_bytes("VmHWM") / 2**20,
            "files_followed": len(agent.follower.positions)}


def run_case(nodes: int, updates: int, every_node: bool) -> dict:
    with fast_dir(Path("/tmp")) as base:
        run_dir = base / f"run-{nodes}"
        write_fleet(run_dir, nodes=nodes, ranks_per_node=RANKS, steps=2)
        time.sleep(2.5)    # past the racy window of the last file written (a running cluster's RUN/tls is settled)
        out = subprocess.run([sys.executable, __file__, "--child", str(run_dir), "--updates", str(updates)]
                             + (["--every-node"] if every_node else []),
                             check=True, capture_output=True, text=True).stdout
    return {"nodes": nodes, "follows": "every node" if every_node else "own node", **json.loads(out)}


def write_torchrun_logs(run_dir: Path, nodes: int) -> list[subprocess.Popen]:
    """RUN/logs as torchrun's --log-dir leaves it on a shared run directory: a directory per node's launcher
    (<run id>_<random>/attempt_0/<local rank>/stdout.log, stderr.log), none naming its host; every rank
    registered. Node 0's ranks are real processes writing into their files (returned: end them)."""
    ranks = []
    for node in range(nodes):
        for local in range(RANKS):
            folder = run_dir / "logs" / f"job_{node:04d}x1y2" / "attempt_0" / str(local)
            folder.mkdir(parents=True)
            (folder / "stdout.log").write_bytes(b"step 1\n")
            (folder / "stderr.log").write_bytes(b"%s:1:1 [0] NCCL INFO comm 0x1 rank 0 nranks 8 - Init COMPLETE\n"
                                                % node_name(node).encode())
            pid = 10_000_000 + node * RANKS + local
            if node == 0:
                with open(folder / "stdout.log", "ab") as out, open(folder / "stderr.log", "ab") as err:
                    ranks.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                                  stdout=out, stderr=err))
                pid = ranks[-1].pid
            register_rank_pid(run_dir, node * RANKS + local, node_name(node), pid)
    return ranks


def register_rank_pid(run_dir: Path, rank: int, host: str, pid: int) -> None:
    from trainguard import rundir
    rundir.write_rank_file(run_dir, rank, {"rank": rank, "pid": pid, "host": host, "started_at": time.time()})


def nccl_case(run_dir: Path, updates: int) -> dict:
    """In this process: the nccl collector of node-0000 on that RUN/logs, `updates` updates."""
    from trainguard.agent.collector import Context
    from trainguard.agent.collectors.nccl import NCCLCollector

    collector = NCCLCollector(Context(run_dir=run_dir, node=node_name(0)))
    first = timed_update(collector)
    times = [timed_update(collector) for _ in range(updates)]
    return {"followers": len(collector.logs.followers), "files_followed": collector.logs.files,
            "first_cpu_s": first, "update_cpu_ms": 1000 * statistics.median(times),
            "rss_mib": memory_bytes() / 2**20}


def run_nccl_case(nodes: int, updates: int) -> dict:
    with fast_dir(Path("/tmp")) as base:
        run_dir = base / f"run-{nodes}"
        ranks = write_torchrun_logs(run_dir, nodes)
        try:
            time.sleep(2.5)
            out = subprocess.run([sys.executable, __file__, "--nccl-child", str(run_dir), "--updates", str(updates)],
                                 check=True, capture_output=True, text=True).stdout
        finally:
            for rank in ranks:
                rank.kill()
                rank.wait()
    return {"nodes": nodes, **json.loads(out)}


def prom_value(url: str, expr: str) -> float:
    from tests.servers import prometheus_query
    result = prometheus_query(url, expr)
    return float(result[0]["value"][1]) if result else float("nan")


def own_metrics(url: str) -> dict[str, float]:
    """Prometheus's own /metrics, summed per family (rule groups counted)."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.servers import http_get
    _, _, body = http_get(f"{url}/metrics")
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
            if sample.name == "prometheus_rule_group_last_duration_seconds":
                totals["rule_groups"] = totals.get("rule_groups", 0) + 1
    return totals


def simulate(nodes: int, seconds: float, scrape_interval: str) -> dict:
    import tempfile
    import threading

    from trainguard.alerts import rules

    from tests.fleet.agents import start_node_agent, write_node_ranks
    from tests.servers import start_prometheus, stop_all

    tmp = Path(tempfile.mkdtemp(prefix="trainguard-fleet-sim-"))
    run = tmp / "run"
    stop = threading.Event()
    try:
        agents = []
        for node in range(nodes):
            write_node_ranks(run, node)
            agents.append(start_node_agent(tmp, run, node, interval=2.0))

        def steps():   # every rank of every node makes a step each 2 s
            step = 4
            while not stop.wait(2.0):
                for node in range(nodes):
                    append_steps(run, range(node * RANKS, (node + 1) * RANKS), node_name(node), step)
                step += 1
        threading.Thread(target=steps, daemon=True).start()
        files = rules.write(tmp / "rules", None, rules.CONCERNS + rules.FLEET_CONCERNS[:1])
        prometheus = start_prometheus(tmp, [address for _, address in agents], rule_files=files,
                                      scrape_interval=scrape_interval, eval_interval=scrape_interval)
        time.sleep(max(0.0, seconds - 30))
        first, started = own_metrics(prometheus), time.monotonic()
        time.sleep(30)
        last, elapsed = own_metrics(prometheus), time.monotonic() - started
        url, window = prometheus, "1m"
        figures = {
            "nodes": nodes, "scrape_interval": scrape_interval, "seconds": seconds,
            "series_per_node": prom_value(url, 'avg(scrape_samples_scraped{job="trainguard"})'),
            "scrape_duration_s": prom_value(url, f'avg(avg_over_time(scrape_duration_seconds{{job="trainguard"}}[{window}]))'),
            "scrape_duration_max_s": prom_value(url, f'max(max_over_time(scrape_duration_seconds{{job="trainguard"}}[{window}]))'),
            "samples_per_s": (last["prometheus_tsdb_head_samples_appended_total"]
                              - first["prometheus_tsdb_head_samples_appended_total"]) / elapsed,
            "head_series": last["prometheus_tsdb_head_series"],
            "rule_eval_s": last["prometheus_rule_group_last_duration_seconds"],
            "rule_groups": last.get("rule_groups", 0),
            "rss_mib": last["process_resident_memory_bytes"] / 2**20,
            "prometheus_cpu_s_per_s": (last["process_cpu_seconds_total"] - first["process_cpu_seconds_total"]) / elapsed,
        }
        return figures
    finally:
        stop.set()
        stop_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--simulate", type=int, metavar="N", help="N agents scraped by a real Prometheus")
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--scrape-interval", default="5s")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--every-node", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nccl-logs", action="store_true",
                        help="the nccl collector on 1 and --nodes nodes' torchrun logs in RUN/logs")
    parser.add_argument("--nccl-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_case(args.child, args.updates, args.every_node)))
        return
    if args.nccl_child:
        print(json.dumps(nccl_case(args.nccl_child, args.updates)))
        return
    if args.nccl_logs:
        for row in (run_nccl_case(n, args.updates) for n in (1, args.nodes)):
            print(json.dumps(row))
        print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        return
    if args.simulate:
        figures = simulate(args.simulate, args.seconds, args.scrape_interval)
        print(json.dumps(figures, indent=1))
        return
    rows = [run_case(n, args.updates, every) for n in (1, args.nodes) for every in (False, True)]
    print(f"{'nodes':>6} {'follows':>11} {'files':>6} {'update CPU ms':>14} {'after RUN/tls changed':>22} "
          f"{'catch-up CPU s':>15} {'RSS MiB':>8} {'peak MiB':>9}")
    for row in rows:
        print(f"{row['nodes']:>6} {row['follows']:>11} {row['files_followed']:>6} {row['update_cpu_ms']:>14.2f} "
              f"{row['relist_cpu_ms']:>22.2f} {row['catch_up_cpu_s']:>15.2f} {row['rss_mib']:>8.1f} "
              f"{row['peak_rss_mib']:>9.1f}")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    own = {row["nodes"]: row for row in rows if row["follows"] == "own node"}
    print(f"own node: update CPU {args.nodes} nodes / 1 node = "
          f"{own[args.nodes]['update_cpu_ms'] / own[1]['update_cpu_ms']:.2f}x, RSS "
          f"{own[args.nodes]['rss_mib'] / own[1]['rss_mib']:.2f}x")


if __name__ == "__main__":
    main()
