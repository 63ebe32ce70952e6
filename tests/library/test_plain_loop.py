"""The loop of docs/library.md, run as it stands on CPU: a NaN skipped, a run of spikes rolled back to the
last stable checkpoint, and the agent's cost_stop (appended to the control file as the agent does) obeyed."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import torch
import yaml

from tests.trainer.helpers import events, step_records
from trainguard.runtime.checkpoint import CheckpointManager
from tests import signing

DOC = Path(__file__).resolve().parents[2] / "docs" / "library.md"
GUARD = dict(spike_min_steps=10, spike_window=64, grad_min_steps=10, rollback_after=3, rollback_window=10,
             rewarmup_steps=5, rollback_lr_factor=0.5)


def documented_loop():
    """The `train` function of the doc's loop, executed from the doc's own text."""
    block = next(b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S) if "def train(" in b)
    assert 25 <= len(block.strip().splitlines()) <= 50
    namespace: dict = {}
    exec(compile(block, str(DOC), "exec"), namespace)
    return namespace["train"]


def request_when_step_written(run: Path, step: int, action: str) -> threading.Thread:
    """The agent's part: append a request once the trainer's TLS file shows `step`."""
    def watch():
        path, deadline = run / "tls" / "rank-0.jsonl", time.time() + 120
        while time.time() < deadline:
            if path.exists() and f'"step":{step},"metrics"' in path.read_text():
                signing.append(run, action, "s1", alertname="CostBudgetStop", reason="budget spent")
                return
            time.sleep(0.002)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_documented_loop_skips_a_nan_rolls_back_spikes_and_obeys_cost_stop(tmp_path):
    train = documented_loop()
    run, policy = tmp_path / "run", tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"guard": GUARD}))
    agent = request_when_step_written(run, 40, "cost_stop")
    code = train(run, steps=3000, faults={5: float("nan"), 22: 1e3, 23: 1e3, 24: 1e3}, policy=str(policy))
    agent.join()
    assert code == 0

    assert [(e["step"], e["reason"]) for e in events(run, "skip_step")][0] == (5, "nan")
    assert [e["step"] for e in events(run, "skip_step")] == [5, 22, 23]
    (rollback,) = events(run, "rollback")
    assert (rollback["step"], rollback["restored_step"], rollback["source"]) == (24, 20, "guard")
    assert rollback["lr_scale"] == 0.5
    steps = [r["step"] for r in step_records(run)]
    assert steps[:24] == list(range(1, 25)) and steps[24] == 21          # replayed from the checkpoint
    rates = [r["metrics"]["learning_rate"] for r in step_records(run)]
    assert rates[:24] == [0.05] * 24 and set(rates[24:]) == {0.025}     # the default scale_lr: lr x 0.5
    saved = [(e["step"], e["stable"]) for e in events(run, "checkpoint_saved")]
    assert saved[:2] == [(10, False), (20, True)]                        # the NaN made step_10 unstable

    (ack,) = events(run, "action")
    end = events(run, "run_end")[-1]
    assert ack["action"] == "cost_stop" and ack["id"] == "s1" and end["reason"] == "cost_stop"
    assert end["step"] == ack["step"] == steps[-1] < 3000
    summary = json.loads((run / "cost_summary.json").read_text())
    assert summary["step"] == end["step"] and summary["checkpoint_verified"] is True
    assert summary["stopped_by"] == {"id": "s1", "alertname": "CostBudgetStop", "reason": "budget spent"}
    latest = CheckpointManager(run).latest_verified()
    assert latest.step == end["step"]

    # The checkpoint the run ended on holds the loop's states and the library's, and resumes exactly.
    state = CheckpointManager(run).load(latest)
    assert set(state) == {"model", "optim", "rng", "guard", "cost", "trainer"}
    assert state["trainer"]["step"] == end["step"] and state["trainer"]["lr_scale"] == 0.5
    assert train(run, steps=end["step"] + 2, policy=str(policy)) == 0
    assert events(run, "checkpoint_restored")[-1]["step"] == end["step"]
    assert [r["step"] for r in step_records(run)][-2:] == [end["step"] + 1, end["step"] + 2]
    assert all(torch.isfinite(t).all() for t in CheckpointManager(run).load(
        CheckpointManager(run).latest_verified())["model"].values())
