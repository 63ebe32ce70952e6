"""The webhook installed in the real agent HTTP server, as `trainguard agent` does it (agent/app.py)."""

import json
import urllib.error
import urllib.request

import pytest

from tests.alerts.helpers import alert, payload, read_jsonl
from trainguard.agent.config import AgentConfig
from trainguard.agent.runner import Agent
from trainguard.agent.server import AgentServer
from trainguard.agent.app import build_actions


def request(url, data: bytes, headers: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@pytest.fixture
def served(tmp_path):
    def serve(policy=None, **webhook):
        config = AgentConfig(run_dir=tmp_path, node="n1", webhook=webhook, policy=policy)
        agent = Agent(config, registry={})
        server = AgentServer(agent, "127.0.0.1", 0)
        started.append(server)
        build_actions(config, agent, server)
        server.start()
        return server, agent
    started = []
    yield serve
    for server in started:
        server.stop()


def test_install_serves_the_webhook_with_a_generated_private_token(tmp_path, served):
    server, agent = served(embedded=False)
    token_file = tmp_path / "agent" / "webhook.token"
    assert (token_file.stat().st_mode & 0o777) == 0o600
    url = server.url + "/api/v1/alerts"
    body = json.dumps(payload(alert())).encode()
    assert request(url, body, {"Content-Type": "application/json"})[0] == 401
    status, answer = request(url, body, {"Content-Type": "application/json",
                                         "Authorization": "Bearer " + token_file.read_text().strip()})
    assert status == 200 and answer["verdicts"][0]["outcome"] == "act"
    assert [r["action"] for r in read_jsonl(tmp_path / "control" / "actions.jsonl")] == ["rollback"]
    names = {family.name for family in agent.families()}
    assert {"trainguard_webhook_requests", "trainguard_alert_verdicts", "trainguard_actions_executed"} <= names


@pytest.mark.parametrize("setting", [{"shadow": True}, {"dry_run": True}])   # dry_run: the older name
def test_shadow_from_the_config_executes_nothing(tmp_path, served, setting):
    token_file = tmp_path / "token"
    token_file.write_text("t0k3n\n")
    token_file.chmod(0o600)
    server, agent = served(token_file=str(token_file), embedded=False, **setting)
    status, answer = request(server.url + "/api/v1/alerts", json.dumps(payload(alert())).encode(),
                             {"Content-Type": "application/json", "Authorization": "Bearer t0k3n"})
    assert status == 200 and answer["verdicts"][0]["shadow"] is True
    assert not (tmp_path / "control" / "actions.jsonl").exists()
    alert_event, shadowed = [r["event"] for r in read_jsonl(tmp_path / "tls" / "node-n1-actions.jsonl")]
    assert alert_event["shadow"] is True and alert_event["action"] == "rollback"
    assert shadowed["type"] == "shadow_action" and shadowed["action"] == "rollback"
    [family] = [f for f in agent.families() if f.name == "trainguard_actions_shadowed"]
    assert [(s.labels["action"], s.value) for s in family.samples] == [("rollback", 1.0)]


def test_the_policys_shadow_mode_records_a_restore_and_a_cost_stop_and_does_nothing(tmp_path, served):
    """The agent in shadow (the policy's actions.mode) receiving Alertmanager's restore and cost_stop over
    HTTP: each is a shadow_action with its alert, no control request is written, no rank file is touched."""
    policy = tmp_path / "policy-shadow.yaml"
    policy.write_text("actions: {mode: shadow}\n")
    ranks = tmp_path / "control" / "ranks"
    ranks.mkdir(parents=True)
    (ranks / "rank-0.json").write_text(json.dumps({"rank": 0, "pid": 1, "host": "n1"}))
    server, agent = served(policy=str(policy), embedded=False)
    token = (tmp_path / "agent" / "webhook.token").read_text().strip()
    body = payload(alert("TrainingStalled", "restore", fingerprint="1111111111111111"),
                   alert("CostBudgetStop", "cost_stop", fingerprint="2222222222222222"))
    status, answer = request(server.url + "/api/v1/alerts", json.dumps(body).encode(),
                             {"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    assert status == 200 and [(v["action"], v["shadow"]) for v in answer["verdicts"]] == [
        ("restore", True), ("cost_stop", True)]
    assert not (tmp_path / "control" / "actions.jsonl").exists()
    assert [p.name for p in ranks.iterdir()] == ["rank-0.json"]
    events = [r["event"] for r in read_jsonl(tmp_path / "tls" / "node-n1-actions.jsonl")]
    shadowed = {e["action"]: e for e in events if e["type"] == "shadow_action"}
    assert set(shadowed) == {"restore", "cost_stop"}
    assert shadowed["restore"]["alertname"] == "TrainingStalled" and shadowed["restore"]["source"] == "alertmanager"
    assert not [e for e in events if e["type"] == "action"]                  # nothing carried out
    [family] = [f for f in agent.families() if f.name == "trainguard_actions_shadowed"]
    assert {s.labels["action"]: s.value for s in family.samples} == {"cost_stop": 1.0, "restore": 1.0}


def test_a_bad_webhook_setting_stops_the_agent_naming_the_key(tmp_path, served, capsys):
    with pytest.raises(SystemExit) as stopped:
        served(dry_run="yes")
    assert stopped.value.code == 2


def test_an_explicit_token_file_must_exist(tmp_path, served):
    with pytest.raises(SystemExit) as stopped:
        served(token_file=str(tmp_path / "missing.token"), embedded=False)
    assert stopped.value.code == 2
