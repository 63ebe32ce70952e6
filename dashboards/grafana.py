"""Small builders for Grafana's dashboard JSON model: queries, panels, rows, variables, annotations.

The dashboards in build.py are written with these, so each panel is one line of intent (title, query,
unit) and the JSON details (gridPos, ids, fieldConfig, the datasource variable) are decided here once.
Layout is automatic: panels flow left to right in rows of 24 columns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24
SCHEMA_VERSION = 39
GREEN, YELLOW, ORANGE, RED = "green", "#EAB839", "orange", "red"
LEGEND_CALCS = ("mean", "lastNotNull", "max")     # a time series' legend: a table of these, as mixins draw it


@dataclass(frozen=True)
class Query:
    """One PromQL target. `only_when` names the condition without which it has no data (an event such as a
    skipped step or an Xid error, or hardware such as a CUDA device); empty: it always has data."""

    expr: str
    legend: str = ""
    only_when: str = ""
    instant: bool = False


def q(expr: str, legend: str = "", *, only_when: str = "", instant: bool = False) -> Query:
    return Query(" ".join(expr.split()), legend, only_when, instant)


@dataclass(frozen=True)
class Threshold:
    value: float
    color: str


@dataclass
class Panel:
    title: str
    queries: Sequence[Query]
    kind: str = "timeseries"           # timeseries | stat | state-timeline | table | bargauge
    unit: str = "short"
    width: int = 12
    height: int = 8
    description: str = ""
    thresholds: Sequence[Threshold] = ()
    min: float | None = None
    max: float | None = None
    stack: bool = False
    mappings: Sequence[dict] = ()
    decimals: int | None = None
    no_value: str = ""                 # what a stat shows when the series is absent (MFU: "n/a", not 0)

    def to_json(self, panel_id: int, x: int, y: int) -> dict:
        defaults: dict = {"unit": self.unit, "color": {"mode": "thresholds" if self.kind == "stat" else "palette-classic"},
                          "thresholds": {"mode": "absolute", "steps": [{"color": GREEN, "value": None}] + [
                              {"color": t.color, "value": t.value} for t in self.thresholds]}}
        for key in ("min", "max", "decimals"):
            if getattr(self, key) is not None:
                defaults[key] = getattr(self, key)
        if self.mappings:
            defaults["mappings"] = list(self.mappings)
        if self.no_value:
            defaults["noValue"] = self.no_value
        if self.kind == "timeseries":
            defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 20 if self.stack else 8,
                                  "showPoints": "never", "spanNulls": False,
                                  "stacking": {"mode": "normal" if self.stack else "none", "group": "A"},
                                  "thresholdsStyle": {"mode": "dashed" if self.thresholds else "off"}}
        panel = {
            "id": panel_id, "type": self.kind, "title": self.title, "datasource": DATASOURCE,
            "gridPos": {"h": self.height, "w": self.width, "x": x, "y": y},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": _options(self.kind),
            "targets": [_target(query, chr(ord("A") + i)) for i, query in enumerate(self.queries)],
        }
        if self.description:
            panel["description"] = self.description
        return panel


def _target(query: Query, ref_id: str) -> dict:
    target = {"datasource": DATASOURCE, "expr": query.expr, "legendFormat": query.legend or "__auto",
              "refId": ref_id, "range": not query.instant, "instant": query.instant}
    if query.instant:
        target["format"] = "table"
    return target


def _options(kind: str) -> dict:
    if kind == "timeseries":
        return {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                           "calcs": list(LEGEND_CALCS), "sortBy": "Max", "sortDesc": True},
                "tooltip": {"mode": "multi", "sort": "desc"}}
    if kind == "stat":
        return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "value", "graphMode": "area", "justifyMode": "auto", "textMode": "auto"}
    if kind == "state-timeline":
        return {"showValue": "auto", "mergeValues": True, "rowHeight": 0.9, "alignValue": "left",
                "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}}
    if kind == "bargauge":
        return {"displayMode": "gradient", "orientation": "horizontal", "showUnfilled": True,
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
    return {"showHeader": True}


def timeseries(title: str, *queries: Query, unit: str = "short", **kw) -> Panel:
    return Panel(title, queries, "timeseries", unit, **kw)


def stat(title: str, *queries: Query, unit: str = "short", width: int = 4, height: int = 4, **kw) -> Panel:
    return Panel(title, queries, "stat", unit, width=width, height=height, **kw)


def state_timeline(title: str, *queries: Query, **kw) -> Panel:
    return Panel(title, queries, "state-timeline", **kw)


def table(title: str, *queries: Query, **kw) -> Panel:
    return Panel(title, [Query(x.expr, x.legend, x.only_when, instant=True) for x in queries], "table", **kw)


@dataclass(frozen=True)
class Row:
    title: str


@dataclass(frozen=True)
class Variable:
    name: str
    label: str
    query: str = ""                    # label_values(...) for a query variable; empty for the datasource
    default: str = ""                  # the datasource variable's: a data source's name (alerts/mixin.py)

    def to_json(self) -> dict:
        if self.name == "datasource":
            current = {"selected": True, "text": self.default, "value": self.default} if self.default else {}
            return {"name": "datasource", "label": self.label, "type": "datasource", "query": "prometheus",
                    "current": current, "hide": 0, "refresh": 1, "regex": "", "options": []}
        return {"name": self.name, "label": self.label, "type": "query", "datasource": DATASOURCE,
                "query": self.query, "definition": self.query, "refresh": 2, "includeAll": True,
                "multi": True, "allValue": ".*", "current": {}, "hide": 0, "sort": 1, "regex": "",
                "options": []}


@dataclass(frozen=True)
class Annotation:
    name: str
    expr: str
    color: str
    title: str
    only_when: str = ""

    def to_json(self) -> dict:
        return {"name": self.name, "datasource": DATASOURCE, "enable": True, "hide": False,
                "iconColor": self.color, "expr": " ".join(self.expr.split()), "step": "15s",
                "titleFormat": self.title, "textFormat": "", "tagKeys": "run_id", "useValueForTime": False}


BUILTIN_ANNOTATION = {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
                      "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts",
                      "type": "dashboard"}


@dataclass
class Board:
    uid: str
    title: str
    description: str
    variables: Sequence[Variable]
    items: Sequence[Panel | Row]
    annotations: Sequence[Annotation] = ()
    tags: Sequence[str] = field(default_factory=lambda: ("trainguard",))
    links: Sequence[dict] = ()

    def panels(self) -> Iterator[Panel]:
        return (item for item in self.items if isinstance(item, Panel))

    def to_json(self) -> dict:
        return {
            "uid": self.uid, "title": self.title, "description": self.description, "tags": list(self.tags),
            "editable": True, "graphTooltip": 1, "refresh": "30s", "schemaVersion": SCHEMA_VERSION,
            "time": {"from": "now-6h", "to": "now"}, "timezone": "", "version": 1, "fiscalYearStartMonth": 0,
            "liveNow": False, "weekStart": "", "id": None,
            "links": list(self.links),
            "annotations": {"list": [BUILTIN_ANNOTATION] + [a.to_json() for a in self.annotations]},
            "templating": {"list": [v.to_json() for v in self.variables]},
            "panels": layout(self.items),
        }


def layout(items: Sequence[Panel | Row]) -> list[dict]:
    """gridPos for every item: rows span the width; panels fill left to right and wrap at 24 columns."""
    out, panel_id, x, y, line_height = [], 1, 0, 0, 0
    for item in items:
        if isinstance(item, Row):
            y += line_height
            out.append({"id": panel_id, "type": "row", "title": item.title, "collapsed": False, "panels": [],
                        "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}})
            panel_id, x, y, line_height = panel_id + 1, 0, y + 1, 0
            continue
        if x + item.width > GRID_WIDTH:
            x, y, line_height = 0, y + line_height, 0
        out.append(item.to_json(panel_id, x, y))
        panel_id, x, line_height = panel_id + 1, x + item.width, max(line_height, item.height)
    return out
