"""End to end against a running agent: requests without the token, with bad JSON, oversized or invalid are
refused with a 4xx and execute nothing; the same request with the token acts once."""

from __future__ import annotations

import json

import pytest

from tests.alerts.helpers import alert, payload, read_jsonl
from tests.e2e.stack import post, stack

pytestmark = [pytest.mark.servers, pytest.mark.timeout(120)]


def test_refused_requests_execute_nothing_and_a_good_one_acts_once(tmp_path):
    with stack(tmp_path) as s:
        agent = s.start_agent("n1")
        url = f"http://{agent.address}/api/v1/alerts"
        token = s.token_file.read_text().strip()
        good = json.dumps(payload(alert("LossSpike", "rollback"))).encode()
        auth = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        refused = {
            "no token": (good, {"Content-Type": "application/json"}),
            "wrong token": (good, {**auth, "Authorization": "Bearer " + "x" * len(token)}),
            "bad JSON": (b'{"version": "4", "status": "firing", "alerts": [', auth),
            "invalid payload": (json.dumps(payload(alert(action="reboot"))).encode(), auth),
            "oversized": (b'{"pad": "' + b"x" * 100_000 + b'"}', auth),      # the webhook's limit is 64 KiB
        }
        codes = {name: post(url, body, headers) for name, (body, headers) in refused.items()}
        assert codes == {"no token": 401, "wrong token": 401, "bad JSON": 400, "invalid payload": 422,
                         "oversized": 413}
        assert read_jsonl(s.run_dir / "control" / "actions.jsonl") == []
        assert read_jsonl(s.run_dir / "tls" / "node-n1-actions.jsonl") == []

        assert post(url, good, auth) == 200
        assert post(url, good, auth) == 200      # Alertmanager repeating itself
        assert [r["action"] for r in read_jsonl(s.run_dir / "control" / "actions.jsonl")] == ["rollback"]
        recorded = [r["event"]["outcome"] for r in read_jsonl(s.run_dir / "tls" / "node-n1-actions.jsonl")
                    if r["event"]["type"] == "alert"]
        assert recorded == ["act", "duplicate"]
