"""--expect: loading expectation files and comparing them with a replay (trainguard.replay.expect)."""

import re

import pytest

from trainguard.replay import expect

T0 = 1_710_512_538.0


def load(tmp_path, text):
    path = tmp_path / "expect.yml"
    path.write_text(text)
    return expect.load(path)


def action(name, step, offset, reason=""):
    return expect.Found("action", name, step, T0 + offset, reason=reason)


def alert(name, offset, **labels):
    return expect.Found("alert", name, None, T0 + offset, severity="warning", labels=labels)


def test_matching_by_kind_step_time_reason_and_labels(tmp_path):
    expected = load(tmp_path, """
actions:
  - {action: skip_step, step: [100, 102], reason: loss_spike, count: 2}
  - {action: rollback, step: 102}
alerts:
  - {alertname: GPUOverheating, time: ["+1m", "+2m30s"], labels: {gpu: "3"}}
""")
    found = [action("skip_step", 100, 1, "loss_spike"), action("skip_step", 101, 2, "loss_spike"),
             action("rollback", 102, 3, "repeated_loss_spike"), alert("GPUOverheating", 90, gpu="3")]
    assert expect.compare(expected, found, T0, alerts_evaluated=True) == []


def test_missing_and_unexpected_are_listed_readably(tmp_path):
    expected = load(tmp_path, """
actions:
  - {action: rollback, step: [100, 110]}
  - {action: skip_step, count: 1}
""")
    found = [action("skip_step", 100, 1, "nan"), action("skip_step", 105, 2, "nan"),
             action("cost_warn", 400, 3600 + 62.5, "cost_overrun_warn")]
    diff = expect.compare(expected, found, T0, alerts_evaluated=False)
    assert diff == [
        "- action rollback  step 100..110   (expected by actions[0]; none found)",
        "- action skip_step   (expected by actions[1]: 1, found 2)",
        "+ action cost_warn  step 400  at +1h1m2.5s  reason cost_overrun_warn   (unexpected)",
    ]


def test_none_means_no_action_and_no_alert(tmp_path):
    expected = load(tmp_path, "none: true\n")
    assert expect.compare(expected, [], T0, alerts_evaluated=True) == []
    diff = expect.compare(expected, [alert("DiskAwaitHigh", 30, device="sda")], T0, alerts_evaluated=True)
    assert diff == ["+ alert  DiskAwaitHigh  at +30s  severity warning  labels device=sda   (unexpected)"]


def test_not_strict_ignores_what_it_does_not_mention(tmp_path):
    expected = load(tmp_path, "strict: false\nactions:\n  - {action: rollback}\n")
    found = [action("rollback", 5, 5), action("skip_step", 4, 4)]
    assert expect.compare(expected, found, T0, alerts_evaluated=False) == []


def test_alerts_expected_without_rules_is_a_mismatch(tmp_path):
    expected = load(tmp_path, "alerts:\n  - {alertname: TrainingStalled}\n")
    assert expect.compare(expected, [], T0, alerts_evaluated=False) == [
        "! alerts are expected but were not evaluated: give --rules DIR"]


def test_absolute_times_and_offsets(tmp_path):
    expected = load(tmp_path, """
actions:
  - {action: cost_stop, time: ["2024-03-15T15:22:18Z", "2024-03-15T15:22:20Z"]}
  - {action: cost_warn, time: [3500, "+1h0m1s"]}
""")
    found = [action("cost_stop", 10, 3601), action("cost_warn", 9, 3600)]
    assert expect.compare(expected, found, T0, alerts_evaluated=False) == []


def test_replay_options(tmp_path):
    expected = load(tmp_path, "none: true\nreplay: {hold: 150, scrape_interval: 5}\n")
    assert expected.replay == {"hold": 150.0, "scrape_interval": 5.0}


@pytest.mark.parametrize("text, message", [
    ("actions: [{action: rollback, stepp: 3}]", r"actions\[0\]\.stepp: unknown key"),
    ("actions: [{action: rollback, step: [1]}]", r"actions\[0\]\.step: expected a step or \[from, to\]"),
    ("alerts: [{alertname: X, time: ['+1m', 'soon']}]", r"alerts\[0\]\.time: .*soon"),
    ("actions: [{step: 3}]", r"actions\[0\]: expected a mapping with a string 'action'"),
    ("none: true\nactions: [{action: rollback}]", "cannot be combined"),
    ("strict: true", "expects nothing"),
    ("nonee: true", "nonee: unknown key"),
    ("none: yes please", "none: expected true or false"),
    ("none: true\nreplay: {hold: -1}", r"replay\.hold: expected seconds"),
    ("actions: [{action: rollback, count: -1}]", r"actions\[0\]\.count: expected a whole number"),
    ("[1, 2", "not valid YAML"),
])
def test_bad_files_name_file_and_key(tmp_path, text, message):
    with pytest.raises(expect.ExpectError, match=message) as caught:
        load(tmp_path, text)
    assert str(tmp_path / "expect.yml") in str(caught.value)


def test_missing_file(tmp_path):
    with pytest.raises(expect.ExpectError, match="no such expectation file"):
        expect.load(tmp_path / "nope.yml")


def test_recorded_entries_parse_and_match_what_the_live_run_did(tmp_path):
    path = tmp_path / "expect.yml"
    path.write_text("recorded:\n  - {alert: TrainingStalled, source: embedded}\n  - {action: restart, step: [20, 30]}\n")
    expected = expect.load(path)
    assert expected.wants_recorded and not expected.wants_alerts
    found = [expect.Found("recorded_alert", "TrainingStalled", None, T0 + 5, labels={"source": "embedded"}),
             expect.Found("recorded_action", "restart", 20, T0 + 30, labels={"source": "trainer"})]
    assert expect.compare(expected, found, T0, alerts_evaluated=False) == []
    found.append(expect.Found("recorded_action", "restore", None, T0 + 6, labels={"source": "agent+control"}))
    [extra] = expect.compare(expected, found, T0, alerts_evaluated=False)
    assert extra.startswith("+ recorded_action restore")


@pytest.mark.parametrize("entry, message", [
    ("{action: restore, alert: TrainingStalled}", "recorded[0]: expected a mapping with a string 'action' or 'alert'"),
    ("{action: restore, labels: {a: b}}", "recorded[0].labels: unknown key"),
    ("{alert: X, count: -1}", "recorded[0].count: expected a whole number"),
])
def test_a_bad_recorded_entry_names_its_place(tmp_path, entry, message):
    path = tmp_path / "expect.yml"
    path.write_text(f"recorded:\n  - {entry}\n")
    with pytest.raises(expect.ExpectError, match=re.escape(message)):
        expect.load(path)
