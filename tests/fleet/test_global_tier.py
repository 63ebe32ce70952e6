"""A job-level alert fires on a global Prometheus from node-level data (docs/scale.md).

Three real agents (one node each, 8 ranks of step records; node 2 steps five times slower) scraped by
two real shard Prometheus servers, which record fleet-shard.rules.yml and remote-write their per-node
series to a real global Prometheus (`--web.enable-remote-write-receiver`); the global one evaluates
fleet-global.rules.yml: JobNodeSlow names node 2, and the job's cost is recorded once for the run.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.fleet.agents import start_node_agent, write_node_ranks
from tests.fleet.tiers import start_global, start_shard
from tests.servers import http_get, prometheus_query, wait_for
from trainguard.policy import Policy

pytestmark = [pytest.mark.servers, pytest.mark.slow]


def firing(url: str, name: str) -> list[dict]:
    import json
    _, _, body = http_get(f"{url}/api/v1/alerts")
    return [a for a in json.loads(body)["data"]["alerts"] if a["labels"]["alertname"] == name and a["state"] == "firing"]


def test_one_slow_node_fires_on_the_global_tier(tmp_path):
    policy = Policy(alerts=dataclasses.replace(Policy().alerts, for_long="0s"))
    run = tmp_path / "run"
    agents = []
    for node in range(3):
        write_node_ranks(run, node, step_time=5.0 if node == 2 else 1.0)
        agents.append(start_node_agent(tmp_path, run, node, interval=0.5, collectors="training"))
    addresses = [address for _, address in agents]
    with start_global(tmp_path, policy) as global_url, \
            start_shard(tmp_path, 0, addresses[:2], global_url, policy), \
            start_shard(tmp_path, 1, addresses[2:], global_url, policy):
        alerts = wait_for(lambda: firing(global_url, "JobNodeSlow"), timeout=90, interval=1,
                          message="JobNodeSlow firing on the global Prometheus")
        assert [a["labels"]["instance"] for a in alerts] == [addresses[2]]
        assert alerts[0]["labels"]["run_id"] == "fleet"
        cost = wait_for(lambda: prometheus_query(global_url, "trainguard:job:cost_usd"), timeout=30,
                        message="the job's cost recorded on the global tier")
        assert [r["metric"].get("run_id") for r in cost] == ["fleet"]
        shards = prometheus_query(global_url, "count by (shard) (trainguard:node:step_time_seconds)")
        assert sorted((r["metric"]["shard"], r["value"][1]) for r in shards) == [("0", "2"), ("1", "1")]
        # The global tier holds the per-node records, not the ~1,200 raw series per node.
        assert prometheus_query(global_url, "trainguard_training_loss") == []
    for server, _ in agents:
        server.stop()
