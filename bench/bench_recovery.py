"""Time from a crash to training again: the tiny model on CPU, killed mid-run, restarted by the launcher.

    .venv/bin/python bench/bench_recovery.py                 # 3 crashes, median
    .venv/bin/python bench/bench_recovery.py --runs 5 --steps 80 --crash-at 55

Each run is `trainguard train --max-restarts 1 --checkpoint-every 10 --inject crash@K`: rank 0 SIGKILLs
itself at step K, torch's elastic launcher sees the worker die and starts a new one, which verifies and
restores the newest checkpoint and trains on. Read from the run's own TLS log (rank 0):

  crash -> restored       the `fault_injected` event to the `checkpoint_restored` event (launcher notices,
                          new interpreter, torch import, rendezvous, checkpoint verified and loaded)
  crash -> training again the `fault_injected` event to the first step record after the restart
  crash -> caught up      ... to the step record of step K again (the steps lost since the checkpoint
                          trained once more)

Side by side, the peer: the floor any restart of a PyTorch trainer pays, measured the same way in the
same run: a new interpreter that imports torch and loads the same checkpoint (format /2: its tensors
through torch.distributed.checkpoint, extra.pt with torch.load; no verification, no launcher, no model,
no first step), from spawn to exit.

Targets: crash to training again under 10 s for the tiny model on CPU, and at most 1.5x the
peer.

`--side-by-side` (issue 31, docs/recovery.md): 2 simulated nodes x 2 ranks on loopback (two `trainguard
train --nnodes 2 --nproc 2` launchers and a rendezvous store, tests/culprit/cluster.py), checkpoint every 10
steps, for each fault (`error`: an exception in rank 3's step; `crash`: rank 3 SIGKILLed) under each
`recovery.mode` (`restart`: today's path, torchrun restarts every worker from the durable checkpoint;
`in_process`: snapshots every 5 steps, the group re-formed in the same processes, no standby; and for the
kill `standby`: in_process with a warm standby per rank, runtime/resilience/standby.py), in one run:

  fault -> next step   the fault's `fault_injected` event (rank 3's log) to rank 0's first step record
                       after its recovery (the `in_process_restart` event, or the restarted worker's
                       `run_start`)
  work lost            steps done before the fault that were trained again (last step done - restored step)
  healthy ranks ended  the ranks other than 3 whose process was replaced (a second `run_start`)

    .venv/bin/python bench/bench_recovery.py --side-by-side --steps 24 --fault-at 18

`--hang` (issue 31): the same 2 x 2 cluster with an agent beside each node (the embedded stall watchdog,
evidence, the culprit's verdict; eviction off, so its action is the restore), rank 3 hung at the fault's
step (`--inject hang@K:3`, asleep outside any collective), for each `recovery.mode` (the agent reads the
same policy): fault -> next step as above, and verdict -> next step (the first agent's `restore` action
record, after the evidence, to rank 0's next step).

    .venv/bin/python bench/bench_recovery.py --hang --runs 1 --steps 30 --fault-at 18
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainguard import event_types, tls  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TRAINGUARD = ROOT / ".venv" / "bin" / "trainguard"
TARGET_SECONDS = 10.0
TARGET_RATIO = 1.5


def crash_run(run_dir: Path, steps: int, crash_at: int) -> dict[str, float]:
    subprocess.run([str(TRAINGUARD), "train", "--run-dir", str(run_dir), "--steps", str(steps),
                    "--checkpoint-every", "10", "--max-restarts", "1", "--inject", f"crash@{crash_at}"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    crashed = restored = again = caught_up = None
    for line in tls.iter_lines(run_dir / "tls" / "rank-0.jsonl"):
        record = line.record or {}
        event = record.get("event") or {}
        when = tls.parse_timestamp(record["timestamp"]) if "timestamp" in record else None
        if event.get("type") == "fault_injected":
            crashed = when
        elif crashed is not None and event.get("type") == "checkpoint_restored":
            restored = when
        elif crashed is not None and restored is not None and not event and "metrics" in record:
            again = again or when
            if record.get("step") == crash_at:
                caught_up = when
    if None in (crashed, restored, again, caught_up):
        raise RuntimeError(f"{run_dir}: the log does not show a crash, a restore and training again")
    checkpoint = max((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return {"restored": restored - crashed, "again": again - crashed, "caught_up": caught_up - crashed,
            "checkpoint": str(checkpoint)}


# The peer's load of the same checkpoint, as a plain PyTorch program does it: format /2's tensors through
# torch.distributed.checkpoint (the whole state, no process group), the rest with torch.load; no check.
BARE_LOAD = """\
import sys, warnings, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
warnings.filterwarnings("ignore")
state = {}
_load_state_dict(state, storage_reader=dcp.FileSystemReader(sys.argv[1]), planner=_EmptyStateDictLoadPlanner(),
                 no_dist=True)
torch.load(sys.argv[1] + "/extra.pt", weights_only=True)
"""


def bare_restart(checkpoint: Path) -> float:
    """A new interpreter importing torch and loading the checkpoint (no verification): spawn to exit."""
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", BARE_LOAD, str(checkpoint)], check=True)
    return time.perf_counter() - began


FAULT_RANK = 3
MODES = ("restart", "in_process")
FAULTS = ("error", "crash")
STANDBY = "standby"     # in_process with a warm standby per rank (recovery.standbys: 1): for the kill
CASES = {"error": MODES, "crash": (*MODES, STANDBY)}
# recovery.mode (and standbys) of each compared path: in_process alone keeps no standby, so a kill restarts
POLICIES = {"restart": {"mode": "restart"}, "in_process": {"mode": "in_process", "standbys": 0},
            STANDBY: {"mode": "in_process", "standbys": 1}}


def two_node_run(folder: Path, mode: str, fault: str, steps: int, fault_at: int, agents: bool = False) -> dict:
    """One 2 x 2 run with `fault` at `fault_at` on rank 3 under `recovery.mode: mode`; its measures.
    `agents`: an agent beside each node (the embedded stall watchdog, evidence, the culprit's verdict; eviction
    off, so the verdict's action is the restore), as tests/culprit runs them; a hang needs them."""
    import yaml

    from tests.culprit.cluster import POLICY, Cluster
    from tests.e2e.stack import merge

    run_dir = folder / "run"
    (run_dir / "tls").mkdir(parents=True)
    policy = folder / "policy.yaml"
    chosen = {"recovery": {**POLICIES[mode], "snapshot_every": 5}}
    policy.write_text(yaml.safe_dump(merge(POLICY, {**chosen, "restore": {"evict": "off"}}) if agents else chosen))
    cluster = Cluster(folder, run_dir, policy)
    try:
        cluster.start_store()
        for node in ("n1", "n2") if agents else ():
            cluster.start_agent(node)
        cluster.wait_store()
        for node in ("n1", "n2") if agents else ():
            cluster.wait_agent(node)
        args = ("--steps", str(steps), "--checkpoint-every", "10", "--device", "cpu",
                "--inject", f"{fault}@{fault_at}:{FAULT_RANK}")
        launchers = [cluster.launch(node, *args, nnodes="2", nproc=2) for node in ("n1", "n2")]
        codes = [launcher.wait(timeout=900) for launcher in launchers]
    finally:
        cluster.stop()
    if codes != [0, 0]:
        raise RuntimeError(f"{mode}/{fault}: launchers exited {codes}\n{cluster.diagnostics()}")
    logs = {rank: tls.read_records(run_dir / "tls" / f"rank-{rank}.jsonl") for rank in range(4)}
    fault_time = next(r["timestamp"] for r in logs[FAULT_RANK]
                      if (r.get("event") or {}).get("type") == event_types.FAULT_INJECTED)
    recovered = restored = None
    starts = 0       # (a node restarted only because another node's worker failed keeps restart_count 0)
    for record in logs[0]:
        event = record.get("event") or {}
        starts += event.get("type") == event_types.RUN_START
        if event.get("type") == event_types.IN_PROCESS_RESTART:
            recovered, restored = record["timestamp"], event["restored_step"]
        elif event.get("type") == event_types.RUN_START and starts > 1 and recovered is None:
            recovered, restored = record["timestamp"], event.get("resumed_from") or 0
        elif event.get("type") == event_types.SNAPSHOT_RESTORED and recovered is not None:
            restored = event["restored_step"]      # a restarted worker took the fresher in-memory snapshot
        elif recovered is not None and not event and "metrics" in record:
            next_step = record["timestamp"]
            break
    else:
        raise RuntimeError(f"{mode}/{fault}: no step after the recovery in {run_dir}")
    ended = sorted(rank for rank in range(4) if rank != FAULT_RANK and sum(
        (r.get("event") or {}).get("type") == event_types.RUN_START for r in logs[rank]) > 1)
    found = {"to_next_step": next_step - fault_time, "work_lost": fault_at - 1 - restored,
             "healthy_ended": ended, "restored_step": restored}
    if agents:      # the verdict: the first agent's restore action (the evidence was gathered before it)
        restores = [{**r["event"], "node": node} for node in ("n1", "n2")
                    for r in tls.read_records(run_dir / "tls" / f"node-{node}-actions.jsonl")
                    if (r.get("event") or {}).get("type") == event_types.ACTION and r["event"].get("action") == "restore"]
        found.update(verdict_to_next_step=next_step - min(e["issued_at"] for e in restores),
                     agents=[{k: e.get(k) for k in ("node", "recovery", "in_process")} for e in restores])
    return found


def side_by_side(args: argparse.Namespace) -> int:
    found: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as folder:
        for run in range(args.runs):
            for fault in FAULTS:
                for mode in CASES[fault]:
                    place = Path(folder) / f"{fault}-{mode}-{run}"
                    place.mkdir()
                    found.setdefault((fault, mode), []).append(two_node_run(place, mode, fault, args.steps,
                                                                            args.fault_at))
    print(f"## Recovery side by side\n\n`.venv/bin/python bench/bench_recovery.py --side-by-side --runs {args.runs} "
          f"--steps {args.steps} --fault-at {args.fault_at}`: 2 simulated nodes x 2 ranks on loopback, the tiny "
          f"model on CPU, checkpoint every 10 steps (in_process: snapshot every 5), the fault at step "
          f"{args.fault_at} on rank {FAULT_RANK}, median of {args.runs}; load average {os.getloadavg()[0]:.1f}.\n")
    print("| fault | recovery.mode | fault -> next step (s) | work lost (steps) | healthy ranks ended | ratio to restart |")
    print("|---|---|---:|---:|---|---:|")
    for fault in FAULTS:
        base = statistics.median(r["to_next_step"] for r in found[(fault, "restart")])
        for mode in CASES[fault]:
            runs = found[(fault, mode)]
            seconds = statistics.median(r["to_next_step"] for r in runs)
            lost = statistics.median(r["work_lost"] for r in runs)
            ended = sorted({rank for r in runs for rank in r["healthy_ended"]})
            print(f"| {fault} | {mode} | {seconds:.2f} | {lost:g} | {ended or 'none'} | {seconds / base:.2f} |")
    print(json.dumps({f"{fault}/{mode}": runs for (fault, mode), runs in found.items()}))
    return 0


def hang_side_by_side(args: argparse.Namespace) -> int:
    """A hang with a named culprit (rank 3 sleeps forever at `fault_at`), an agent beside each node: the
    agent's restore today (ends the ranks, torchrun restarts them) against in-process (a signed request,
    agent/recover_in_process.py), in one run."""
    found: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-recovery-hang-") as folder:
        for run in range(args.runs):
            for mode in MODES:
                place = Path(folder) / f"hang-{mode}-{run}"
                place.mkdir()
                found.setdefault(mode, []).append(two_node_run(place, mode, "hang", args.steps, args.fault_at,
                                                               agents=True))
    print(f"## Recovery of a hang side by side\n\n`.venv/bin/python bench/bench_recovery.py --hang --runs {args.runs} "
          f"--steps {args.steps} --fault-at {args.fault_at}`: 2 simulated nodes x 2 ranks on loopback, an agent "
          f"beside each (stall after 6 s, evidence up to 8 s, eviction off: the verdict's action is the restore), "
          f"the tiny model on CPU, checkpoint every 10 steps (in_process: snapshot every 5), rank {FAULT_RANK} "
          f"hangs at step {args.fault_at}, median of {args.runs}; load average {os.getloadavg()[0]:.1f}.\n")
    print("| recovery.mode | fault -> next step (s) | verdict -> next step (s) | work lost (steps) | healthy ranks ended "
          "| ratio to restart (fault / verdict) |")
    print("|---|---:|---:|---:|---|---:|")
    base = {key: statistics.median(r[key] for r in found["restart"]) for key in ("to_next_step", "verdict_to_next_step")}
    for mode in MODES:
        runs = found[mode]
        seconds, after = (statistics.median(r[key] for r in runs) for key in ("to_next_step", "verdict_to_next_step"))
        ended = sorted({rank for r in runs for rank in r["healthy_ended"]})
        print(f"| {mode} | {seconds:.2f} | {after:.2f} | {statistics.median(r['work_lost'] for r in runs):g} | "
              f"{ended or 'none'} | {seconds / base['to_next_step']:.2f} / {after / base['verdict_to_next_step']:.2f} |")
    print(json.dumps(found))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--crash-at", type=int, default=45)
    parser.add_argument("--side-by-side", action="store_true",
                        help="2 nodes x 2 ranks: restart against in_process, for an exception and a kill")
    parser.add_argument("--fault-at", type=int, default=18)
    parser.add_argument("--hang", action="store_true",
                        help="2 nodes x 2 ranks, an agent beside each: a hang's restore today against in-process")
    args = parser.parse_args(argv)
    if args.side_by_side:
        return side_by_side(args)
    if args.hang:
        return hang_side_by_side(args)
    found: dict[str, list[float]] = {"restored": [], "again": [], "caught_up": [], "peer": []}
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as folder:
        for run in range(args.runs):
            times = crash_run(Path(folder) / f"run-{run}", args.steps, args.crash_at)
            found["peer"].append(bare_restart(Path(times.pop("checkpoint"))))
            for key, seconds in times.items():
                found[key].append(seconds)
    median = {key: statistics.median(values) for key, values in found.items()}
    peer = median["peer"]
    print(f"## Crash recovery\n\n`.venv/bin/python bench/bench_recovery.py --runs {args.runs} --steps {args.steps} "
          f"--crash-at {args.crash_at}`: the tiny model on CPU, checkpoint every 10 steps, crash at step "
          f"{args.crash_at}, median of {args.runs} runs.\n")
    print("| measure | seconds | / bare restart (peer) |\n|---|---:|---:|")
    for key, what in (("restored", "crash -> checkpoint verified and restored"),
                      ("again", "crash -> training again (first step)"),
                      ("caught_up", f"crash -> back at step {args.crash_at}"),
                      ("peer", "peer: new interpreter + import torch + load (DCP + torch.load)")):
        print(f"| {what} | {median[key]:.2f} | {median[key] / peer:.2f} |")
    met = median["again"] < TARGET_SECONDS
    ratio = median["again"] / peer
    print(f"\n- crash to training again under {TARGET_SECONDS:.0f} s: {'met' if met else 'NOT met'} "
          f"({median['again']:.2f} s); at most {TARGET_RATIO}x the peer: {'met' if ratio <= TARGET_RATIO else 'NOT met'}"
          f" ({ratio:.2f}x); load average {os.getloadavg()[0]:.1f}")
    print("- all runs: " + ", ".join(f"{key} " + " / ".join(f"{v:.2f}" for v in values)
                                     for key, values in found.items()))
    print(json.dumps({key: values for key, values in found.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
