"""The GPU health signals: counters for rates, the DCGM 3.3 name and its alias, PCIe link downgrades, GPM
profiling ratios (Hopper+, absent elsewhere), and the degrading scenario of the fake NVML."""

from __future__ import annotations

import copy
import json

from tests.agent.exposition import series, values
from tests.fakes.fake_nvml import SCENARIOS, FakeNVML
from trainguard.agent.collector import Context
from trainguard.agent.collectors.gpu import GPUCollector

GPU1 = {"UUID": "GPU-5a0f9c3e-2d71-48b6-8e4a-91f6c07d3b25", "device": "nvidia1", "gpu": "1", "Hostname": "node-a",
        "model_name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "00000000:2A:00.0"}


def collector(tmp_path, nvml) -> GPUCollector:
    return GPUCollector(Context(devfs=tmp_path, node="node-a", options={"nvml_module": nvml, "kmsg": False}))


def test_gpm_ratios_from_the_second_update_on(tmp_path):
    nvml = FakeNVML("h100x8")
    gpu = collector(tmp_path, nvml)
    first = values(gpu.update().families)
    assert series("DCGM_FI_PROF_SM_ACTIVE", **GPU1) not in first          # a rate needs two GPM samples
    nvml.advance()
    v = values(gpu.update().families)
    # the scenario's GPM percentages at sample 1, as DCGM's ratios
    assert v[series("DCGM_FI_PROF_GR_ENGINE_ACTIVE", **GPU1)] == 0.981
    assert v[series("DCGM_FI_PROF_SM_ACTIVE", **GPU1)] == 0.907
    assert v[series("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", **GPU1)] == 0.461
    assert v[series("DCGM_FI_PROF_DRAM_ACTIVE", **GPU1)] == 0.384


def test_gpm_absent_where_the_gpu_has_none(tmp_path):
    spec = json.loads((SCENARIOS / "h100x8.json").read_text())
    for device in spec["devices"]:        # an A100: NVML says GPM is not supported
        device["static"]["nvmlGpmQueryDeviceSupport"] = {"error": "NVML_ERROR_NOT_SUPPORTED"}
    nvml = FakeNVML(spec)
    gpu = collector(tmp_path, nvml)
    gpu.update()
    nvml.advance()
    v = values(gpu.update().families)
    assert not [name for name, _ in v if name.startswith("DCGM_FI_PROF_")]
    assert nvml.calls["nvmlGpmQueryDeviceSupport"] == 8          # asked once per GPU, not again
    assert nvml.calls["nvmlGpmSampleGet"] == 0


def test_old_throttle_name_is_an_alias_of_the_new(tmp_path):
    v = values(collector(tmp_path, FakeNVML("h100x8")).update().families)
    new = {labels: value for (name, labels), value in v.items() if name == "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"}
    old = {labels: value for (name, labels), value in v.items() if name == "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"}
    assert new and new == old


def test_degrading_gpu_counters_rise_and_the_link_downgrade_counts_once(tmp_path):
    nvml = FakeNVML("degrading")
    gpu = collector(tmp_path, nvml)
    seen = []
    for _ in range(10):
        v = values(gpu.update().families)
        seen.append((v[series("trainguard_gpu_ecc_correctable_errors_total", **GPU1)],
                     v[series("trainguard_gpu_remapped_rows_total", **GPU1)],
                     v[series("trainguard_gpu_pcie_link_downgrades_total", **GPU1)]))
        nvml.advance()
    assert [s[0] for s in seen] == [0, 0, 3, 9, 20, 41, 77, 130, 214, 340]
    assert [s[1] for s in seen] == [0, 0, 0, 1, 1, 2, 3, 4, 6, 8]
    assert [s[2] for s in seen] == [0] * 8 + [1, 1]                  # x8 from sample 8, counted once
    v = values(gpu.update().families)                                # sample 10: fallen off the bus
    assert v[series("trainguard_gpu_lost", **GPU1)] == 1
    assert v[series("trainguard_gpu_xid_errors_total", **GPU1, xid="79", xid_class="node_drain")] == 1
    assert v[series("trainguard_gpu_xid_errors_total", **GPU1, xid="63", xid_class="gpu_reset")] == 2


def test_health_readings_in_the_tls_fragment(tmp_path):
    nvml = FakeNVML("degrading")
    gpu = collector(tmp_path, nvml)
    nvml.advance(4)
    gpu.update()
    nvml.advance()
    entry = gpu.update().tls["hardware"]["gpus"][1]
    assert entry["ecc_sbe_volatile"] == 41 and entry["remapped_rows"] == 2 and entry["remap_pending"] == 1
    assert entry["pcie_downgrades"] == 0 and entry["power_violation_ns"] == 190300000000


def test_link_back_to_full_width_then_narrow_again_counts_twice(tmp_path):
    spec = copy.deepcopy(json.loads((SCENARIOS / "h100x8.json").read_text()))
    spec["devices"] = spec["devices"][:1]
    samples = spec["devices"][0]["samples"]
    for k, width in enumerate((16, 8, 16)):
        samples[k]["nvmlDeviceGetCurrPcieLinkWidth"] = width
    samples.append({"nvmlDeviceGetCurrPcieLinkWidth": 4})
    nvml = FakeNVML(spec)
    gpu = collector(tmp_path, nvml)
    counts = []
    for _ in range(4):
        counts.append(gpu.update().tls["hardware"]["gpus"][0]["pcie_downgrades"])
        nvml.advance()
    assert counts == [0, 1, 1, 2]
