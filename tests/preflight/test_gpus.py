"""GPU health through the agent's GPU collector, driven by the recorded fake NVML (the one allowed fake)."""

from __future__ import annotations

import json

from tests.fakes.fake_nvml import SCENARIOS, FakeNVML
from trainguard.policy import Policy
from trainguard.preflight import run_preflight
from trainguard.preflight.gpus import check_gpus

SETTINGS = Policy().preflight


def scenario(name: str) -> dict:
    return json.loads((SCENARIOS / f"{name}.json").read_text())


def idle(spec: dict) -> dict:
    """The recorded node as it looks before a run: no process, no load, cool."""
    for device in spec["devices"]:
        for sample in device["samples"]:
            sample.update({"nvmlDeviceGetUtilizationRates": {"gpu": 0, "memory": 0},
                           "nvmlDeviceGetComputeRunningProcesses": [], "nvmlDeviceGetTemperature(0)": 34,
                           "nvmlDeviceGetCurrentClocksEventReasons": 1})    # GpuIdle only
    return spec


def test_no_nvml_is_a_skip_not_a_failure():
    result, identity = check_gpus(SETTINGS, FakeNVML("no_gpu"))
    assert result.status == "skip" and result.message.startswith("skipped: no NVML")
    assert identity == {}


def test_idle_healthy_gpus_pass_and_identify_the_node():
    result, identity = check_gpus(SETTINGS, FakeNVML(idle(scenario("h100x8"))))
    assert result.status == "pass", result.message
    assert identity == {"name": "NVIDIA H100 80GB HBM3", "count": 8}
    assert result.details["nvml_count"] == 8 and len(result.details["gpus"]) == 8


def test_gpus_already_in_use_fail():
    result, _ = check_gpus(SETTINGS, FakeNVML(scenario("h100x8")))    # recorded during training
    assert result.status == "fail"
    assert "GPU 0: 2 process(es) already on it (pids 4242, 9137, 71.0 GiB)" in result.message


def test_each_unhealthy_gpu_is_named_with_its_reason():
    spec = idle(scenario("h100x8"))
    spec["devices"][2]["samples"][0]["nvmlDeviceGetRemappedRows"] = [0, 3, 1, 0]
    spec["devices"][5]["samples"][0]["nvmlDeviceGetTemperature(0)"] = 72
    spec["devices"][6]["samples"][0]["nvmlDeviceGetCurrentClocksEventReasons"] = 0x8 | 0x40
    spec["devices"][7]["samples"][0]["nvmlDeviceGetFieldValues"]["4:0"] = 2      # ECC DBE volatile
    result, _ = check_gpus(SETTINGS, FakeNVML(spec))
    assert result.status == "fail"
    assert "GPU 2: a row remap pending (reset the GPU) (remap_pending=1)" in result.message
    assert "GPU 5: 72 C while idle (limit 60 C): check cooling" in result.message
    assert "GPU 6: clocks slowed while idle (hw_slowdown, hw_thermal)" in result.message
    assert "GPU 7: uncorrectable (double-bit) ECC errors since boot (ecc_dbe_volatile=2)" in result.message
    assert "GPU 0" not in result.message


def test_a_lost_gpu_fails():
    spec = idle(scenario("h100x8"))
    spec["devices"][1]["samples"][0]["lost"] = True
    result, identity = check_gpus(SETTINGS, FakeNVML(spec))
    assert result.status == "fail" and "GPU 1: lost" in result.message
    assert identity["count"] == 8


def test_the_lock_pins_the_gpu_model_and_count(tmp_path):
    nvml = idle(scenario("h100x8"))
    skip = ("storage", "checkpoint_drill", "collective")
    written = run_preflight(write_lock=tmp_path / "env.lock", nvml_module=FakeNVML(nvml), skip=skip)
    assert written.environment["gpu_name"] == "NVIDIA H100 80GB HBM3" and written.environment["gpu_count"] == "8"
    seven = json.loads(json.dumps(nvml))
    del seven["devices"][7]
    report = run_preflight(expect=tmp_path / "env.lock", nvml_module=FakeNVML(seven), skip=skip)
    environment = next(c for c in report.checks if c.name == "environment")
    assert environment.status == "fail" and "gpu_count: expected '8', found '7'" in environment.message
    assert not report.passed
