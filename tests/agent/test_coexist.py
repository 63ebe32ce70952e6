"""Beside dcgm-exporter and node_exporter the agent exports none of their series a second time
(agent/coexist.py), and trainguard's dashboards and rules read the peers' series instead."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from tests.dashboards.promql import substitute
from tests.servers import http_get, prometheus_query, require_binary, start_node_exporter, start_prometheus, wait_for
from trainguard.agent import app as agent_app
from trainguard.agent.coexist import Coexistence, Peer
from trainguard.agent.collector import Collector, Context, Sample
from trainguard.agent.config import AgentConfig, ConfigError, from_mapping
from trainguard.agent.runner import Agent
from trainguard.alerts import rules
from trainguard.dashboards import build
from trainguard.metrics.families import Spec

NAMES = Path("/work/shared/real-logs/names")
GPU_TEMP = Spec("gauge", "DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", ["gpu", "UUID", "modelName", "Hostname"])
FB_TOTAL = Spec("gauge", "DCGM_FI_DEV_FB_TOTAL", "Framebuffer memory total (in MiB).", ["gpu"])
OWN = Spec("gauge", "trainguard_gpu_lost", "1 when the GPU fell off.", ["gpu"])


class FakeGPU(Collector):
    """Stands for the gpu collector: two DCGM families (one dcgm-exporter's default counters lack) and one
    of trainguard's own."""

    name = "fakegpu"

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def update(self) -> Sample:
        return Sample([GPU_TEMP.family([(GPU_TEMP.labels("0", "GPU-a", "H100", "n1"), 60)]),
                       FB_TOTAL.family([(FB_TOTAL.labels("0"), 81559)]), OWN.family([(OWN.labels("0"), 0)])], {})


def dcgm_default_names() -> frozenset[str]:
    csv = NAMES / "dcgm-exporter_default-counters.csv"
    if not csv.exists():
        pytest.skip(f"{csv} is absent (the real-logs folder is not on this machine)")
    return frozenset(line.split(",")[0].strip() for line in csv.read_text().splitlines()
                     if line.strip() and not line.startswith("#"))


def exported(agent: Agent) -> set[str]:
    deadline = time.time() + 30
    while time.time() < deadline:
        names = {family.name for family in agent.families()}
        if "DCGM_FI_DEV_GPU_TEMP" in names or "trainguard_gpu_lost" in names:
            return names
        time.sleep(0.05)
    raise AssertionError("the collector never updated")


def run_agent(coexist: Coexistence) -> set[str]:
    agent = Agent(replace(AgentConfig(), only=("fakegpu",)), registry={"fakegpu": FakeGPU}, coexist=coexist)
    agent.start()
    try:
        return exported(agent)
    finally:
        agent.stop()


def test_auto_leaves_out_exactly_what_a_dcgm_exporter_serves_and_keeps_the_rest():
    dcgm = dcgm_default_names()          # dcgm-exporter's stock counters: GPU_TEMP yes, FB_TOTAL no
    coexist = Coexistence("auto", (Peer("dcgm-exporter", "DCGM_", "x:1"),),
                          probe=lambda address, prefix: dcgm)
    coexist.refresh()
    names = run_agent(coexist)
    assert "DCGM_FI_DEV_GPU_TEMP" not in names and "DCGM_FI_DEV_FB_TOTAL" in names and "trainguard_gpu_lost" in names
    assert coexist.status()["peers"]["dcgm-exporter"]["present"] is True


def test_a_peer_that_stops_answering_gets_its_families_back():
    answers = [frozenset({"DCGM_FI_DEV_GPU_TEMP"}), None]
    coexist = Coexistence("auto", (Peer("dcgm-exporter", "DCGM_", "x:1"),), probe=lambda a, p: answers.pop(0))
    coexist.refresh(now=0)
    assert coexist.left_out("DCGM_FI_DEV_GPU_TEMP")
    coexist.refresh(now=1)                  # not due yet: no probe
    assert coexist.left_out("DCGM_FI_DEV_GPU_TEMP")
    coexist.refresh(now=1000)
    assert not coexist.left_out("DCGM_FI_DEV_GPU_TEMP")


def test_on_leaves_out_every_dcgm_and_node_family_off_none():
    assert run_agent(Coexistence("on")) >= {"trainguard_gpu_lost"}
    assert not run_agent(Coexistence("on")) & {"DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_FB_TOTAL"}
    assert {"DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_FB_TOTAL"} <= run_agent(Coexistence("off"))


def test_the_config_takes_a_mode_or_a_mapping_with_addresses():
    assert from_mapping({"coexist": "on"}).coexist == "on"
    assert from_mapping(yaml.safe_load("coexist: on")).coexist == "on"       # YAML 1.1 reads a boolean
    config = from_mapping({"coexist": {"mode": "auto", "node_exporter": "10.0.0.5:9100"}})
    assert config.coexist == "auto" and config.coexist_addresses == {"node_exporter": "10.0.0.5:9100"}
    for bad, key in (("sometimes", "coexist"), ({"mode": "auto", "dcgm": "x:1"}, "coexist.dcgm"),
                     ({"node_exporter": "nohost"}, "coexist.node_exporter")):
        with pytest.raises(ConfigError, match=key):
            from_mapping({"coexist": bad})


def names_of(url: str, job: str) -> set[str]:
    """The names of the peers' families (node_*, DCGM_*) Prometheus holds for `job`: each process's own
    process_* and go_* series, and Prometheus' up and scrape_*, are per target by nature."""
    return {r["metric"]["__name__"] for r in prometheus_query(url, f'count by (__name__) ({{job="{job}"}})')
            if r["metric"]["__name__"].startswith(("node_", "DCGM_"))}


def test_beside_a_real_node_exporter_prometheus_holds_no_series_twice(tmp_path):
    """The agent (host and io collectors: node_cpu_*, node_load*, node_disk_* ...) with `coexist: auto`
    beside a real node_exporter, both scraped by a real Prometheus: no metric name in both jobs, and the
    dashboards' node panels and the disk rule read node_exporter's series."""
    require_binary("prometheus")
    node_exporter = start_node_exporter(tmp_path)
    node_address = node_exporter.split("://", 1)[1]
    config = replace(AgentConfig(), listen="127.0.0.1:0", only=("host", "io"), interval=1.0,
                     coexist="auto", coexist_addresses={"node_exporter": node_address})
    built = agent_app.build(config)
    built.agent.start()
    built.server.start()
    agent_address = "%s:%d" % built.server.address
    try:
        wait_for(lambda: "trainguard_host_memory_available_bytes" in {f.name for f in built.agent.families()},
                 timeout=30, message="the host collector's first update")
        own = {family.name for family in built.agent.families()}
        coexist, built.agent.coexist = built.agent.coexist, Coexistence("off")
        alone = {family.name for family in built.agent.families()}       # what it would export with no peer
        built.agent.coexist = coexist
        _, _, body = http_get(f"{node_exporter}/metrics")
        theirs = {line.split()[2] for line in body.decode().splitlines() if line.startswith("# TYPE ")}
        assert alone & theirs, "the test cannot fail: the agent alone exports none of node_exporter's names"
        rules_dir = tmp_path / "rules"
        rules.write(rules_dir)
        with start_prometheus(tmp_path, {"trainguard": [agent_address], "node": [node_address]},
                              rule_files=sorted(rules_dir.glob("*.rules.yml"))) as url:
            wait_for(lambda: prometheus_query(url, 'trainguard_agent_info{job="trainguard"}')
                     and "node_load1" in names_of(url, "node"), timeout=60, message="both jobs scraped")
            both = names_of(url, "trainguard") & names_of(url, "node")
            assert both == set(), f"exported twice: {sorted(both)[:10]}"
            assert not own & theirs and {f"{name}_total" for name in own} & theirs == set()
            # the dashboards' node panels join node_exporter's series to the agent's host
            values = {"job": "trainguard", "hostname": ".*", "run_id": ".*", "gpu": ".*"}
            load = substitute(build.node("node_load1"), values)
            assert {r["metric"]["job"] for r in prometheus_query(url, load)} == {"node"}
            # the disk rule's recording rule computes from node_exporter's disk counters
            wait_for(lambda: prometheus_query(url, "instance_device:node_disk_await:seconds") or
                     prometheus_query(url, 'count(node_disk_reads_completed_total{job="node"}) == 0'),
                     timeout=60, message="the disk await record (or no disk at all)")
        assert yaml.safe_load(yaml.safe_dump(built.agent.health()["coexist"]))["peers"]["node_exporter"]["present"]
    finally:
        built.server.stop()
        built.agent.stop()
