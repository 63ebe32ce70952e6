"""Every alert the rules define (alerts/rules.py's CONCERNS and FLEET_CONCERNS, each concern's module under
alerts/concerns/) has its runbook and its promtool unit tests, derived from the rules rather than a list.

- Documentation: its name in the row of its rule file in docs/alerts.md's table of rules.
- Runbook: a `## <AlertName>` section of docs/runbooks.md saying what the alert means and what to check
  (its `runbook_url` points there; test_rules.py checks the anchor).
- promtool tests: in alerts/tests/*.test.yml, a file whose `rule_files` load the alert's rule file holds a
  case where the alert fires (`exp_alerts` not empty: promtool compares the full label set, severity and
  `action` included, and the annotations) and a case where it stays quiet (`exp_alerts: []`).
  `test_rules.py::test_promtool_check_and_unit_tests_pass` runs them.

A new alert without either fails here naming it; a runbook section or a promtool case left behind by an
alert that no longer exists fails too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from trainguard.alerts import rules
from trainguard.alerts.promql import Alert
from trainguard.policy import Policy

ROOT = Path(__file__).resolve().parents[2]
RUNBOOKS = ROOT / "docs" / "runbooks.md"
PROMTOOL_TESTS = ROOT / "alerts" / "tests"
ALERTS_DOC = ROOT / "docs" / "alerts.md"
MIN_RUNBOOK_WORDS = 40       # a section that says what the alert means, what was done, what to check


def rule_alerts() -> dict[str, str]:
    """{alert name: the rule file it is rendered into} of both tiers, with the default policy."""
    found: dict[str, str] = {}
    for concern in rules.CONCERNS + rules.FLEET_CONCERNS:
        for group in concern(Policy()):
            for rule in group.rules:
                if isinstance(rule, Alert):
                    assert rule.name not in found, f"alert {rule.name} is defined twice"
                    found[rule.name] = f"{group.file}.rules.yml"
    return found


ALERTS = rule_alerts()


def runbook_sections() -> dict[str, str]:
    """{heading: its text} of every `## ` section of docs/runbooks.md."""
    sections: dict[str, str] = {}
    for chunk in re.split(r"^## ", RUNBOOKS.read_text(), flags=re.MULTILINE)[1:]:
        heading, _, body = chunk.partition("\n")
        sections[heading.strip()] = body
    return sections


def promtool_cases() -> dict[str, dict[str, list[str]]]:
    """{alert name: {"fires": [where], "quiet": [where]}}; `where` is "file:rule file" for each case."""
    cases: dict[str, dict[str, list[str]]] = {}
    for path in sorted(PROMTOOL_TESTS.glob("*.test.yml")):
        document = yaml.safe_load(path.read_text())
        loaded = {Path(name).name for name in document.get("rule_files", [])}
        for test in document.get("tests", []):
            for case in test.get("alert_rule_test", []):
                kind = "fires" if case.get("exp_alerts") else "quiet"
                entry = cases.setdefault(case["alertname"], {"fires": [], "quiet": []})
                entry[kind] += [f"{path.name}:{rule_file}" for rule_file in sorted(loaded)]
    return cases


CASES = promtool_cases()


def test_the_rules_define_alerts_on_both_tiers():
    assert len(ALERTS) >= 20
    assert "fleet-global.rules.yml" in ALERTS.values() and "training.rules.yml" in ALERTS.values()


@pytest.mark.parametrize("name", sorted(ALERTS))
def test_every_alert_has_a_runbook(name):
    sections = runbook_sections()
    assert name in sections, f"{RUNBOOKS}: no '## {name}' section (its runbook_url points there)"
    words = len(sections[name].split())
    assert words >= MIN_RUNBOOK_WORDS, f"{RUNBOOKS}, '## {name}': {words} words; say what it means, what " \
                                       "trainguard did, and what to check"


@pytest.mark.parametrize("name", sorted(ALERTS))
def test_every_alert_has_promtool_tests_that_fire_it_and_keep_it_quiet(name):
    rule_file = ALERTS[name]
    cases = CASES.get(name, {"fires": [], "quiet": []})
    for kind, meaning in (("fires", "a case where it fires (exp_alerts with its labels)"),
                          ("quiet", "a case where it stays quiet (exp_alerts: [])")):
        loading = [where for where in cases[kind] if where.endswith(":" + rule_file)]
        assert loading, f"{name}: no promtool test in {PROMTOOL_TESTS} with {meaning} in a file whose " \
                        f"rule_files load {rule_file} (found: {cases[kind] or 'none'})"


def rules_table() -> dict[str, set[str]]:
    """{rule file: the alerts its row names} of docs/alerts.md's table of rule files."""
    rows = re.findall(r"^\| `([\w-]+\.rules\.yml)` \| ([^|]*) \|", ALERTS_DOC.read_text(), re.MULTILINE)
    return {file: set(re.findall(r"\b[A-Z][A-Za-z0-9]+\b", alerts)) for file, alerts in rows}


def test_the_alerts_doc_names_every_alert_in_the_row_of_its_rule_file():
    table = rules_table()
    misplaced = sorted(f"{name} ({file})" for name, file in ALERTS.items() if name not in table.get(file, set()))
    assert not misplaced, f"{ALERTS_DOC}: the table of rule files does not name {misplaced} in its file's row"
    named = {name for names in table.values() for name in names}
    assert not (named - set(ALERTS)), f"{ALERTS_DOC} names alerts the rules do not define: " \
                                                      f"{sorted(named - set(ALERTS))}"


def test_no_runbook_or_promtool_case_outlives_its_alert():
    general = {heading for heading in runbook_sections() if not re.fullmatch(r"[A-Z][A-Za-z0-9]+", heading)}
    stale_runbooks = sorted(set(runbook_sections()) - set(ALERTS) - general)
    assert not stale_runbooks, f"{RUNBOOKS}: sections of alerts the rules no longer define: {stale_runbooks}"
    stale_cases = sorted(set(CASES) - set(ALERTS))
    assert not stale_cases, f"{PROMTOOL_TESTS}: promtool cases of alerts the rules no longer define: {stale_cases}"


def test_a_missing_runbook_or_promtool_case_is_found(monkeypatch):
    """The checks above can fail: an alert the rules gain without its runbook or tests is caught."""
    monkeypatch.setitem(ALERTS, "PlantedAlert", "training.rules.yml")
    with pytest.raises(AssertionError, match="no '## PlantedAlert' section"):
        test_every_alert_has_a_runbook("PlantedAlert")
    with pytest.raises(AssertionError, match="PlantedAlert: no promtool test"):
        test_every_alert_has_promtool_tests_that_fire_it_and_keep_it_quiet("PlantedAlert")
    monkeypatch.setitem(ALERTS, "LossNaN", "hardware.rules.yml")   # tested, but against another rule file
    with pytest.raises(AssertionError, match="load hardware.rules.yml"):
        test_every_alert_has_promtool_tests_that_fire_it_and_keep_it_quiet("LossNaN")
