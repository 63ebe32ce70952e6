"""The action table: every action trainguard decides, and how each one is carried out.

Pure: no I/O. An action is the unit of everything this product does to a run. The guard, the cost meter,
the alerts (their ``action`` label), the webhook, the ledger, the agent's executor, the trainer's control
channel, replay, the report and the dashboards all read this one table; every other module imports the
names from here rather than spelling them (tests/test_action_names.py rejects the literals elsewhere).

Each row (`Action`) says:

- ``name``: what TLS events, alert labels, control requests and the agent's records call it;
- ``local``: the guard decides it inside the training step, identically on every rank;
- ``remote``: it may arrive from outside the trainer (an alert's ``action`` label, the agent's embedded
  path), decided by the agent's ledger;
- ``code``: its number in the control channel's all-reduce (runtime/control.py); None: it never travels
  to the ranks that way;
- ``tier``: the cost order (a stronger tier supersedes a weaker one); 0: not a cost tier;
- ``hourly_limit``, ``escalation``: the ledger's rate limit (the policy key of the most per hour) and
  what a further one becomes past it (trainguard/decide/ledger.py);
- ``carried_by``: who carries it out: the Protector in the step (`PROTECTOR`, its handlers in
  protect/handlers.py), the node's agent (`AGENT`, agent/handlers.py), the agent's investigator
  (`INVESTIGATOR`, agent/culprit.py), the trainer's replica check (`REPLICA_CHECK`), or a human (`HUMAN`);
- ``group``: how the report and the dashboards group it (`GUARD_GROUP`: "Guard and recovery actions";
  `COST_GROUP`); ``steps_lost``: the dashboards' plural when the action throws steps away;
- ``stands_in_for``: the alert a decision of the agent's embedded path is named after (decide/embedded.py).

A new action is a row here, its handler (protect/handlers.py or agent/handlers.py) and its tests
(docs/contributing.md, "Add an action").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# Who carries an action out.
PROTECTOR = "protector"          # every rank, in the step (protect/handlers.py)
AGENT = "agent"                  # the node's agent, after its ledger decided (agent/handlers.py)
INVESTIGATOR = "investigator"    # the agent's incident investigation (agent/culprit.py)
REPLICA_CHECK = "replica_check"  # rank 0's replica check (trainer/replica_check.py)
HUMAN = "human"                  # nothing acts on the run: a human is paged

# How the report ("Guard and recovery actions", "Cost actions") and the dashboards group actions.
GUARD_GROUP, COST_GROUP = "guard", "cost"


@dataclass(frozen=True)
class Action:
    name: str
    doc: str
    carried_by: str
    local: bool = False
    remote: bool = False
    code: int | None = None
    tier: int = 0
    hourly_limit: str | None = None
    escalation: str | None = None
    group: str = ""
    steps_lost: str = ""
    stands_in_for: str = ""


SKIP_STEP = "skip_step"
ROLLBACK = "rollback"
RESTORE = "restore"
COST_WARN = "cost_warn"
COST_THROTTLE = "cost_throttle"
COST_STOP = "cost_stop"
STOP = "stop"
PAGE = "page"
EVICT = "evict"
CORDON = "cordon"
DRAIN = "drain_at_checkpoint"   # decide/node_risk.py's verdict on a node at hardware risk (docs/node-risk.md)

# Codes travel in a float64 all-reduce; 0 means "nothing this step".
TABLE: tuple[Action, ...] = (
    Action(SKIP_STEP, "skip the optimizer step of a bad step", PROTECTOR, local=True, group=GUARD_GROUP,
           steps_lost="skipped steps"),
    Action(ROLLBACK, "restore the last stable checkpoint, skip the data window, lower the LR", PROTECTOR,
           local=True, remote=True, code=1, hourly_limit="guard.max_rollbacks_per_hour", escalation=COST_STOP,
           group=GUARD_GROUP, steps_lost="rollbacks"),
    Action(RESTORE, "restart hung or dead ranks from the latest verified checkpoint", AGENT, remote=True,
           hourly_limit="alerts.max_restores_per_hour", escalation=PAGE, group=GUARD_GROUP,
           steps_lost="restores", stands_in_for="TrainingStalled"),
    Action(COST_WARN, "pause evaluation", PROTECTOR, remote=True, code=2, tier=1, group=COST_GROUP,
           stands_in_for="CostBudgetWarn"),
    Action(COST_THROTTLE, "cut the micro-batch by a quarter", PROTECTOR, remote=True, code=3, tier=2,
           group=COST_GROUP, stands_in_for="CostBudgetThrottle"),
    Action(COST_STOP, "save a verified checkpoint and end the run cleanly", PROTECTOR, remote=True, code=4,
           tier=3, group=COST_GROUP, stands_in_for="CostBudgetStop"),
    Action(STOP, "the guard's last word (too many rollbacks): the run ends", PROTECTOR, local=True,
           group=GUARD_GROUP),
    Action(PAGE, "the ledger's escalation of a restore: nothing acts on the run, a human must look", HUMAN),
    Action(EVICT, "keep a hang's culprit node out of the job; the job re-forms without it", INVESTIGATOR),
    Action(CORDON, "keep a node out of the job until `trainguard uncordon` (RUN/control/cordon/<host>)",
           REPLICA_CHECK),
    # every rank checkpoints at the step it is in and stops (nothing trained past it); the flagging node's
    # agent then cordons its node and ends its launcher once that checkpoint verifies (agent/node_risk.py).
    # Once per flag: the rule's own circuit breaker (node_risk.max_flags_per_hour) bounds them fleet-wide.
    Action(DRAIN, "checkpoint now and stop; the node at risk is cordoned and the job re-forms without it",
           PROTECTOR, remote=True, code=5, group=GUARD_GROUP),
)

BY_NAME: dict[str, Action] = {action.name: action for action in TABLE}


def of(name: str | None) -> Action | None:
    """The row of `name`, or None (no action, or a name the table does not know)."""
    return BY_NAME.get(name) if name is not None else None


def _names(keep: Callable[[Action], bool]) -> tuple[str, ...]:
    return tuple(action.name for action in TABLE if keep(action))


# What the gradient-health guard decides, in the step.
GUARD_ACTIONS = _names(lambda a: a.local)
# Actions that may arrive from outside the trainer (the webhook), through the agent.
REMOTE_ACTIONS = _names(lambda a: a.remote)
# Every decision a TLS `event.type` can record (the guard's stop included).
DECISIONS = _names(lambda a: a.local or a.remote)
COST_ACTIONS = _names(lambda a: a.tier > 0)
# Severity order for escalation and de-duplication: a stronger cost action supersedes a weaker one.
COST_ORDER = {action.name: action.tier for action in TABLE if action.tier > 0}
# What the report counts as "Guard and recovery actions".
REPORTED_GUARD_ACTIONS = _names(lambda a: a.group == GUARD_GROUP)
# The control channel's codes (runtime/control.py), both ways.
CODES = {action.name: action.code for action in TABLE if action.code is not None}
ACTIONS_BY_CODE = {code: name for name, code in CODES.items()}
# Rate-limited actions (the ledger coalesces and counts them), and what each becomes past its limit.
LIMITED = _names(lambda a: a.hourly_limit is not None)
ESCALATION = {action.name: action.escalation for action in TABLE if action.escalation is not None}
# The alert each decision of the agent's embedded path stands in for.
ALERT_OF = {action.name: action.stands_in_for for action in TABLE if action.stands_in_for}
# The dashboards' "Steps lost" series: (action, plural).
STEPS_LOST = tuple((action.name, action.steps_lost) for action in TABLE if action.steps_lost)

# Shadow mode (`actions.mode: shadow` in the policy, `--shadow` on `train` and `agent`): every action is
# decided as it would be, recorded as a SHADOW_ACTION event with its evidence, and never carried out.
ACT_MODE = "act"
SHADOW_MODE = "shadow"
MODES = (ACT_MODE, SHADOW_MODE)
SHADOW_ACTION = "shadow_action"      # the TLS event type of an action decided and not carried out


def shadow_event(action: str, reason: str, source: str, **evidence: Any) -> dict[str, Any]:
    """The fields of a `shadow_action` event (no `type`): the action that would have been carried out, why,
    who decided it (guard, control, alertmanager, embedded, replica_check) and the decision's evidence."""
    return {"action": action, "reason": reason, "source": source, "would_have": True, **evidence}
