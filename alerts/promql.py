"""The building blocks every concern's rules are written with: what a rule is, and the shared PromQL.

    Record(name, expr)                              a recording rule
    Alert(name, expr, severity, summary, description, for_=, action=)   an alert; `action` (from
                                                    trainguard.actions) routes it to the agent's webhook
    Group(file, name, rules)                        rendered into alerts/<file>.rules.yml
    num(threshold)                                  a policy number as PromQL writes it

and the windows and label sets the concerns share, so every ratio is a ratio of rates over one window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainguard import actions

RUNBOOK_BASE = "https://github.com/trainguard/trainguard/blob/main/docs/runbooks.md"
AGENT_JOB = "trainguard"
# LossNaN, LossSpike, GradNormExplosion: the guard acts within the step and the agent on the alert's `action`;
# they page nobody (alerts/mixin.py `self_handled_severity` changes it per installation)
SELF_HANDLED_SEVERITY = "info"

# Windows: rates over RATE, baselines (median, peak) over BASELINE. Counters are left raw by the agent
# (as node_exporter leaves them) so every ratio of the concerns is a ratio of rates over the same window.
RATE = "5m"
BASELINE = "30m"
# Per run: nodes of one run report the same step counter, so steps are `max`ed and GPUs `sum`med.
RUN = "job, run_id"
NODE = "job, instance"


@dataclass(frozen=True)
class Record:
    record: str
    expr: str

    def to_dict(self) -> dict:
        return {"record": self.record, "expr": clean(self.expr)}


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    severity: str                  # critical | warning | info
    summary: str
    description: str
    for_: str = "0s"
    action: str | None = None      # from trainguard.actions; routed to the agent's webhook
    labels: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.action is not None and self.action not in actions.REMOTE_ACTIONS:
            raise ValueError(f"alert {self.name}: action {self.action!r} is not one of {actions.REMOTE_ACTIONS}")

    def to_dict(self) -> dict:
        labels = {"severity": self.severity, **self.labels}
        if self.action:
            labels["action"] = self.action
        rule = {"alert": self.name, "expr": clean(self.expr)}
        if self.for_ not in ("0s", "0", ""):
            rule["for"] = self.for_
        rule["labels"] = labels
        rule["annotations"] = {
            "summary": self.summary,
            "description": self.description,
            "runbook_url": f"{RUNBOOK_BASE}#{self.name.lower()}",
        }
        return rule


@dataclass(frozen=True)
class Group:
    file: str          # rule file stem: <file>.rules.yml
    name: str
    rules: tuple

    def to_dict(self) -> dict:
        return {"name": self.name, "rules": [rule.to_dict() for rule in self.rules]}


def clean(expr: str) -> str:
    """One line per clause, no trailing blanks: readable in the YAML and in Prometheus' UI."""
    return "\n".join(line.rstrip() for line in expr.strip().splitlines())


def num(value: float) -> str:
    """A threshold as PromQL writes it: 0.3, not 0.30000000000000004; 10, not 10.0."""
    return f"{value:.10g}"
