"""A node drained at a checkpoint, with a hot spare and without: cordon -> next completed step, and the world size.

Each run is the real thing on loopback (tests/culprit/cluster.py): `trainguard train --nnodes 1:2` launchers
for n1 and n2 (1 rank each, c10d rendezvous, gloo), an agent beside each node; n2's agent reads the FAKE
NVML's degrading GPU, so its node-risk rule drains n2 at a checkpoint (issue 33: every rank saves and stops,
the agent cordons n2, signed, and ends its launcher). With `spare`, a third launcher n3 runs `--spare` and
takes n2's place; without, the job shrinks to n1. Steps are paced (slowio, 0.5 s a batch) so the drain
falls mid-run, as in tests/e2e/test_spare_node.py. Measured from the run's own records:

- cordon -> next step: the cordon's signed ``cordoned_at`` to the first step record after the drain's step;
- drain -> next step: the ranks' drain event (the checkpoint saved) to the same;
- the world size of the job before the drain and after it; the steps lost (trained again after the resume).

    .venv/bin/python bench/bench_spare.py                   # both runs, a table
    .venv/bin/python bench/bench_spare.py --only spare --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.culprit.cluster import FAST_KEEP_ALIVE, cluster, wait_until  # noqa: E402
from trainguard import event_types  # noqa: E402
from trainguard.actions import DRAIN  # noqa: E402
from trainguard.agent import evict  # noqa: E402

STEPS = 90


def args_for(steps: int) -> list[str]:
    paced = [f"--inject=slowio@{step}" for step in range(1, steps, 5)]
    return ["--steps", str(steps), "--checkpoint-every", "1000", "--checkpoint-every-seconds", "0",
            "--device", "cpu", *paced]


def steps_of(c) -> list[dict]:
    return [r for r in c.records("rank-0.jsonl") if isinstance(r.get("metrics"), dict) and "loss" in r["metrics"]]


def run(with_spare: bool, steps: int) -> dict:
    """One drained run; its measures from the records."""
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-spare-") as tmp:
        tmp_path = Path(tmp)
        with cluster(tmp_path, nodes=("n1", "n3") if with_spare else ("n1",), rdzv_conf=FAST_KEEP_ALIVE) as c:
            for node in ("n1", "n2"):
                c.launch(node, *args_for(steps))
            if with_spare:
                c.launch("n3", *args_for(steps), "--spare")
            wait_until(lambda: len(steps_of(c)) >= 3, 300, "the first steps", c)
            c.start_agent("n2", "degrading")
            c.wait_agent("n2")
            code = c.wait("n1", 600)
            if with_spare:
                c.wait("n3", 120)
            return measure(c, with_spare, code, time.time() - began)


def measure(c, with_spare: bool, code: int, wall: float) -> dict:
    [drain] = [r for r in c.events("rank-0.jsonl", event_types.ACTION) if r["event"]["action"] == DRAIN]
    step = drain["event"]["checkpoint_step"]
    cordon = evict.cordoned(c.run_dir)["n2"]
    after = [r for r in steps_of(c) if r["step"] > step and r["timestamp"] > drain["timestamp"]]
    starts = [r["event"] for r in c.events("rank-0.jsonl", event_types.RUN_START)]
    trained = [r["step"] for r in steps_of(c)]
    joined = [r["event"] for r in c.events("node-n3-launcher.jsonl", event_types.SPARE_JOINED)]
    return {
        "mode": "spare" if with_spare else "shrink",
        "exit_n1": code,
        "drain_step": step,
        "cordon_to_next_step_s": round(after[0]["timestamp"] - cordon["cordoned_at"], 2) if after else None,
        "drain_to_next_step_s": round(after[0]["timestamp"] - drain["timestamp"], 2) if after else None,
        "spare_join_after_cordon_s": joined[0]["after_cordon_seconds"] if joined else None,
        "world_before": starts[0]["world_size"],
        "world_after": starts[-1]["world_size"],
        "resumed_from": starts[-1].get("resumed_from"),
        "steps_trained_twice": len(trained) - len(set(trained)),
        "completed": c.events("rank-0.jsonl", event_types.RUN_END)[-1]["event"]["reason"] == "completed",
        "wall_s": round(wall, 1),
    }


def table(results: list[dict]) -> str:
    lines = ["| mode | cordon -> next step | drain -> next step | spare joined after cordon | world size before -> after "
             "| resumed from | steps lost | completed |",
             "|---|---:|---:|---:|---|---:|---:|---|"]
    for r in results:
        spare = f"{r['spare_join_after_cordon_s']:.2f} s" if r["spare_join_after_cordon_s"] is not None else "-"
        lines.append(f"| {r['mode']} | {r['cordon_to_next_step_s']} s | {r['drain_to_next_step_s']} s | {spare} | "
                     f"{r['world_before']} -> {r['world_after']} | {r['resumed_from']} | {r['steps_trained_twice']} | "
                     f"{'yes' if r['completed'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("spare", "shrink"), help="one of the two runs")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    modes = [args.only == "spare"] if args.only else [True, False]
    results = [run(mode, args.steps) for mode in modes]
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
