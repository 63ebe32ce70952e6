"""A full disk must not lose an action: a decision that could not be recorded leaves the ledger as it
was, so Alertmanager's retry (after space is freed) acts exactly once.

The agent runs as a real `trainguard agent` process on a run directory on a real 20 MiB tmpfs (root is
needed to mount it; skipped otherwise, failed under CI=true as root).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.alerts.helpers import alert, payload, read_jsonl
from tests.servers import fill_disk, free_port, tmpfs

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def small_disk(tmp_path):
    with tmpfs(tmp_path / "disk", "20m") as disk:
        yield disk


def post(port: int, token: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/alerts", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_a_full_disk_answers_500_and_the_retry_after_space_is_freed_acts_once(small_disk, tmp_path):
    run = small_disk / "R"
    port = free_port()
    log = open(tmp_path / "agent.log", "wb")
    config = tmp_path / "agent.yaml"
    config.write_text("nodelog: {enabled: false}\n")
    agent = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "agent", "--run-dir", str(run), "--listen",
                              f"127.0.0.1:{port}", "--config", str(config), "--create"], stdout=log, stderr=log)
    try:
        token_file = run / "agent" / "webhook.token"
        deadline = time.time() + 30
        while not token_file.exists() or not token_file.read_text().strip():
            assert time.time() < deadline and agent.poll() is None, (tmp_path / "agent.log").read_text()[-2000:]
            time.sleep(0.1)
        time.sleep(1.0)
        token = token_file.read_text().strip()
        warn = payload(alert("CostBudgetWarn", "cost_warn", fingerprint="aa00"))
        fill_disk(small_disk)
        status, answer = post(port, token, warn)
        assert status == 500 and "retry" in answer["error"] and "bytes needed" in answer["error"]
        assert not (run / "control" / "actions.jsonl").exists() or not (run / "control" / "actions.jsonl").read_text()
        os.remove(small_disk / "filler")
        status, answer = post(port, token, warn)                 # Alertmanager's retry
        assert status == 200 and [v["outcome"] for v in answer["verdicts"]] == ["act"]
        status, answer = post(port, token, warn)                 # and a repeat after it
        assert [v["outcome"] for v in answer["verdicts"]] == ["duplicate"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            metrics = response.read().decode()
    finally:
        agent.terminate()
        agent.wait(20)
        log.close()
    assert [r["action"] for r in read_jsonl(run / "control" / "actions.jsonl")] == ["cost_warn"]
    assert "trainguard_actions_not_done_total 1.0" in metrics
    assert (tmp_path / "agent.log").read_text().count("action not done") == 1
