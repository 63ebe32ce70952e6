"""End to end on two simulated nodes: two agents, a two-node torchrun rendezvous on 127.0.0.1.

A burst of loss spikes on every rank raises alerts from both agents; Alertmanager routes the run-wide
rollback to the primary agent (the first), whose ledger turns the alerts of both nodes into one request;
both ranks act on it in the same step, and both nodes finish the run.
"""

from __future__ import annotations

import pytest

from tests.e2e.stack import PACE, SPIKES, record_timing, stack
from tests.servers import free_port

pytestmark = [pytest.mark.servers, pytest.mark.slow, pytest.mark.timeout(300)]


def test_two_nodes_two_agents_one_rollback_acted_on_by_every_rank(tmp_path):
    args = ["--steps", "50", "--checkpoint-every", "10", *PACE, *SPIKES]
    with stack(tmp_path) as s:
        s.start_agent("n1")
        s.start_agent("n2")
        s.start_servers()
        endpoint = f"127.0.0.1:{free_port()}"
        nodes = [s.torchrun_node(rank, 2, endpoint, *args) for rank in (0, 1)]
        assert [s.wait_trainer(node, 200) for node in nodes] == [0, 0]

        requests = [r for r in s.agent_events("n1") if r["event"]["type"] == "action"]
        assert [r["event"]["action"] for r in requests] == ["rollback"]
        alerts = [r["event"] for r in s.agent_events("n1") if r["event"]["type"] == "alert"
                  and r["event"]["status"] == "firing"]
        instances = {e["labels"]["instance"] for e in alerts}
        assert instances == {a.address for a in s.agents}       # both nodes' alerts reached the primary
        assert [e["outcome"] for e in alerts].count("act") == 1
        assert s.agent_events("n2") == []                        # run-wide actions go to the primary only

        rollbacks = [[r for r in s.rank_events(rank) if r["event"]["type"] == "rollback"] for rank in (0, 1)]
        assert [len(r) for r in rollbacks] == [1, 1]
        assert rollbacks[0][0]["step"] == rollbacks[1][0]["step"]
        assert rollbacks[0][0]["event"]["restored_step"] == rollbacks[1][0]["event"]["restored_step"]
        assert rollbacks[0][0]["event"]["id"] == requests[0]["event"]["id"]
        for rank in (0, 1):
            assert s.rank_events(rank)[-1]["event"]["reason"] == "completed"
        fault = next(r for r in s.rank_events(0) if r["event"]["type"] == "fault_injected"
                     and r["event"]["kind"] == "spike")
        record_timing("two nodes: loss spike -> rollback on both",
                      to_action=requests[0]["timestamp"] - fault["timestamp"],
                      to_trainer=max(r[0]["timestamp"] for r in rollbacks) - fault["timestamp"])
