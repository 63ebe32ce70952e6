"""An Alertmanager `TrainingStalled` restore gathers the incident's evidence before it ends ranks, as the
embedded watchdog's does (agent/culprit.py), and the webhook answers before that is done.

Before: the webhook's restore ended the ranks at once, so no incident, no Flight Recorder request, no
py-spy stacks existed for a stall Prometheus saw first (only the embedded watchdog gathered evidence).
Through a real `trainguard agent` (its embedded watchdog off, so only the webhook can act) and real
stand-in ranks under real torchrun.
"""

from __future__ import annotations

import json
import socket
import sys
import time
import urllib.request

import pytest
import yaml

from tests.alerts.helpers import alert, payload, read_jsonl
from tests.alerts.ranks import STANDIN, Ranks, alive
from tests.servers import free_port, start
from trainguard.tls import format_timestamp

HOST = socket.gethostname()
TOKEN = "restore-evidence-token"


@pytest.fixture
def ranks():
    launched = Ranks()
    yield launched
    launched.stop()


def start_agent(tmp_path, run):
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    (run / "policy.yaml").write_text("restore: {evidence_seconds: 1}\n")
    config = tmp_path / "agent.yaml"
    config.write_text(yaml.safe_dump({"run_dir": str(run), "node": "n1", "nodelog": {"enabled": False},
                                      "policy": str(run / "policy.yaml"),     # its own: an unsigned RUN/ one is not
                                      "webhook": {"token_file": str(token), "embedded": False,
                                                  "restore_entry_points": [STANDIN]}}))
    address = f"127.0.0.1:{free_port()}"
    return start([sys.executable, "-m", "trainguard.cli", "agent", "--config", str(config), "--listen", address,
                  "--collectors", "training"], url=f"http://{address}", ready_url=f"http://{address}/healthz",
                 log_path=tmp_path / "agent.log")


def post(url: str, data: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}/api/v1/alerts", data=json.dumps(data).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status, json.loads(response.read())


def wait_for(check, timeout=60.0, what="it"):
    deadline = time.time() + timeout
    while (found := check()) is None:
        assert time.time() < deadline, f"no {what} within {timeout}s"
        time.sleep(0.1)
    return found


def test_an_alertmanager_restore_gathers_an_incident_before_ending_the_ranks(tmp_path, ranks):
    run = tmp_path / "run"
    hung = ranks.start(run, 2)
    agent = start_agent(tmp_path, run)
    try:
        stalled = alert("TrainingStalled", "restore", starts_at=format_timestamp(time.time() + 5))
        status, answer = post(agent, payload(stalled))
        assert status == 200 and [v["outcome"] for v in answer["verdicts"]] == ["act"]
        assert all(alive(rank["pid"]) for rank in hung)       # answered: nothing ended yet, evidence first
        log = run / "tls" / "node-n1-actions.jsonl"
        action = wait_for(lambda: next((r["event"] for r in read_jsonl(log) if r["event"]["type"] == "action"),
                                       None), what="restore")
    finally:
        agent.stop()
    assert sorted(e["rank"] for e in action["ended"]) == [0, 1] and action["outcome"] == "issued"
    [incident] = [p for p in (run / "incidents").iterdir() if not p.name.startswith(".")]
    verdict = json.loads((incident / "incident.json").read_text())
    assert verdict["kind"] == "hang" and verdict["detected_by"] == f"agent:{HOST}"
    node = json.loads((incident / f"node-{HOST}.json").read_text())
    assert sorted(int(rank) for rank in node["ranks"]) == [0, 1]
    for rank in (0, 1):       # py-spy's stacks of the live rank, or why they could not be taken
        assert (incident / f"rank-{rank}.stack.txt").read_text().strip()
    # the evidence was taken while the ranks lived: every file is older than the restore's record
    assert max(p.stat().st_mtime for p in incident.iterdir()) <= action_time(log)


def action_time(log) -> float:
    [record] = [r for r in read_jsonl(log) if r["event"]["type"] == "action"]
    return float(record["event"]["issued_at"]) + 0.001


@pytest.mark.slow
def test_a_restore_redone_after_the_agent_crashed_gathers_the_evidence_again(tmp_path, ranks):
    """The agent decided a restore (recorded, fsynced) and died before its evidence and the restore were
    done. Its next start redoes the restore: the evidence is gathered again from the ranks it ends, before
    it ends them. Before: `recover()` ended the ranks at once, at start, with no evidence gathered."""
    from trainguard import policy as policy_mod
    from trainguard.agent.config import AgentConfig
    from trainguard.agent.culprit import Investigator
    from trainguard.agent.action_log import alert_record
    from trainguard.agent.executor import Executor, WebhookSettings, actions_log
    from trainguard.decide.ledger import Ledger, Notice

    run = tmp_path / "run"
    hung = ranks.start(run, 2)
    (run / "policy.yaml").write_text("restore: {evidence_seconds: 1}\n")
    config = AgentConfig(run_dir=run, node="n1", webhook={"restore_entry_points": [STANDIN]})
    policy, settings = policy_mod.load(run / "policy.yaml"), WebhookSettings.from_config(config)
    stalled = Notice(alertname="TrainingStalled", status="firing", action="restore", key="fp-stall@1",
                     starts_at=time.time() + 5, source="alertmanager",
                     labels={"alertname": "TrainingStalled", "instance": f"{HOST}:9655"})
    first = Executor(run, "n1", Ledger())
    [decided] = first.ledger.decide_all([stalled], now=time.time())
    first.records.append([alert_record(decided, time.time(), "n1")])   # the agent died right after this
    # its next start, as agent/app.py: the actions log, the Investigator recording into it, the executor
    records = actions_log(run, "n1", settings.checkpoint_key_file)
    investigator = Investigator(run, HOST, policy.restore, record=records.append,
                                entry_points=settings.restore_entry_points, launchers=settings.restore_launchers,
                                key_file=settings.checkpoint_key_file)
    Executor.for_agent(config, policy, settings, investigator=investigator, records=records)
    assert all(alive(rank["pid"]) for rank in hung)                       # before: ended here, unseen
    log = run / "tls" / "node-n1-actions.jsonl"
    action = wait_for(lambda: next((r["event"] for r in read_jsonl(log) if r["event"]["type"] == "action"),
                                   None), what="redone restore")
    assert sorted(e["rank"] for e in action["ended"]) == [0, 1] and action["redone_after_restart"] is True
    [incident] = [p for p in (run / "incidents").iterdir() if not p.name.startswith(".")]
    assert json.loads((incident / "incident.json").read_text())["kind"] == "hang"
    node = json.loads((incident / f"node-{HOST}.json").read_text())
    assert sorted(int(rank) for rank in node["ranks"]) == [0, 1]
    assert all((incident / f"rank-{rank}.stack.txt").read_text().strip() for rank in (0, 1))
    assert max(p.stat().st_mtime for p in incident.iterdir()) <= action_time(log)
