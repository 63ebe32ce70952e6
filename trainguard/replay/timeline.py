"""One replay end to end: inputs -> guard and cost decisions (+ alerts) -> the timeline and its JSON form.

    from trainguard.replay import replay_logs
    result = replay_logs(["runs/exp1"], policy, rules_dir="alerts")
    result.to_json()      # the design's `trainguard replay --json` document

What acts, as in the live system: the guard's decisions act inside the trainer, directly. The cost
meter's tier decisions (the agent's embedded path) and the firing alerts that carry an `action` label
(the Alertmanager path) both go through the agent's ledger (`trainguard.decide.ledger.Ledger`), in time
order, so each cost tier acts once whichever path saw it first, a second restore within the cooldown
joins the first, and rate limits escalate. `actions` lists what executes; `ledger` every verdict.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from trainguard import tls
from trainguard.decide import ledger as tgledger
from trainguard.decide.cost import CostMeter
from trainguard.policy import Policy
from trainguard.replay import engine, expect, rules, source

DEFAULT_SCRAPE_INTERVAL = 15.0


@dataclass
class Result:
    files: list[Path]
    outcome: engine.Outcome
    problems: source.Problems
    alerts: list[rules.FiredAlert] | None = None     # None: the rules were not evaluated
    actions: list[engine.Action] = field(default_factory=list)      # what executes, in time order
    verdicts: list[tgledger.Verdict] = field(default_factory=list)  # the ledger's every verdict
    rules_dir: str | None = None
    scrape_interval: float = DEFAULT_SCRAPE_INTERVAL
    lead_rank: int | None = None
    diff: list[str] | None = None                    # set by check(): None when no expectation was given
    expect_file: str | None = None
    extra: dict = field(default_factory=dict)

    # ---------------------------------------------------------------------------------- expectations
    def found(self) -> list[expect.Found]:
        items = [expect.Found("action", a.action, a.step, a.timestamp, reason=a.reason)
                 for a in self.actions]
        items += [expect.Found("alert", a.alertname, None, a.starts_at, severity=a.severity, labels=a.labels)
                  for a in self.alerts or []]
        return items

    def check(self, expected: expect.Expected) -> list[str]:
        self.expect_file = expected.source
        self.diff = expect.compare(expected, self.found(), self.outcome.first_timestamp,
                                   alerts_evaluated=self.alerts is not None)
        return self.diff

    # -------------------------------------------------------------------------------------- output
    def to_json(self) -> dict:
        out = self.outcome
        document = {
            "records": out.records,
            "malformed": self.problems.count,
            "first_timestamp": _time(out.first_timestamp),
            "last_timestamp": _time(out.last_timestamp),
            "actions": [_action(a) for a in self.actions],
            "alerts": [_alert(a) for a in self.alerts or []],
            # additions to the design's document
            "malformed_lines": [{"file": m.file, "line": m.line, "error": m.error} for m in self.problems.kept],
            "files": [str(path) for path in self.files],
            "steps": out.steps,
            "duplicate_steps": out.duplicate_steps,
            "partial_steps": out.partial_steps,
            "lead_rank": self.lead_rank,
            "recorded_actions": [_action(a) for a in out.recorded],
            "ledger": [_verdict(v) for v in self.verdicts],
            "cost": out.cost,
            "rules": None if self.alerts is None else {"dir": self.rules_dir,
                                                       "scrape_interval_seconds": self.scrape_interval},
        }
        if self.diff is not None:
            document["expect"] = {"file": self.expect_file, "ok": not self.diff, "diff": self.diff}
        return document


def _time(seconds: float | None) -> str | None:
    return None if seconds is None else tls.format_timestamp(seconds)


def _action(action: engine.Action) -> dict:
    return {"action": action.action, "step": action.step, "timestamp": _time(action.timestamp),
            "reason": action.reason, "source": action.source, "detail": engine.finite_or_text(action.detail)}


def _verdict(verdict: tgledger.Verdict) -> dict:
    notice = verdict.notice
    return {"alertname": notice.alertname, "source": notice.source, "requested": notice.action,
            "outcome": verdict.outcome, "action": verdict.action, "reason": verdict.reason,
            "timestamp": _time(verdict.decided_at)}


def _alert(alert: rules.FiredAlert) -> dict:
    return {"alertname": alert.alertname, "severity": alert.severity, "starts_at": _time(alert.starts_at),
            "ends_at": _time(alert.ends_at), "labels": alert.labels}


def replay_logs(paths: Iterable[str | os.PathLike], policy: Policy | None = None, *,
                rules_dir: str | os.PathLike | None = None, scrape_interval: float = DEFAULT_SCRAPE_INTERVAL,
                hold: float = 0.0, keep_test: str | os.PathLike | None = None) -> Result:
    """Replay the logs through the guard and the cost meter, and the alert rules when `rules_dir` is given.

    Raises source.InputError (no such input), rules.RulesError (rule files, promtool)."""
    policy = policy or Policy()
    if rules_dir is not None:
        rules.rule_files(rules_dir)          # refuse a bad rules directory before reading any log
        rules.promtool()
    stream = source.Stream(paths, full=rules_dir is not None)
    meter = CostMeter(policy.cost)
    exporters = None
    if rules_dir is not None:
        from trainguard.replay.series import Exporters   # imports the agent's collectors: only for --rules

        exporters = Exporters(stream, meter, scrape_interval)
    outcome = engine.replay(stream, policy, observer=exporters, meter=meter)
    result = Result(stream.files, outcome, stream.problems, lead_rank=stream.lead_rank,
                    scrape_interval=scrape_interval)
    if exporters is not None:
        table = exporters.finish(outcome.last_timestamp, hold) if outcome.records else None
        result.alerts = rules.evaluate(table, rules_dir, keep=keep_test)
        result.rules_dir = str(rules_dir)
    result.actions, result.verdicts = _execute(outcome.actions, result.alerts or [], policy)
    return result


def _execute(decided: list[engine.Action], alerts: list[rules.FiredAlert], policy: Policy
             ) -> tuple[list[engine.Action], list[tgledger.Verdict]]:
    """Guard actions as they are; cost decisions and acting alerts through the agent's ledger."""
    from trainguard.agent.actions_embedded import cost_notice   # the agent's own cost notice

    notices = [cost_notice(action.decision) for action in decided if action.source == "cost"]
    for alert in alerts:
        labels = {"alertname": alert.alertname, **alert.labels}
        notices.append(tgledger.Notice(alertname=alert.alertname, status=tgledger.FIRING,
                                       action=alert.labels.get("action"),
                                       key=f"{sorted(labels.items())}@{_time(alert.starts_at)}",
                                       starts_at=alert.starts_at, reason=alert.alertname, labels=labels,
                                       step=alert.step))
    ledger = tgledger.Ledger(tgledger.Limits.from_policy(policy))
    verdicts = [ledger.decide(notice, notice.starts_at)
                for notice in sorted(notices, key=lambda n: (n.starts_at, n.source != "embedded"))]
    executed = [engine.Action(v.action, v.notice.step, v.decided_at, v.notice.reason,
                              "cost" if v.notice.source == "embedded" else "alert",
                              {"alertname": v.notice.alertname, "outcome": v.outcome})
                for v in verdicts if v.action is not None]
    guard = [action for action in decided if action.source != "cost"]
    return sorted(guard + executed, key=lambda a: a.timestamp), verdicts
