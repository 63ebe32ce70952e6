"""The embedded path's notices: a decision the agent makes itself, as the alert it stands in for.

The agent's cost meter and stall watchdog (agent/actions_embedded.py) act without Prometheus; their
decisions reach the ledger as notices named after the alert that would have said the same (the action
table's `stands_in_for`, trainguard/actions.py ALERT_OF), so records,
de-duplication and replay (trainguard/replay/timeline.py) treat both paths alike. Pure.
"""

from __future__ import annotations

from trainguard import actions
from trainguard.decide.decision import Decision
from trainguard.decide.ledger import Notice


def cost_notice(decision: Decision) -> Notice:
    """A cost meter decision (a cost tier) as a notice; its key is the tier, which acts once per run."""
    tier = decision.action
    if tier not in actions.COST_ORDER:
        raise ValueError(f"not a cost tier: {tier!r}")
    return Notice.from_decision(decision, actions.ALERT_OF[tier], key=f"embedded:{tier}")
