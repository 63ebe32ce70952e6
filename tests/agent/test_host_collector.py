"""The host collector on the fixture procfs tree and the live one, checked against the real node_exporter
(its golden exposition is test_golden.py's); trainer processes found through control/ranks; the software
versions in trainguard_node_info."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import http_get, start_node_exporter
from trainguard.agent.collector import Context
from trainguard.agent.collectors.host import HostCollector
from trainguard.runtime.control import write_rank_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def values_of(families) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def fixture_sample(**ctx):
    return HostCollector(Context(procfs=FIXTURES / "proc", sysfs=FIXTURES / "sys", node="node-a", **ctx)).update()


def test_fixture_values():
    values = values_of(fixture_sample().families)
    assert values[("node_load1", ())] == 12.34 and values[("node_load15", ())] == 8.78
    assert values[("node_cpu_seconds_total", (("cpu", "2"), ("mode", "user")))] == 1180481 / os.sysconf("SC_CLK_TCK")
    assert values[("trainguard_host_memory_total_bytes", ())] == 1056612680 * 1024
    assert values[("trainguard_host_memory_hugepages", ())] == 1024
    assert values[("node_procs_blocked", ())] == 1


def test_cpu_percent_from_two_updates(tmp_path):
    proc = tmp_path / "proc"
    proc.mkdir()
    for name in ("meminfo", "loadavg"):
        (proc / name).write_bytes((FIXTURES / "proc" / name).read_bytes())
    (proc / "stat").write_text("cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 100 0 100 800 0 0 0 0 0 0\n")
    collector = HostCollector(Context(procfs=proc))
    assert "hardware" not in collector.update().tls
    (proc / "stat").write_text("cpu  175 0 100 825 0 0 0 0 0 0\ncpu0 175 0 100 825 0 0 0 0 0 0\n")
    assert collector.update().tls["hardware"] == {"cpu_percent": 75.0}


def node_exporter_values(tmp_path, procfs: Path) -> dict[tuple, float]:
    server = start_node_exporter(tmp_path, [f"--path.procfs={procfs}", "--collector.disable-defaults",
                                            "--collector.cpu", "--collector.meminfo", "--collector.loadavg",
                                            "--collector.stat"])
    with server:
        status, _, body = http_get(server + "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(body.decode()) for s in f.samples}


def compare_with_node_exporter(ours: dict, theirs: dict, tolerance: float) -> None:
    shared = [key for key in ours if key[0].startswith(("node_cpu_seconds", "node_cpu_guest", "node_load",
                                                        "node_procs", "node_boot", "node_context", "node_forks"))]
    assert len(shared) > 10
    for key in shared:
        assert theirs[key] == pytest.approx(ours[key], rel=tolerance, abs=tolerance * 10), key
    # Memory names differ (node_exporter's camelCase fails promtool): compare the fields that map.
    for field, ours_name in (("MemTotal_bytes", "total_bytes"), ("SwapTotal_bytes", "swap_total_bytes"),
                             ("HugePages_Total", "hugepages"), ("Hugepagesize_bytes", "hugepage_size_bytes")):
        assert theirs[(f"node_memory_{field}", ())] == ours[(f"trainguard_host_memory_{ours_name}", ())], field


@pytest.mark.servers
def test_matches_node_exporter_on_the_fixture_tree(tmp_path):
    compare_with_node_exporter(values_of(fixture_sample().families),
                               node_exporter_values(tmp_path, FIXTURES / "proc"), tolerance=0)


@pytest.mark.servers
def test_matches_node_exporter_on_the_live_machine(tmp_path):
    ours = values_of(HostCollector(Context()).update().families)
    theirs = node_exporter_values(tmp_path, Path("/proc"))
    # Read a moment apart on a live machine: counters and load move a little.
    live = {k: v for k, v in ours.items() if not k[0].startswith(("node_procs", "node_context", "node_forks",
                                                                  "node_load"))}
    compare_with_node_exporter(live, theirs, tolerance=0.05)


def test_trainer_processes_from_control_ranks(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(32 << 20); time.sleep(60)"])
    try:
        time.sleep(0.5)
        write_rank_file(tmp_path, 0, pid=child.pid)
        write_rank_file(tmp_path, 1, pid=child.pid, host="some-other-node")   # another node's rank: not ours
        collector = HostCollector(Context(run_dir=tmp_path))
        values = values_of(collector.update().families)
        assert values[("trainguard_rank_process_up", (("rank", "0"),))] == 1
        assert ("trainguard_rank_process_up", (("rank", "1"),)) not in values
        assert values[("trainguard_rank_resident_memory_bytes", (("rank", "0"),))] > 32 << 20
        assert values[("trainguard_rank_threads", (("rank", "0"),))] >= 1
        assert ("trainguard_rank_cpu_seconds_total", (("mode", "user"), ("rank", "0"))) in values
        child.kill()
        child.wait()
        values = values_of(collector.update().families)
        assert values[("trainguard_rank_process_up", (("rank", "0"),))] == 0
        restarted = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:   # the elastic launcher starts the rank again: a new pid in its rank file
            write_rank_file(tmp_path, 0, pid=restarted.pid)
            values = values_of(collector.update().families)
            assert values[("trainguard_rank_process_up", (("rank", "0"),))] == 1
        finally:
            restarted.kill()
            restarted.wait()
    finally:
        child.kill()
        child.wait()


def test_node_info_versions_without_importing_torch():
    code = ("import sys; from trainguard.agent.collector import Context;"
            "from trainguard.agent.collectors.host import HostCollector;"
            "s = HostCollector(Context()).update(); "
            "info = [x for f in s.families if f.name == 'trainguard_node' for x in f.samples][0];"
            "import json; print(json.dumps(info.labels)); print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    labels_line, imported = result.stdout.strip().splitlines()[-2:]
    labels = json.loads(labels_line)
    import torch

    assert labels["torch"] == torch.__version__
    assert labels["cuda"] == (torch.version.cuda or "")
    assert labels["python"] == ".".join(map(str, sys.version_info[:3]))
    assert imported == "False"


def test_driver_version_from_sysfs_or_procfs(tmp_path):
    from trainguard.agent.versions import driver_version

    proc = tmp_path / "proc" / "driver" / "nvidia"
    proc.mkdir(parents=True)
    (proc / "version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 "
                                  "01:15:15 UTC 2023\nGCC version:  gcc version 12.2.0\n")
    assert driver_version(Context(procfs=tmp_path / "proc", sysfs=tmp_path / "sys")) == "535.104.05"
    module = tmp_path / "sys" / "module" / "nvidia"
    module.mkdir(parents=True)
    (module / "version").write_text("550.54.15\n")
    assert driver_version(Context(procfs=tmp_path / "proc", sysfs=tmp_path / "sys")) == "550.54.15"
    assert driver_version(Context(procfs=tmp_path / "none", sysfs=tmp_path / "none")) == ""
