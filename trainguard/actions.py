"""The action vocabulary shared by the guard, the cost policy, the alerts and the webhook.

Pure: no I/O. The agent's executor, the trainer's control channel and replay all speak these names;
every use imports them from here rather than spelling them.
"""

from __future__ import annotations

from typing import Any

from trainguard import event_types

SKIP_STEP = "skip_step"
ROLLBACK = "rollback"        # restore the last stable checkpoint, skip the data window, lower the LR
RESTORE = "restore"          # restart hung or dead ranks from the latest verified checkpoint
COST_WARN = "cost_warn"
COST_THROTTLE = "cost_throttle"
COST_STOP = "cost_stop"
STOP = "stop"                # the guard's last word: too many rollbacks, the run ends (not a remote action)
PAGE = "page"                # the ledger's escalation of a restore: nothing acts on the run, a human must look

ACTIONS = (SKIP_STEP, ROLLBACK, RESTORE, COST_WARN, COST_THROTTLE, COST_STOP)
GUARD_ACTIONS = (SKIP_STEP, ROLLBACK, STOP)      # what the gradient-health guard decides
COST_ACTIONS = (COST_WARN, COST_THROTTLE, COST_STOP)
# Every decision a TLS `event.type` can record (the guard's stop included).
DECISIONS = (*ACTIONS, STOP)

# Severity order for escalation and de-duplication: a stronger cost action supersedes a weaker one.
COST_ORDER = {COST_WARN: 1, COST_THROTTLE: 2, COST_STOP: 3}

# Actions that may arrive from outside the trainer (the webhook), through the control channel.
REMOTE_ACTIONS = (ROLLBACK, RESTORE, COST_WARN, COST_THROTTLE, COST_STOP)


def is_action(name: str) -> bool:
    return name in ACTIONS

# Shadow mode (`actions.mode: shadow` in the policy, `--shadow` on `train` and `agent`): every action is
# decided as it would be, recorded as a SHADOW_ACTION event with its evidence, and never carried out.
ACT_MODE = "act"
SHADOW_MODE = "shadow"
MODES = (ACT_MODE, SHADOW_MODE)
SHADOW_ACTION = event_types.SHADOW_ACTION      # the TLS event type of an action decided and not carried out


def shadow_event(action: str, reason: str, source: str, **evidence: Any) -> dict[str, Any]:
    """The fields of a `shadow_action` event (no `type`): the action that would have been carried out, why,
    who decided it (guard, control, alertmanager, embedded, replica_check) and the decision's evidence."""
    return {"action": action, "reason": reason, "source": source, "would_have": True, **evidence}
