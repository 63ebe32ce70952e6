"""What the agent's actions count, and the families those counts become on /metrics.

A custom collector in client_python's shape: `collect()` yields metric families computed from state it
already holds (the counts here, the claims' and the actions log's refusals); the executor's parts only
count.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily

from trainguard.agent import claims, restore
from trainguard.agent.action_log import ActionLog


class ActionCounts:
    def __init__(self, claims_: claims.Claims, records: ActionLog):
        self.claims, self.records = claims_, records
        self.outcomes: dict[str, int] = {}
        self.executed: dict[str, int] = {}
        self.shadowed: dict[str, int] = {}        # shadow mode: actions decided and recorded, not carried out
        self.refused: dict[str, int] = {}         # restore refusals by reason
        self.failures = 0                         # decisions not done: a write or the action failed

    def outcome(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def executed_one(self, action: str) -> None:
        self.executed[action] = self.executed.get(action, 0) + 1

    def shadowed_one(self, action: str) -> None:
        self.shadowed[action] = self.shadowed.get(action, 0) + 1

    def refused_one(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def failed_one(self) -> None:
        self.failures += 1

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield _counts("trainguard_alert_verdicts", "Alerts and embedded decisions the ledger decided, by outcome "
                      "(act, duplicate, coalesced, escalated ...).", "outcome", self.outcomes)
        yield _counts("trainguard_actions_executed", "Actions the agent carried out on the run.", "action",
                      self.executed)
        yield _counts("trainguard_actions_shadowed", "Shadow mode: actions the agent decided and recorded as "
                      "shadow_action events, and did not carry out.", "action", self.shadowed)
        refused = CounterMetricFamily("trainguard_restore_refused", "Rank processes a restore did not end, by "
                                      "reason (not a proven rank of this run; no_restarts_left: a human paged).",
                                      labels=["reason"])
        for reason in restore.REFUSALS:
            refused.add_metric([reason], self.refused.get(reason, 0))
        yield refused
        not_done = CounterMetricFamily("trainguard_actions_not_done", "Decisions that could not be recorded or "
                                       "carried out (a full disk); the ledger was left as it was, to retry.")
        not_done.add_metric([], self.failures)
        yield not_done
        yield _counts("trainguard_claims_refused", "Claim files of job-level actions that did not prove themselves "
                      "(not signed with the job's token, or copied from another request), by reason: ignored, the "
                      "action went on.", "reason", self.claims.refused)
        taken_over = CounterMetricFamily("trainguard_claims_taken_over", "Job-level actions this agent carried out "
                                         "after their claimant did not record them done within "
                                         "webhook.claim_timeout_seconds.")
        taken_over.add_metric([], self.claims.taken_over)
        yield taken_over
        yield _counts("trainguard_action_records_refused", "Lines of this agent's actions log "
                      "(RUN/tls/node-<node>-actions.jsonl) it did not rebuild from or redo at start: not signed by "
                      "it with the run's checkpoint key.", "reason", self.records.refused)


def _counts(name: str, documentation: str, label: str, counts: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=[label])
    for value, count in sorted(counts.items()):
        family.add_metric([value], count)
    return family
