"""What the checkpoint autopilot reads from disk: a run's own log, and the earlier runs of its runs root.

The rule itself (trainguard/decide/checkpoint_interval.py) is pure; this module feeds it records. A
malformed line is left out (the run's own `trainguard goodput` names it); an unreadable log of an earlier
run is skipped, so a stranger's broken run directory beside yours costs the prior that run, nothing more.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from trainguard import rundir, tls
from trainguard.decide.checkpoint_interval import History, history_of


def records(path: str | os.PathLike) -> Iterator[dict]:
    """The decoded records of one TLS file (none when it does not exist yet)."""
    if not Path(path).is_file():
        return
    try:
        for line in tls.iter_lines(path):
            if line.record is not None:
                yield line.record
    except (OSError, ValueError):
        return


def timed(record: dict) -> dict:
    """A record as the trainer writes it (an RFC 3339 timestamp), as the rule reads it (Unix seconds)."""
    stamp = record.get("timestamp")
    return record if isinstance(stamp, (int, float)) else {**record, "timestamp": tls.parse_timestamp(stamp)}


def earlier_runs(run_dir: str | os.PathLike, limit: int) -> History | None:
    """The failures and GPU-seconds of the `limit` most recent other runs of `run_dir`'s parent (rank 0's
    log each), or None with none to read."""
    if limit <= 0:
        return None
    here = Path(run_dir).resolve()
    found = []
    try:
        for sibling in here.parent.iterdir():
            log = rundir.rank_log(sibling, 0)
            if sibling.resolve() != here and log.is_file():
                found.append((log.stat().st_mtime, log))
    except OSError:
        return None
    logs = [log for _, log in sorted(found, reverse=True)[:limit]]
    if not logs:
        return None
    return history_of(records(log) for log in logs)
