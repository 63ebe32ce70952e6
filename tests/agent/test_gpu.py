"""The gpu collector driven by the fake NVML (tests/fakes/fake_nvml.py) over recorded scenarios: 8 H100s,
no GPU, a GPU lost and recovered; plus the real pynvml on this machine when it has no GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.agent.exposition import render, series, values
from tests.fakes.fake_nvml import FakeNVML
from tests.servers import promtool_check_metrics
from trainguard.agent.collector import CollectorDisabled, Context
from trainguard.agent.collectors.gpu import GPUCollector
from trainguard.agent.config import ConfigError
from trainguard.runtime.control import write_rank_file

H100 = {"UUID": "GPU-1c8e2f0a-6b4d-4f51-9a57-3e0c8d2b7f14", "device": "nvidia0", "gpu": "0",
        "Hostname": "node-a", "model_name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "00000000:18:00.0"}


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def make(tmp_path: Path, nvml, run_dir: Path | None = None, **options) -> GPUCollector:
    devfs = tmp_path / "dev"
    devfs.mkdir(exist_ok=True)
    ctx = Context(devfs=devfs, run_dir=run_dir, node="node-a", options={"nvml_module": nvml, **options})
    collector = GPUCollector(ctx)
    collector.clock = Clock()
    return collector


def gpu_labels(index: int, uuid: str, bus: str) -> dict:
    return {"UUID": uuid, "device": f"nvidia{index}", "gpu": str(index), "Hostname": "node-a",
            "model_name": "NVIDIA H100 80GB HBM3", "pci_bus_id": bus}


def test_eight_h100s_dcgm_names_units_and_labels(tmp_path):
    nvml = FakeNVML("h100x8")
    collector = make(tmp_path, nvml)
    v = values(collector.update().families)
    assert v[series("DCGM_FI_DEV_GPU_UTIL", **H100)] == 100
    assert v[series("DCGM_FI_DEV_MEM_COPY_UTIL", **H100)] == 38
    # memory in MiB as DCGM: NVML's bytes // 2**20
    assert v[series("DCGM_FI_DEV_FB_USED", **H100)] == 76_234_000_384 // 2**20
    assert v[series("DCGM_FI_DEV_FB_TOTAL", **H100)] == 81559
    assert v[series("DCGM_FI_DEV_FB_USED", **H100)] + v[series("DCGM_FI_DEV_FB_FREE", **H100)] in (81558, 81559)
    # power in W from NVML's mW; energy stays mJ; clocks in MHz
    assert v[series("DCGM_FI_DEV_POWER_USAGE", **H100)] == pytest.approx(612.0 + (
        nvml.devices[0].samples[0]["nvmlDeviceGetPowerUsage"] - 612_000) / 1000)
    assert v[series("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", **H100)] == 700.0
    assert v[series("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", **H100)] == 1_284_000_000_000
    assert v[series("DCGM_FI_DEV_SM_CLOCK", **H100)] == 1980 and v[series("DCGM_FI_DEV_MEM_CLOCK", **H100)] == 2619
    assert v[series("DCGM_FI_DEV_GPU_TEMP", **H100)] == 41 and v[series("DCGM_FI_DEV_MEMORY_TEMP", **H100)] == 49
    assert v[series("DCGM_FI_DEV_PCIE_TX_THROUGHPUT", **H100)] == 2104
    assert v[series("DCGM_FI_DEV_PCIE_RX_THROUGHPUT", **H100)] == 14873
    # GPU 2 of the scenario has corrected ECC errors and a remapped row
    gpu2 = gpu_labels(2, "GPU-9e4b7d21-c83a-4e0f-b6d2-5f18a9c4e036", "00000000:3A:00.0")
    assert v[series("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", **gpu2)] == 12
    assert v[series("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", **gpu2)] == 40
    assert v[series("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", **gpu2)] == 1
    # cumulative NVLink/PCIe counters in bytes
    assert v[series("trainguard_gpu_nvlink_transmitted_bytes_total", **H100)] == 9_183_746_112 * 1024
    assert v[series("trainguard_gpu_pcie_received_bytes_total", **H100)] == 301_928_374_655_488
    assert all(v[series("trainguard_gpu_lost", **gpu_labels(0, H100["UUID"], H100["pci_bus_id"]))] == 0 for _ in [0])
    gpus = {dict(labels)["gpu"] for name, labels in v if name == "DCGM_FI_DEV_GPU_UTIL"}
    assert gpus == {str(i) for i in range(8)}


def test_not_supported_is_left_out_and_not_asked_again(tmp_path):
    """H100s have no retired pages (row remapping instead): no series, no failure, one call per GPU and cause."""
    nvml = FakeNVML("h100x8")
    collector = make(tmp_path, nvml)
    for _ in range(3):
        names = {name for name, _ in values(collector.update().families)}
        nvml.advance()
    assert not any(name.startswith("DCGM_FI_DEV_RETIRED_") for name in names)
    assert nvml.calls["nvmlDeviceGetRetiredPages"] == 8 * 2
    assert nvml.calls["nvmlDeviceGetRetiredPagesPendingStatus"] == 8
    assert nvml.calls["nvmlDeviceGetUtilizationRates"] == 8 * 3


def test_nvlink_bandwidth_is_dcgm_rate_between_updates(tmp_path):
    nvml = FakeNVML("h100x8")
    collector = make(tmp_path, nvml)
    first = values(collector.update().families)
    assert series("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", **H100) not in first    # needs two readings
    nvml.advance()
    collector.clock.now += 5.0
    second = values(collector.update().families)
    # (731e6 + 729e6) KiB in 5 s, divided by 1000 as DCGM does
    assert second[series("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", **H100)] == pytest.approx(1_460_000_000 / 5 / 1000)


def test_throttle_reasons_decoded_per_reason(tmp_path):
    nvml = FakeNVML("h100x8")
    collector = make(tmp_path, nvml)
    gpu5 = gpu_labels(5, "GPU-7b2d9f4e-5c18-4a6e-8f3b-d41e6c0a9f69", "00000000:AB:00.0")
    nvml.advance(2)
    v = values(collector.update().families)
    assert v[series("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", **gpu5)] == 0x4 | 0x20
    active = {reason for (name, labels), value in v.items()
              if name == "trainguard_gpu_clock_throttle_active" and value == 1 and dict(labels)["gpu"] == "5"
              for reason in [dict(labels)["reason"]]}
    assert active == {"power_cap", "sw_thermal"}
    assert v[series("DCGM_FI_DEV_SM_CLOCK", **gpu5)] == 1755


def test_process_memory_by_rank(tmp_path):
    """Ranks from RUN/control/ranks (the trainer's own writer); the profiler on GPU 0 is 'other'."""
    run = tmp_path / "run"
    for rank in range(8):
        write_rank_file(run, rank, pid=4242 + rank, host="node-a")
    write_rank_file(run, 8, pid=9137, host="node-b")    # another node's rank, same pid by chance: not ours
    collector = make(tmp_path, FakeNVML("h100x8"), run_dir=run)
    v = values(collector.update().families)
    per_rank = {(dict(l)["gpu"], dict(l)["rank"]): value for (name, l), value in v.items()
                if name == "trainguard_gpu_process_memory_bytes"}
    assert per_rank[("3", "3")] == 76_234_000_384 + 3 * 3 * 2**20 - 536 * 2**20   # the scenario: +3 MiB per GPU
    assert per_rank[("0", "other")] == 512 * 2**20
    assert set(per_rank) == {(str(r), str(r)) for r in range(8)} | {("0", "other")}


def test_tls_fragment(tmp_path):
    sample = make(tmp_path, FakeNVML("h100x8")).update()
    hardware, system = sample.tls["hardware"], sample.tls["system"]
    assert system == {"gpu_count": 8}
    assert len(hardware["gpus"]) == 8
    first = hardware["gpus"][0]
    assert first["gpu_util"] == 100 and first["gpu_temp_c"] == 41 and first["lost"] is False
    assert first["mem_util"] == pytest.approx(100 * 76_234_000_384 / (81559 * 2**20), abs=0.01)
    assert hardware["gpu_util"] == pytest.approx(sum(g["gpu_util"] for g in hardware["gpus"]) / 8, abs=0.01)
    assert hardware["gpu_power_w"] == pytest.approx(sum(g["gpu_power_w"] for g in hardware["gpus"]) / 8, abs=0.01)


def test_gpu_lost_then_recovered_with_reinit(tmp_path, caplog):
    nvml = FakeNVML("gpu_lost")
    collector = make(tmp_path, nvml, reinit_backoff_seconds=5, reinit_backoff_max_seconds=20)
    gpu1 = gpu_labels(1, "GPU-5a0f9c3e-2d71-48b6-8e4a-91f6c07d3b25", "00000000:2A:00.0")

    def lost_of(v):
        return v[series("trainguard_gpu_lost", **gpu1)]

    v = values(collector.update().families)
    assert lost_of(v) == 0 and nvml.init_calls == 1

    nvml.advance()                                   # GPU 1 falls off the bus
    sample = collector.update()
    v = values(sample.families)
    assert lost_of(v) == 1
    assert series("DCGM_FI_DEV_GPU_UTIL", **gpu1) not in v            # nothing half-read from a lost GPU
    assert series("DCGM_FI_DEV_GPU_UTIL", **H100) in v                # the other GPU goes on
    assert sample.tls["hardware"]["gpus"][1]["lost"] is True and sample.tls["system"]["gpu_count"] == 2

    nvml.advance()
    collector.clock.now += 1.0                       # before the backoff: no re-init yet
    assert lost_of(values(collector.update().families)) == 1 and nvml.init_calls == 1
    collector.clock.now += 5.0                       # re-init: GPU 1 still lost, backoff doubles
    assert lost_of(values(collector.update().families)) == 1 and nvml.init_calls == 2

    nvml.advance()                                   # the GPU answers again (after a reset)
    collector.clock.now += 5.0
    assert lost_of(values(collector.update().families)) == 1 and nvml.init_calls == 2     # 10 s backoff now
    collector.clock.now += 5.0
    v = values(collector.update().families)
    assert nvml.init_calls == 3 and lost_of(v) == 0
    assert v[series("DCGM_FI_DEV_GPU_UTIL", **gpu1)] == 100 - 1 - 3
    # the XID event set was made again after the re-init: XID 79 came through NVML before the loss
    assert v[series("trainguard_gpu_xid_errors_total", **gpu1, xid="79", xid_class="node_drain")] == 1


def test_no_nvml_library_disables_with_one_line(tmp_path):
    with pytest.raises(CollectorDisabled) as info:
        make(tmp_path, FakeNVML("no_gpu"))
    message = str(info.value)
    assert "\n" not in message and "NVML" in message and "Library Not Found" in message


def test_no_gpu_at_all_disables(tmp_path):
    scenario = {"format": "trainguard-fake-nvml/1", "system": {}, "devices": []}
    with pytest.raises(CollectorDisabled, match="no GPU"):
        make(tmp_path, FakeNVML(scenario))


def test_real_pynvml_without_gpu_disables(tmp_path):
    """The real library on this machine: skipped where a GPU and its driver are present."""
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has NVML; the disabled path is tested with the fake")
    with pytest.raises(CollectorDisabled, match="NVML is not available here"):
        make(tmp_path, None)


def test_options_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="collectors.gpu.labels"):
        make(tmp_path, FakeNVML("h100x8"), labels="prometheus")
    with pytest.raises(ConfigError, match="collectors.gpu.kmsgg: unknown option"):
        make(tmp_path, FakeNVML("h100x8"), kmsgg=False)


def test_dcgm_label_style_is_dcgm_exporters(tmp_path):
    v = values(make(tmp_path, FakeNVML("h100x8"), labels="dcgm").update().families)
    labels = {**H100, "modelName": H100["model_name"]}
    del labels["model_name"]
    assert series("DCGM_FI_DEV_GPU_UTIL", **labels) in v


def test_exposition_passes_promtool(tmp_path):
    nvml = FakeNVML("h100x8")
    collector = make(tmp_path, nvml)
    collector.update()
    nvml.advance()
    collector.clock.now += 5
    result = promtool_check_metrics(render(collector.update().families))
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


def test_scenarios_are_recorded_format():
    for path in sorted((Path(__file__).resolve().parents[1] / "fakes" / "nvml").glob("*.json")):
        spec = json.loads(path.read_text())
        assert spec["format"] == "trainguard-fake-nvml/1" and spec["origin"], path
        FakeNVML(path)          # loads and validates
