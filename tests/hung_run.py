"""A real run with a rollback and a hang, made once per session by the `hung_run` fixture (tests/conftest.py).

Two ranks of the bundled trainer under `trainguard train --nproc 2` with its default flags (the launcher
gets room for the agent's restores), `trainguard agent` beside them: NaNs at steps 15-17 make the guard
roll back to step 10 (steps 11-17 run twice); a hang at step 40 is seen by the agent's embedded stall
watchdog, which restores (ends the ranks; the launcher starts them again from step 30).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.report.agent_beside import start_agent, stop

TRAINGUARD = [sys.executable, "-m", "trainguard.cli"]
STALL_SECONDS = 5.0
STEPS, HANG_STEP, CHECKPOINT_EVERY = 60, 40, 10


def run_with_a_hang(run_dir: Path) -> Path:
    (run_dir / "agent").mkdir(parents=True)
    policy = run_dir / "policy.yaml"           # given to the agent (its config) and to the trainer, which signs it
    # snapshots every 5 steps exactly (not paced to their cost, docs/recovery.md): the restart resumes from
    # the one of step 35, whatever the machine's load, and the story's steps are the same on every run
    policy.write_text(yaml.safe_dump({"alerts": {"stall_seconds": STALL_SECONDS}, "recovery": {"snapshot_budget": 0}}))
    config = run_dir / "agent" / "agent.yaml"
    # The agent restores today's way (ends the ranks; the launcher restarts them, which take the in-memory
    # snapshot): the story the report and goodput tests read. Its own policy says so; the trainer's is the
    # default (in_process). An in-process restore of a hang: tests/culprit/test_two_nodes_culprit.py.
    agent_policy = run_dir / "agent" / "policy.yaml"
    agent_policy.write_text(yaml.safe_dump({"alerts": {"stall_seconds": STALL_SECONDS}, "recovery": {"mode": "restart"}}))
    config.write_text(yaml.safe_dump({"policy": str(agent_policy), "nodelog": {"interval": 1},
                                      "collectors": {"training": {"interval": 1}, "host": {"interval": 1}}}))
    agent, _ = start_agent(run_dir, config)
    try:
        faults = ["--inject=nan@15", "--inject=nan@16", "--inject=nan@17", f"--inject=hang@{HANG_STEP}"]
        done = subprocess.run(TRAINGUARD + ["train", "--run-dir", str(run_dir), "--policy", str(policy), "--steps",
                                            str(STEPS), "--nproc", "2", "--checkpoint-every", str(CHECKPOINT_EVERY),
                                            *faults], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        time.sleep(1.5)                        # one more node record after the end
    finally:
        stop(agent)
    return run_dir
