"""Golden expositions: each collector's families on the fixture trees (and the fake NVML), rendered as /metrics
renders them and diffed against tests/fixtures/golden/<collector>.prom. UPDATE_GOLDEN=1 writes them anew."""

from __future__ import annotations

import difflib
import os
import shutil
from pathlib import Path

import pytest

from tests.agent.exposition import render, without
from tests.fakes.fake_nvml import FakeNVML
from tests.servers import promtool_check_metrics
from trainguard.agent.collector import Context
from trainguard.metrics import gpu_metrics, node
from trainguard.agent.collectors import ib
from trainguard.agent.collectors.gpu import GPUCollector
from trainguard.agent.collectors.ib import InfiniBandCollector
from trainguard.agent.collectors.io import IOCollector
from trainguard.agent.collectors.nccl import NCCLCollector
from trainguard.runtime.control import write_rank_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GOLDEN = FIXTURES / "golden"
# values that depend on the machine the test runs on, not on the fixtures
VOLATILE = ("trainguard_checkpoint_fs_",)


def fixture_context(tmp_path: Path, **kwargs) -> Context:
    return Context(procfs=FIXTURES / "proc", sysfs=FIXTURES / "sys", devfs=tmp_path / "dev", node="node-a", **kwargs)


def io_exposition(tmp_path: Path) -> str:
    return render(IOCollector(fixture_context(tmp_path, run_dir=tmp_path)).update().families)


def ib_exposition(tmp_path: Path) -> str:
    return render(InfiniBandCollector(fixture_context(tmp_path)).update().families)


def gpu_exposition(tmp_path: Path) -> str:
    """8 H100s of the fake NVML, ranks 0-7 on GPUs 0-7, and a double-bit-error XID in the kernel log."""
    (tmp_path / "dev").mkdir()
    shutil.copy(FIXTURES / "dev" / "kmsg", tmp_path / "dev" / "kmsg")
    for rank in range(8):
        write_rank_file(tmp_path / "run", rank, pid=4242 + rank, host="node-a")
    nvml = FakeNVML("h100x8")
    gpu = GPUCollector(fixture_context(tmp_path, run_dir=tmp_path / "run", options={"nvml_module": nvml}))
    now = [1000.0]
    gpu.clock = lambda: now[0]
    gpu.update()
    nvml.advance()
    now[0] += 5.0
    with open(tmp_path / "dev" / "kmsg", "ab") as kmsg:
        kmsg.write(b"4,2001,99000000000,-;NVRM: Xid (PCI:0000:5d:00): 48, pid=4245, name=python, An uncorrectable "
                   b"double bit error (DBE) has been detected on GPU in the framebuffer at partition 6.\n")
    return render(gpu.update().families)


def nccl_exposition(tmp_path: Path) -> str:
    run = tmp_path / "run"
    write_rank_file(run, 0, pid=4242, host="node-a")
    write_rank_file(run, 1, pid=4243, host="node-a")
    nccl = NCCLCollector(fixture_context(tmp_path, run_dir=run, options={"rescan_seconds": 0}))  # logs appear next
    shutil.copytree(FIXTURES / "logs" / "nccl", run / "logs")
    return render(nccl.update().families)


@pytest.mark.parametrize("name, produce", [("io", io_exposition), ("ib", ib_exposition),
                                           ("gpu", gpu_exposition), ("nccl", nccl_exposition)])
def test_golden_exposition(name, produce, tmp_path):
    text = without(produce(tmp_path), *VOLATILE)
    path = GOLDEN / f"{name}.prom"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    expected = path.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), str(path), "now", n=1))
        pytest.fail(f"{name} exposition differs from {path} (UPDATE_GOLDEN=1 rewrites it if intended):\n{diff[:6000]}")


@pytest.mark.parametrize("name", ["io", "ib", "gpu", "nccl"])
def test_golden_passes_promtool(name):
    result = promtool_check_metrics((GOLDEN / f"{name}.prom").read_text())
    assert result.returncode == 0, (result.stdout + result.stderr).decode()


def test_every_metric_is_documented():
    """docs/collectors.md names every family these collectors can produce (golden files and code tables)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "collectors.md").read_text()
    names = {line.split()[2] for path in GOLDEN.glob("*.prom") for line in path.read_text().splitlines()
             if line.startswith("# TYPE")}
    names |= {name for name, _, _ in gpu_metrics.DCGM_GAUGES}
    names |= {f"node_infiniband_{name}_total" for table in (ib.COUNTERS, ib.COUNTERS_EXT)
              for name, _ in table.values()}
    names |= {f"node_disk_{name}" for _, name, *_ in node.DISK_SERIES}
    names |= {"trainguard_checkpoint_fs_avail_bytes", "trainguard_checkpoint_fs_free_bytes",
              "trainguard_checkpoint_fs_size_bytes"}

    missing = sorted(n for n in names if f"`{n}`" not in doc and f"`{n}{{" not in doc)
    assert not missing, f"not in docs/collectors.md: {missing}"
