"""Shadow mode end to end on the bundled trainer (`trainguard train --shadow`, the policy's `actions.mode`):
injected faults are decided as they would be, recorded as `shadow_action` events with their evidence, and
none is carried out: no step skipped, no rollback, no stop, training goes on unchanged to its end."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml

from tests.trainer.helpers import events, step_records, train, write_policy
from tests.trainer.test_guard_hook import GUARD
from trainguard import tls
from trainguard.actions import SHADOW_ACTION, shadow_event
from trainguard.metrics.training import families
from trainguard.metrics.training_state import TrainingState
from trainguard.report import data as report_data
from trainguard.report import status_cli as status_mod
from trainguard.report.summary import sentences

TOKENS_PER_STEP = 8 * 64          # the tiny preset's batch x block size


def shadowed(run) -> list[tuple[int, str, str]]:
    return [(e["step"], e["action"], e["reason"]) for e in events(run, "shadow_action")]


def test_train_shadow_records_the_guards_actions_and_carries_out_none(tmp_path):
    run = tmp_path / "run"
    policy = write_policy(tmp_path / "policy.yaml", **GUARD)
    faults = ["spike@22", "spike@33", "spike@34", "spike@35", "nan@38"]
    code = train(run, "--steps", "40", "--checkpoint-every", "10", "--policy", str(policy), "--shadow",
                 *sum((["--inject", f] for f in faults), []))
    assert code == 0

    # what the live guard does on the same faults (tests/trainer/test_guard_hook.py), as "would have"
    assert shadowed(run) == [(22, "skip_step", "loss_spike"), (33, "skip_step", "loss_spike"),
                             (34, "skip_step", "loss_spike"), (35, "rollback", "repeated_loss_spike"),
                             (38, "skip_step", "nan"), (39, "skip_step", "nan"), (40, "rollback", "repeated_nan")]
    first = events(run, "shadow_action")[0]
    assert first["source"] == "guard" and first["would_have"] is True
    assert first["loss"] > first["threshold"]                                # the evidence it decided on
    assert events(run, "run_start")[0]["actions_mode"] == "shadow"
    for line in (run / "tls" / "rank-0.jsonl").read_text().splitlines():
        if SHADOW_ACTION in line:
            jsonschema.validate(json.loads(line), json.loads(tls.SCHEMA_PATH.read_text()))

    # ... and nothing of it happened
    assert not events(run, "skip_step") and not events(run, "rollback") and not events(run, "stop")
    steps = step_records(run)
    assert [r["step"] for r in steps] == list(range(1, 41))                  # no step repeated
    assert steps[-1]["metrics"]["tokens_trained"] == 40 * TOKENS_PER_STEP    # no step skipped
    assert len({r["metrics"]["learning_rate"] for r in steps[25:]}) > 1     # the LR was never cut and held
    assert events(run, "run_end")[-1]["reason"] == "completed"
    assert not (run / "control" / "stopped.json").exists()
    assert [e["step"] for e in events(run, "checkpoint_saved")] == [10, 20, 30, 40]

    # shown by status, report and the metrics
    status = status_mod.collect(run)
    assert status.shadowed == {"skip_step": 5, "rollback": 2}
    assert "SHADOW" in status_mod.render(status) and "would have" in status_mod.render(status)
    report = report_data.load_run(run)
    assert report.shadowed == {"skip_step": 5, "rollback": 2}
    assert not report.actions.get("skip_step") and not report.actions.get("rollback")
    assert any("shadow" in line.lower() and "rollback" in line for line in sentences(report))
    state = TrainingState()
    for record in step_records(run) + [{"event": e, "timestamp": 0.0} for e in events(run)]:
        state.apply(record, 0)
    [family] = [f for f in families(state, 0.0) if f.name == "trainguard_training_shadow_actions"]
    assert {s.labels["action"]: s.value for s in family.samples} == {"rollback": 2.0, "skip_step": 5.0}


def test_shadow_from_the_policy_records_one_stop_and_trains_on(tmp_path):
    """The guard's stop (its rollback limit) in shadow: recorded once, the run is not ended, no marker."""
    run = tmp_path / "run"
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"guard": {**GUARD, "max_rollbacks_per_hour": 0},
                                      "actions": {"mode": "shadow"}}))
    assert train(run, "--steps", "24", "--checkpoint-every", "10", "--policy", str(policy),
                 "--inject", "spike@15", "--inject", "spike@16", "--inject", "spike@17") == 0
    assert shadowed(run) == [(15, "skip_step", "loss_spike"), (16, "skip_step", "loss_spike"),
                             (17, "stop", "rollback_limit")]      # a stopped guard says stop again: once
    assert not events(run, "stop") and not (run / "control" / "stopped.json").exists()
    assert [r["step"] for r in step_records(run)] == list(range(1, 25))
    assert events(run, "run_end")[-1]["reason"] == "completed"


def test_the_schema_holds_a_shadow_action_to_would_have():
    record = tls.event(SHADOW_ACTION, step=3, timestamp=1.0, **shadow_event("rollback", "repeated_nan", "guard"))
    jsonschema.validate(record, json.loads(tls.SCHEMA_PATH.read_text()))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**record, "event": {**record["event"], "would_have": False}}, json.loads(tls.SCHEMA_PATH.read_text()))
