"""Prometheus and Alertmanager down: the agent keeps serving /metrics and its embedded path still acts.

The whole stack is started for real (agent with the embedded path on, Prometheus scraping it with the
generated rules, Alertmanager routing to it), then Alertmanager and Prometheus are killed, and a run with
a budget it cannot meet trains. Nothing on the agent's side depends on them: it answers /metrics and
/healthz throughout, its cost meter crosses every tier and each tier reaches the trainer once, and the
run stops cleanly on a verified checkpoint.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.e2e.stack import read_records, stack
from tests.servers import http_get, wait_for

pytestmark = [pytest.mark.servers, pytest.mark.slow, pytest.mark.timeout(300)]

LOW_BUDGET = {"cost": {"budget_per_1k_steps": 0.01, "gpu_count_override": 1, "min_steps": 20}}
# Slow data for the first 20 steps (0.5 s a batch): the run is still young when the meter can first judge
# it, so the agent's requests reach a trainer that is still training, however fast the machine.
PACE = [f"--inject=slowio@{step}" for step in (1, 6, 11, 16)]


def test_with_prometheus_and_alertmanager_down_the_agent_serves_and_acts_alone(tmp_path):
    with stack(tmp_path, LOW_BUDGET) as s:
        agent = s.start_agent("n1", embedded=True)
        base = f"http://{agent.address}"
        s.start_servers()
        wait_for(lambda: s.firing_alerts() is not None and _scraped(s.prometheus), 60,
                 message="Prometheus scraping the agent")
        s.alertmanager.stop()
        s.prometheus.stop()

        statuses: list[int] = []
        done = threading.Event()

        def watch():
            while not done.is_set():
                statuses.append(http_get(base + "/metrics", timeout=30)[0])
                statuses.append(http_get(base + "/healthz", timeout=30)[0])
                time.sleep(0.5)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            trainer = s.train("--steps", "5000", "--checkpoint-every", "50", *PACE)
            assert s.wait_trainer(trainer, 240) == 0
        finally:
            done.set()
            watcher.join(60)

        assert agent.server.process.poll() is None, "the agent died with its servers gone"
        assert len(statuses) >= 4 and set(statuses) == {200}, statuses
        acted = [r for r in s.rank_events() if r["event"]["type"] == "action"]
        assert [r["event"]["action"] for r in acted] == ["cost_warn", "cost_throttle", "cost_stop"]
        decided = [r["event"] for r in s.agent_events("n1") if r["event"]["type"] == "alert"
                   and r["event"]["outcome"] == "act"]
        assert [(e["action"], e["source"]) for e in decided] == [
            ("cost_warn", "embedded"), ("cost_throttle", "embedded"), ("cost_stop", "embedded")]
        end = s.rank_events()[-1]
        assert end["event"]["type"] == "run_end" and end["event"]["reason"] == "cost_stop"
        summary = json.loads((s.run_dir / "cost_summary.json").read_text())
        assert summary["checkpoint_verified"] is True and summary["step"] == end["step"]
        # Nothing lost: every step the trainer wrote is in its log once.
        steps = [r["step"] for r in read_records(s.run_dir / "tls" / "rank-0.jsonl") if r.get("metrics")]
        assert steps == list(range(steps[0], steps[0] + len(steps)))


def _scraped(prometheus) -> bool:
    status, _, body = http_get(f"{prometheus}/api/v1/query?query=up", timeout=5)
    if status != 200:
        return False
    result = json.loads(body)["data"]["result"]
    return bool(result) and all(r["value"][1] == "1" for r in result)
