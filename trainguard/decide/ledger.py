"""The ledger: alerts (and the agent's own decisions) in, what to execute out.

Alertmanager repeats itself (group intervals, repeat intervals, retries), several alerts can describe one
incident, the embedded cost meter and the `CostBudget*` alerts see the same tier, and an action that
keeps failing must not loop. The ledger turns that stream into at most one action per incident:

- idempotent per (fingerprint, startsAt): a repeat is a DUPLICATE and acts once;
- `resolved` closes an open alert and never acts;
- cost tiers act once each per run, whichever path saw them first; a weaker tier after a stronger one
  is SUPERSEDED; tiers arriving together act in order (warn, throttle, stop);
- a rollback or restore within `action_cooldown_seconds` of the last one is COALESCED into it;
- rate limits with escalation: past `guard.max_rollbacks_per_hour` rollbacks a further rollback becomes
  a clean `cost_stop` (the run is not converging; save it and stop spending), past
  `alerts.max_restores_per_hour` restores a further restore pages a human (ending ranks again will not
  help a node that keeps hanging);
- shadow (`actions.mode: shadow`; once called dry-run) decides exactly as a live ledger, but nothing executes:
  the executor records each action a verdict would carry out as a `shadow_action` event instead.

Pure: no clock (the caller passes `now`), no files. The agent records every verdict (`NoticeVerdict.as_event`)
before it replies to Alertmanager, and rebuilds the ledger after a restart with `remember()`. A verdict
counts only once it is durably recorded and carried out: the executor takes a `snapshot()` before it
decides and puts it back (`restore()`) when a write or the action fails, so the retry decides afresh and
acts exactly once (a full disk must not turn a `cost_stop` or a `restore` into a "duplicate").
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from trainguard import actions, event_types
from trainguard.config import at_least, key
from trainguard.decide.decision import Decision

if TYPE_CHECKING:      # the policy assembles this module's LedgerConfig: imported for the annotation only
    from trainguard.policy import Policy

FIRING, RESOLVED_STATUS = "firing", "resolved"

# Outcomes
ACT = "act"                    # the action executes (or would, in shadow)
ESCALATED = "escalated"        # over a rate limit: a stronger action executes, or a human is paged
DUPLICATE = "duplicate"        # seen before (same alert, or a tier that already acted)
SUPERSEDED = "superseded"      # a stronger cost tier already acted
COALESCED = "coalesced"        # joins an action of the same kind within the cooldown
RESOLVED = "resolved"          # an alert closed; never acts
NO_ACTION = "no_action"        # an alert without an action label: recorded, routed to humans only

HOUR = 3600.0


@dataclass(frozen=True)
class Notice:
    """One alert, as the ledger sees it: from the webhook, or a decision of the agent's embedded path."""

    alertname: str
    status: str                        # firing | resolved
    action: str | None                 # the `action` label (from trainguard.actions), or None
    key: str                           # the de-duplication key: "fingerprint@startsAt" for alerts
    starts_at: float | None = None
    source: str = "alertmanager"       # alertmanager | embedded
    reason: str = ""
    step: int | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_decision(cls, decision: Decision, alertname: str, key: str) -> "Notice":
        """A decision of the embedded path (cost meter, stall watchdog) as a firing notice."""
        return cls(alertname=alertname, status=FIRING, action=decision.action, key=key,
                   starts_at=decision.timestamp, source="embedded", reason=decision.reason, step=decision.step)


@dataclass(frozen=True)
class NoticeVerdict:
    """The ledger's answer to one notice: its outcome, the action that executes (if any) and why."""

    notice: Notice
    outcome: str
    action: str | None             # what executes (ACT, ESCALATED); None otherwise, or actions.PAGE
    reason: str
    decided_at: float
    shadow: bool = False
    detail: Mapping[str, Any] = field(default_factory=dict)

    @property
    def would_execute(self) -> bool:
        """An action on the run was decided (carried out live, recorded as a `shadow_action` in shadow)."""
        return self.action in actions.REMOTE_ACTIONS

    @property
    def executes(self) -> bool:
        """True when the executor must carry out `action` now."""
        return self.would_execute and not self.shadow

    def as_event(self) -> dict[str, Any]:
        """The TLS `alert` event that records this verdict (and lets a restarted ledger `remember` it)."""
        n = self.notice
        event: dict[str, Any] = {"type": event_types.ALERT, "alertname": n.alertname, "status": n.status, "key": n.key,
                 "source": n.source, "requested": n.action, "outcome": self.outcome, "action": self.action,
                 "reason": self.reason, "decided_at": self.decided_at}
        if n.starts_at is not None:
            event["starts_at"] = n.starts_at
        if n.step is not None:
            event["step"] = n.step
        if self.shadow:
            event["shadow"] = True
        if self.detail:
            event["detail"] = dict(self.detail)
        if n.labels:
            event["labels"] = dict(n.labels)
        return event


@dataclass(frozen=True)
class LedgerConfig:
    """The webhook ledger's keys, in the policy's `alerts` section: a second rollback or restore within the
    cooldown joins the first (one incident, several alerts); restores beyond the hourly limit page a human."""

    action_cooldown_seconds: float = key(120.0, at_least(0, 10**7), "a second rollback or restore within this "
                                         "joins the first")
    max_restores_per_hour: int = key(3, at_least(0, 10**4), "restores an hour beyond which a human is paged")


@dataclass(frozen=True)
class Limits:
    """The ledger's cooldown and hourly limits (from the policy's alerts and guard sections)."""

    cooldown_seconds: float = 120.0
    max_rollbacks_per_hour: int = 3
    max_restores_per_hour: int = 3

    @classmethod
    def from_policy(cls, policy: Policy) -> "Limits":
        """Each rate-limited action's `hourly_limit` (a policy key, trainguard/actions.py) read from the policy."""
        per_hour = {}
        for name in actions.LIMITED:
            section, key = str(actions.BY_NAME[name].hourly_limit).split(".")
            per_hour[key] = getattr(getattr(policy, section), key)
        return cls(cooldown_seconds=policy.alerts.action_cooldown_seconds, **per_hour)

    def per_hour(self, action: str) -> int:
        """The most `action`s an hour before the ledger escalates (its `hourly_limit` in the action table)."""
        key = str(actions.BY_NAME[action].hourly_limit).split(".")[-1]
        return int(getattr(self, key))


def job_level(notice: Notice) -> bool:
    """An alert about the whole job rather than one node: it names no `instance` (the global tier and the
    run-wide rules aggregate it away). Alertmanager delivers it to every agent of the job; one of them
    carries it out - the executor's claim in the shared run directory decides which (docs/scale.md)."""
    return notice.source == "alertmanager" and "instance" not in notice.labels


# What `Ledger.snapshot()` copies: seen keys, open keys, the cost level, executed times by action.
Snapshot = tuple[set[str], set[str], int, dict[str, deque[float]]]


class Ledger:
    def __init__(self, limits: Limits | None = None, shadow: bool = False):
        self.limits = limits or Limits()
        self.shadow = shadow
        self.seen: set[str] = set()               # keys of firing notices already decided
        self.open: set[str] = set()               # firing alerts not resolved yet
        self.cost_level = 0                       # COST_ORDER of the strongest tier that acted
        self.executed: dict[str, deque[float]] = {action: deque() for action in actions.LIMITED}

    # ------------------------------------------------------------------------------------ decide
    def decide_all(self, notices: Iterable[Notice], now: float) -> list[NoticeVerdict]:
        """Verdicts for one webhook payload: closes first, then firing alerts with cost tiers in order."""
        ordered = sorted(notices, key=lambda n: (n.status == FIRING, actions.COST_ORDER.get(n.action or "", 0)))
        return [self.decide(notice, now) for notice in ordered]

    def decide(self, notice: Notice, now: float) -> NoticeVerdict:
        if notice.status == RESOLVED_STATUS:
            closed = notice.key in self.open
            self.open.discard(notice.key)
            return self._verdict(notice, RESOLVED, None, "closed" if closed else "not open here", now)
        if notice.key in self.seen:
            return self._verdict(notice, DUPLICATE, None, "already decided", now)
        self.seen.add(notice.key)
        self.open.add(notice.key)
        action = notice.action
        if action is None:
            return self._verdict(notice, NO_ACTION, None, "no action label", now)
        if action in actions.COST_ORDER:
            return self._cost(notice, action, now)
        if action in self.executed:
            return self._limited(notice, action, now)
        return self._verdict(notice, ACT, action, notice.reason or notice.alertname, now)

    def _cost(self, notice: Notice, action: str, now: float) -> NoticeVerdict:
        level = actions.COST_ORDER[action]
        if level == self.cost_level:
            return self._verdict(notice, DUPLICATE, None, "tier already acted", now)
        if level < self.cost_level:
            return self._verdict(notice, SUPERSEDED, None, "a stronger tier already acted", now)
        self.cost_level = level
        return self._verdict(notice, ACT, action, notice.reason or notice.alertname, now)

    def _limited(self, notice: Notice, action: str, now: float) -> NoticeVerdict:
        """Rate-limited actions (rollback, restore): coalesce within the cooldown, escalate past the hourly
        limit (the action table's `hourly_limit` and `escalation`: a rollback past its limit stops the run
        cleanly, a restore past its limit pages a human)."""
        history = self.executed[action]
        while history and history[0] <= now - HOUR:
            history.popleft()
        # 0 <= elapsed: after the agent's clock steps back, a new incident is not "within" the old one's cooldown.
        if history and 0 <= now - history[-1] < self.limits.cooldown_seconds:
            return self._verdict(notice, COALESCED, None, f"{action} {now - history[-1]:.0f}s ago", now)
        if len(history) >= self.limits.per_hour(action):
            return self._escalate(notice, action, len(history), now)
        history.append(now)
        return self._verdict(notice, ACT, action, notice.reason or notice.alertname, now)

    def _escalate(self, notice: Notice, action: str, count: int, now: float) -> NoticeVerdict:
        stronger = actions.ESCALATION[action]
        detail = {f"{action}s_last_hour": count}
        reason = f"{action}_limit"
        if stronger in actions.COST_ORDER:
            if self.cost_level >= actions.COST_ORDER[stronger]:
                return self._verdict(notice, SUPERSEDED, None, f"{reason}; run already stopping", now, detail)
            self.cost_level = actions.COST_ORDER[stronger]
        return self._verdict(notice, ESCALATED, stronger, reason, now, detail)

    def _verdict(self, notice: Notice, outcome: str, action: str | None, reason: str, now: float,
                 detail: Mapping[str, Any] | None = None) -> NoticeVerdict:
        return NoticeVerdict(notice, outcome, action, reason, now, self.shadow, detail or {})

    # ------------------------------------------------------------------------------- persistence
    def snapshot(self) -> Snapshot:
        """Everything a decision changes, copied: `restore(snapshot)` undoes the decisions made since."""
        return (set(self.seen), set(self.open), self.cost_level,
                {action: deque(times) for action, times in self.executed.items()})

    def restore(self, snapshot: Snapshot) -> None:
        seen, open_, cost_level, executed = snapshot
        self.seen, self.open, self.cost_level = set(seen), set(open_), cost_level
        self.executed = {action: deque(times) for action, times in executed.items()}

    def remember(self, event: Mapping[str, Any]) -> None:
        """Fold a recorded verdict (`NoticeVerdict.as_event()`) back in, so a restarted agent does not act twice."""
        key, status, outcome = event.get("key"), event.get("status"), event.get("outcome")
        shadowed = event.get("shadow") or event.get("dry_run")      # dry_run: records of older agents
        if not key or shadowed and not self.shadow:
            return      # a live ledger owes nothing to what a shadow only pretended to do
        if status == RESOLVED_STATUS:
            self.open.discard(key)
            return
        if status != FIRING or outcome == DUPLICATE:
            return
        self.seen.add(key)
        self.open.add(key)
        action = event.get("action")
        if outcome not in (ACT, ESCALATED):
            return
        if action in actions.COST_ORDER:
            self.cost_level = max(self.cost_level, actions.COST_ORDER[action])
        elif action in self.executed and outcome == ACT:
            self.executed[action].append(float(event.get("decided_at") or 0.0))
