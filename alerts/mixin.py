"""What differs between installations of the mixin, in one place (kubernetes-mixin's `_config`).

    # mixin.yaml: every key optional
    selectors:                      # added to every series of the family, in every rule
      trainguard: 'job="trainguard"'
      dcgm: 'job="dcgm-exporter"'   # DCGM_* (dcgm-exporter's, or the agent's when it exports them)
      node: 'job="node-exporter"'   # node_* (node_exporter's, or the agent's when it exports them)
    runbook_url_base: https://wiki.example.com/trainguard/runbooks
    self_handled_severity: info     # LossNaN, LossSpike, GradNormExplosion: the guard and the agent act on them
    datasource: Prometheus          # the dashboards' default data source

    trainguard alerts render --mixin mixin.yaml --out DIR
    trainguard dashboards render --mixin mixin.yaml --out DIR

The defaults render the checked-in files: no selectors (a rule matches its series from any job), the
project's runbooks, `info` for the alerts trainguard handles by itself (they page nobody: they are
actions the guard already took within the step, and the agent's webhook gets them by their `action` label
whatever their severity), and the data source Grafana calls `prometheus`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from trainguard.alerts.promql import AGENT_JOB, RUNBOOK_BASE
from trainguard.policy import read_yaml

SELF_HANDLED = ("LossNaN", "LossSpike", "GradNormExplosion")
SEVERITIES = ("critical", "warning", "info")
FAMILIES = {"trainguard": "trainguard_", "dcgm": "DCGM_", "node": "node_"}

# A series name of one of FAMILIES: not part of a recording rule's name (those have colons), of a label
# matcher's value (quoted), or a function call.
_SERIES = re.compile(r'(?<![\w:"=~])(trainguard_\w+|DCGM_\w+|node_\w+)(?![\w:(])')
_MATCHER = re.compile(r'^\s*[A-Za-z_]\w*\s*(=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*(,\s*[A-Za-z_]\w*\s*(=~|!~|!=|=)\s*'
                      r'"(?:[^"\\]|\\.)*"\s*)*$')


class MixinError(ValueError):
    """A bad mixin file; the message names the file and the key."""


@dataclass(frozen=True)
class Mixin:
    selectors: dict = field(default_factory=dict)       # family -> 'label="value", ...'
    runbook_url_base: str = RUNBOOK_BASE
    self_handled_severity: str = "info"
    datasource: str = "prometheus"

    def selector(self, series: str) -> str:
        for family, prefix in FAMILIES.items():
            if series.startswith(prefix):
                return self.selectors.get(family, "")
        return ""


def load(path: str | Path | None) -> Mixin:
    """The defaults, or the mixin file at `path` (MixinError naming the file and key)."""
    if path is None:
        return Mixin()
    try:
        data = read_yaml(path, "mixin file") or {}
    except ValueError as exc:
        raise MixinError(str(exc)) from None
    try:
        return from_mapping(data)
    except MixinError as exc:
        raise MixinError(f"{path}: {exc}") from None


def from_mapping(data) -> Mixin:
    if not isinstance(data, dict):
        raise MixinError("expected a mapping")
    known = ("selectors", "runbook_url_base", "self_handled_severity", "datasource")
    for key in data:
        if key not in known:
            raise MixinError(f"{key}: unknown key (known: {', '.join(known)})")
    mixin = Mixin()
    selectors = data.get("selectors") or {}
    if not isinstance(selectors, dict):
        raise MixinError("selectors: expected a mapping of family to label matchers")
    for family, value in selectors.items():
        if family not in FAMILIES:
            raise MixinError(f"selectors.{family}: unknown family (known: {', '.join(FAMILIES)})")
        if not isinstance(value, str) or (value.strip() and not _MATCHER.match(value)):
            raise MixinError(f"selectors.{family}: expected label matchers such as 'job=\"trainguard\"', "
                             f"got {value!r}")
    changes: dict = {"selectors": {k: v.strip() for k, v in selectors.items() if v.strip()}}
    for key in ("runbook_url_base", "datasource"):
        if key in data:
            if not isinstance(data[key], str) or not data[key]:
                raise MixinError(f"{key}: expected a non-empty string, got {data[key]!r}")
            changes[key] = data[key].rstrip("/") if key == "runbook_url_base" else data[key]
    if "self_handled_severity" in data:
        if data["self_handled_severity"] not in SEVERITIES:
            raise MixinError(f"self_handled_severity: expected one of {', '.join(SEVERITIES)}, "
                             f"got {data['self_handled_severity']!r}")
        changes["self_handled_severity"] = data["self_handled_severity"]
    return replace(mixin, **changes)


def select(expr: str, mixin: Mixin) -> str:
    """`expr` with the mixin's selector in every series of a configured family."""
    if not mixin.selectors:
        return expr

    def add(match: re.Match) -> str:
        name, rest = match.group(1), expr[match.end():]
        selector = mixin.selector(name)
        if not selector:
            return name
        if rest.lstrip().startswith("{"):
            inside = rest.lstrip()[1:].lstrip()
            return name + "{" + selector + ("" if inside.startswith("}") else ", ") + "\0"
        return name + "{" + selector + "}"

    agent = mixin.selectors.get("trainguard")
    if agent:      # AgentDown: the agents' own scrape health
        expr = expr.replace(f'up{{job="{AGENT_JOB}"}}', f"up{{{agent}}}")
    out = _SERIES.sub(add, expr)
    # a series that had matchers: drop the `{` that followed it (the one written above replaces it)
    return re.sub(r"\0\s*\{\s*", "", out)


def apply(rule: dict, mixin: Mixin) -> dict:
    """A rendered rule (alerts/promql.py `to_dict`) as this installation wants it."""
    rule = {**rule, "expr": select(rule["expr"], mixin)}
    if "alert" in rule:
        labels = dict(rule["labels"])
        if rule["alert"] in SELF_HANDLED:
            labels["severity"] = mixin.self_handled_severity
        annotations = dict(rule["annotations"])
        annotations["runbook_url"] = f"{mixin.runbook_url_base}#{rule['alert'].lower()}"
        rule["labels"], rule["annotations"] = labels, annotations
    return rule
