"""Replay reads a recorded node log through the node-risk rule the agent ran live: the same flag, at the
same time (the degrading fake NVML scenario, through the real gpu collector and the node log's joining)."""

from __future__ import annotations

from tests.fakes.fake_nvml import FakeNVML
from trainguard import tls
from trainguard.agent.collector import Context
from trainguard.agent.collectors.gpu import GPUCollector
from trainguard.agent.node_risk import NodeRiskWatch
from trainguard.agent.nodelog import join_fragments
from trainguard.decide.node_risk import DRAIN_AT_CHECKPOINT, NodeRiskPolicy
from trainguard.policy import Policy
from trainguard.replay.timeline import replay_logs

START = 1_764_000_000.0


def test_replay_flags_the_node_the_live_agent_flagged(tmp_path):
    policy = Policy(node_risk=NodeRiskPolicy(settle_seconds=0))
    nvml = FakeNVML("degrading")
    gpu = GPUCollector(Context(devfs=tmp_path, node="node-a", options={"nvml_module": nvml, "kmsg": False}))
    fragments: dict = {}
    live = []
    watch = NodeRiskWatch(lambda: fragments, "node-a", policy.node_risk, on_flag=live.append)
    log = tmp_path / "node-node-a.jsonl"
    with open(log, "wb") as out:
        for i in range(12):
            now = START + 60.0 * i
            fragments["gpu"] = gpu.update().tls
            out.write(tls.encode(join_fragments(fragments, "node-a", now)))   # what the node log writes
            watch.observe_once(now)
            nvml.advance()
    assert len(live) == 1
    result = replay_logs([log], policy)
    drains = [a for a in result.actions if a.action == DRAIN_AT_CHECKPOINT]
    assert [(a.timestamp, a.reason, a.source) for a in drains] == [(live[0].timestamp, "node_risk", "node_risk")]
    assert drains[0].detail["signals"] == {k: round(v, 4) for k, v in sorted(live[0].signals.items())}


def test_a_training_log_holds_no_node_health(tmp_path):
    log = tmp_path / "rank-0.jsonl"
    log.write_bytes(b"".join(tls.encode({"timestamp": START + i, "step": i, "metrics": {"loss": 2.0}})
                             for i in range(50)))
    assert not [a for a in replay_logs([log]).actions if a.action == DRAIN_AT_CHECKPOINT]
