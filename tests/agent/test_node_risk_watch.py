"""agent/node_risk.py: the gpu collector's readings of the degrading fake NVML through the node-risk rule, on
/metrics, and the flag handed on once."""

from __future__ import annotations

from tests.agent.exposition import render, series, values
from tests.fakes.fake_nvml import FakeNVML
from tests.servers import promtool_check_metrics
from trainguard.agent.collector import Context
from trainguard.agent.collectors.gpu import GPUCollector
from trainguard.agent.node_risk import NodeRiskWatch
from trainguard.decide.node_risk import DRAIN_AT_CHECKPOINT, NodeRiskPolicy


def watch_over(tmp_path, scenario: str, policy: NodeRiskPolicy, **kwargs):
    nvml = FakeNVML(scenario)
    gpu = GPUCollector(Context(devfs=tmp_path, node="node-a", options={"nvml_module": nvml, "kmsg": False}))
    fragments: dict = {}
    watch = NodeRiskWatch(lambda: fragments, "node-a", policy, **kwargs)
    clock = [1000.0]
    gpu.clock = lambda: clock[0]       # the collector's re-init backoff runs on the readings' time

    def step(now: float):
        clock[0] = 1000.0 + now
        fragments["gpu"] = gpu.update().tls
        verdict = watch.observe_once(now)
        nvml.advance()
        return verdict
    return watch, step


def test_degrading_gpu_flags_its_node_once_and_exports_the_score(tmp_path):
    flagged = []
    # readings a minute apart; no settle period at the agent's start (the policy's default is for reboots)
    watch, step = watch_over(tmp_path, "degrading", NodeRiskPolicy(settle_seconds=0), on_flag=flagged.append)
    verdicts = [step(60.0 * i) for i in range(12)]
    assert len(flagged) == 1 and flagged[0].action == DRAIN_AT_CHECKPOINT and flagged[0].node == "node-a"
    first = next(i for i, v in enumerate(verdicts) if v.flagged)
    assert first < 10                      # before the GPU falls off the bus (sample 10)
    v = values(watch.families())
    assert v[series("trainguard_node_at_risk")] == 1 and v[series("trainguard_node_risk_flags_total")] == 1
    assert {"remapped_rows", "correctable_ecc", "remap_pending"} <= set(flagged[0].signals)
    assert v[series("trainguard_node_risk_signal", signal="xid_drain")] == 1.0      # fallen off the bus by now
    assert v[series("trainguard_node_risk_score")] == verdicts[-1].score
    promtool_check_metrics(render(watch.families()))


def test_healthy_node_is_never_flagged(tmp_path):
    flagged = []
    _, step = watch_over(tmp_path, "h100x8", NodeRiskPolicy(settle_seconds=0), on_flag=flagged.append)
    # the scenario's few NVLink replays weigh a little, far from the threshold
    assert max(step(60.0 * i).score for i in range(6)) < 0.1 and not flagged


def test_flags_of_other_nodes_spend_the_budget(tmp_path):
    flagged = []
    watch, step = watch_over(tmp_path, "degrading", NodeRiskPolicy(settle_seconds=0, max_flags_per_hour=1),
                             on_flag=flagged.append, known_flags=lambda: [1.0])     # another node, at t=1 s
    verdicts = [step(60.0 * i) for i in range(12)]
    assert not flagged and any(v.suppressed == "circuit_open" for v in verdicts)
    assert values(watch.families())[series("trainguard_node_risk_suppressed_total")] >= 1


def test_no_gpu_or_ib_health_no_reading():
    watch = NodeRiskWatch(lambda: {"training": {"metrics": {"loss": 1.0}}}, "node-a", NodeRiskPolicy())
    assert watch.observe_once(10.0) is None and watch.families()[0].samples[0].value == 0


def test_a_planned_reboot_seen_by_a_running_agent_drains_nothing(tmp_path):
    """GPUs lost (driver unloaded), back with their counters at 0 and a link still at x8: the settle period
    keeps it out; the same readings through a rule without debounce or settle would flag the node."""
    flagged = []
    _, step = watch_over(tmp_path, "reboot", NodeRiskPolicy(), on_flag=flagged.append)
    verdicts = [step(20.0 * i) for i in range(14)]
    assert not flagged and not any(v.at_risk for v in verdicts)
    assert any(v.settling for v in verdicts[6:])                   # back from lost: settling
    naive = []
    _, step = watch_over(tmp_path / "naive", "reboot", NodeRiskPolicy(threshold=0.2, consecutive=1,
                                                                     settle_seconds=0), on_flag=naive.append)
    [step(20.0 * i) for i in range(14)]
    assert naive and set(naive[0].signals) == {"pcie_link"}


def test_drain_cordons_only_after_the_signed_ack_and_a_verified_checkpoint(tmp_path, monkeypatch):
    import time
    from types import SimpleNamespace

    import torch

    from tests import signing
    from trainguard import rundir
    from trainguard.agent import evict
    from trainguard.agent.node_risk import Drain
    from trainguard.runtime.checkpoint import CheckpointManager

    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_KEY", str(tmp_path / "key"))
    run = tmp_path / "run"
    rundir.control_dir(run).mkdir(parents=True)
    drain = Drain(run, "node-a", submit=lambda notices: [], request_id=lambda v: "d1", wait_seconds=1.0,
                  poll_seconds=0.05)
    issued = time.time()
    assert drain.follow("d1", issued)["outcome"] == "no_checkpoint" and not evict.cordoned(run)   # no ack yet
    rundir.append_ack(run, "d1", DRAIN_AT_CHECKPOINT, 7, key=signing.key())
    assert drain.follow("d1", issued)["outcome"] == "no_checkpoint"       # acknowledged, nothing saved yet
    CheckpointManager(run, keep_last=1).save(7, {"model": torch.nn.Linear(2, 2).state_dict()},
                                                             stable=True)
    done = drain.follow("d1", issued)
    assert (done["outcome"], done["checkpoint_step"]) == ("drained", 7)
    assert evict.cordoned(run)["node-a"]["reason"] == "node_risk"
    # in shadow mode the executor only records the drain: nothing is followed
    shadowed = SimpleNamespace(action=DRAIN_AT_CHECKPOINT, shadow=True)
    quiet = Drain(run, "node-a", submit=lambda notices: [shadowed], request_id=lambda v: "d2")
    quiet(SimpleNamespace(action=DRAIN_AT_CHECKPOINT, node="node-a", timestamp=1.0))
    assert not quiet._threads
