"""End to end through `trainguard agent`: a forged claim in the run directory does not stop a job-level
action that two real agents receive; exactly one carries it out, and both count the forged claim."""

from __future__ import annotations

import json
import os
import time
import urllib.request

import pytest

from tests.alerts.helpers import alert, payload, read_jsonl
from tests.fleet.agents import scrape, start_node_agent
from tests.fleet.synthetic import node_name
from trainguard import rundir

pytestmark = pytest.mark.slow


def post(address: str, token: str, data: dict) -> int:
    request = urllib.request.Request(f"http://{address}/api/v1/alerts", data=json.dumps(data).encode(),
                                     method="POST", headers={"Authorization": f"Bearer {token}",
                                                             "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status


def test_a_forged_claim_does_not_stop_two_real_agents_and_one_acts(tmp_path):
    run = tmp_path / "run"
    (run / "tls").mkdir(parents=True)
    token = tmp_path / "webhook.token"
    token.write_text("fleet-" + os.urandom(16).hex() + "\n")
    token.chmod(0o600)
    # a stranger who can write the run directory claims every cost tier ahead of the agents
    rundir.claims_dir(run).mkdir(parents=True)
    for tier in ("cost_warn", "cost_throttle", "cost_stop"):
        rundir.claim_path(run, f"cost-{tier}").write_text(json.dumps({"node": "stranger", "claimed_at": time.time()}))
    agents = [start_node_agent(tmp_path, run, i, collectors="training",
                               webhook={"token_file": str(token), "embedded": False}) for i in range(2)]
    try:
        job_alert = alert("CostBudgetWarn", "cost_warn", fingerprint="0f0f0f0f0f0f0f0f")
        del job_alert["labels"]["instance"]                    # the run-wide tier: job-level
        for _, address in agents:
            assert post(address, token.read_text().strip(), payload(job_alert)) == 200
        metrics = [scrape(address) for _, address in agents]
    finally:
        for server, _ in agents:
            server.stop()
    outcomes = sorted(r["event"]["outcome"] for i in range(2)
                      for r in read_jsonl(rundir.node_actions_log(run, node_name(i))) if r["event"]["type"] == "action")
    assert outcomes == ["claimed", "issued"]
    assert [r["action"] for r in rundir.read_requests(run)] == ["cost_warn"]
    for text in metrics:
        assert 'trainguard_claims_refused_total{reason="unsigned"} 1.0' in text
