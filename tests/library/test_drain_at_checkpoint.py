"""drain_at_checkpoint (a node at hardware risk, decide/node_risk.py): every rank saves a verified checkpoint
of the step it is in and stops, so nothing is trained past it; in shadow mode it is a shadow_action and
nothing is saved or stopped; a signed request reaches the documented loop end to end."""

from __future__ import annotations

import torch
import yaml

from tests.library.test_plain_loop import documented_loop, request_when_step_written
from tests.trainer.helpers import events, step_records
from trainguard import actions
from trainguard.actions import DRAIN
from trainguard.policy import Policy, in_shadow
from trainguard.protect import Protector, handlers
from trainguard.runtime.checkpoint import CheckpointManager

IDS = {"id": "d1", "alertname": "NodeAtRisk", "reason": "node_risk"}
ORDER = handlers.Order(DRAIN, handlers.CONTROL, "node_risk", IDS, {"id": "d1", "alertname": "NodeAtRisk"})


def protector(run_dir, **options) -> Protector:
    model = torch.nn.Linear(2, 2)
    made = Protector(run_dir, states={"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)},
                     **options)
    made.begin(integration="plain")
    return made


def test_the_row_reaches_the_ranks_by_its_code_once_per_flag():
    row = actions.of(DRAIN)
    assert row.remote and row.carried_by == actions.PROTECTOR and actions.ACTIONS_BY_CODE[row.code] == DRAIN
    assert row.hourly_limit is None       # the rule's circuit breaker bounds the flags, fleet-wide


def test_a_verified_checkpoint_of_this_step_then_every_rank_stops(tmp_path):
    guarded = protector(tmp_path)
    guarded.state.step = 7
    outcome = guarded._carry_out(ORDER)
    guarded.close()
    assert outcome.stop and (outcome.exit_code, outcome.reason) == (handlers.EXIT_DRAINED, DRAIN)
    assert CheckpointManager(tmp_path).latest_verified().step == 7
    [event] = [e for e in events(tmp_path, "action") if e["action"] == DRAIN]
    assert (event["step"], event["checkpoint_step"], event["checkpoint_verified"], event["id"]) == (7, 7, True, "d1")
    assert events(tmp_path, "run_end")[-1]["reason"] == DRAIN


def test_in_shadow_mode_it_is_recorded_and_nothing_is_saved_or_stopped(tmp_path):
    guarded = protector(tmp_path, policy=in_shadow(Policy()))
    guarded.state.step = 7
    outcome = guarded._carry_out(ORDER)
    guarded.close()
    assert not outcome.stop and CheckpointManager(tmp_path).latest_verified() is None
    [shadow] = events(tmp_path, "shadow_action")
    assert (shadow["action"], shadow["reason"], shadow["source"], shadow["would_have"]) == (
        DRAIN, "node_risk", handlers.CONTROL, True)
    assert not [e for e in events(tmp_path, "action") if e.get("action") == DRAIN]


def test_the_signed_request_drains_the_documented_loop_with_no_step_past_the_checkpoint(tmp_path):
    run, policy = tmp_path / "run", tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({}))
    agent = request_when_step_written(run, 30, DRAIN)
    code = documented_loop()(run, steps=3000, faults={}, policy=str(policy))
    agent.join()
    assert code == handlers.EXIT_DRAINED
    [event] = [e for e in events(run, "action") if e["action"] == DRAIN]
    steps = [r["step"] for r in step_records(run)]
    assert event["checkpoint_step"] == steps[-1] == CheckpointManager(run).latest_verified().step < 3000
    assert steps == list(range(1, steps[-1] + 1))          # every step once, the last one checkpointed
