"""Replay of node risk (trainguard/decide/node_risk.py): the recorded node logs' GPU and InfiniBand health
through the same rule the agent runs, its flags as replay actions beside the guard's and the meter's.

The agent's joined node log (RUN/tls/node-<host>.jsonl) holds, every interval, the gpu collector's
`hardware.gpus` (health counters, XIDs per code) and the ib collector's `system.ib_*`: exactly the reading
the live agent fed the rule (agent/node_risk.py reads the same fragments with the same `reading_from_tls`).
Only files that hold such records are read (a byte search first), and only lines naming GPUs are decoded.
"""

from __future__ import annotations

import mmap
from pathlib import Path

from trainguard import safe_read, tls
from trainguard.decide import node_risk
from trainguard.policy import Policy
from trainguard.replay import engine, source

MARKS = (b'"gpus"', b'"ib_symbol_errors"', b'"ib_link_downed"')


def actions(files: list[Path], policy: Policy) -> list[engine.Action]:
    """The drains the node-risk rule decides over `files`' node records, in time order."""
    readings = sorted((r for path in files for r in _readings(path)), key=lambda r: (r.timestamp, r.node))
    return [engine.Action(v.action or node_risk.DRAIN_AT_CHECKPOINT, None, v.timestamp,
                          "node_risk" if v.flagged else "node_risk_suppressed", "node_risk", v.evidence())
            for v in node_risk.replay(readings, policy.node_risk) if v.flagged or v.suppressed]


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
