"""Fault to action: seconds from a fault in training to the action on the run, alert path beside its peer.

    .venv/bin/python bench/fault_to_action.py [--scenarios hang,cost] [--repeat 1]

Each scenario runs twice in the same session, side by side, with the same trainer and policy:

- **alerts**: Prometheus (scrape 1s, eval 1s, the policy's `for`) -> Alertmanager (group_wait 1s) -> the
  agent's webhook -> the action;
- **embedded**: the agent alone (its cost meter, its stall watchdog) -> the same executor -> the action.

and reports both times and their ratio (alerts / embedded): what the Prometheus path costs in reaction
time. Times come from the run's own records: the trainer's `fault_injected` event (for cost, the step at
which the budget can first be judged: `cost.min_steps`) to the agent's `action` event ("to action"), and
to the trainer acting on it ("to trainer": the resumed `run_start`, or the `cost_stop`).

Needs prometheus and prometheus-alertmanager (scripts/setup --servers). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.stack import read_records, stack  # noqa: E402

SCENARIOS = {
    "hang": {"policy": {"recovery": {"mode": "restart"}}, "args": ["--steps", "40", "--checkpoint-every", "10", "--nproc", "2",
                                    "--max-restarts", "3", "--inject=hang@25"]},
    "cost": {"policy": {"cost": {"budget_per_1k_steps": 0.0001, "gpu_count_override": 1, "min_steps": 20}},
             "args": ["--steps", "2000", "--checkpoint-every", "50"]},
}


def run_once(scenario: str, path: str) -> dict[str, float | None]:
    spec = SCENARIOS[scenario]
    with tempfile.TemporaryDirectory(prefix=f"tg-bench-{scenario}-{path}-") as tmp, \
            stack(Path(tmp), spec["policy"]) as s:
        s.start_agent("n1", embedded=path == "embedded")
        if path == "alerts":
            s.start_servers()
        trainer = s.train(*spec["args"])
        s.wait_for_event(lambda: s.agent_events("n1"), lambda r: r["event"]["type"] == "action", 240,
                         f"{scenario}/{path}: the agent's action")
        try:
            finished = s.wait_trainer(trainer, 240) == 0
        except AssertionError:      # the launcher's restart can hang (see the report); the action was taken
            finished = False
        return measure(scenario, s, finished)


def measure(scenario: str, s, finished: bool) -> dict[str, float | None]:
    issued = [r for r in s.agent_events("n1") if r["event"]["type"] == "action"]
    events = s.rank_events()
    if scenario == "hang":
        fault = next(r for r in events if r["event"]["type"] == "fault_injected")["timestamp"]
        resumed = [r for r in events if r["event"]["type"] == "run_start"][1:]
        acted = resumed[0]["timestamp"] if resumed and finished else None
    else:
        steps = [r for r in read_records(s.run_dir / "tls" / "rank-0.jsonl") if r.get("metrics")]
        fault = steps[SCENARIOS["cost"]["policy"]["cost"]["min_steps"]]["timestamp"]
        ends = [r for r in events if r["event"]["type"] == "run_end"]
        acted = ends[0]["timestamp"] if ends else None
    return {"to_action": issued[0]["timestamp"] - fault, "to_trainer": None if acted is None else acted - fault}


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _cell(value: float | None) -> str:
    return "restart failed" if value is None else f"{value:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default="hang,cost")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    print("| scenario | path | fault -> action (s) | fault -> trainer acted (s) | ratio alerts/embedded (to action) |")
    print("|---|---|---|---|---|")
    for scenario in args.scenarios.split(","):
        results = {path: [run_once(scenario, path) for _ in range(args.repeat)] for path in ("embedded", "alerts")}
        median = {path: {key: _median(r[key] for r in runs) for key in runs[0]} for path, runs in results.items()}
        ratio = median["alerts"]["to_action"] / median["embedded"]["to_action"]
        for path in ("embedded", "alerts"):
            m = median[path]
            print(f"| {scenario} | {path} | {_cell(m['to_action'])} | {_cell(m['to_trainer'])} | "
                  f"{f'{ratio:.2f}' if path == 'alerts' else ''} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
