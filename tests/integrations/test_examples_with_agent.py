"""Each example of examples/ run end to end beside a real `trainguard agent` on CPU: a NaN skipped, a run of
spikes rolled back to the last stable checkpoint, and the agent's cost_stop (its embedded cost meter on the
run's TLS file, a tiny budget) obeyed with a verified checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.alerts.helpers import read_jsonl
from tests.library.test_plain_loop import GUARD
from tests.servers import free_port
from tests.trainer.helpers import events, step_records

ROOT = Path(__file__).resolve().parents[2]
# One billed device at $2/h: any CPU step costs many times $0.0001 per 1000 steps, so once the meter may
# judge (min_steps) every tier fires; the faults come before it.
POLICY = {"guard": GUARD, "cost": {"budget_per_1k_steps": 0.0001, "gpu_count_override": 1, "min_steps": 20}}
EXAMPLES = {"plain_loop": None, "hf_trainer": "transformers", "lightning_module": "lightning"}


def start_agent(run: Path, policy: Path, tmp_path: Path) -> tuple[subprocess.Popen, object]:
    config = tmp_path / "agent.yaml"
    config.write_text("nodelog: {enabled: false}\n")
    log = open(tmp_path / "agent.log", "wb")
    agent = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "agent", "--create", "--run-dir", str(run),
                              "--listen", f"127.0.0.1:{free_port()}", "--config", str(config), "--policy",
                              str(policy), "--interval", "0.5"], stdout=log, stderr=log, cwd=ROOT)
    return agent, log


@pytest.mark.slow
@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_example_with_the_agent_skips_a_nan_rolls_back_spikes_and_obeys_cost_stop(example, tmp_path):
    if EXAMPLES[example]:
        pytest.importorskip(EXAMPLES[example])
    run, policy = tmp_path / "run", tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(POLICY))
    agent, log = start_agent(run, policy, tmp_path)
    try:
        done = subprocess.run([sys.executable, "-m", f"examples.{example}", "--run-dir", str(run), "--steps", "400",
                               "--inject", "nan@3", "--inject", "spike@14", "--policy", str(policy),
                               "--checkpoint-every", "5"], cwd=ROOT, capture_output=True, text=True, timeout=400)
    finally:
        agent.terminate()
        agent.wait(30)
        log.close()
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exit_code=0" in done.stdout

    assert [(e["step"], e["reason"]) for e in events(run, "skip_step")] == [
        (3, "nan"), (14, "loss_spike"), (15, "loss_spike")]
    (rollback,) = events(run, "rollback")
    assert (rollback["step"], rollback["restored_step"], rollback["source"]) == (16, 10, "guard")

    issued = read_jsonl(run / "control" / "actions.jsonl")          # written by the agent
    assert [r["action"] for r in issued] == ["cost_warn", "cost_throttle", "cost_stop"]
    acked = {e["id"]: e for e in events(run, "action")}
    stop = acked[issued[-1]["id"]]
    # none of the examples keeps a micro-batch the throttle could cut: the event says so, claims no change
    assert acked[issued[1]["id"]]["micro_batch"] == "unchanged" and "micro_batch_size" not in acked[issued[1]["id"]]
    assert stop["action"] == "cost_stop"
    steps = [r["step"] for r in step_records(run)]
    assert steps[-1] == stop["step"] < 400 and events(run, "run_end")[-1]["reason"] == "cost_stop"
    summary = json.loads((run / "cost_summary.json").read_text())
    assert summary["checkpoint_verified"] is True and summary["step"] == stop["step"]
    assert summary["stopped_by"]["id"] == issued[-1]["id"]
