"""End to end on two simulated nodes: two agents, a two-node torchrun rendezvous on 127.0.0.1.

A burst of loss spikes on every rank raises alerts from both agents; Alertmanager routes the run-wide
rollback to the primary agent (the first), whose ledger turns the alerts of both nodes into one request;
both ranks act on it in the same step, and both nodes finish the run.

One run, shared by the tests below: the first reads it as the alert path of one node (fault in training
-> Prometheus alert -> Alertmanager -> the primary's webhook -> rollback), the second as two nodes acting
together. (A single-node run of the same scenario through `trainguard train` used to run apart; the alert
path through `trainguard train` stays proved by the hang and cost scenarios of test_alert_actions.py.)
"""

from __future__ import annotations

import pytest

from tests.e2e.stack import PACE, SPIKES, record_timing, stack
from tests.servers import free_port

pytestmark = [pytest.mark.servers, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def spiked(tmp_path_factory):
    """The two-node run with the burst of spikes, finished; its stack still up for diagnostics."""
    args = ["--steps", "50", "--checkpoint-every", "10", *PACE, *SPIKES]
    with stack(tmp_path_factory.mktemp("two-nodes")) as s:
        s.start_agent("n1", wait=False)
        s.start_agent("n2", wait=False)
        s.start_servers()
        endpoint = f"127.0.0.1:{free_port()}"
        nodes = [s.torchrun_node(rank, 2, endpoint, *args) for rank in (0, 1)]
        assert [s.wait_trainer(node, 200) for node in nodes] == [0, 0]
        yield s


def test_loss_spike_alert_rolls_back_and_the_run_finishes(spiked):
    s = spiked
    [rollback] = [r for r in s.rank_events() if r["event"]["type"] == "rollback"]
    assert rollback["event"]["source"] == "control"                      # the trainer acted on a request
    fault = next(r for r in s.rank_events() if r["event"]["type"] == "fault_injected"
                 and r["event"]["kind"] == "spike")
    alerts = [r["event"] for r in s.agent_events("n1") if r["event"]["type"] == "alert"]
    # The spike also blows up the gradient norm: LossSpike and GradNormExplosion describe one incident,
    # and the ledger turns them into one rollback (the other is coalesced into it). Which of the two
    # reaches the agent first depends on scrape timing; once the rollback has removed the spike, the
    # other may never fire.
    assert any(e["alertname"] in ("LossSpike", "GradNormExplosion") and e["status"] == "firing"
               for e in alerts)
    decided = [e for e in alerts if e["outcome"] == "act"]
    assert len(decided) == 1 and decided[0]["action"] == "rollback" and decided[0]["source"] == "alertmanager"
    assert decided[0]["alertname"] in ("LossSpike", "GradNormExplosion")
    assert all(e["outcome"] in ("coalesced", "duplicate", "resolved") for e in alerts if e is not decided[0])
    [issued] = [r for r in s.agent_events("n1") if r["event"]["type"] == "action"]
    assert issued["event"]["id"] == decided[0]["request_id"] == rollback["event"]["id"]
    assert rollback["event"]["alertname"] == decided[0]["alertname"]
    assert rollback["event"]["restored_step"] is not None and rollback["event"]["restored_step"] <= 30
    events = s.rank_events()
    assert not [r for r in events if r["event"]["type"] == "skip_step"]      # the guard left it to the alert
    assert events[-1]["event"] == {"type": "run_end", "step": 50, "reason": "completed"}
    record_timing("loss spike -> LossSpike -> rollback",
                  to_action=issued["timestamp"] - fault["timestamp"],
                  to_trainer=rollback["timestamp"] - fault["timestamp"])


def test_two_nodes_two_agents_one_rollback_acted_on_by_every_rank(spiked):
    s = spiked
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
