"""XID errors: kernel-log parsing, the /dev/kmsg reader, NVML events (fake NVML), and the two merged by max."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.agent.exposition import series, values
from tests.fakes.fake_nvml import FakeNVML
from trainguard.agent.collector import Context
from trainguard.agent.collectors.gpu import GPUCollector
from trainguard import xid_catalog
from trainguard.agent.collectors.xid import KmsgSource, XidCounts, parse_kmsg_xid, pci_key_from_bus_id

FIXTURE_KMSG = Path(__file__).resolve().parents[1] / "fixtures" / "dev" / "kmsg"
GPU0 = {"UUID": "GPU-1c8e2f0a-6b4d-4f51-9a57-3e0c8d2b7f14", "device": "nvidia0", "gpu": "0", "Hostname": "node-a",
        "model_name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "00000000:18:00.0"}


@pytest.mark.parametrize("line, expected", [
    (b"4,1505,96230001928,-;NVRM: Xid (PCI:0000:9a:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off "
     b"the bus.", ("0000:9a:00", 79)),
    (b"[96172.839401] NVRM: Xid (PCI:0000:5D:00): 48, pid=4245, name=python, An uncorrectable double bit error",
     ("0000:5d:00", 48)),
    (b"NVRM: Xid (PCI:0002:1b:00.0): 119, pid=811, name=nv-hostengine, Timeout after 6s of waiting for RPC response",
     ("0002:1b:00", 119)),
    (b"6,1504,96172851002,-;nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 12028, Non-fatal, Link 32 egress", None),
    (b"4,1506,96230001955,-;NVRM: GPU 0000:9a:00.0: GPU has fallen off the bus.", None),
    (b" DEVICE=+pci:0000:5d:00.0", None),
])
def test_parse_kmsg_xid(line, expected):
    assert parse_kmsg_xid(line) == expected


def test_nvml_bus_id_and_kmsg_address_meet():
    assert pci_key_from_bus_id("00000000:9A:00.0") == parse_kmsg_xid(b"NVRM: Xid (PCI:0000:9a:00): 79, x")[0]


def test_kmsg_reader_starts_at_the_end_and_reads_appended_records(tmp_path):
    shutil.copy(FIXTURE_KMSG, tmp_path / "kmsg")
    source = KmsgSource(tmp_path)
    assert source.available and source.poll() == []        # what was logged before the agent: not replayed
    with open(tmp_path / "kmsg", "ab") as log:
        log.write(FIXTURE_KMSG.read_bytes())
        log.write(b"4,1600,97000000000,-;NVRM: Xid (PCI:0000:18:00): 31, pid=42")    # no newline yet
    assert source.poll() == [("0000:5d:00", 48), ("0000:5d:00", 63), ("0000:9a:00", 79)]
    with open(tmp_path / "kmsg", "ab") as log:
        log.write(b", name=python, Ch 00000010, intr 10000000. MMU Fault\n")
    assert source.poll() == [("0000:18:00", 31)]
    source.close()


def test_kmsg_unreadable_is_reported_not_raised(tmp_path):
    source = KmsgSource(tmp_path / "missing")
    assert not source.available and "No such file" in source.reason and source.poll() == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads anything")
def test_kmsg_without_permission(tmp_path):
    (tmp_path / "kmsg").write_bytes(b"")
    (tmp_path / "kmsg").chmod(0)
    assert not KmsgSource(tmp_path).available


def test_counts_merge_by_max_never_double():
    counts = XidCounts()
    counts.add("nvml", [("0000:18:00", 13), ("0000:18:00", 13)])
    counts.add("kmsg", [("0000:18:00", 13), ("0000:18:00", 13), ("0000:9a:00", 79)])   # the same XIDs, seen again
    counts.add("nvml", [("0000:18:00", 31)])
    assert counts.merged() == {("0000:18:00", 13): 2, ("0000:18:00", 31): 1, ("0000:9a:00", 79): 1}
    assert counts.last == {"0000:18:00": 31, "0000:9a:00": 79}


def collector(tmp_path, nvml, kmsg: bool = True) -> GPUCollector:
    devfs = tmp_path / "dev"
    devfs.mkdir()
    shutil.copy(FIXTURE_KMSG, devfs / "kmsg")
    return GPUCollector(Context(devfs=devfs, node="node-a", options={"nvml_module": nvml, "kmsg": kmsg}))


def test_xid_from_nvml_events_counted_per_code(tmp_path):
    nvml = FakeNVML("xid")
    gpu = collector(tmp_path, nvml)
    v = values(gpu.update().families)
    # the codes that matter exist at 0 on every GPU from the start, each with its catalogue class
    xids = {labels: value for (name, labels), value in v.items() if name == "trainguard_gpu_xid_errors_total"}
    assert len(xids) == 2 * len(xid_catalog.WATCHED) and set(xids.values()) == {0}
    assert v[series("trainguard_gpu_xid_errors_total", **GPU0, xid="79", xid_class="node_drain")] == 0
    assert series("DCGM_FI_DEV_XID_ERRORS", **GPU0) not in v         # blank until an XID, as in DCGM
    nvml.advance()
    v = values(gpu.update().families)
    assert v[series("trainguard_gpu_xid_errors_total", **GPU0, xid="13", xid_class="application_error")] == 1
    assert v[series("DCGM_FI_DEV_XID_ERRORS", **GPU0)] == 13
    nvml.advance()
    v = values(gpu.update().families)
    assert v[series("trainguard_gpu_xid_errors_total", **GPU0, xid="13", xid_class="application_error")] == 2
    assert v[series("trainguard_gpu_xid_errors_total", **GPU0, xid="31", xid_class="application_error")] == 1
    assert v[series("DCGM_FI_DEV_XID_ERRORS", **GPU0)] == 31
    assert v[series("trainguard_gpu_xid_source_available", source="nvml")] == 1
    assert v[series("trainguard_gpu_xid_source_available", source="kmsg")] == 1
    assert gpu.update().tls["hardware"]["gpus"][0]["xid_errors"] == 3


def test_kmsg_and_nvml_seeing_the_same_xid_count_it_once(tmp_path):
    nvml = FakeNVML("xid")
    gpu = collector(tmp_path, nvml)
    gpu.update()
    nvml.advance()                        # NVML: XID 13 on GPU 0 ...
    with open(tmp_path / "dev" / "kmsg", "ab") as log:      # ... and the kernel logs the same one
        log.write(b"4,1700,98000000000,-;NVRM: Xid (PCI:0000:18:00): 13, Graphics Exception: ESR 0x50df30\n"
                  b"4,1701,98000000100,-;NVRM: Xid (PCI:0000:5d:00): 48, pid=1, DBE on a GPU NVML does not list\n")
    v = values(gpu.update().families)
    assert v[series("trainguard_gpu_xid_errors_total", **GPU0, xid="13", xid_class="application_error")] == 1
    # an XID for a PCI address that is none of this node's GPUs keeps its address, nothing else
    assert v[series("trainguard_gpu_xid_errors_total", gpu="", UUID="", pci_bus_id="0000:5d:00", device="",
                    model_name="", Hostname="node-a", xid="48", xid_class="gpu_reset")] == 1


def test_kmsg_off_by_option(tmp_path):
    v = values(collector(tmp_path, FakeNVML("xid"), kmsg=False).update().families)
    assert series("trainguard_gpu_xid_source_available", source="kmsg") not in v


def test_fake_steps_by_time_in_agent_processes(tmp_path):
    """TRAINGUARD_FAKE_NVML_STEP_S: the fake moves one sample per step of time, delivering the XIDs it passes."""
    nvml = FakeNVML("xid", step_seconds=10.0)
    gpu = collector(tmp_path, nvml)
    nvml._started -= 25.0                 # as if 25 s had passed: samples 1 and 2
    v = values(gpu.update().families)
    assert nvml.position == 2
    assert v[series("trainguard_gpu_xid_errors_total", **GPU0, xid="13", xid_class="application_error")] == 2
