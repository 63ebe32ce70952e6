"""Naming the culprit and keeping it out, end to end: a scenario matrix on two simulated nodes.

Each scenario runs the real thing (tests/culprit/cluster.py): two `trainguard train --nnodes 1:2`
launchers (torch's elastic agent, c10d rendezvous on loopback, gloo), one agent per node, a fault
injected on a chosen rank. Measured from the run's own records:

- the verdict against what the fault was (the culprit node, or none), and that no healthy node is ever
  cordoned;
- fault -> verdict: the `fault_injected` event to the incident's `detected_at`;
- fault -> training again: to the first step record after the fault of a resumed attempt (without the
  culprit when it was evicted).

Beside it, the peer: torchrun's plain restart on the same nodes (`restore.evict: off`, the restore in
place that trainguard did before), with the fault re-armed after each firing as a bad node would be:
the restarted run hangs again.

    .venv/bin/python bench/bench_culprit.py                        # every scenario
    .venv/bin/python bench/bench_culprit.py --only hang-r1,peer-hang-r1 --healthy-steps 300
    .venv/bin/python bench/bench_culprit.py --write-docs           # and replace its section in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.culprit.cluster import cluster  # noqa: E402
from trainguard import tls  # noqa: E402

FAULT_STEP = 25
STEPS = 45
TITLE = "Culprit and eviction (two simulated nodes)"


@dataclass
class Scenario:
    name: str
    faults: list[str]
    expect: str | None          # "rank:R" (the node of rank R), "node:N", or None (no culprit, no incident needed)
    policy: dict = field(default_factory=dict)
    nvml: dict = field(default_factory=dict)
    rearm: bool = False         # re-arm the fault after each firing (a bad node hangs again)
    steps: int = STEPS
    peer: bool = False


def scenarios(healthy_steps: int) -> list[Scenario]:
    # the restore in place as torchrun's restart (today's path); in-process: bench_recovery.py --hang
    off = {"restore": {"evict": "off"}, "recovery": {"mode": "restart"}}
    return [
        Scenario("hang-r0", [f"hang@{FAULT_STEP}:0"], "rank:0"),
        Scenario("hang-r1", [f"hang@{FAULT_STEP}:1"], "rank:1"),
        Scenario("peer-hang-r1", [f"hang@{FAULT_STEP}:1"], "rank:1", policy=off, rearm=True, peer=True),
        Scenario("hang-r1-evict-off", [f"hang@{FAULT_STEP}:1"], "rank:1", policy=off),
        Scenario("xid-node", [f"commhang@{FAULT_STEP}"], "node:n2", nvml={"n2": "xid"}),
        Scenario("all-in-collective", [f"commhang@{FAULT_STEP}"], None),
        Scenario("slow-rank", [f"slowio@{FAULT_STEP}:1"], None),
        Scenario("crash-r1", [f"crash@{FAULT_STEP}:1"], None),
        Scenario("healthy", [], None, steps=healthy_steps),
    ]


def records(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / "tls" / name
    return [line.record for line in tls.iter_lines(path) if line.record is not None] if path.exists() else []


def rank_records(run_dir: Path) -> list[dict]:
    return [r for path in sorted((run_dir / "tls").glob("rank-*.jsonl")) for r in records(run_dir, path.name)]


def rearm(run_dir: Path, stop: threading.Event) -> None:
    """Keep the injected fault armed: a bad node hangs its rank again at every attempt."""
    fired = run_dir / "control" / "faults-fired.jsonl"
    while not stop.wait(0.5):
        if fired.exists() and fired.stat().st_size:
            fired.write_text("")


def run_one(s: Scenario, budget: float) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"culprit-{s.name}-") as tmp, \
            cluster(Path(tmp), policy=s.policy, nvml=s.nvml) as c:
        began = time.time()
        stop = threading.Event()
        if s.rearm:
            threading.Thread(target=rearm, args=(c.run_dir, stop), daemon=True).start()
        for node in ("n1", "n2"):
            c.launch(node, "--steps", str(s.steps), "--checkpoint-every", "10", *[f"--inject={f}" for f in s.faults])
        deadline = began + budget
        while time.time() < deadline and any(p.poll() is None for p in c.launchers.values()):
            if s.peer and c.incidents() and _resumed(c.run_dir) is not None and time.time() > _resumed(c.run_dir) + 40:
                break           # the peer resumed and had 40 s to get past the fault again
            time.sleep(1.0)
        stop.set()
        return measure(s, c, began)


def _resumed(run_dir: Path) -> float | None:
    fault = _fault_time(run_dir)
    starts = [r["timestamp"] for r in rank_records(run_dir)
              if (r.get("event") or {}).get("type") == "run_start" and fault and r["timestamp"] > fault]
    return min(starts) if starts else None


def _fault_time(run_dir: Path) -> float | None:
    times = [r["timestamp"] for r in rank_records(run_dir) if (r.get("event") or {}).get("type") == "fault_injected"]
    return min(times) if times else None


def measure(s: Scenario, c, began: float) -> dict:
    run_dir = c.run_dir
    incidents = c.incidents()
    first = incidents[0] if incidents else None
    expected_node = _expected_node(s, first, run_dir)
    named = (first or {}).get("culprit") or {}
    cordoned = sorted(p.name for p in (run_dir / "control" / "cordon").glob("*")) if \
        (run_dir / "control" / "cordon").exists() else []
    fault = _fault_time(run_dir)
    steps_after = sorted((r["timestamp"], r.get("step")) for r in rank_records(run_dir)
                         if isinstance(r.get("metrics"), dict) and fault and r["timestamp"] > (_resumed(run_dir) or 1e18))
    again = steps_after[0][0] - fault if steps_after and fault else None
    past_fault = any(step and step > FAULT_STEP for _, step in steps_after)
    correct = (named.get("node") == expected_node) if s.expect else (not named)
    healthy_cordoned = [h for h in cordoned if h != expected_node]
    return {"scenario": s.name, "peer": s.peer, "expected": expected_node or "none",
            "verdict": named.get("node") or "none", "correct": correct and not healthy_cordoned,
            "action": (first or {}).get("action") or "-", "cordoned": cordoned, "healthy_cordoned": healthy_cordoned,
            "fault_to_verdict_s": round(first["detected_at"] - fault, 1) if first and fault else None,
            "fault_to_training_s": round(again, 1) if again is not None else None,
            "past_fault_again": past_fault, "incidents": len(incidents),
            "finished": all(p.poll() == 0 for p in c.launchers.values()) or
                        any(p.poll() == 0 for n, p in c.launchers.items() if n not in cordoned),
            "wall_s": round(time.time() - began, 1)}


def _expected_node(s: Scenario, incident: dict | None, run_dir: Path) -> str | None:
    if s.expect is None:
        return None
    kind, _, value = s.expect.partition(":")
    if kind == "node":
        return value
    if incident is None:
        return f"(node of rank {value})"
    for path in (run_dir / "incidents" / incident["id"]).glob("node-*.json"):
        data = json.loads(path.read_text())
        if value in data.get("ranks", {}):
            return data["node"]
    return None


def table(results: list[dict], command: str, stall_seconds: float) -> str:
    ours = [r for r in results if not r["peer"]]
    accuracy = sum(r["correct"] for r in ours) / max(1, len(ours))
    lines = [f"## {TITLE}", "", f"`{command}` — {time.strftime('%Y-%m-%d')}, 2 simulated nodes × 1 rank (gloo, "
             f"CPU), `stall_seconds` {stall_seconds:g}, fault at step {FAULT_STEP}.", "",
             "| scenario | expected culprit | verdict | action | cordoned | fault → verdict (s) | "
             "fault → training again (s) | past the fault again | correct |",
             "|---|---|---|---|---|---:|---:|---|---|"]
    for r in results:
        name = r["scenario"] + (" (peer: torchrun restart in place, fault re-armed)" if r["peer"] else "")
        lines.append(f"| {name} | {r['expected']} | {r['verdict']} | {r['action']} | {', '.join(r['cordoned']) or '-'} "
                     f"| {_n(r['fault_to_verdict_s'])} | {_n(r['fault_to_training_s'])} | "
                     f"{'yes' if r['past_fault_again'] else 'no'} | {'yes' if r['correct'] else '**no**'} |")
    healthy = sum(len(r["healthy_cordoned"]) for r in ours)
    lines += ["", f"Verdict accuracy {accuracy:.0%} over {len(ours)} scenarios (target 100%); healthy nodes "
              f"cordoned: {healthy} (target 0). Target for fault → verdict: within `stall_seconds` + 30 s "
              f"= {stall_seconds + 30:g} s (Holmes: 30.3 s)."]
    return "\n".join(lines) + "\n"


def _n(value) -> str:
    return "-" if value is None else f"{value:g}"


def write_docs(section: str) -> None:
    import re

    path = ROOT / "docs" / "benchmarks.md"
    text = path.read_text()
    pattern = re.compile(rf"(?ms)^##+ {re.escape(TITLE)}\n.*?(?=^## |\Z)")
    text = pattern.sub(section.replace("\\", "\\\\") + "\n", text) if pattern.search(text) \
        else text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated scenario names")
    parser.add_argument("--healthy-steps", type=int, default=2000)
    parser.add_argument("--budget", type=float, default=240.0, help="seconds per scenario at most")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "culprit-scenarios.json")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    chosen = scenarios(args.healthy_steps)
    if args.only:
        wanted = set(args.only.split(","))
        chosen = [s for s in chosen if s.name in wanted]
    results = []
    for s in chosen:
        budget = args.budget if s.name != "healthy" else max(args.budget, args.healthy_steps * 0.5)
        result = run_one(s, budget)
        print(json.dumps(result), flush=True)
        results.append(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    from tests.culprit.cluster import POLICY

    command = ".venv/bin/python bench/bench_culprit.py " + " ".join(argv if argv is not None else sys.argv[1:])
    section = table(results, command.strip(), POLICY["alerts"]["stall_seconds"])
    print(section)
    if args.write_docs:
        write_docs(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
