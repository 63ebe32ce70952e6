"""The action table (trainguard/actions.py) against everything that acts on it: every action has the handler
its row names on the side that carries it out, and nothing else has one; codes, escalations, limits and
the alerts a row names are real."""

from __future__ import annotations

import pytest

from trainguard import actions
from trainguard.agent import handlers as agent_handlers
from trainguard.alerts import rules
from trainguard.decide.ledger import Ledger, Limits, Notice
from trainguard.policy import Policy
from trainguard.protect import handlers as trainer_handlers


def carried_by(who: str) -> set[str]:
    return {action.name for action in actions.TABLE if action.carried_by == who}


def test_each_action_the_protector_carries_out_has_one_trainer_handler_and_no_other_has_one():
    assert set(trainer_handlers.HANDLERS) == carried_by(actions.PROTECTOR)


def test_each_action_the_agent_carries_out_has_one_agent_handler_and_no_other_has_one():
    assert set(agent_handlers.HANDLERS) == carried_by(actions.AGENT)


def test_a_remote_action_for_the_ranks_has_a_control_code_and_no_other_action_has_one():
    """The control channel is how a remote action reaches the ranks: its code travels in the step's
    all-reduce (runtime/control.py), so codes are distinct and never 0 ("nothing this step")."""
    for_the_ranks = {a.name for a in actions.TABLE if a.remote and a.carried_by == actions.PROTECTOR}
    assert set(actions.CODES) == for_the_ranks
    assert len(set(actions.CODES.values())) == len(actions.CODES) and 0 not in actions.CODES.values()
    assert {actions.ACTIONS_BY_CODE[code] for code in actions.CODES.values()} == for_the_ranks


def test_escalations_are_actions_and_every_limit_is_a_policy_key_the_ledger_reads():
    policy = Policy()
    for action in actions.TABLE:
        assert (action.hourly_limit is None) == (action.escalation is None), action.name
        if action.hourly_limit is not None:
            assert action.escalation in actions.BY_NAME
            section, key = action.hourly_limit.split(".")
            limit = getattr(getattr(policy, section), key)
            assert Limits.from_policy(policy).per_hour(action.name) == limit


def test_a_remote_action_without_a_tier_or_limit_acts_once_per_incident():
    """A new remote action (no cost tier, no hourly limit) needs no ledger change: it acts once per alert."""
    drain = actions.Action("drain_test", "a test action", actions.PROTECTOR, remote=True, code=99)
    ledger = Ledger()
    first = ledger.decide(Notice("NodeRisk", "firing", drain.name, "fp@1"), now=10.0)
    again = ledger.decide(Notice("NodeRisk", "firing", drain.name, "fp@1"), now=11.0)
    assert (first.outcome, first.action, again.outcome) == ("act", drain.name, "duplicate")


def test_the_alert_an_embedded_decision_stands_in_for_exists_with_that_action():
    alerts = {alert.name: alert for alert in rules.alerts()}
    for action, alertname in actions.ALERT_OF.items():
        assert alerts[alertname].action == action


# The actions before the table (issue 30), in the order every view listed them: a new action is a row after them.
ORIGINAL = ("skip_step", "rollback", "restore", "cost_warn", "cost_throttle", "cost_stop", "stop", "page", "evict",
            "cordon")


def test_the_derived_views_keep_the_vocabulary_they_always_had():
    """The report's and dashboards' groups, the webhook's and the guard's sets, as the table derives them: for
    the original actions exactly what the modules spelled before the table (so the report, the rendered rules
    and the dashboards stay byte for byte the same); a newer row joins the views its fields put it in."""
    assert tuple(action.name for action in actions.TABLE[:len(ORIGINAL)]) == ORIGINAL

    def original(view):
        return tuple(name for name in view if name in ORIGINAL)

    assert original(actions.REMOTE_ACTIONS) == ("rollback", "restore", "cost_warn", "cost_throttle", "cost_stop")
    assert original(actions.GUARD_ACTIONS) == ("skip_step", "rollback", "stop")
    assert original(actions.DECISIONS) == ("skip_step", "rollback", "restore", "cost_warn", "cost_throttle",
                                           "cost_stop", "stop")
    assert original(actions.REPORTED_GUARD_ACTIONS) == ("skip_step", "rollback", "restore", "stop")
    assert original(actions.COST_ACTIONS) == ("cost_warn", "cost_throttle", "cost_stop")
    assert {name: tier for name, tier in actions.COST_ORDER.items() if name in ORIGINAL} == {
        "cost_warn": 1, "cost_throttle": 2, "cost_stop": 3}
    assert {name: to for name, to in actions.ESCALATION.items() if name in ORIGINAL} == {
        "rollback": "cost_stop", "restore": "page"}
    assert [name for name, _ in actions.STEPS_LOST if name in ORIGINAL] == ["skip_step", "rollback", "restore"]
    for view in (actions.REMOTE_ACTIONS, actions.GUARD_ACTIONS, actions.DECISIONS, actions.REPORTED_GUARD_ACTIONS):
        newer = view[len(original(view)):]
        assert original(view) + newer == view, f"a newer action listed before the original ones in {view}"


@pytest.mark.parametrize("register", [trainer_handlers.handles, agent_handlers.handles])
def test_an_action_cannot_get_two_handlers(register):
    taken = next(iter(trainer_handlers.HANDLERS if register is trainer_handlers.handles
                      else agent_handlers.HANDLERS))
    with pytest.raises(ValueError, match="two"):
        register(taken)(lambda *args: None)
