"""--rules: recorded series through Prometheus's own rule engine (promtool), trainguard.replay.rules/series."""

import textwrap

import pytest

from tests.servers import require_binary
from trainguard import tls
from trainguard.policy import Policy
from trainguard.replay import replay_logs, rules
from trainguard.replay.series import Grid, SeriesTable

T0 = 1_710_512_538.0


@pytest.fixture
def promtool():
    return require_binary("promtool")


def write_rules(folder, body):
    folder.mkdir(exist_ok=True)
    (folder / "replay-test.rules.yml").write_text(textwrap.dedent(body))
    return folder


def write_log(path, records):
    with tls.Writer(path) as writer:
        for record in records:
            writer.write(record)
    return path


def training(step, when, loss, **extra):
    return {"timestamp": when, "run_id": "r1", "node": "node-a", "rank": 0, "step": step,
            "metrics": {"loss": loss, "grad_norm": 1.0, **extra}}


LOSS_RULES = """\
    groups:
    - name: replay-test
      rules:
      - alert: LossHigh
        expr: trainguard_training_loss > 10
        for: 30s
        labels: {severity: critical, action: rollback}
      - alert: NeverFires
        expr: trainguard_training_loss < -1
"""


def test_an_alert_fires_after_its_for_and_resolves(tmp_path, promtool):
    # One step every 5 s; the loss is high from 100 s to 200 s (scrapes every 10 s).
    log = write_log(tmp_path / "rank-0.jsonl", [
        training(i + 1, T0 + 5 * i, 50.0 if 100 <= 5 * i < 200 else 2.0) for i in range(60)])
    rules_dir = write_rules(tmp_path / "rules", LOSS_RULES)
    result = replay_logs([log], Policy(), rules_dir=rules_dir, scrape_interval=10)
    assert [(a.alertname, a.severity, a.starts_at - T0, a.ends_at - T0) for a in result.alerts] == \
        [("LossHigh", "critical", 130.0, 200.0)]          # pending at 100 s, firing once 30 s have passed
    labels = result.alerts[0].labels
    assert labels["action"] == "rollback" and labels["instance"] == "node-a" and labels["job"] == "trainguard"
    assert labels["rank"] == "0" and labels["run_id"] == "r1"
    # the firing alert's action went through the ledger
    assert [(a.action, a.source, a.timestamp - T0) for a in result.actions if a.source == "alert"] == \
        [("rollback", "alert", 130.0)]


def test_an_alert_still_firing_at_the_end_has_no_end(tmp_path, promtool):
    log = write_log(tmp_path / "rank-0.jsonl", [training(i + 1, T0 + 5 * i, 50.0) for i in range(30)])
    result = replay_logs([log], Policy(), rules_dir=write_rules(tmp_path / "rules", LOSS_RULES),
                         scrape_interval=10)
    assert [(a.alertname, a.starts_at - T0, a.ends_at) for a in result.alerts] == [("LossHigh", 30.0, None)]


def test_hold_keeps_exporting_past_the_last_record(tmp_path, promtool):
    stall_rules = """\
        groups:
        - name: stall
          rules:
          - alert: Stalled
            expr: time() - trainguard_training_last_step_timestamp_seconds > 60
            for: 30s
            labels: {severity: critical}
    """
    log = write_log(tmp_path / "rank-0.jsonl", [training(i + 1, T0 + i, 2.0) for i in range(20)])
    folder = write_rules(tmp_path / "rules", stall_rules)
    assert replay_logs([log], Policy(), rules_dir=folder, scrape_interval=5).alerts == []
    held = replay_logs([log], Policy(), rules_dir=folder, scrape_interval=5, hold=150).alerts
    # last step at +19 s: more than 60 s idle from +80 s, firing 30 s later
    assert [(a.alertname, a.starts_at - T0) for a in held] == [("Stalled", 110.0)]


def test_two_separate_firings_are_two_alerts(tmp_path, promtool):
    high = lambda i: 50.0 if 10 <= i < 30 or 50 <= i < 70 else 2.0   # noqa: E731
    log = write_log(tmp_path / "rank-0.jsonl", [training(i + 1, T0 + 5 * i, high(i)) for i in range(90)])
    result = replay_logs([log], Policy(), rules_dir=write_rules(tmp_path / "rules", LOSS_RULES),
                         scrape_interval=10)
    assert [(a.starts_at - T0, a.ends_at - T0) for a in result.alerts] == [(80.0, 150.0), (280.0, 350.0)]
    # the second rollback request comes long after the cooldown: both act
    assert [a.action for a in result.actions if a.source == "alert"] == ["rollback", "rollback"]


def test_a_broken_rule_file_is_a_clear_error(tmp_path, promtool):
    log = write_log(tmp_path / "rank-0.jsonl", [training(i + 1, T0 + i, 2.0) for i in range(5)])
    folder = write_rules(tmp_path / "rules", """\
        groups:
        - name: broken
          rules:
          - alert: Broken
            expr: rate(trainguard_training_loss[5m]
    """)
    with pytest.raises(rules.RulesError, match="promtool"):
        replay_logs([log], Policy(), rules_dir=folder, scrape_interval=1)


def test_a_directory_without_rules_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(rules.RulesError, match="no Prometheus rule files"):
        rules.rule_files(tmp_path / "empty")


def test_series_notation():
    nan, inf = float("nan"), float("inf")
    column = [None, None, 1.0, 1.0, 1.0, nan, nan, 2.5, None, None, None, 3.0, inf, -inf]
    assert rules.series_values(column) == "_x2 1.0x2 NaN NaN 2.5 stale _x2 3.0 Inf -Inf"


def test_timestamps_are_shifted_to_test_time():
    table = SeriesTable(Grid(T0, 15.0))
    sample = [("x_timestamp_seconds", (), T0 + 7.0), ("y", (), 5.0)]
    table.scrape_until(T0 + 20.0, lambda at: sample)
    assert table.values == {("x_timestamp_seconds", ()): [7.0, 7.0], ("y", ()): [5.0, 5.0]}


def test_parse_firing_reads_promtools_report_with_escaped_labels():
    output = textwrap.dedent('''\
        Unit Testing:  replay.test.json
          FAILED:
            alertname: LossHigh, time: 1m30s,
                exp:[],
                got:[
                    0:
                      Labels:{alertname="LossHigh", instance="a\\"b", path="c:\\\\d"}
                      Annotations:{summary="two\\nlines"},
                    1:
                      Labels:{alertname="LossHigh", instance="e"}
                      Annotations:{}
                    ]
            alertname: LossHigh, time: 1h0m0.5s,
                exp:[],
                got:[
                    0:
                      Labels:{alertname="LossHigh", instance="e"}
                      Annotations:{}
                    ]
        ''')
    assert rules.parse_firing(output) == {
        90.0: [{"alertname": "LossHigh", "instance": 'a"b', "path": "c:\\d"},
               {"alertname": "LossHigh", "instance": "e"}],
        3600.5: [{"alertname": "LossHigh", "instance": "e"}]}
    with pytest.raises(rules.RulesError, match="something other"):
        rules.parse_firing(output + "group \"x\": could not load rules\n")


def test_promtool_times_of_a_day_and_more_are_read():
    """A log over a day long (a real Trainer run: 15 hours, replayed with hold) has alert times promtool
    prints as Prometheus durations with days and weeks."""
    from trainguard.replay.rules import go_duration

    assert go_duration("1d") == 86400.0 and go_duration("1d2h3m") == 93780.0 and go_duration("2w") == 14 * 86400.0
    assert go_duration("1h2m3.5s") == 3723.5 and go_duration("500ms") == 0.5
