"""Other tools' health findings as the agent put them on a node's timeline, shown by `trainguard replay` (its
node-health section, human and JSON) and `trainguard report` (the GPU section's node findings): the collector,
the node log and the readers end to end on a synthetic run."""

from __future__ import annotations

import shutil
import types
from pathlib import Path

from tests.report.synthetic import T0, write_run
from trainguard.agent.collector import Context
from trainguard.agent.collectors import health_reports as collector_module
from trainguard.agent.nodelog import NodeLog
from trainguard.policy import Policy
from trainguard.replay.cli import render
from trainguard.replay.timeline import replay_logs
from trainguard.report import render_report

HEALTH = Path(__file__).resolve().parents[1] / "fixtures" / "health"


def run_with_findings(tmp_path: Path, monkeypatch) -> Path:
    run = write_run(tmp_path / "run", steps=60, ranks=1, gpus=2, spike_at=None, malformed=0)
    monkeypatch.setattr(collector_module, "time", types.SimpleNamespace(time=lambda: T0 + 20.0))
    diag, ras = tmp_path / "diag.json", tmp_path / "ras.txt"
    shutil.copy(HEALTH / "dcgmi-diag.json", diag)
    shutil.copy(HEALTH / "ncclras-verbose.txt", ras)
    collector = collector_module.HealthReportsCollector(Context(
        procfs=tmp_path, sysfs=tmp_path, devfs=tmp_path, node="host-a", run_dir=run,
        options={"dcgm_diag": str(diag), "nccl_ras": str(ras), "addresses": ["172.16.64.213"]}))
    fragments = {"health_reports": collector.update().tls}
    log = NodeLog(lambda: fragments, run, "host-a")
    log.write_once(T0 + 21.0)
    log.file.close()
    return run


def test_replay_lists_the_node_findings(tmp_path, monkeypatch):
    run = run_with_findings(tmp_path, monkeypatch)
    result = replay_logs([run], Policy())
    assert result.health_total == 12 and len(result.health) == 12
    assert {(f.node, f.tool) for f in result.health} == {("host-a", "dcgmi diag"), ("host-a", "nccl ras")}
    memory = next(f for f in result.health if f.test == "memory")
    assert (memory.status, memory.detail["gpu"], memory.detail["action_class"]) == ("fail", 1, "node_drain")
    text = render(result)
    assert "node health (other tools' findings" in text
    assert "nccl ras    process_dead" in text and "hosts=172.16.64.213 this_node=True" in text
    document = result.to_json()["node_health"]
    assert document["total"] == 12 and document["findings"][0]["node"] == "host-a"


def test_report_shows_the_node_findings_in_the_gpu_section(tmp_path, monkeypatch):
    html = render_report(run_with_findings(tmp_path, monkeypatch))
    gpus = html[html.index('<section id="gpus">'):]
    gpus = gpus[:gpus.index("</section>")]
    assert "Node health findings" in gpus
    assert "dcgmi diag memory" in gpus and "nccl ras ranks_missing" in gpus and "host-a" in gpus


def test_a_run_without_findings_says_nothing_of_them(tmp_path):
    run = write_run(tmp_path / "run", steps=20, ranks=1, gpus=1, spike_at=None, malformed=0)
    result = replay_logs([run], Policy())
    assert result.health == [] and "node health" not in render(result)
    assert "Node health findings" not in render_report(run)


def test_replay_drains_on_a_recorded_isolate_verdict_as_the_live_rule_would(tmp_path):
    """The node log's joined records carry the collector's counts (system.health_*): replay's node-risk pass
    reads them through the same rule, so a dcgmi diag ISOLATE verdict is a drain in replay too."""
    from trainguard import tls
    from trainguard.decide.node_risk import DRAIN_AT_CHECKPOINT

    log = tmp_path / "node-gpu-node-3.jsonl"
    with open(log, "wb") as out:
        for i in range(8):
            counts = {"health_diag_isolate": int(i >= 3), "health_diag_failures": 0, "health_ras_not_responding": 0}
            out.write(tls.encode({"schema": "tls/1", "timestamp": tls.format_timestamp(T0 + 60.0 * i),
                                  "node": "gpu-node-3", "system": counts}))
    drains = [a for a in replay_logs([log], Policy()).actions if a.action == DRAIN_AT_CHECKPOINT]
    assert [(a.timestamp, a.detail["signals"]) for a in drains] == [(T0 + 300.0, {"diag_isolate": 1.0})]
