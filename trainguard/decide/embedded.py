"""The embedded path's notices: a decision the agent makes itself, as the alert it stands in for.

The agent's cost meter and stall watchdog (agent/actions_embedded.py) act without Prometheus; their
decisions reach the ledger as notices named after the alert that would have said the same, so records,
de-duplication and replay (trainguard/replay/timeline.py) treat both paths alike. Pure.
"""

from __future__ import annotations

from trainguard import actions
from trainguard.decide.decision import Decision
from trainguard.decide.ledger import Notice

# The alert each embedded decision stands in for: the records name it, as an alert's would.
ALERT_OF = {actions.COST_WARN: "CostBudgetWarn", actions.COST_THROTTLE: "CostBudgetThrottle",
            actions.COST_STOP: "CostBudgetStop", actions.RESTORE: "TrainingStalled"}


def cost_notice(decision: Decision) -> Notice:
    """A cost meter decision (a cost tier) as a notice; its key is the tier, which acts once per run."""
    tier = decision.action
    if tier not in actions.COST_ORDER:
        raise ValueError(f"not a cost tier: {tier!r}")
    return Notice.from_decision(decision, ALERT_OF[tier], key=f"embedded:{tier}")
