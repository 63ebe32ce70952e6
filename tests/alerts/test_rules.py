"""The generated rules: one source of truth, checked in, linted and unit-tested with the real promtool/amtool."""

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests.alerts.test_alert_coverage import ALERTS
from tests.servers import require_binary
from trainguard import actions
from trainguard.alerts import alertmanager, cli, rules
from trainguard.policy import Policy

ROOT = Path(__file__).resolve().parents[2]
ALERTS_DIR = ROOT / "alerts"
def rendered_alerts(directory: Path) -> dict[str, dict]:
    found = {}
    for path in sorted(directory.glob("*.rules.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    found[rule["alert"]] = rule
    return found


def test_checked_in_files_match_the_generator(tmp_path):
    """Fails when alerts/*.yml drift from alerts/rules.py: run `trainguard alerts render --out alerts` and commit."""
    assert cli.main(["render", "--out", str(tmp_path)]) == 0
    produced = sorted(p.name for p in tmp_path.iterdir())
    checked_in = sorted(p.name for p in ALERTS_DIR.glob("*.yml"))
    assert produced == checked_in
    for name in produced:
        assert (tmp_path / name).read_text() == (ALERTS_DIR / name).read_text(), f"alerts/{name} drifted"


def test_every_core_alert_is_there_with_its_labels_and_annotations():
    """The checked-in files hold every alert of the rules (the set derived from them: test_alert_coverage.py,
    which also holds each to its runbook and its promtool cases; those pin each alert's labels, `action`
    included, as promtool compares the whole label set)."""
    alerts = rendered_alerts(ALERTS_DIR)
    assert set(alerts) == set(ALERTS)
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        assert rule["labels"].get("action") in (None, *actions.REMOTE_ACTIONS), name
        annotations = rule["annotations"]
        assert annotations["summary"] and annotations["description"], name
        assert annotations["runbook_url"].endswith("docs/runbooks.md#" + name.lower()), name


def test_every_runbook_url_has_its_section():
    anchors = {re.sub(r"[^a-z0-9 -]", "", line[3:].strip().lower()).replace(" ", "-")
               for line in (ROOT / "docs" / "runbooks.md").read_text().splitlines() if line.startswith("## ")}
    for rule in rendered_alerts(ALERTS_DIR).values():
        assert rule["annotations"]["runbook_url"].rsplit("#", 1)[1] in anchors


def test_an_action_outside_the_vocabulary_is_refused():
    try:
        rules.Alert("X", "vector(1)", "critical", "s", "d", action="reboot")
    except ValueError as exc:
        assert "reboot" in str(exc)
    else:
        raise AssertionError("an unknown action was accepted")


def test_thresholds_come_from_the_policy(tmp_path):
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(
        "cost: {price_per_gpu_hour: 3.5, budget_per_1k_steps: 40, tiers: {warn: 0.1, throttle: 0.2, stop: 0.5}}\n"
        "alerts: {stall_seconds: 7, disk_await_ms: 25, for_short: 2s, data_utilization_min: 0.8}\n")
    out = tmp_path / "out"
    assert cli.main(["render", "--policy", str(policy_file), "--out", str(out)]) == 0
    alerts = rendered_alerts(out)
    assert alerts["CostBudgetWarn"]["expr"].endswith(">= 0.1")
    assert alerts["CostBudgetStop"]["expr"].endswith(">= 0.5")
    assert alerts["CostBudgetStop"]["for"] == "2s"
    assert "> 7\n" in alerts["TrainingStalled"]["expr"] and alerts["TrainingStalled"]["for"] == "2s"
    assert alerts["DiskAwaitHigh"]["expr"].endswith("> 0.025")
    assert alerts["LowDataUtilization"]["expr"].endswith("< 0.8")
    cost = (out / "cost.rules.yml").read_text()
    # the price is applied by the agents' cost meters (same policy file); the rules judge the budget
    assert "/ 40 - 1" in cost and "$3.5 per GPU-hour" in cost
    assert ">= 20" in cost   # min_steps, as the cost meter
    assert Policy().cost.min_steps == 20


def test_a_bad_policy_is_refused_naming_the_key(tmp_path, capsys):
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text("alerts: {stall_secs: 7}\n")
    assert cli.main(["render", "--policy", str(policy_file), "--out", str(tmp_path / "out")]) == 2
    assert "alerts.stall_secs: unknown key" in capsys.readouterr().err


def test_promtool_check_and_unit_tests_pass():
    require_binary("promtool")
    require_binary("amtool")
    for command in cli.checks(ALERTS_DIR):
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"{' '.join(command[:3])}:\n{result.stdout}{result.stderr}"
    assert len(cli.checks(ALERTS_DIR)) == 3   # check rules, test rules, check-config


def test_the_unit_tests_catch_a_changed_threshold(tmp_path):
    """The promtool tests can fail: with a laxer policy, the 'fires' cases must break."""
    promtool = require_binary("promtool")
    lax = Policy(guard=dataclasses.replace(Policy().guard, spike_sigma=1000.0),
                 alerts=dataclasses.replace(Policy().alerts, stall_seconds=100000.0))
    rules.write(tmp_path, lax)
    shutil.copytree(ALERTS_DIR / "tests", tmp_path / "tests")
    result = subprocess.run([promtool, "test", "rules", str(tmp_path / "tests" / "training.test.yml")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "LossSpike" in result.stdout + result.stderr and "TrainingStalled" in result.stdout + result.stderr


def test_alertmanager_routes_actions_to_the_agents_and_everything_to_a_human(tmp_path):
    amtool = require_binary("amtool")
    config = tmp_path / "alertmanager.yml"
    config.write_text(alertmanager.render(["10.0.0.1:9655", "10.0.0.2:9655"], token_file="/etc/tg/token"))
    check = subprocess.run([amtool, "check-config", str(config)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr

    def receivers(*labels: str) -> list[str]:
        result = subprocess.run([amtool, "config", "routes", "test", f"--config.file={config}", *labels],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
        return sorted(result.stdout.strip().split(","))

    first, second = (alertmanager.receiver_name(a) for a in ("10.0.0.1:9655", "10.0.0.2:9655"))
    assert receivers("alertname=LossSpike", "action=rollback", "instance=10.0.0.2:9655") == sorted([first, "human"])
    # the self-handled alerts are severity info: they reach the agent, and page nobody
    assert receivers("alertname=LossSpike", "severity=info", "action=rollback") == [first]
    assert receivers("alertname=Whatever", "severity=info") == ["nobody"]
    assert receivers("alertname=CostBudgetStop", "action=cost_stop") == sorted([first, "human"])
    assert receivers("alertname=TrainingStalled", "action=restore", "instance=10.0.0.2:9655") == sorted(
        [second, "human"])
    assert receivers("alertname=TrainingStalled", "action=restore", "instance=10.0.0.9:9655") == ["human"]
    assert receivers("alertname=GPUOverheating") == ["human"]


def test_the_webhook_receivers_carry_the_bearer_token_file():
    config = alertmanager.config(["127.0.0.1:9655"], token_file="/run/secrets/tg")
    hook = config["receivers"][2]["webhook_configs"][0]
    assert hook["url"] == "http://127.0.0.1:9655/api/v1/alerts"
    assert hook["http_config"]["authorization"] == {"type": "Bearer", "credentials_file": "/run/secrets/tg"}
    assert hook["send_resolved"] is True
    run_wide = config["route"]["routes"][0]
    assert set(run_wide["matchers"][0].split('"')[1].split("|")) == set(actions.REMOTE_ACTIONS) - {"restore"}


def test_the_alerts_test_command_passes_on_the_checked_in_files():
    require_binary("promtool")
    require_binary("amtool")
    result = subprocess.run([str(Path(sys.executable).with_name("trainguard")), "alerts", "test"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": ok") == 3


def test_every_metric_the_rules_read_is_exported_by_an_agent_collector():
    """A renamed metric would silence an alert: the names in the rules must be in the agent's code (its
    collectors in agent/, the families they share with replay in trainguard/metrics/)."""
    sources = "\n".join(p.read_text() for folder in (ROOT / "agent", ROOT / "trainguard" / "metrics")
                         for p in folder.rglob("*.py"))
    exprs = "\n".join(rule.expr for group in rules.groups() for rule in group.rules)
    names = set(re.findall(r"(?<![:\w])((?:trainguard|node|DCGM_FI)_[A-Za-z0-9_]+)(?![:\w])", exprs))
    assert "trainguard_training_loss" in names and "node_disk_reads_completed_total" in names
    for name in sorted(names):
        spelled = {f'"{name}"'} | {f'"{name[:-len(suffix)]}"' for suffix in ("_total", "_info") if name.endswith(suffix)}
        if name.startswith("node_disk_"):       # io.py builds these from a table: f"node_disk_{name}"
            spelled.add(f'"{name[len("node_disk_"):]}"')
        assert any(s in sources for s in spelled), f"{name} is read by the rules but no collector exports it"


def test_render_writes_routes_to_merge_and_merges_them_into_an_existing_configuration(tmp_path):
    amtool = require_binary("amtool")
    existing = tmp_path / "existing.yml"
    existing.write_text(yaml.safe_dump({
        "route": {"receiver": "ops", "routes": [{"receiver": "pager", "matchers": ['severity="critical"']}]},
        "receivers": [{"name": "ops"}, {"name": "pager"}]}))
    out = tmp_path / "out"
    assert cli.main(["render", "--out", str(out), "--agent", "10.0.0.1:9655", "--merge-into", str(existing)]) == 0
    part = yaml.safe_load((out / "alertmanager-routes.yml").read_text())
    assert set(part) == {"route", "receivers"} and "receiver" not in part["route"]     # no root: a fragment
    merged = yaml.safe_load((out / "alertmanager.yml").read_text())
    assert merged["route"]["receiver"] == "ops" and merged["route"]["routes"][-1]["receiver"] == "pager"
    assert {"ops", "pager", alertmanager.receiver_name("10.0.0.1:9655")} <= {r["name"] for r in merged["receivers"]}
    assert alertmanager.merge(merged, part) == merged           # merging twice adds nothing
    config = out / "alertmanager.yml"
    assert subprocess.run([amtool, "check-config", str(config)], capture_output=True).returncode == 0
    routed = subprocess.run([amtool, "config", "routes", "test", f"--config.file={config}", "alertname=TrainingStalled",
                             "severity=critical", "action=restore", "instance=10.0.0.1:9655"],
                            capture_output=True, text=True)
    assert sorted(routed.stdout.strip().split(",")) == sorted([alertmanager.receiver_name("10.0.0.1:9655"), "pager"])


def test_an_agent_without_its_port_is_refused(tmp_path, capsys):
    for address in ("gpu-node-01", "gpu-node-01:", ":9655", "gpu-node-01:http", "gpu-node-01:70000"):
        assert cli.main(["render", "--out", str(tmp_path), "--agent", address]) == 2, address
        assert "expected HOST:PORT" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())          # nothing written
    assert cli.main(["render", "--out", str(tmp_path), "--agent", "[fd00::1]:9655"]) == 0


def test_the_mixin_sets_selectors_runbooks_and_the_self_handled_severity(tmp_path):
    promtool = require_binary("promtool")
    mixin_file = tmp_path / "mixin.yaml"
    mixin_file.write_text("selectors: {trainguard: 'job=\"tg\"', dcgm: 'job=\"dcgm-exporter\"', "
                          "node: 'job=~\"node-exporter|tg\"'}\n"
                          "runbook_url_base: https://wiki.example.com/runbooks/\nself_handled_severity: warning\n")
    out = tmp_path / "out"
    assert cli.main(["render", "--out", str(out), "--mixin", str(mixin_file)]) == 0
    alerts = rendered_alerts(out)
    assert alerts["LossSpike"]["labels"]["severity"] == "warning"
    assert alerts["GPUOverheating"]["expr"].startswith('DCGM_FI_DEV_GPU_TEMP{job="dcgm-exporter"}')
    assert 'up{job="tg"} == 0' in alerts["AgentDown"]["expr"]
    assert alerts["DiskAwaitHigh"]["annotations"]["runbook_url"] == "https://wiki.example.com/runbooks#diskawaithigh"
    text = "\n".join(rule["expr"] for p in out.glob("*.rules.yml") for group in yaml.safe_load(p.read_text())["groups"]
                     for rule in group["rules"])
    assert 'trainguard_training_loss{job="tg"}' in text and 'node_disk_reads_completed_total{job=~"node-exporter|tg"}' in text
    bare = re.findall(r"(?<![:\w])(?:trainguard|node|DCGM)_[A-Za-z0-9_]+(?![\w:({])", text)
    assert bare == [], f"series without the selector: {sorted(set(bare))[:5]}"
    check = subprocess.run([promtool, "check", "rules", *map(str, out.glob("*.rules.yml"))], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_bad_mixin_is_refused_naming_the_key(tmp_path, capsys):
    mixin_file = tmp_path / "mixin.yaml"
    for text, key in (("selectors: {gpu: 'job=\"x\"'}\n", "selectors.gpu"), ("severity: info\n", "severity"),
                      ("selectors: {dcgm: 'job=dcgm'}\n", "selectors.dcgm"),
                      ("self_handled_severity: page\n", "self_handled_severity")):
        mixin_file.write_text(text)
        assert cli.main(["render", "--out", str(tmp_path / "out"), "--mixin", str(mixin_file)]) == 2
        assert key in capsys.readouterr().err
