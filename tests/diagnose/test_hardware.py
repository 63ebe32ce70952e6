"""Hardware and driver layers, fed the way a run is: the agent's real GPU collector reading NVML (the
recorded fake, tests/fakes/fake_nvml.py) writes the node records, diagnose reads them back."""

from __future__ import annotations

import json

import pytest

from tests.diagnose import records
from tests.fakes.fake_nvml import SCENARIOS, FakeNVML
from trainguard import tls
from trainguard.agent.collector import Context
from trainguard.agent.collectors.gpu import GPUCollector
from trainguard.diagnose import NO_DATA, OK, PROBLEM, diagnose_run
from trainguard.diagnose.hardware import gpu_links, gpu_slowdown
from trainguard.diagnose.loader import RunData, add_node_record
from trainguard.policy import Policy

GiB = 2**30
INTERVAL = 5.0


def scenario(name: str) -> dict:
    return json.loads((SCENARIOS / f"{name}.json").read_text())


def record_agent(run_dir, spec: dict, samples: int, host: str = "node-a") -> None:
    """What the agent's node log holds after `samples` GPU collector updates, INTERVAL seconds apart."""
    nvml = FakeNVML(spec)
    collector = GPUCollector(Context(options={"nvml_module": nvml, "kmsg": False}))
    try:
        with tls.Writer(run_dir / "tls" / f"node-{host}.jsonl") as writer:
            for n in range(samples):
                sample = collector.update()
                writer.write({"timestamp": records.START + n * INTERVAL, "node": host, **sample.tls})
                nvml.advance()
    finally:
        collector.close()


def test_healthy_gpus_are_checked_and_clean(tmp_path):
    records.write_ranks(tmp_path, records.run_of(records.healthy, steps=600))   # ~70 s, as the node samples
    record_agent(tmp_path, scenario("h100x8"), samples=12)
    found = {f.check: f for f in diagnose_run(tmp_path)}
    assert found["gpu_slowdown"].status == OK
    assert found["gpu_errors"].status == OK
    assert found["memory_growth"].status == OK


def test_a_hot_gpu_is_named_first(tmp_path):
    spec = scenario("h100x8")
    for sample in spec["devices"][3]["samples"]:
        sample["nvmlDeviceGetTemperature(0)"] = 91
    records.write_ranks(tmp_path, records.run_of(records.healthy))
    record_agent(tmp_path, spec, samples=12)
    first = diagnose_run(tmp_path)[0]
    assert (first.layer, first.check, first.status) == ("hardware", "gpu_slowdown", PROBLEM)
    assert first.evidence["gpu"] == "node-a GPU 3" and first.evidence["max_temp_c"] == 91


def test_xid_errors_during_the_run_are_reported(tmp_path):
    records.write_ranks(tmp_path, records.run_of(records.healthy))
    record_agent(tmp_path, scenario("xid"), samples=6)
    first = diagnose_run(tmp_path)[0]
    assert (first.check, first.status, first.score) == ("gpu_errors", PROBLEM, 1.0)
    assert first.evidence["events"][0]["gpu"] == "node-a GPU 0" and first.evidence["events"][0]["increase"] == 3


def test_device_memory_growing_under_a_flat_allocator_is_a_driver_leak(tmp_path):
    spec = scenario("h100x8")
    device = spec["devices"][0]
    memory = device["samples"][0]["nvmlDeviceGetMemoryInfo"]
    device["samples"] += [{"nvmlDeviceGetMemoryInfo": {**memory, "used": memory["used"] + k * GiB // 4,
                                                        "free": memory["free"] - k * GiB // 4}} for k in range(1, 13)]
    records.write_ranks(tmp_path, records.run_of(records.healthy, steps=600))   # ~70 s of steps
    record_agent(tmp_path, spec, samples=15)
    leak = {f.check: f for f in diagnose_run(tmp_path)}["memory_growth"]
    assert leak.status == PROBLEM and leak.layer == "driver"
    assert leak.evidence["unexplained_bytes"] == pytest.approx(3 * GiB, rel=0.15)
    assert abs(leak.evidence["allocator_reserved_growth_bytes"]) < GiB / 10


def test_the_collector_does_not_record_link_state_yet(tmp_path):
    """PCIe link generation and width are not in the agent's GPU records: the check says so."""
    records.write_ranks(tmp_path, records.run_of(records.healthy))
    record_agent(tmp_path, scenario("h100x8"), samples=3)
    links = {f.check: f for f in diagnose_run(tmp_path)}["gpu_links"]
    assert links.status == NO_DATA and "PCIe link generation" in links.needs


def test_a_link_trained_down_is_named_from_records():
    run = RunData(run_dir="-")
    for n in range(10):
        gpu = {"gpu": 0, "pcie_link_gen": 4 if n >= 3 else 5, "pcie_link_gen_max": 5,
               "pcie_link_width": 4 if n >= 3 else 16, "pcie_link_width_max": 16}
        add_node_record(run, "node-b", {"timestamp": records.START + n * INTERVAL, "hardware": {"gpus": [gpu]}})
    finding = gpu_links(run, Policy())
    assert finding.status == PROBLEM and finding.evidence["gpu"] == "node-b GPU 0"
    assert finding.evidence["min_ratio"] == pytest.approx(4 * 1.969 / (16 * 3.938), abs=0.01)
    assert finding.score == pytest.approx(0.7)


def test_throttle_reasons_and_low_clocks_are_named_from_records():
    """Fields the GPU collector reads but does not yet put in its node records (see docs/diagnose.md)."""
    run = RunData(run_dir="-")
    for n in range(20):
        braked = 8 <= n < 16
        gpus = [{"gpu": 0, "gpu_util": 99, "gpu_temp_c": 70, "sm_clock_mhz": 1980, "sm_clock_max_mhz": 1980,
                 "throttle_reasons": 0},
                {"gpu": 1, "gpu_util": 99, "gpu_temp_c": 70, "sm_clock_mhz": 1095 if braked else 1980,
                 "sm_clock_max_mhz": 1980, "throttle_reasons": 0x80 if braked else 0}]
        add_node_record(run, "node-c", {"timestamp": records.START + n * INTERVAL, "hardware": {"gpus": gpus}})
    finding = gpu_slowdown(run, Policy())
    assert finding.status == PROBLEM and finding.evidence["gpu"] == "node-c GPU 1"
    assert finding.evidence["reasons"] == ["hw_power_brake", "SM clock under 85% of max while busy"]
    assert finding.score == pytest.approx(8 / 20)
    assert finding.evidence["stretches"][0]["rows"] == 8
