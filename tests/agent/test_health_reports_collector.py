"""The health_reports collector (agent/collectors/health_reports.py): what its golden scenario cannot show."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.agent.exposition import render
from trainguard.agent.collector import CollectorDisabled, Context
from trainguard.agent.collectors.health_reports import HealthReportsCollector
from trainguard.agent.config import ConfigError

HEALTH = Path(__file__).resolve().parents[1] / "fixtures" / "health"
XID_79 = "NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.\n"


def collector(tmp_path: Path, **options) -> HealthReportsCollector:
    return HealthReportsCollector(Context(procfs=tmp_path, sysfs=tmp_path, devfs=tmp_path, node="n",
                                          options=options))


def xid_count(families, code: str) -> float | None:
    for family in families:
        for sample in family.samples:
            if sample.name == "trainguard_health_kernel_xid_total" and sample.labels["xid"] == code:
                return sample.value
    return None


def test_without_paths_it_is_disabled_and_an_unknown_option_is_refused(tmp_path):
    with pytest.raises(CollectorDisabled, match="dcgm_diag"):
        collector(tmp_path)
    with pytest.raises(ConfigError, match="collectors.health_reports.path"):
        collector(tmp_path, path="x")


def test_absent_files_give_only_the_kernel_counter_and_no_error(tmp_path):
    text = render(collector(tmp_path, dcgm_diag=str(tmp_path / "no.json"),
                            kernel_log=str(tmp_path / "no.log")).update().families)
    assert "trainguard_health_dcgm" not in text
    assert "trainguard_health_kernel_gpu_fallen_off_bus_total 0.0" in text


@pytest.mark.parametrize("content", ["{not json", '{"other": 1}', '{"DCGM Diagnostic": {"test_categories": 3}}'])
def test_a_bad_diag_file_fails_the_update_in_one_line_naming_it(tmp_path, content):
    diag = tmp_path / "diag.json"
    diag.write_text(content)
    os.utime(diag, (diag.stat().st_mtime - 60,) * 2)        # not one still being written (WRITING_SECONDS)
    log = tmp_path / "kern.log"
    log.write_text(XID_79)
    c = collector(tmp_path, dcgm_diag=str(diag), kernel_log=str(log))
    with pytest.raises(ValueError) as failed:
        c.update()
    assert str(diag) in str(failed.value) and "\n" not in str(failed.value)
    shutil.copy(HEALTH / "dcgmi-diag.json", diag)            # repaired: the log was not read twice meanwhile
    assert xid_count(c.update().families, "79") == 1


def test_a_fifo_in_place_of_the_log_is_refused_naming_it(tmp_path):
    log = tmp_path / "kern.log"
    os.mkfifo(log)
    with pytest.raises(OSError, match=str(log)):
        collector(tmp_path, kernel_log=str(log)).update()


def test_counts_follow_appends_truncation_and_partial_lines(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text(XID_79 + "NVRM: Xid (PCI:0000:2b:00): 79, cut")
    c = collector(tmp_path, kernel_log=str(log))
    assert xid_count(c.update().families, "79") == 1           # the partial line waits for its end
    with open(log, "a") as f:
        f.write(" short\n")
    assert xid_count(c.update().families, "79") == 2
    assert xid_count(c.update().families, "79") == 2           # nothing new: nothing counted again
    log.write_text(XID_79)                                      # truncated and rewritten: read from the top
    assert xid_count(c.update().families, "79") == 3
    log.unlink()                                                # gone: the counts stay
    assert xid_count(c.update().families, "79") == 3
