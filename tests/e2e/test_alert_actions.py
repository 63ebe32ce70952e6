"""End to end, real servers: a fault in training -> Prometheus alert -> Alertmanager -> agent webhook -> action.

Each scenario runs the bundled trainer (tiny model, CPU), one agent (`trainguard agent`), Prometheus with
the rules rendered from the scenario's policy, and Alertmanager with the generated route, all on loopback.
The agents' embedded path is off here: these tests prove the alert path; tests/alerts/test_embedded.py
covers the embedded one. The loss-spike scenario runs on two nodes, once, in tests/e2e/test_two_nodes.py.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.stack import read_records, record_timing, stack

pytestmark = [pytest.mark.servers, pytest.mark.slow, pytest.mark.timeout(300)]


def of_type(kind, **fields):
    return lambda r: r["event"]["type"] == kind and all(r["event"].get(k) == v for k, v in fields.items())


# The restarted ranks report no step until they have imported torch and loaded the checkpoint, and
# TrainingStalled keeps firing until then: the product's default cooldown (120 s) coalesces that into the
# one restore. The stack's 20 s let a loaded machine's slow restart be restored a second time (seen:
# resumed_from [None, 20, 20]).
ONE_RESTORE_PER_HANG = {"alerts": {"action_cooldown_seconds": 120.0}}


def test_hang_is_restored_and_the_run_resumes_from_the_latest_verified_checkpoint(tmp_path):
    # today's path, the restore's restart (under in_process the ranks recover in their own processes:
    # tests/culprit/test_two_nodes_culprit.py)
    with stack(tmp_path, {**ONE_RESTORE_PER_HANG, "recovery": {"mode": "restart"}}) as s:
        s.start_agent("n1", wait=False)
        s.start_servers()
        # the hang comes after the checkpoint of step 20; 10 steps after it show the resumed run finishing
        trainer = s.train("--steps", "30", "--checkpoint-every", "10", "--nproc", "2", "--max-restarts", "3",
                          "--inject=hang@25")

        issued = s.wait_for_event(lambda: s.agent_events("n1"), of_type("action", action="restore"), 150,
                                  "the agent's restore")
        assert sorted(e["rank"] for e in issued["event"]["ended"]) == [0, 1]
        assert s.wait_trainer(trainer, 180) == 0

        events = s.rank_events()
        fault = next(r for r in events if r["event"]["type"] == "fault_injected")
        starts = [r for r in events if r["event"]["type"] == "run_start"]
        assert [r["event"]["resumed_from"] for r in starts] == [None, 20]
        assert starts[1]["event"]["restart_count"] >= 1
        decided = [r["event"] for r in s.agent_events("n1") if r["event"]["type"] == "alert"
                   and r["event"]["outcome"] == "act"]
        assert [(e["alertname"], e["action"]) for e in decided] == [("TrainingStalled", "restore")]
        assert events[-1]["event"]["type"] == "run_end" and events[-1]["step"] == 30
        steps = [r["step"] for r in s.rank_events(1) if r["event"]["type"] == "run_end"]
        assert steps == [30]
        record_timing("hang -> TrainingStalled -> restore",
                      to_action=issued["timestamp"] - fault["timestamp"],
                      to_trainer=starts[1]["timestamp"] - fault["timestamp"])


def test_a_low_budget_warns_then_throttles_then_stops_with_a_verified_checkpoint(tmp_path):
    # One billed device at $2/h; even a fast tiny CPU step (5 ms) costs 28x the $0.0001 budget per 1000 steps: every tier is crossed.
    policy = {"cost": {"budget_per_1k_steps": 0.0001, "gpu_count_override": 1, "min_steps": 20}}
    with stack(tmp_path, policy) as s:
        s.start_agent("n1", wait=False)
        s.start_servers()
        trainer = s.train("--steps", "2000", "--checkpoint-every", "50")
        assert s.wait_trainer(trainer, 200) == 0

        acted = [r for r in s.rank_events() if r["event"]["type"] == "action"]
        assert [r["event"]["action"] for r in acted] == ["cost_warn", "cost_throttle", "cost_stop"]
        assert [r["event"]["alertname"] for r in acted] == ["CostBudgetWarn", "CostBudgetThrottle", "CostBudgetStop"]
        assert acted[0]["step"] <= acted[1]["step"] <= acted[2]["step"]
        decided = [r["event"] for r in s.agent_events("n1") if r["event"]["type"] == "alert"
                   and r["event"]["outcome"] == "act"]
        assert [(e["alertname"], e["source"]) for e in decided] == [
            ("CostBudgetWarn", "alertmanager"), ("CostBudgetThrottle", "alertmanager"),
            ("CostBudgetStop", "alertmanager")]
        end = s.rank_events()[-1]
        assert end["event"]["type"] == "run_end" and end["event"]["reason"] == "cost_stop"
        summary = json.loads((s.run_dir / "cost_summary.json").read_text())
        assert summary["checkpoint_verified"] is True and summary["step"] == end["step"]
        assert (s.run_dir / "checkpoints" / f"step_{end['step']}" / "manifest.json").exists()
        steps = [r for r in read_records(s.run_dir / "tls" / "rank-0.jsonl") if r.get("metrics")]
        first_judged = steps[policy["cost"]["min_steps"]]     # the first step the budget could be judged on
        issued = [r for r in s.agent_events("n1") if r["event"]["type"] == "action"]
        record_timing("low budget -> CostBudget* -> cost_warn, throttle, stop",
                      to_action=issued[0]["timestamp"] - first_judged["timestamp"],
                      to_trainer=acted[-1]["timestamp"] - first_judged["timestamp"])
