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

from trainguard import actions, event_types, rundir, tls
from trainguard.decide import stall
from trainguard.decide import ledger as tgledger
from trainguard.decide.embedded import cost_notice   # the agent's own notices
from trainguard.decide.cost import CostMeter
from trainguard.policy import Policy
from trainguard.replay import dynamics, engine, expect, node_risk, replica, rules, source, stall_pass

DEFAULT_SCRAPE_INTERVAL = 15.0
# What the live run did, beyond the lead rank's own decisions: only lines naming these are decoded, so
# a long log is scanned, not parsed, for them.
_RESTART_MARK = b'"%s"' % event_types.RUN_START.encode()
_AGENT_MARKS = (b'"%s"' % event_types.ALERT.encode(), b'"%s"' % event_types.ACTION.encode())
_LR_MARK = b'"%s"' % event_types.LR_PHASE.encode()   # what opens a log with an LR schedule (replay.dynamics)


@dataclass(frozen=True)
class Recorded:
    """One thing the live run did, as its log says: an action (trainer, agent, control channel), a
    restart, or an alert the agent received and decided on."""

    kind: str                   # "action" | "alert"
    name: str                   # skip_step, rollback, restore, restart, cost_*, stop; or the alertname
    step: int | None
    timestamp: float
    reason: str
    source: str                 # trainer | agent | control | embedded | alertmanager ...
    detail: dict = field(default_factory=dict)


@dataclass
class Result:
    files: list[Path]
    outcome: engine.ReplayOutcome
    problems: source.Problems
    alerts: list[rules.FiredAlert] | None = None     # None: the rules were not evaluated
    actions: list[engine.Action] = field(default_factory=list)      # what executes, in time order
    verdicts: list[tgledger.NoticeVerdict] = field(default_factory=list)  # the ledger's every verdict
    rules_dir: str | None = None
    scrape_interval: float = DEFAULT_SCRAPE_INTERVAL
    lead_rank: int | None = None
    diff: list[str] | None = None                    # set by check(): None when no expectation was given
    expect_file: str | None = None
    extra: dict = field(default_factory=dict)
    recorded: list[Recorded] = field(default_factory=list)   # what the live run did, every source
    health: list[node_risk.HealthFinding] = field(default_factory=list)   # other tools' findings on node timelines
    health_total: int = 0

    # ---------------------------------------------------------------------------------- expectations
    def found(self) -> list[expect.Found]:
        items = [expect.Found("action", a.action, a.step, a.timestamp, reason=a.reason)
                 for a in self.actions]
        items += [expect.Found("alert", a.alertname, None, a.starts_at, severity=a.severity, labels=a.labels)
                  for a in self.alerts or []]
        return items

    def found_recorded(self) -> list[expect.Found]:
        return [expect.Found(f"recorded_{r.kind}", r.name, r.step, r.timestamp, reason=r.reason or None,
                             labels={"source": r.source}) for r in self.recorded]

    def check(self, expected: expect.Expected) -> list[str]:
        self.expect_file = expected.source
        found = self.found() + (self.found_recorded() if expected.wants_recorded else [])
        self.diff = expect.compare(expected, found, self.outcome.first_timestamp,
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
            "recorded_actions": [_recorded(r) for r in self.recorded if r.kind == "action"],
            "recorded_alerts": [_recorded(r) for r in self.recorded if r.kind == "alert"],
            "ledger": [_verdict(v) for v in self.verdicts],
            "cost": out.cost,
            "node_health": {"findings": [f.to_json() for f in self.health], "total": self.health_total},
            "rules": None if self.alerts is None else {"dir": self.rules_dir,
                                                       "scrape_interval_seconds": self.scrape_interval},
        }
        document.update(dynamics.json_part(self.extra.get("lr_phases")))
        document.update(without_clock=self.extra.get("without_clock", []), passed_over=self.extra.get("notes", []))
        if self.diff is not None:
            document["expect"] = {"file": self.expect_file, "ok": not self.diff, "diff": self.diff}
        return document


def _time(seconds: float | None) -> str | None:
    return None if seconds is None else tls.format_timestamp(seconds)


def _action(action: engine.Action) -> dict:
    return {"action": action.action, "step": action.step, "timestamp": _time(action.timestamp),
            "reason": action.reason, "source": action.source, "detail": engine.finite_or_text(action.detail)}


def _recorded(item: Recorded) -> dict:
    key = "action" if item.kind == "action" else "alertname"
    return {key: item.name, "step": item.step, "timestamp": _time(item.timestamp), "reason": item.reason,
            "source": item.source, "detail": engine.finite_or_text(item.detail)}


def _verdict(verdict: tgledger.NoticeVerdict) -> dict:
    notice = verdict.notice
    return {"alertname": notice.alertname, "source": notice.source, "requested": notice.action,
            "outcome": verdict.outcome, "action": verdict.action, "reason": verdict.reason,
            "timestamp": _time(verdict.decided_at)}


def _alert(alert: rules.FiredAlert) -> dict:
    return {"alertname": alert.alertname, "severity": alert.severity, "starts_at": _time(alert.starts_at),
            "ends_at": _time(alert.ends_at), "labels": alert.labels}


def replay_logs(paths: Iterable[str | os.PathLike], policy: Policy | None = None, *,
                rules_dir: str | os.PathLike | None = None, scrape_interval: float = DEFAULT_SCRAPE_INTERVAL,
                hold: float = 0.0, keep_test: str | os.PathLike | None = None,
                conversions: source.Conversions | None = None) -> Result:
    """Replay the logs through the guard and the cost meter, and the alert rules when `rules_dir` is given.
    `conversions`: other tools' logs already converted to TLS (a replay of several runs: replay.sections).

    Raises source.InputError (no such input), rules.RulesError (rule files, promtool)."""
    policy = policy or Policy()
    paths = list(paths)
    paths_given = [Path(p) for p in paths if Path(p).is_dir()]
    if rules_dir is not None:
        rules.rule_files(rules_dir)          # refuse a bad rules directory before reading any log
        rules.promtool()
    stream = source.Stream(paths, full=rules_dir is not None, conversions=conversions)
    if stream.without_clock and rules_dir is not None:
        raise source.InputError(f"{stream.without_clock[0]}: has no wall clock (its records are ordered by step): "
                                "the alert rules need time; replay it without --rules")
    meter = CostMeter(policy.cost)
    exporters = None
    if rules_dir is not None:
        from trainguard.replay.series import Exporters   # imports the agent's collectors: only for --rules

        exporters = Exporters(stream, meter, scrape_interval, restart_silence=policy.alerts.stall_seconds)
    outcome = engine.replay(stream, policy, observer=exporters, meter=meter)
    result = Result(stream.sources, outcome, stream.problems, lead_rank=stream.lead_rank,
                    scrape_interval=scrape_interval)
    if exporters is not None:
        table = exporters.finish(outcome.last_timestamp, hold) if outcome.records else None
        result.alerts = rules.evaluate(table, rules_dir, keep=keep_test)
        result.rules_dir = str(rules_dir)
    decided, stalls = outcome.actions, []
    if stream.without_clock:      # no time: the stall watchdog and the cost meter have nothing to measure
        decided, outcome.cost = [a for a in decided if a.source != "cost"], {}
    else:
        stalls = stall_notices(stream, outcome, policy)
    result.extra.update(without_clock=[str(p) for p in stream.without_clock], notes=stream.notes)
    result.actions, result.verdicts = _execute(decided, result.alerts or [], policy, stalls)
    result.actions = sorted(result.actions + replica.actions(_may_hold_checks(stream.files, outcome), policy)
                            + node_risk.actions(stream.files, policy), key=lambda a: a.timestamp)
    result.recorded = recorded_actions(outcome.recorded, stream.files, paths_given, outcome.event_lines)
    result.health, result.health_total = node_risk.health_events(stream.files)
    # the LR schedule's machine, again, over the logs that may open with its event (a byte check first)
    opening = [path for path in stream.files if source.head_names(path, _LR_MARK, 2 * dynamics.HEAD_LINES)]
    result.extra["lr_phases"] = dynamics.replay_phases(opening)
    return result


def _may_hold_checks(files: list[Path], outcome: engine.ReplayOutcome) -> list[Path]:
    """The files the replica pass reads: those the replay's own read saw naming a check (all, where it did
    not look: engine.ReplayOutcome.event_lines)."""
    if outcome.event_lines is None:
        return files
    return [path for path in files if any(replica.MARK in raw for _, raw in outcome.event_lines.get(str(path), ()))]


# ------------------------------------------------------------------------------ what the live run did

def recorded_actions(lead: list[engine.Action], files: list[Path], given: list[Path],
                     event_lines: dict[str, list] | None = None) -> list[Recorded]:
    """Every action the live run took, from every source, in time order: the lead rank's decisions, its
    restarts (a `run_start` that resumed), the agents' alert verdicts and actions (node logs), and the
    requests of RUN/control/actions.jsonl (merged into the agent's action of the same id). `event_lines`:
    each file's lines naming the marks, as the replay's own read found them (engine.ReplayOutcome), else
    searched for here."""
    found = [Recorded("action", a.action, a.step, a.timestamp, a.reason, "trainer") for a in lead]
    restarts: dict[tuple, Recorded] = {}
    by_id: dict[str, Recorded] = {}
    for path in files:
        marks = _AGENT_MARKS if path.name.startswith("node-") else (_RESTART_MARK, *_AGENT_MARKS)
        found_lines = None if event_lines is None else event_lines.get(str(path), [])
        for record in _records_naming(path, marks, found_lines):
            event = record.get("event")
            if not isinstance(event, dict):
                continue
            if event.get("type") == event_types.RUN_START and event.get("resumed_from") is not None:
                item = _restart(record, event)
                restarts.setdefault((item.step, round(item.timestamp)), item)   # every rank says it once
            elif event.get("type") == event_types.ALERT and event.get("status", "firing") == "firing":
                found.append(_agent_alert(record, event))
            elif event.get("type") == event_types.ACTION:
                _merge(by_id, _action_event(record, event))
    for request in _control_requests(given):
        when = request.get("issued_at")
        _merge(by_id, Recorded("action", str(request.get("action")), request.get("step"),
                               float(when) if isinstance(when, (int, float)) else 0.0,
                               str(request.get("alertname") or request.get("reason") or ""), "control",
                               {"id": request.get("id")}))
    found += list(restarts.values()) + list(by_id.values())
    return sorted(found, key=lambda r: r.timestamp)


def _merge(by_id: dict[str, "Recorded"], item: "Recorded") -> None:
    """One action seen by several sources (the agent issues it, the control file carries it, every rank
    acknowledges it) is one entry naming them all; the first sighting gives its time."""
    key = item.detail.get("id") or f"{item.name}@{item.step}@{item.timestamp:.0f}"
    known = by_id.get(key)
    if known is None:
        by_id[key] = item
    elif item.source not in known.source.split("+"):
        by_id[key] = Recorded(known.kind, known.name, known.step, known.timestamp, known.reason,
                              f"{known.source}+{item.source}", known.detail)


def _records_naming(path: Path, marks: tuple[bytes, ...], found_lines: list | None = None):
    """The records of a TLS file whose line names one of `marks` (malformed ones are replay's to report;
    a cut-off compressed file ends the search: replay's own pass reports it)."""
    lines = source.lines_naming(path, marks) if found_lines is None else \
        ((number, raw) for number, raw in found_lines if any(mark in raw for mark in marks))
    for number, raw in lines:
        line = tls.decode_line(raw, str(path), number)
        if line.record is not None:
            yield line.record


def _restart(record: dict, event: dict) -> Recorded:
    resumed = event.get("resumed_from")
    return Recorded("action", "restart", resumed if isinstance(resumed, int) else record.get("step"),
                    record["timestamp"], f"resumed from step {resumed} (restart {event.get('restart_count', '?')})",
                    "trainer", {"restart_count": event.get("restart_count")})


def _agent_alert(record: dict, event: dict) -> Recorded:
    detail = {k: event.get(k) for k in ("outcome", "action", "requested", "key") if event.get(k) is not None}
    return Recorded("alert", str(event.get("alertname", "?")), event.get("step", record.get("step")),
                    record["timestamp"], str(event.get("reason") or ""), str(event.get("source") or "agent"), detail)


def _action_event(record: dict, event: dict) -> Recorded:
    detail = {k: event.get(k) for k in ("id", "outcome", "key") if event.get(k) is not None}
    if isinstance(event.get("ended"), list):
        detail["ended_ranks"] = [e.get("rank") for e in event["ended"] if isinstance(e, dict)]
    when = event.get("issued_at")
    return Recorded("action", str(event.get("action", "?")), event.get("step", record.get("step")),
                    float(when) if isinstance(when, (int, float)) else record["timestamp"],
                    str(event.get("alertname") or event.get("reason") or ""),
                    "trainer" if record.get("rank") is not None else "agent", detail)


def _control_requests(given: list[Path]) -> list[dict]:
    """RUN/control/actions.jsonl of each run directory given: the requests the agents wrote for the ranks."""
    return [request for root in given for request in rundir.read_requests(rundir.run_dir_of(root))]


def stall_notices(stream: source.Stream, outcome: engine.ReplayOutcome, policy: Policy) -> list[tgledger.Notice]:
    """The agent's stall watchdog over the recorded logs: its `restore` notices, in the log's time.

    The rule is trainguard.decide.stall's, over the records replay read (the lines it counts malformed
    are not records to it), in the merged stream's order (a node log that keeps writing while no step
    advances is what a hang looks like). The engine's screen of the lead rank's steps says first whether
    a stall is possible at all, so a healthy log is read once; where one is, `stall_pass` reads the files
    again (on every CPU, or streamed: the same stalls)."""
    stall_seconds = policy.alerts.stall_seconds
    if not outcome.may_have_stalled(stall_seconds):
        return []
    entries = stall_pass.entries(stream, stall_seconds, outcome.records)
    return [tgledger.Notice(alertname=actions.ALERT_OF[actions.RESTORE], status=tgledger.FIRING,
                            action=actions.RESTORE, key=f"stall@{found.since:.3f}",
                            starts_at=found.since + stall_seconds, source="embedded", reason="stall",
                            step=found.step)
            for found in stall.replay(entries, stall_seconds)]


def _decided_by(notice: tgledger.Notice) -> str:
    if notice.source != "embedded":
        return "alert"
    return "stall" if notice.action == actions.RESTORE else "cost"


def _execute(decided: list[engine.Action], alerts: list[rules.FiredAlert], policy: Policy,
             stalls: list[tgledger.Notice] = ()) -> tuple[list[engine.Action], list[tgledger.NoticeVerdict]]:
    """Guard actions as they are; cost decisions, the stall watchdog's restores and acting alerts
    through the agent's ledger (its de-duplication and hourly limits, as live)."""

    notices = [cost_notice(action.decision) for action in decided if action.source == "cost"]
    notices += stalls
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
                              _decided_by(v.notice),
                              {"alertname": v.notice.alertname, "outcome": v.outcome})
                for v in verdicts if v.action is not None]
    guard = [action for action in decided if action.source != "cost"]
    return sorted(guard + executed, key=lambda a: a.timestamp), verdicts
