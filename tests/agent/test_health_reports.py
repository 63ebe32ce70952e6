"""trainguard/health_reports.py: dcgmi diag -j and the kernel log's NVRM lines as health_check events
(fixtures: tests/fixtures/health/README.md names their sources)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainguard import event_types
from trainguard.health_reports import ReportError, as_records, dcgm_diag, kernel_log

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "health"
KMSG = Path(__file__).resolve().parents[1] / "fixtures" / "dev" / "kmsg"


def test_dcgm_4_findings_and_summary():
    events = dcgm_diag(json.loads((FIXTURES / "dcgmi-diag.json").read_text()))
    assert all(e["type"] == event_types.HEALTH_CHECK and e["tool"] == "dcgmi diag" for e in events)
    warn, fail, summary = events
    assert (warn["test"], warn["gpu"], warn["status"]) == ("pcie", 1, "warn") and "action_class" not in warn
    assert warn["warnings"][0]["severity"] == "monitor"
    assert (fail["test"], fail["category"], fail["gpu"], fail["status"]) == ("memory", "Hardware", 1, "fail")
    assert fail["action_class"] == "node_drain" and fail["warnings"][0]["severity"] == "isolate"
    assert summary == {"type": event_types.HEALTH_CHECK, "tool": "dcgmi diag", "status": "fail", "test": "summary",
                       "tests": 4, "findings": 2, "version": "4.2.3"}


def test_dcgm_1_shape():
    events = dcgm_diag(json.loads((FIXTURES / "dcgmi-diag-v1.json").read_text()))
    assert [(e["test"], e["status"], e.get("gpu")) for e in events] == [("GPU Memory", "fail", "1"),
                                                                         ("summary", "fail", None)]
    assert events[0]["warnings"] == [{"message": "placeholder: memory error text of the 1.x shape"}]


@pytest.mark.parametrize("document, message", [([], "expected a JSON object"), ({"x": 1}, "no 'DCGM Diagnostic'"),
                                               ({"DCGM Diagnostic": {"test_categories": {}}}, "expected a list")])
def test_not_a_dcgm_report_is_named(document, message):
    with pytest.raises(ReportError, match=message):
        dcgm_diag(document)


def test_kernel_log_xids_falls_and_identities():
    events = kernel_log((FIXTURES / "kern.log").read_text().splitlines())
    assert [(e["test"], e.get("xid"), e["pci"], e["status"], e["action_class"]) for e in events] == [
        ("xid", 79, "0000:2b:00", "fail", "node_drain"),
        ("fallen_off_the_bus", None, "0000:2b:00", "fail", "node_drain"),
        ("xid", 63, "0000:10:1c", "fail", "gpu_reset")]
    assert events[0]["uuid"] == "GPU-0b11d014-1685-04bd-26ed-5fc0bc1c44ae"     # from the line before it
    assert events[2]["message"].startswith("pid=1896, Row Remapper")
    assert [e["line"] for e in events] == [2, 3, 7]


def test_kmsg_records_carry_the_kernel_clock():
    events = kernel_log(KMSG.read_text(errors="replace").splitlines())
    assert events and all("uptime_seconds" in e for e in events)
    assert {e["xid"] for e in events if e["test"] == "xid"} >= {48, 79}


def test_records_on_the_node_timeline():
    records = as_records(kernel_log(["NVRM: Xid (PCI:0000:10:1c): 13, pid=7, Graphics Exception"]), "n1", 100.0)
    assert records == [{"timestamp": 100.0, "node": "n1", "event": {
        "type": event_types.HEALTH_CHECK, "tool": "kernel log", "status": "warn", "test": "xid", "xid": 13,
        "pci": "0000:10:1c", "action_class": "application_error", "message": "pid=7, Graphics Exception", "line": 1}}]
