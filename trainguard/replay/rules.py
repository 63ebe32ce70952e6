"""``--rules DIR``: the Prometheus alert rules over a recorded log, evaluated by Prometheus's own engine.

There is no PromQL here. The recorded series (series.py: what the agent would have exported, sampled on
the scrape grid) become the ``input_series`` of a ``promtool test rules`` unit test, whose
``evaluation_interval`` is the scrape interval. For every grid instant and every alert of the rule files
the test states "no alert fires" (``exp_alerts: []``); promtool evaluates every rule group at every
instant, exactly as a Prometheus server would, and reports each instant where that expectation fails,
listing the alerts that *were* firing there with their labels. Reading that report gives, per alert and
label set, the instants it was firing: ``starts_at`` is the first (Prometheus's ``FiredAt``, after any
``for``), ``ends_at`` the first instant after it that it was not (``None``: still firing at the end).

Why this and not a server: Prometheus evaluates rules only at wall-clock "now"; backfilling blocks
(``promtool tsdb create-blocks-from``) can replay recording rules but not alerts. The unit-test runner
is the one place Prometheus evaluates alerting rules over a chosen past, with its real rule manager
(``for`` durations, ``ALERTS``, staleness, recording rules feeding alerts).

The test file is written as JSON (YAML's subset), runs of equal values compressed with promtool's
``VALUExN`` notation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from trainguard import safe_read

if TYPE_CHECKING:       # annotations only: the series module (the metric families) is for --rules alone
    from trainguard.replay.series import Grid, SeriesTable

PROMTOOL_TIMEOUT = 1800.0


class RulesError(RuntimeError):
    pass


@dataclass(frozen=True)
class FiredAlert:
    alertname: str
    severity: str | None
    starts_at: float
    ends_at: float | None
    labels: dict = field(default_factory=dict)
    step: int | None = None         # the training step the run had reached when it fired (`step_at`)


STEP_SERIES = "trainguard_training_step"    # the training collector's latest step, per rank


# ------------------------------------------------------------------------------------- rule files

# The global tier's rules (alerts/rules.py FLEET_CONCERNS, docs/scale.md) judge a whole job across the
# shards' remote-written records; replay plays one Prometheus scraping the agents, as the node tier does.
GLOBAL_TIER = "fleet-global.rules.yml"


def rule_files(directory: str | Path) -> list[Path]:
    """The rule files of DIR: its *.rules.yml (the global tier's left out), else every *.yml / *.yaml
    holding rule groups."""
    folder = Path(directory)
    if not folder.is_dir():
        raise RulesError(f"{folder}: not a directory of rule files")
    files = sorted(p for p in folder.glob("*.rules.yml") if p.name != GLOBAL_TIER) or sorted(
        p for p in [*folder.glob("*.yml"), *folder.glob("*.yaml")] if "groups" in (_load(p) or {}))
    if not files:
        raise RulesError(f"{folder}: no Prometheus rule files (*.rules.yml)")
    return files


def _load(path: Path) -> dict | None:
    import yaml   # only a replay with --rules reads them: the others start without YAML

    try:
        data = safe_read.read_yaml(path, what="rules file")
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise RulesError(f"{path}: not readable as YAML: {exc}") from None
    return data if isinstance(data, dict) else None


def alert_names(files: list[Path]) -> list[str]:
    names: list[str] = []
    for path in files:
        for group in (_load(path) or {}).get("groups") or []:
            for rule in group.get("rules") or []:
                if "alert" in rule and rule["alert"] not in names:
                    names.append(rule["alert"])
    return names


# ------------------------------------------------------------------------------------- test file

def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Inf" if value > 0 else "-Inf"
    return repr(value)


def series_values(column: list[float | None]) -> str:
    """promtool's expanding notation: '_x2 1.5x3 NaN stale 7' (None right after a value is a stale
    marker, as Prometheus writes when a series stops being exported). ``VxN`` is N+1 samples of V,
    ``_xN`` is N missing ones; NaN has no run notation and is written out."""
    words: list[str] = []
    previous: float | None = None
    index = 0
    while index < len(column):
        value = column[index]
        if value is None and previous is not None:
            words.append("stale")
            run = 1
        elif value is None:
            run = _run(column, index)
            words.append("_" if run == 1 else f"_x{run}")
        elif math.isnan(value):
            words.append("NaN")
            run = 1
        else:
            run = _run(column, index)
            words.append(_number(value) if run == 1 else f"{_number(value)}x{run - 1}")
        previous = value
        index += run
    return " ".join(words)


def _run(column: list, start: int) -> int:
    """Length of the run of samples equal to column[start] (None equals None)."""
    first = column[start]
    end = start + 1
    while end < len(column) and column[end] == first and (first is None) == (column[end] is None):
        end += 1
    return end - start


def _selector(name: str, labels: tuple) -> str:
    inner = ", ".join(f"{key}={json.dumps(value)}" for key, value in labels)
    return f"{name}{{{inner}}}" if inner else name


def test_document(table: SeriesTable, files: list[Path], names: list[str]) -> dict:
    """The promtool unit test: the series, and 'nothing fires' for every alert at every grid instant."""
    millis = _millis(table.grid.interval)
    return {
        "rule_files": [str(path.resolve()) for path in files],
        "evaluation_interval": f"{millis}ms",
        "tests": [{
            "interval": f"{millis}ms",
            "input_series": [{"series": _selector(name, labels), "values": series_values(column)}
                             for (name, labels), column in sorted(table.values.items())],
            "alert_rule_test": [{"eval_time": f"{tick * millis}ms", "alertname": name, "exp_alerts": []}
                                for tick in range(table.ticks) for name in names],
        }],
    }


def _millis(seconds: float) -> int:
    millis = int(round(seconds * 1000))
    if millis < 1:
        raise RulesError(f"scrape interval {seconds}s is under a millisecond")
    return millis


# ------------------------------------------------------------------------------------ promtool run

def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        raise RulesError("promtool not found: --rules needs Prometheus's promtool (Debian package 'prometheus')")
    return path


def run_promtool(test_path: Path, timeout: float = PROMTOOL_TIMEOUT) -> tuple[int, str]:
    import subprocess   # a replay without --rules starts no process: it does not import the machinery

    try:
        done = subprocess.run([promtool(), "test", "rules", str(test_path)], capture_output=True, text=True,
                              timeout=timeout, cwd=test_path.parent)
    except subprocess.TimeoutExpired:
        raise RulesError(f"promtool test rules took longer than {timeout:.0f}s") from None
    return done.returncode, done.stdout + done.stderr


_HEADER = re.compile(r"^\s*alertname: (?P<name>\S+), time: (?P<time>[0-9.a-zµ]+),\s*$")
_LABELS = re.compile(r"^\s*Labels:\{(?P<labels>.*)\}\s*$")
_PAIR = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_EXPECTED_NOISE = re.compile(r"^\s*(Unit Testing:.*|FAILED:|SUCCESS|exp:\[\],?|got:\[|\d+:|\],?|Annotations:\{.*\},?|)\s*$")
_GO_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|.)")
_GO_SIMPLE = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}
# promtool prints an alert's time as Prometheus's model.Duration: days, weeks and years too ('1d2h').
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(y|w|d|h|ms|us|µs|ns|m|s)")
_UNIT_SECONDS = {"y": 365 * 86400.0, "w": 7 * 86400.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0,
                 "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _go_unquote(text: str) -> str:
    def replace(match: re.Match) -> str:
        escape = match.group(1)
        if escape[0] in "xuU" and len(escape) > 1:
            return chr(int(escape[1:], 16))
        return _GO_SIMPLE.get(escape, escape)

    return _GO_ESCAPE.sub(replace, text)


def go_duration(text: str) -> float:
    """Seconds of a Go duration as promtool prints it ('1h2m3.5s', '500ms', '0s', '1d2h')."""
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise RulesError(f"cannot read promtool's time {text!r}")
    return sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)


def parse_firing(output: str) -> dict[float, list[dict]]:
    """promtool's failure report -> {eval time (s): [labels of each alert firing then]}."""
    firing: dict[float, list[dict]] = {}
    current: list[dict] | None = None
    unknown = []
    for line in output.splitlines():
        if header := _HEADER.match(line):
            current = firing.setdefault(go_duration(header["time"]), [])
        elif labels := _LABELS.match(line):
            if current is None:
                unknown.append(line)
                continue
            current.append({key: _go_unquote(value) for key, value in _PAIR.findall(labels["labels"])})
        elif not _EXPECTED_NOISE.match(line):
            unknown.append(line)
    if unknown:
        raise RulesError("promtool reported something other than firing alerts:\n" + "\n".join(unknown[:40]))
    return firing


def intervals(firing: dict[float, list[dict]], grid: Grid, ticks: int) -> list[FiredAlert]:
    """Runs of consecutive grid instants an alert (one label set) was firing."""
    seen: dict[tuple, list[int]] = {}
    for offset, alerts in firing.items():
        tick = int(round(offset / grid.interval))
        for labels in alerts:
            seen.setdefault(tuple(sorted(labels.items())), []).append(tick)
    fired = []
    for key, instants in seen.items():
        labels = dict(key)
        name = labels.pop("alertname")
        severity = labels.pop("severity", None)
        instants.sort()
        start = previous = instants[0]
        for tick in instants[1:] + [None]:
            if tick is not None and tick == previous + 1:
                previous = tick
                continue
            end = previous + 1
            fired.append(FiredAlert(name, severity, grid.tick(start),
                                    grid.tick(end) if end < ticks else None, labels))
            if tick is not None:
                start = previous = tick
    return sorted(fired, key=lambda a: (a.starts_at, a.alertname, sorted(a.labels.items())))


def evaluate(table: SeriesTable | None, rules_dir: str | Path, *, keep: str | Path | None = None,
             timeout: float = PROMTOOL_TIMEOUT) -> list[FiredAlert]:
    """Every alert of the rule files in `rules_dir` that fires over `table`, with when it started and ended."""
    import tempfile   # as subprocess (run_promtool): only a replay with --rules writes a test for promtool

    files = rule_files(rules_dir)
    names = alert_names(files)
    if table is None or table.ticks == 0 or not names:
        return []
    document = test_document(table, files, names)
    with tempfile.TemporaryDirectory(prefix="trainguard-replay-") as scratch:
        test_path = Path(keep) if keep else Path(scratch) / "replay.test.json"
        test_path.write_text(json.dumps(document))
        code, output = run_promtool(test_path, timeout)
    if code != 0 and "FAILED:" not in output:
        raise RulesError(f"promtool test rules failed (exit {code}):\n{output[-4000:]}")
    return [dataclasses.replace(alert, step=step_at(table, alert))
            for alert in intervals(parse_firing(output), table.grid, table.ticks)]


def step_at(table: SeriesTable, alert: FiredAlert) -> int | None:
    """The step the run had reached when `alert` fired: the highest `trainguard_training_step` exported at
    that scrape by the series its labels agree with (an alert about one rank: that rank's step), or None
    when no step was exported then (a node alert before the first step)."""
    tick = int(round((alert.starts_at - table.grid.origin) / table.grid.interval))
    steps = [column[tick] for (name, labels), column in table.values.items()
             if name == STEP_SERIES and tick < len(column) and column[tick] is not None
             and all(alert.labels.get(key, value) == value for key, value in labels)]
    return int(max(steps)) if steps else None
