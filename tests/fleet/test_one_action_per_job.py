"""A job-level alert delivered to every agent of the job is carried out once (docs/scale.md).

Four real agents on one shared run directory behind one real Alertmanager route (the generated config,
every agent a receiver); a JobStalledEverywhere alert (no instance: about the whole job) is posted to
Alertmanager, which notifies every agent. Each agent's ledger decides to act; exactly one claims it in
RUN/control/claims/, and the request reaches the trainer's control channel once.
"""

from __future__ import annotations

import json
import os
import urllib.request

import pytest
from trainguard.alerts import alertmanager

from tests.fleet.agents import start_node_agent, write_node_ranks
from tests.fleet.synthetic import node_name
from tests.servers import start_alertmanager, wait_for

pytestmark = [pytest.mark.servers, pytest.mark.slow]
AGENTS = 4
FAST = alertmanager.Timing(group_wait="1s", group_interval="1s", repeat_interval="1h")


def actions_of(run, node: str) -> list[dict]:
    path = run / "tls" / f"node-{node}-actions.jsonl"
    if not path.exists():
        return []
    return [r["event"] for r in map(json.loads, path.read_text().splitlines()) if r.get("event", {}).get("type") == "action"]


def post_alert(url: str, labels: dict) -> None:
    body = json.dumps([{"labels": labels, "annotations": {"summary": "test"}}]).encode()
    request = urllib.request.Request(f"{url}/api/v2/alerts", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def test_every_agent_gets_the_job_alert_and_one_acts(tmp_path):
    run = tmp_path / "run"
    token = tmp_path / "webhook.token"
    token.write_text("fleet-" + os.urandom(16).hex() + "\n")
    token.chmod(0o600)
    agents = []
    for node in range(AGENTS):
        write_node_ranks(run, node)
        agents.append(start_node_agent(tmp_path, run, node, collectors="training", interval=1.0,
                                       webhook={"token_file": str(token), "embedded": False}))
    config = alertmanager.render([address for _, address in agents], str(token), timing=FAST)
    with start_alertmanager(tmp_path, config) as am_url:
        post_alert(am_url, {"alertname": "JobStalledEverywhere", "action": "restore", "severity": "critical",
                            "job": "trainguard", "run_id": "fleet"})
        nodes = [node_name(i) for i in range(AGENTS)]
        def every_agent_recorded():
            found = [actions_of(run, n) for n in nodes]
            return found if all(found) else None

        results = wait_for(every_agent_recorded, timeout=90, interval=0.5,
                           message="every agent recording the job-level alert")
    outcomes = sorted(events[-1]["outcome"] for events in results)
    assert outcomes == ["claimed"] * (AGENTS - 1) + ["issued"], outcomes
    [claim] = list((run / "control" / "claims").iterdir())
    claimant = json.loads(claim.read_text())["node"]
    assert {e[-1].get("claimed_by") for e in results if e[-1]["outcome"] == "claimed"} == {claimant}
    requests = [json.loads(line) for line in (run / "control" / "actions.jsonl").read_text().splitlines()]
    assert [r["action"] for r in requests] == ["restore"] and requests[0]["alertname"] == "JobStalledEverywhere"
    for server, _ in agents:
        server.stop()
