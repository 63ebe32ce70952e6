"""Golden expositions, node_exporter's end-to-end way: every collector of the registry runs on one fixture tree
and its whole exposition, rendered as /metrics renders it, is diffed against its golden file.

- The collectors come from the registry (`trainguard.agent.collector.REGISTRY`, filled by importing
  `agent/collectors/`), not from a list here: a collector registered without a golden file fails
  `test_golden_exposition[<name>]`, a golden file no registered collector claims fails too.
- The fixture tree is `tests/fixtures/`: `proc/`, `sys/`, `dev/` (the roots of the collector's Context),
  `run/` (a run directory: two ranks' TLS logs cut from the recorded `nan` incident, a real
  `trainguard preflight` result), `logs/` (NCCL's debug output) and the fake NVML (`tests/fakes/`).
- `golden/<collector>.prom` is one update of the collector on that tree. A collector whose exposition
  needs more than that (a kernel log line arriving between two updates, logs appearing after the first
  scan) has a scenario below, named by its golden file's stem: `<collector>` or `<collector>-<scenario>`.

`UPDATE_GOLDEN=1` writes the golden files anew (a new collector's too); read the diff before committing it.
"""

from __future__ import annotations

import difflib
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

import pytest

import trainguard.agent.collectors as collector_modules
from tests.agent.exposition import render, without
from tests.fakes.fake_nvml import FakeNVML
from tests.servers import promtool_check_metrics
from trainguard.agent.collector import REGISTRY, Context
from trainguard.agent.collectors import ib
from trainguard.metrics import gpu_metrics, node
from trainguard.runtime.control import write_rank_file

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GOLDEN = FIXTURES / "golden"
COLLECTORS_DOC = Path(__file__).resolve().parents[2] / "docs" / "collectors.md"
# values that depend on the machine the test runs on, not on the fixtures
VOLATILE = ("trainguard_checkpoint_fs_", "trainguard_node_info")
FIXED_NOW = 1_795_945_100.0      # the wall clock of the scenarios: 85 s after the fixture run's last record


def fixture_context(tmp_path: Path, **kwargs) -> Context:
    """The fixture tree as a collector sees it; the run directory is a copy (collectors write their state there)."""
    if "run_dir" not in kwargs:
        kwargs["run_dir"] = shutil.copytree(FIXTURES / "run", tmp_path / "run")
    return Context(procfs=FIXTURES / "proc", sysfs=FIXTURES / "sys", devfs=tmp_path / "dev", node="node-a",
                   checkpoint_key_file=str(tmp_path / "checkpoint.key"), **kwargs)


def one_update(name: str, tmp_path: Path) -> list:
    """The default scenario: the collector's first update on the fixture tree."""
    collector = REGISTRY[name](fixture_context(tmp_path))
    if hasattr(collector, "wall_clock"):
        collector.wall_clock = lambda: FIXED_NOW
    return collector.update().families


# golden file stem -> the families of a scenario that needs more than `one_update`
SCENARIOS: dict[str, Callable[[Path], list]] = {}


def scenario(stem: str):
    def register(produce: Callable[[Path], list]) -> Callable[[Path], list]:
        SCENARIOS[stem] = produce
        return produce
    return register


@scenario("gpu")
def gpu_families(tmp_path: Path) -> list:
    """8 H100s of the fake NVML, ranks 0-7 on GPUs 0-7, and a double-bit-error XID in the kernel log."""
    (tmp_path / "dev").mkdir()
    shutil.copy(FIXTURES / "dev" / "kmsg", tmp_path / "dev" / "kmsg")
    for rank in range(8):
        write_rank_file(tmp_path / "run", rank, pid=4242 + rank, host="node-a")
    nvml = FakeNVML("h100x8")
    gpu = REGISTRY["gpu"](fixture_context(tmp_path, run_dir=tmp_path / "run", options={"nvml_module": nvml}))
    now = [1000.0]
    gpu.clock = lambda: now[0]
    gpu.update()
    nvml.advance()
    now[0] += 5.0
    with open(tmp_path / "dev" / "kmsg", "ab") as kmsg:
        kmsg.write(b"4,2001,99000000000,-;NVRM: Xid (PCI:0000:5d:00): 48, pid=4245, name=python, An uncorrectable "
                   b"double bit error (DBE) has been detected on GPU in the framebuffer at partition 6.\n")
    return gpu.update().families


@scenario("nccl")
def nccl_families(tmp_path: Path) -> list:
    """Two ranks whose NCCL debug files appear after the collector's first scan."""
    run = tmp_path / "run"
    write_rank_file(run, 0, pid=4242, host="node-a")
    write_rank_file(run, 1, pid=4243, host="node-a")
    nccl = REGISTRY["nccl"](fixture_context(tmp_path, run_dir=run, options={"rescan_seconds": 0}))
    shutil.copytree(FIXTURES / "logs" / "nccl", run / "logs")
    return nccl.update().families


@scenario("health_reports")
def health_reports_families(tmp_path: Path) -> list:
    """The dcgmi diag -j, NCCL RAS and kernel log samples of tests/fixtures/health/ (copied: a report's mtime is
    its timestamp), a second update after an Xid line is appended, and a third after the log is rotated."""
    diag, log, ras = tmp_path / "dcgmi-diag.json", tmp_path / "kern.log", tmp_path / "ras.txt"
    shutil.copy(FIXTURES / "health" / "dcgmi-diag.json", diag)
    os.utime(diag, (FIXED_NOW - 600, FIXED_NOW - 600))
    shutil.copy(FIXTURES / "health" / "ncclras-verbose.txt", ras)
    os.utime(ras, (FIXED_NOW - 300, FIXED_NOW - 300))
    shutil.copy(FIXTURES / "health" / "kern.log", log)
    collector = REGISTRY["health_reports"](fixture_context(tmp_path, options={"dcgm_diag": str(diag),
                                                                              "kernel_log": str(log),
                                                                              "nccl_ras": str(ras)}))
    collector.update()
    with open(log, "a") as kernel:       # counted once more, not the whole file again
        kernel.write("May 18 19:05:02 kernel: NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.\n")
    collector.update()
    log.rename(tmp_path / "kern.log.1")  # rotated: the new file's lines are added to the counts
    log.write_text("May 18 19:06:00 kernel: NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row "
                   "marked for remapping, reset gpu to activate.\n")
    return collector.update().families


def owner(stem: str) -> str | None:
    """The registered collector a golden file belongs to (`gpu` for gpu.prom and gpu-lost.prom)."""
    names = [name for name in REGISTRY if stem == name or stem.startswith(name + "-")]
    return max(names, key=len, default=None)


def cases() -> list:
    """(collector, golden stem) for every golden file; (collector, None) for a collector without one, and
    (None, stem) for a golden file without a collector: both fail, so neither can go unnoticed."""
    stems = sorted(path.name[:-len(".prom")] for path in GOLDEN.glob("*.prom"))
    found = [(owner(stem), stem) for stem in stems]
    claimed = {name for name, _ in found}
    return found + [(name, None) for name in sorted(REGISTRY) if name not in claimed]


def case_id(case) -> str:
    name, stem = case
    return stem or f"{name}-without-golden"


def produce(name: str, stem: str, tmp_path: Path) -> str:
    families = SCENARIOS[stem](tmp_path) if stem in SCENARIOS else one_update(name, tmp_path)
    return without(render(families), *VOLATILE)


@pytest.mark.parametrize("case", cases(), ids=case_id)
def test_golden_exposition(case, tmp_path):
    name, stem = case
    if name is None:
        pytest.fail(f"{GOLDEN / stem}.prom: no registered collector is named {stem.split('-')[0]!r} "
                    f"(registered: {sorted(REGISTRY)}; not importable: {collector_modules.UNAVAILABLE})")
    path = GOLDEN / f"{stem or name}.prom"
    if stem is None and os.environ.get("UPDATE_GOLDEN") != "1":
        pytest.fail(f"collector {name!r} has no golden exposition: add what it reads to the fixture tree "
                    f"({FIXTURES}), then UPDATE_GOLDEN=1 writes {path} (a scenario here if one update is not enough)")
    if stem is not None and stem != name and stem not in SCENARIOS:
        pytest.fail(f"{path}: a second golden file of {name!r} needs its scenario, @scenario({stem!r})")
    text = produce(name, stem or name, tmp_path)
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    expected = path.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), str(path), "now", n=1))
        pytest.fail(f"{stem} exposition differs from {path} (UPDATE_GOLDEN=1 rewrites it if intended):\n{diff[:6000]}")
    assert "# TYPE" in text, f"{path}: the fixture tree gives {name!r} nothing to export"


def test_a_collector_without_a_golden_file_or_a_golden_file_without_a_collector_fails(monkeypatch, tmp_path):
    """The two ways the registry and the golden folder can part, each a failing case of the test above."""
    class Planted:
        name = "planted"

    monkeypatch.setitem(REGISTRY, "planted", Planted)
    assert ("planted", None) in cases()
    monkeypatch.setattr(sys.modules[__name__], "GOLDEN", tmp_path)
    (tmp_path / "retired-scenario.prom").write_text("")
    assert (None, "retired-scenario") in cases()


def test_every_scenario_has_its_golden_file():
    """A scenario whose golden file was renamed or deleted would otherwise never run."""
    missing = sorted(stem for stem in SCENARIOS if not (GOLDEN / f"{stem}.prom").exists())
    assert not missing, f"scenarios without a golden file in {GOLDEN}: {missing}"


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.prom")), ids=lambda path: path.stem)
def test_golden_passes_promtool(path):
    result = promtool_check_metrics(path.read_text())
    assert result.returncode == 0, (result.stdout + result.stderr).decode()


def test_every_collector_has_its_section_in_the_collectors_doc():
    headings = {line[3:].split(" ")[0] for line in COLLECTORS_DOC.read_text().splitlines() if line.startswith("## ")}
    missing = sorted(set(REGISTRY) - headings)
    assert not missing, f"{COLLECTORS_DOC}: no '## <name> — what it reads' section for {missing}"


def test_every_metric_is_documented():
    """docs/collectors.md names every family these collectors can produce (golden files and code tables)."""
    doc = COLLECTORS_DOC.read_text()
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
