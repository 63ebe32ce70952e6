"""Replay of the replica checks (trainguard/decide/replica.py): the recorded ``replica_check`` events
through a fresh monitor, its verdicts as replay actions beside the guard's and the meter's.

Only lines that name the event are decoded: a healthy log of a million steps holds a few thousand
checks, and a plain file without one is skipped by a byte search before any line is read.
"""

from __future__ import annotations

import mmap
from pathlib import Path

from trainguard import event_types, safe_read, tls
from trainguard.decide import replica
from trainguard.policy import Policy
from trainguard.replay import engine, source

MARK = b'"%s"' % event_types.REPLICA_CHECK.encode()


def actions(files: list[Path], policy: Policy) -> list[engine.Action]:
    """The rollbacks (and stops) the replica checks of `files` decide, in time order."""
    records = sorted((record for path in files for record in _check_records(path)),
                     key=lambda r: r["timestamp"])
    verdicts = replica.replay(records, replica.ReplicaPolicy(policy.guard.replica_cordon_window_seconds))
    return [engine.Action(v.action, v.step, v.timestamp, v.kind, "replica",
                          {"what": v.what, "ranks": list(v.ranks), "nodes": list(v.nodes),
                           "cordon": list(v.cordon), "confidence": v.confidence})
            for v in verdicts if v.action is not None]


def _check_records(path: Path):
    if not _may_hold_checks(path):
        return
    with tls.open_log(path) as handle:
        try:
            for lineno, raw in enumerate(handle, 1):
                if MARK in raw:
                    try:
                        yield tls.decode(raw, str(path), lineno)
                    except tls.TLSError:
                        continue      # the main pass reports the malformed line, with its file and line
        except source.UNREADABLE:
            return                    # a compressed log cut short: the main pass reports where


def _may_hold_checks(path: Path) -> bool:
    if path.suffix in (".gz", ".zst"):
        return True               # compressed: only reading tells
    try:
        with safe_read.open_file(path, what="log file") as handle, \
                mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return data.find(MARK) != -1
    except (OSError, ValueError):  # empty (mmap refuses length 0) or unreadable: the main pass says why
        return False
