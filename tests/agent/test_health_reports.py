"""trainguard/health_reports.py: dcgmi diag -j and the kernel log's NVRM lines as health_check events
(fixtures: tests/fixtures/health/README.md names their sources)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainguard import event_types, nccl_ras
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


# ------------------------------------------------------------------------------- NCCL RAS (trainguard/nccl_ras.py)

def ras_events(name: str) -> list[dict]:
    return nccl_ras.events(nccl_ras.parse((FIXTURES / name).read_bytes()))


def test_ras_verbose_text_every_finding_and_the_job_summary():
    events = ras_events("ncclras-verbose.txt")
    assert all(e["type"] == event_types.HEALTH_CHECK and e["tool"] == "nccl ras" for e in events)
    assert [(e["test"], e.get("communicator"), e["status"]) for e in events] == [
        ("process_missing", None, "fail"), ("process_dead", None, "fail"), ("ranks_missing", "#0-0", "fail"),
        ("rank_errors", "#0-0", "fail"), ("ranks_missing", "#2-0", "fail"), ("ranks_missing", "#2-1", "fail"),
        ("timeout", None, "warn"), ("mismatch", "#3-0", "warn"), ("summary", None, "fail")]
    missing, dead, comm, errors = events[:4]
    assert missing["ranks"] == [{"pid": 3487984, "host": "172.16.64.213", "gpu": "5"}] and missing["count"] == 1
    assert dead["ranks"] == [{"pid": 3487985, "host": "172.16.64.213", "gpu": "6"}]
    assert comm["comm_hash"] == "cf264af53edbe986" and comm["count"] == 2
    assert [(r["rank"], r["gpu"], r["pid"]) for r in comm["ranks"]] == [(21, "5", 3487984), (22, "6", 3487985)]
    assert errors["ranks"] == [{"rank": 13, "gpu": "5", "pid": 1598393, "host": "172.16.64.212",
                                "reported": "Remote process error"}]
    assert events[6]["count"] == 2
    assert events[7]["ranks"][0]["reported"] == "6649" and "AllReduce" in events[7]["message"]
    assert events[-1] == {"type": event_types.HEALTH_CHECK, "tool": "nccl ras", "status": "fail", "test": "summary",
                          "nodes": 4, "processes_per_node": 8, "gpus_per_process": 1, "processes": 32, "gpus": 32,
                          "findings": 8, "communicators": 9, "version": "2.29.7"}
    assert [nccl_ras.not_responding(e) for e in events[:3]] == [True, True, True]
    assert not nccl_ras.not_responding(errors)


def test_ras_docs_excerpt_224_missing_rank_list():
    """NCCL's own documented output (ras.rst), with 2.24's `The missing rank: 21`."""
    events = ras_events("ncclras-docs-incomplete.txt")
    assert [(e["test"], e["status"]) for e in events] == [("process_missing", "fail"), ("ranks_missing", "fail"),
                                                          ("timeout", "warn"), ("summary", "fail")]
    assert events[1]["ranks"] == [{"rank": 21}] and events[1]["comm_hash"] == "cf264af53edbe986"
    assert events[0]["hosts"] == ["172.16.64.213"]
    assert events[-1]["communicators"] == 1 and "complete" not in events[-1]


def test_ras_docs_healthy_excerpt_has_no_findings_but_is_not_a_whole_report():
    """The documented healthy job: no findings; the excerpt lacks the Errors and Warnings sections every answer
    has, so it cannot say the job is healthy (a cut-off file reads the same)."""
    (summary,) = ras_events("ncclras-docs-healthy.txt")
    assert summary["status"] == "warn" and summary["complete"] is False and summary["findings"] == 0
    assert (summary["nodes"], summary["gpus"], summary["communicators"]) == (4, 32, 8)


def test_ras_json_missing_rank_unresponsive():
    """NCCL's documented `ncclras -f json` sample (2.28.7+)."""
    events = ras_events("ncclras-docs.json")
    assert [(e["test"], e["status"]) for e in events] == [("ranks_missing", "fail"), ("summary", "fail")]
    assert events[0]["ranks"] == [{"rank": 1, "gpu": "1", "pid": 1524345, "host": "172.16.64.245",
                                   "reported": "unresponsive"}]
    assert events[0]["comm_hash"] == "0xae94423cfbb2ef4a" and events[-1]["version"] == "2.29.1"


def test_ras_text_cut_off_keeps_what_it_has_and_says_so():
    text = (FIXTURES / "ncclras-verbose.txt").read_text()
    cut = text[:text.index("#0-0 (cf264af53edbe986) ERROR")]
    events = nccl_ras.events(nccl_ras.parse(cut))
    assert [e["test"] for e in events] == ["process_missing", "process_dead", "ranks_missing", "summary"]
    assert events[-1]["complete"] is False and events[-1]["status"] == "fail"


@pytest.mark.parametrize("data, message", [
    (b"hello\nworld\n", "no 'Job summary'"), (b"\x00\x01\x02garbage", "binary"),
    (b'{"nccl_version": "2.29.1", "communicators": [', "JSON"), (b'{"x": 1}', "'communicators' list"),
    ((FIXTURES / "ncclras-docs.json").read_bytes().replace(b'"ranks": [', b'"ranks": 7, "x": [', 1), None)])
def test_ras_garbled_reports_are_named_or_read_as_far_as_they_hold(data, message):
    if message is None:                      # a field of the wrong type: the rest is still read
        assert nccl_ras.events(nccl_ras.parse(data))[-1]["test"] == "summary"
        return
    with pytest.raises(nccl_ras.RasError, match=message):
        nccl_ras.parse(data)


def test_kernel_lines_name_the_host_a_forwarded_log_gives():
    events = kernel_log(["Dec  3 10:00:01 gpu-node-07 kernel: NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off "
                         "the bus.", "May 18 19:02:39 kernel: NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off."])
    assert [e.get("host") for e in events] == ["gpu-node-07", None]


def test_a_diag_names_no_host_but_its_gpus_serials_say_whose_gpus_it_tested():
    document = json.loads((FIXTURES / "dcgmi-diag.json").read_text())
    document["entity_groups"] = [{"entity_group": "GPU", "entity_group_id": 1, "entities": [
        {"entity_id": 0, "device_id": "2330", "serial_num": "1652222014738"},
        {"entity_id": 1, "device_id": "2330", "serial_num": "1652222014739"}]}]     # the schema's shape
    assert dcgm_diag(document)[-1]["gpu_serials"] == ["1652222014738", "1652222014739"]
    assert "gpu_serials" not in dcgm_diag(json.loads((FIXTURES / "dcgmi-diag.json").read_text()))[-1]


def test_ras_mismatch_rank_lines_of_every_form():
    """client_support.cc's per-rank MISMATCH lines: `has status %s`, `has not launched any operations`,
    `[process information not found]` (lines 1507, 1628, 1516 at 5067397c)."""
    text = ("Communicators... (0.012s)\n=============\n\nWarnings\n========\n\n"
            "#0-0 (9e17999afaa87dbb) MISMATCH\n  Communicator ranks have different status\n"
            "  26 ranks have status NOCOMM\n"
            "  Rank 4 has status FINALIZE -- GPU 4 managed by process 507289 on node 172.16.64.210\n"
            "  Communicator ranks have different AllGather operation counts\n"
            "  Rank 9 has not launched any operations -- GPU 1 (NVML 3) managed by process 1598389 on node "
            "172.16.64.212\n"
            "  Rank 17 -- [process information not found]\n\n")
    (mismatch, summary) = nccl_ras.events(nccl_ras.parse(text))
    assert mismatch["ranks"] == [
        {"rank": 4, "gpu": "4", "pid": 507289, "host": "172.16.64.210", "reported": "FINALIZE"},
        {"rank": 9, "gpu": "1 (NVML 3)", "pid": 1598389, "host": "172.16.64.212", "reported": "not launched"},
        {"rank": 17}]
    assert mismatch["without_process_information"] == 1 and summary["status"] == "warn"


def test_ras_monitor_log_peer_events():
    """`ncclras -m` kept as a log: NCCL's documented PEER_DEAD line and lines from the format strings."""
    events = nccl_ras.monitor_events((FIXTURES / "ncclras-monitor.log").read_text().splitlines())
    assert [(e["test"], e["status"], e["at"], e["hosts"]) for e in events] == [
        ("peer_dead", "fail", "2025-12-19 13:07:07", ["172.16.64.245"]),        # PEER_NEW passed over
        ("peer_unresponsive", "warn", "2025-12-19 13:07:14", ["172.16.64.246"]),
        ("peer_send_stuck", "warn", "2025-12-19 13:07:19", ["172.16.64.246"]),
        ("peer_timeout_dead", "fail", "2025-12-19 13:08:15", ["172.16.64.246"])]
    assert events[0]["ranks"] == [{"pid": 1524345, "host": "172.16.64.245", "gpu": "1"}] and "message" not in events[0]
    assert events[1]["message"] == "peer not responding for 5s (connect timeout)" and "ranks" not in events[1]
    assert events[2]["message"] == "send operation stuck for 5s, terminating connection"
    assert [e["line"] for e in events] == [9, 11, 12, 13]
    assert [nccl_ras.not_responding(e) for e in events] == [True, True, False, True]


@pytest.mark.parametrize("name", ["ncclras-verbose.txt", "ncclras-docs-incomplete.txt", "ncclras-docs.json",
                                  "ncclras-monitor.log"])
def test_ras_any_cut_or_flipped_byte_is_a_report_or_a_named_refusal(name):
    """A stranger's file: cut anywhere, or with bytes changed, the parser answers with events or RasError,
    never another exception (every 37th cut, 300 seeded corruptions)."""
    import random

    data = (FIXTURES / name).read_bytes()
    rng = random.Random(0)
    variants = [data[:cut] for cut in range(0, len(data), 37)]
    for _ in range(300):
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        variants.append(bytes(mutated))
    for variant in variants:
        try:
            found = nccl_ras.events(nccl_ras.parse(variant))
        except nccl_ras.RasError:
            continue
        assert found[-1]["test"] == "summary" and all(e["type"] == event_types.HEALTH_CHECK for e in found)
        nccl_ras.monitor_events(variant.decode("utf-8", "replace").splitlines())


def test_dcgm_any_corrupted_document_is_events_or_a_named_refusal():
    """Seeded corruptions of the DCGM 4.x fixture's JSON values (types swapped at random): events or
    ReportError, never another exception, and the collector's families of what was read."""
    import random

    from trainguard.agent.collectors.health_reports import diag_families

    rng = random.Random(0)
    odd = [None, 7, "x", [1], {"a": 1}, True, 1.5, []]

    def corrupt(value):
        if rng.random() < 0.08:
            return rng.choice(odd)
        if isinstance(value, dict):
            return {k: corrupt(v) for k, v in value.items()}
        if isinstance(value, list):
            return [corrupt(v) for v in value]
        return value

    base = json.loads((FIXTURES / "dcgmi-diag.json").read_text())
    for _ in range(300):
        document = corrupt(base)
        try:
            events = dcgm_diag(document)
        except ReportError:
            continue
        assert events[-1]["test"] == "summary"
        assert len(diag_families(events, document, 0.0)) == 4           # what the collector exports of it
