"""Other tools' verdicts on a node's health as TLS events on its timeline: `dcgmi diag -j` and the kernel log's
NVRM lines. Pure (text or decoded JSON in, event records out); docs/node-risk.md says how to feed them.

Each finding is a ``health_check`` event (trainguard/event_types.py) with ``tool``, ``status``
(pass | warn | fail | skip), the GPU where the tool names one, and what the tool said; ``action_class``
carries the class of action the finding calls for in the XID catalogue's words (trainguard/xid_catalog.py:
application_error, driver_firmware, gpu_reset, node_drain), so a timeline reads the same whoever found it.

Formats, from their sources:

- ``dcgmi diag -j``: DCGM 3.x/4.x write ``{"DCGM Diagnostic": {"test_categories": [{"category", "tests":
  [{"name", "results": [{"entity_group", "entity_group_id", "entity_id", "status", "warnings": [{"error_id",
  "error_category", "error_severity", "warning"}]}], "test_summary": {"status"}}]}]}, "metadata": {...}}``
  (NVIDIA/DCGM testing/python3/dcgm_diag_schema.json); DCGM 1.x/2.x wrote ``"DCGM GPU Diagnostic"`` with
  ``results: [{"gpu_ids", "status": PASS|FAIL|WARN|SKIPPED, "warnings": [text]}]`` (nvvs/include/NvvsCommon.h).
  ``error_severity`` is DCGM's dcgmErrorSeverity_t (DCGM docs, "Diagnostic Errors"): 1 MONITOR, 2 ISOLATE,
  3 UNKNOWN, 4 TRIAGE, 5 CONFIG, 6 RESET.
- kernel log (``dmesg``, ``journalctl -k``, /dev/kmsg records): ``NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen
  off the bus.``, ``NVRM: GPU 0000:2b:00.0: GPU has fallen off the bus.``, ``NVRM: GPU at PCI:0000:2b:00:
  GPU-<uuid>`` (which GPU a PCI address is).

NCCL's RAS client (``ncclras``, NCCL 2.24+) is read by trainguard/nccl_ras.py.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from trainguard import event_types, xid_catalog

DCGMI = "dcgmi diag"
KERNEL = "kernel log"
PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"
_STATUS = {"pass": PASS, "fail": FAIL, "warn": WARN, "warning": WARN, "skip": SKIP, "skipped": SKIP,
           "not run": SKIP, "not_run": SKIP}
# dcgmErrorSeverity_t -> the action class it calls for
DCGM_SEVERITY = {1: ("monitor", None), 2: ("isolate", xid_catalog.DRAIN), 3: ("unknown", None),
                 4: ("triage", None), 5: ("config", xid_catalog.DRIVER), 6: ("reset", xid_catalog.RESET)}


class ReportError(ValueError):
    """A document that is not the format it claims (names the field)."""


def dcgm_diag(document: Any) -> list[dict[str, Any]]:
    """`dcgmi diag -j`'s findings as health_check events: one per result that did not pass, then a summary."""
    if not isinstance(document, dict):
        raise ReportError("dcgmi diag -j: expected a JSON object")
    root = document.get("DCGM Diagnostic", document.get("DCGM GPU Diagnostic"))
    if not isinstance(root, dict):
        raise ReportError("dcgmi diag -j: no 'DCGM Diagnostic' (or 'DCGM GPU Diagnostic') object")
    metadata = document.get("metadata") if isinstance(document.get("metadata"), dict) else {}
    version = metadata.get("version") or root.get("version")
    version = version if isinstance(version, str) else None
    events: list[dict[str, Any]] = []
    tests = failed = 0
    if isinstance(root.get("runtime_error"), str):
        events.append(_event(DCGMI, FAIL, test="runtime", message=root["runtime_error"]))
    for c, category in enumerate(_list(root.get("test_categories"), "test_categories")):
        for t, test in enumerate(_list(category.get("tests"), f"test_categories[{c}].tests")):
            name = str(test.get("name", f"test {t}"))
            tests += 1
            for result in _list(test.get("results"), f"test_categories[{c}].tests[{t}].results"):
                status = _status(result.get("status"))
                if status in (PASS, SKIP):
                    continue
                failed += status == FAIL
                events.append(_dcgm_finding(str(category.get("category", "")), name, status, result))
    overall = FAIL if failed else WARN if events else PASS
    # the document names no host: the GPUs' serial numbers (DCGM 4.x entity_groups) say whose GPUs it tested
    serials = sorted({str(e["serial_num"]) for g in _list(document.get("entity_groups"), "entity_groups")
                      for e in _list(g.get("entities"), "entity_groups[].entities") if e.get("serial_num")})
    events.append(_event(DCGMI, overall, test="summary", tests=tests, findings=len(events),
                         **({"version": version} if version else {}), **({"gpu_serials": serials} if serials else {})))
    return events


def _dcgm_finding(category: str, test: str, status: str, result: dict) -> dict[str, Any]:
    fields: dict[str, Any] = {"category": category, "test": test}
    if "entity_id" in result:
        fields["gpu" if result.get("entity_group", "GPU") == "GPU" else "entity"] = result["entity_id"]
    elif "gpu_ids" in result:
        fields["gpu"] = result["gpu_ids"]
    warnings = []
    classes = set()
    given = result.get("warnings")
    for warning in given if isinstance(given, list) else ():
        if isinstance(warning, dict):
            severity = warning.get("error_severity")
            severity = severity if isinstance(severity, int) else None      # a list or object is no severity
            name, action_class = DCGM_SEVERITY.get(severity, ("unknown", None))
            if action_class:
                classes.add(action_class)
            warnings.append({"error_id": warning.get("error_id"), "category": warning.get("error_category"),
                             "severity": name, "message": str(warning.get("warning", ""))})
        else:
            warnings.append({"message": str(warning)})
    fields["warnings"] = warnings
    for action_class in (xid_catalog.DRAIN, xid_catalog.RESET, xid_catalog.DRIVER):
        if action_class in classes:
            fields["action_class"] = action_class
            break
    return _event(DCGMI, status, **fields)


_PCI = r"([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.[0-9a-fA-F])?"
_XID = re.compile(r"NVRM: Xid \(PCI:" + _PCI + r"\): (\d+),\s*(.*)")
_FALLEN = re.compile(r"NVRM: GPU (?:at )?(?:PCI:)?" + _PCI + r":? (?:has fallen|GPU has fallen) off the bus")
_IDENTITY = re.compile(r"NVRM: GPU at PCI:" + _PCI + r": (GPU-[0-9a-fA-F-]+)")
_KMSG_HEAD = re.compile(r"^\d+,\d+,(\d+),[^;]*;")                  # /dev/kmsg: level,seq,usec,flags;
_DMESG_TIME = re.compile(r"^\[\s*(\d+\.\d+)\]\s*")                 # dmesg: [seconds since boot]
# The host a forwarded or aggregated log names: syslog's "Mar 15 14:22:18 gpu-node-01 kernel: ...", RFC 3339
# "2026-04-22T21:25:20.45Z gpu-node-01 kernel: ...", Talos' "192.168.11.119: kern: warning: [...]: ..."
_HOST = (re.compile(r"^(?:[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d|\d{4}-\d\d-\d\dT\S+) (\S+) kernel:"),
         re.compile(r"^(\S+): kern:\s"))


def kernel_log(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The NVRM lines of a kernel log as health_check events, in order; other lines are passed over.
    ``uptime_seconds`` is the kernel's clock where the line has one (dmesg, /dev/kmsg); ``host`` the host a
    forwarded line names (syslog, Talos), so a log gathered from several nodes says whose line it is."""
    events: list[dict[str, Any]] = []
    uuids: dict[str, str] = {}
    for number, raw in enumerate(lines, 1):
        line, clock = _strip_head(raw.rstrip("\n"))
        if "NVRM:" not in line:
            continue
        found = _IDENTITY.search(line)
        if found:
            uuids[_pci(found)] = found.group(4)
            continue
        found = _XID.search(line)
        if found:
            code = int(found.group(4))
            pci = _pci(found)
            events.append(_event(KERNEL, FAIL if xid_catalog.class_of(code) in (xid_catalog.DRAIN, xid_catalog.RESET)
                                 else WARN, test="xid", xid=code, pci=pci, action_class=xid_catalog.class_of(code),
                                 message=found.group(5).strip(), line=number, **_extra(pci, uuids, clock, raw)))
            continue
        found = _FALLEN.search(line)
        if found:
            pci = _pci(found)
            events.append(_event(KERNEL, FAIL, test="fallen_off_the_bus", pci=pci, action_class=xid_catalog.DRAIN,
                                 message="GPU has fallen off the bus", line=number, **_extra(pci, uuids, clock, raw)))
    return events


def as_records(events: Iterable[dict[str, Any]], node: str, timestamp: float) -> list[dict[str, Any]]:
    """TLS records of these events on `node`'s timeline at `timestamp` (when the report was read)."""
    return [{"timestamp": timestamp, "node": node, "event": event} for event in events]


def _strip_head(line: str) -> tuple[str, float | None]:
    kmsg = _KMSG_HEAD.match(line)
    if kmsg:
        return line[kmsg.end():], int(kmsg.group(1)) / 1e6
    dmesg = _DMESG_TIME.search(line)
    if dmesg:
        return line[dmesg.end():], float(dmesg.group(1))
    return line, None


def _pci(found: re.Match) -> str:
    domain, bus, device = found.group(1), found.group(2), found.group(3)
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}"


def host_of(line: str) -> str | None:
    """The host a forwarded kernel log line names in its header, None where it names none."""
    for pattern in _HOST:
        found = pattern.match(line)
        if found:
            return found.group(1)
    return None


def _extra(pci: str, uuids: dict[str, str], clock: float | None, raw: str) -> dict[str, Any]:
    host = host_of(raw)
    out: dict[str, Any] = {"host": host} if host else {}
    if pci in uuids:
        out["uuid"] = uuids[pci]
    if clock is not None:
        out["uptime_seconds"] = clock
    return out


def _event(tool: str, status: str, **fields: Any) -> dict[str, Any]:
    return {"type": event_types.HEALTH_CHECK, "tool": tool, "status": status, **fields}


def _status(value: Any) -> str:
    return _STATUS.get(str(value).strip().lower(), WARN)


def _list(value: Any, where: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ReportError(f"dcgmi diag -j: {where}: expected a list")
    return [item for item in value if isinstance(item, dict)]
