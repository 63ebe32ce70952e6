"""Replay of node risk (trainguard/decide/node_risk.py): the recorded node logs' GPU and InfiniBand health
through the same rule the agent runs, its flags as replay actions beside the guard's and the meter's.

The agent's joined node log (RUN/tls/node-<host>.jsonl) holds, every interval, the gpu collector's
`hardware.gpus` (health counters, XIDs per code) and the ib collector's `system.ib_*`: exactly the reading
the live agent fed the rule (agent/node_risk.py reads the same fragments with the same `reading_from_tls`).
Only files that hold such records are read (a byte search first), and only lines naming GPUs are decoded.

`health_events` lists the other tools' findings the agents put on the node timelines (`health_check` events:
dcgmi diag, NCCL RAS, kernel NVRM lines; agent/health_timeline.py), for replay's node-health section.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path

from trainguard import event_types, safe_read, tls
from trainguard.decide import node_risk
from trainguard.policy import Policy
from trainguard.replay import engine, source

HEALTH_MARK = b'"%s"' % event_types.HEALTH_CHECK.encode()
HEALTH_KEPT = 1000      # findings listed (the count says how many there were)
MARKS = (b'"gpus"', b'"ib_symbol_errors"', b'"ib_link_downed"', b'"health_diag_isolate"')


def actions(files: list[Path], policy: Policy) -> list[engine.Action]:
    """The drains the node-risk rule decides over `files`' node records, in time order."""
    readings = sorted((r for path in files for r in _readings(path)), key=lambda r: (r.timestamp, r.node))
    return [engine.Action(v.action or node_risk.DRAIN_AT_CHECKPOINT, None, v.timestamp,
                          "node_risk" if v.flagged else "node_risk_suppressed", "node_risk", v.evidence())
            for v in node_risk.replay(readings, policy.node_risk) if v.flagged or v.suppressed]


@dataclass(frozen=True)
class HealthFinding:
    """One health_check event of a node's timeline."""

    timestamp: float
    node: str
    tool: str
    test: str
    status: str
    detail: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"timestamp": tls.format_timestamp(self.timestamp), "node": self.node, "tool": self.tool,
                "test": self.test, "status": self.status, "detail": self.detail}

    def describe(self) -> str:
        """The finding's own words: what it names (GPU, XID, ranks, host), in one line."""
        shown = [f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in self.detail.items()
                 if k in ("gpu", "xid", "pci", "action_class", "count", "communicator", "host", "hosts", "this_node",
                          "findings", "complete", "message") and v not in (None, "", [])]
        return " ".join(shown)[:160]


def health_events(files: list[Path]) -> tuple[list[HealthFinding], int]:
    """The first HEALTH_KEPT health_check events of the node logs among `files`, in time order, and how many
    there were (a byte search first: only lines naming the event type are decoded)."""
    found: list[HealthFinding] = []
    total = 0
    for path in files:
        if not path.name.startswith("node-"):
            continue
        for lineno, raw in source.lines_naming(path, (HEALTH_MARK,)):
            try:
                record = tls.decode(raw, str(path), lineno)
            except tls.TLSError:
                continue              # the main pass reports it
            event = record.get("event")
            if not isinstance(event, dict) or event.get("type") != event_types.HEALTH_CHECK:
                continue
            total += 1
            detail = {k: v for k, v in event.items() if k not in ("type", "tool", "test", "status", "ranks")}
            found.append(HealthFinding(float(record["timestamp"]), str(record.get("node", "")),
                                       str(event.get("tool", "")), str(event.get("test", "")),
                                       str(event.get("status", "")), detail))
    found.sort(key=lambda f: (f.timestamp, f.node))
    return found[:HEALTH_KEPT], total


def _readings(path: Path):
    if not _may_hold_health(path):
        return
    try:
        with tls.open_log(path) as handle:
            for lineno, raw in enumerate(handle, 1):
                if not any(mark in raw for mark in MARKS):
                    continue
                try:
                    record = tls.decode(raw, str(path), lineno)
                except tls.TLSError:
                    continue          # the main pass reports the malformed line, with its file and line
                reading = node_risk.reading_from_tls(record)
                if reading is not None:
                    yield reading
    except source.UNREADABLE:
        return                        # a compressed log cut short: the main pass reports where
    except OSError:
        return


def _may_hold_health(path: Path) -> bool:
    """A byte search before any line is read: a rank's log of a million steps names no GPU health."""
    if path.suffix in (".gz", ".zst"):
        return True               # compressed: only reading tells
    try:
        with safe_read.open_file(path, what="log file") as handle, \
                mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return any(data.find(mark) != -1 for mark in MARKS)
    except (OSError, ValueError):  # empty (mmap refuses length 0) or unreadable: the main pass says why
        return False
