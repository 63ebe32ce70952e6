"""Health findings on the node's timeline (agent/health_timeline.py, agent/collectors/health_reports.py,
agent/nodelog.py): new ones only, once each across agent restarts, bounded, labelled with the host they name,
and a stranger's files (cut off, garbled, huge, a FIFO, another node's) refused in one line naming them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.agent.exposition import render
from trainguard import event_types, rundir
from trainguard.agent import health_timeline
from trainguard.agent.collector import Context
from trainguard.agent.collectors import health_reports as collector_module
from trainguard.agent.collectors.health_reports import HealthReportsCollector
from trainguard.agent.nodelog import NodeLog

HEALTH = Path(__file__).resolve().parents[1] / "fixtures" / "health"
XID_79 = "NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.\n"
HERE = "172.16.64.213"          # the node the fixtures' unresponsive ranks are on


def setup(tmp_path: Path, **options) -> HealthReportsCollector:
    return HealthReportsCollector(Context(procfs=tmp_path / "proc", sysfs=tmp_path, devfs=tmp_path, node="gpu-node-3",
                                          run_dir=tmp_path / "run", options={"addresses": [HERE], **options}))


def files(tmp_path: Path) -> dict[str, Path]:
    paths = {"dcgm_diag": tmp_path / "diag.json", "nccl_ras": tmp_path / "ras.txt", "kernel_log": tmp_path / "kern.log"}
    shutil.copy(HEALTH / "dcgmi-diag.json", paths["dcgm_diag"])
    shutil.copy(HEALTH / "ncclras-verbose.txt", paths["nccl_ras"])
    shutil.copy(HEALTH / "kern.log", paths["kernel_log"])
    return paths


def events(sample) -> list[dict]:
    return [record["event"] for record in sample.tls["events"]]


def test_new_findings_become_events_once_and_survive_a_restart(tmp_path):
    paths = files(tmp_path)
    first = setup(tmp_path, **{k: str(v) for k, v in paths.items()})
    sample = first.update()
    found = events(sample)
    # the kernel log's lines before the agent's first look are history; the diag and the RAS report are news
    assert {e["tool"] for e in found} == {"dcgmi diag", "nccl ras"}
    assert [e["test"] for e in found if e["tool"] == "dcgmi diag"] == ["pcie", "memory", "summary"]
    assert all(isinstance(e["id"], str) and len(e["id"]) == 16 for e in found)
    assert sample.tls["system"] == {"health_diag_isolate": 1, "health_diag_failures": 0,
                                    "health_ras_not_responding": 5}
    assert events(first.update()) == found                      # the same records: nothing new was added
    with open(paths["kernel_log"], "a") as log:
        log.write("Dec  3 10:00:01 gpu-node-3 kernel: " + XID_79)
    added = events(first.update())[len(found):]
    assert [(e["tool"], e["test"], e["xid"], e["host"]) for e in added] == [("kernel log", "xid", 79, "gpu-node-3")]
    assert added[0]["offset"] == paths["kernel_log"].stat().st_size - len("Dec  3 10:00:01 gpu-node-3 kernel: "
                                                                               + XID_79)
    restarted = setup(tmp_path, **{k: str(v) for k, v in paths.items()})
    sample = restarted.update()
    assert events(sample) == []                                  # nothing put on the timeline twice
    assert sample.tls["system"]["health_ras_not_responding"] == 5   # the counts the rule reads did not reset
    with open(paths["kernel_log"], "a") as log:
        log.write(XID_79)
    assert [e["test"] for e in events(restarted.update())] == ["xid"]
    state = json.loads(rundir.health_state_path(tmp_path / "run", "gpu-node-3").read_text())
    assert state["offsets"]["kernel_log"]["offset"] == paths["kernel_log"].stat().st_size


def test_a_rewritten_ras_report_adds_only_its_new_findings(tmp_path):
    ras = tmp_path / "ras.txt"
    text = (HEALTH / "ncclras-verbose.txt").read_text()
    ras.write_text(text)
    c = setup(tmp_path, nccl_ras=str(ras))
    before = len(events(c.update()))
    ras.write_text(text.replace("Communicators... (2.051s)", "Communicators... (2.274s)"))  # the next minute's
    assert len(events(c.update())) == before                     # same findings, same summary: nothing new
    ras.write_text(text.replace("3487984", "3487999"))           # another process stopped answering
    new = events(c.update())[before:]
    assert [e["test"] for e in new] == ["process_missing", "ranks_missing", "ranks_missing"]
    assert c.update().tls["system"]["health_ras_not_responding"] == 8


def test_the_node_log_writes_each_event_once_beside_the_joined_record(tmp_path):
    paths = files(tmp_path)
    c = setup(tmp_path, dcgm_diag=str(paths["dcgm_diag"]))
    fragments = {"health_reports": c.update().tls}
    log = NodeLog(lambda: fragments, tmp_path / "run", "gpu-node-3")
    assert log.write_once(1000.0) and log.write_once(1010.0)
    log.file.close()
    records = [json.loads(line) for line in rundir.node_log(tmp_path / "run", "gpu-node-3").read_text().splitlines()]
    health = [r for r in records if (r.get("event") or {}).get("type") == event_types.HEALTH_CHECK]
    assert [r["event"]["test"] for r in health] == ["pcie", "memory", "summary"]
    joined = [r for r in records if "event" not in r]
    assert len(joined) == 2 and joined[0]["system"]["health_diag_isolate"] == 1 and "events" not in joined[0]


def test_an_xid_storm_is_bounded_per_update(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("")
    c = setup(tmp_path, kernel_log=str(log))
    c.update()
    log.write_text(XID_79 * 200)
    found = events(c.update())
    assert len(found) == health_timeline.MAX_EVENTS_PER_UPDATE + 1
    assert found[-1]["test"] == "more_findings" and found[-1]["count"] == 200 - health_timeline.MAX_EVENTS_PER_UPDATE
    for _ in range(5):
        log.write_text(log.read_text() + XID_79 * 100)
        c.update()
    assert len(c.update().tls["events"]) <= health_timeline.EVENTS_KEPT


def test_another_nodes_lines_keep_their_host_and_count_for_nothing_here(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("")
    c = setup(tmp_path, kernel_log=str(log))
    c.update()
    log.write_text("Dec  3 10:00:01 gpu-node-9 kernel: " + XID_79 + "Dec  3 10:00:02 gpu-node-3 kernel: " + XID_79)
    sample = c.update()
    other, mine = sample.tls["events"]
    assert other["node"] == "gpu-node-3" and (other["event"]["host"], other["event"]["this_node"]) == \
        ("gpu-node-9", False)
    assert mine["node"] == "gpu-node-3" and mine["event"]["host"] == "gpu-node-3" and "this_node" not in mine["event"]
    assert 'trainguard_health_kernel_xid_total{xid="79",xid_class="node_drain"} 1.0' in render(sample.families)


def test_a_ras_report_about_other_nodes_is_labelled_and_not_counted(tmp_path):
    ras = tmp_path / "ras.txt"
    shutil.copy(HEALTH / "ncclras-verbose.txt", ras)
    c = HealthReportsCollector(Context(procfs=tmp_path, sysfs=tmp_path, devfs=tmp_path, node="gpu-node-1",
                                       run_dir=tmp_path / "run", options={"nccl_ras": str(ras),
                                                                          "addresses": ["172.16.64.210"]}))
    sample = c.update()
    missing = [e for e in events(sample) if e["test"] == "ranks_missing"]
    assert missing and all(e["this_node"] is False for e in missing)
    assert sample.tls["system"]["health_ras_not_responding"] == 0


def test_this_nodes_addresses_come_from_procfs(tmp_path):
    net = tmp_path / "net"
    net.mkdir()
    (net / "fib_trie").write_text("Local:\n  +-- 0.0.0.0/0 3 0 5\n     |-- 172.16.64.213\n        /32 host LOCAL\n"
                                  "     |-- 172.16.64.255\n        /32 link BROADCAST\n")
    (net / "if_inet6").write_text("fe800000000000000000000000000001 02 40 20 80     ib0\n")
    assert health_timeline.local_addresses(tmp_path) == {"172.16.64.213", "fe80::1"}
    node = health_timeline.ThisNode("gpu-node-3.cluster", health_timeline.local_addresses(tmp_path))
    assert [node.owns(h) for h in ("172.16.64.213", "GPU-NODE-3", "172.16.64.212", "gpu-node-30", None)] == \
        [True, True, False, False, True]


@pytest.mark.parametrize("option, content, message", [
    ("nccl_ras", b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)), "binary"),
    ("nccl_ras", b"Connection refused\n", "not `ncclras` output"),
    ("nccl_ras", b'{"nccl_version": "2.29.1", "communicators": [{"hash": "0x1", "ra', "JSON"),
    ("dcgm_diag", (HEALTH / "dcgmi-diag.json").read_bytes()[:400], "not JSON"),
    ("dcgm_diag", b"[" * 100_000 + b"]" * 100_000, "nested too deeply")])
def test_a_cut_off_or_garbled_report_fails_in_one_line_and_puts_nothing_on_the_timeline(tmp_path, option, content,
                                                                                        message):
    report = tmp_path / "report"
    report.write_bytes(content)
    written_a_minute_ago(report)
    c = setup(tmp_path, **{option: str(report)})
    with pytest.raises(ValueError) as failed:
        c.update()
    text = str(failed.value)
    assert str(report) in text and message in text and "\n" not in text
    state = rundir.health_state_path(tmp_path / "run", "gpu-node-3")
    assert not state.exists() or json.loads(state.read_text())["seen"] == []


def written_a_minute_ago(path: Path) -> None:
    """Past the collector's WRITING_SECONDS: a bad file is an error, not one still being written."""
    old = path.stat().st_mtime - 60
    os.utime(path, (old, old))


def test_a_report_still_being_written_is_read_again_not_refused(tmp_path):
    """`ncclras > file` writes the job summary first and the communicators seconds later."""
    ras = tmp_path / "ras.txt"
    text = (HEALTH / "ncclras-verbose.txt").read_text()
    ras.write_text(text[:text.index("\nCommunicators...")])
    c = setup(tmp_path, nccl_ras=str(ras))
    sample = c.update()                                          # no error, nothing on the timeline yet
    assert events(sample) == [] and "trainguard_health_nccl_ras" not in render(sample.families)
    ras.write_text(text)
    found = events(c.update())
    assert found[-1]["test"] == "summary" and "complete" not in found[-1]
    cut = tmp_path / "cut.txt"                                   # cut off for good: put on the timeline as such
    cut.write_text(text[:text.index("Warnings\n====")])
    written_a_minute_ago(cut)
    (summary,) = [e for e in events(setup(tmp_path / "other", nccl_ras=str(cut)).update()) if e["test"] == "summary"]
    assert summary["complete"] is False and summary["status"] == "fail"


def test_a_huge_report_is_refused_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(collector_module, "RAS_BYTES", 4096)
    ras = tmp_path / "ras.txt"
    ras.write_text((HEALTH / "ncclras-verbose.txt").read_text() * 10)
    with pytest.raises(OSError, match=str(ras)):
        setup(tmp_path, nccl_ras=str(ras)).update()


@pytest.mark.parametrize("option", ["nccl_ras", "dcgm_diag", "kernel_log"])
def test_a_fifo_in_place_of_a_report_is_refused_without_blocking(tmp_path, option):
    fifo = tmp_path / "report"
    os.mkfifo(fifo)                  # nobody writes it: an open that waited for a writer would hang the update
    with pytest.raises(OSError, match=str(fifo)):
        setup(tmp_path, **{option: str(fifo)}).update()


def test_a_lost_state_file_starts_again_without_failing(tmp_path):
    paths = files(tmp_path)
    state = rundir.health_state_path(tmp_path / "run", "gpu-node-3")
    state.parent.mkdir(parents=True)
    state.write_text("{garbled")
    c = setup(tmp_path, dcgm_diag=str(paths["dcgm_diag"]))
    assert c.state.load_error and str(state) in c.state.load_error
    assert [e["test"] for e in events(c.update())] == ["pcie", "memory", "summary"]
    assert json.loads(state.read_text())["counts"]["health_diag_isolate"] == 1


def test_through_a_running_agent_the_findings_reach_the_node_log_once(tmp_path):
    """The collector in its runner thread, the node log reading the agent's fragments: what an operator runs."""
    from tests.servers import agent_server, wait_for
    from trainguard import tls
    from trainguard.agent.config import CollectorConfig

    paths = files(tmp_path)
    run_dir = tmp_path / "run"
    settings = CollectorConfig(enabled=True, interval=0.1, options={
        "dcgm_diag": str(paths["dcgm_diag"]), "nccl_ras": str(paths["nccl_ras"]), "addresses": [HERE]})
    with agent_server(run_dir=run_dir, procfs=tmp_path, node="gpu-node-3", only=("health_reports",),
                      collectors={"health_reports": settings}) as (agent, _):
        log = NodeLog(agent.tls_fragments, run_dir, "gpu-node-3", interval=0.1).start()
        path = rundir.node_log(run_dir, "gpu-node-3")
        try:
            wait_for(lambda: path.exists() and path.read_text().count('"health_ras_not_responding":5') >= 3, 30,
                     message="joined records with the counts, after the findings")
        finally:
            log.stop()
    records = list(tls.read_records(path))
    findings = [r["event"] for r in records if (r.get("event") or {}).get("type") == event_types.HEALTH_CHECK]
    assert len(findings) == 12 and len({e["id"] for e in findings}) == 12       # each once, however many writes


def test_a_ras_monitor_log_is_followed_and_its_lines_about_this_node_counted(tmp_path):
    monitor = tmp_path / "ras-monitor.log"
    lines = (HEALTH / "ncclras-monitor.log").read_text().splitlines(keepends=True)
    monitor.write_text("".join(lines[:8]))                       # the header and banner: history
    c = HealthReportsCollector(Context(procfs=tmp_path, sysfs=tmp_path, devfs=tmp_path, node="gpu-node-6",
                                       run_dir=tmp_path / "run", options={"nccl_ras_monitor": str(monitor),
                                                                          "addresses": ["172.16.64.246"]}))
    assert events(c.update()) == []
    monitor.write_text("".join(lines))
    sample = c.update()
    found = events(sample)
    assert [(e["test"], e["this_node"]) for e in found] == [("peer_dead", False), ("peer_unresponsive", True),
                                                           ("peer_send_stuck", True), ("peer_timeout_dead", True)]
    assert sample.tls["system"]["health_ras_not_responding"] == 2      # unresponsive and dead: this node's
    assert events(HealthReportsCollector(c.ctx).update()) == []        # restarted: nothing twice
