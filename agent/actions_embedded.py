"""The embedded default: the agent acts on its own, without Prometheus or Alertmanager.

Two sources feed the same executor (and so the same ledger) as the webhook:

- the cost meter the training collector runs on the lead rank's steps (trainguard.decide.cost): each
  tier decision (cost_warn, cost_throttle, cost_stop) arrives through the agent's decision handlers;
- a stall watchdog: this node's ranks are alive (RUN/control/ranks) and have reached a step since they
  started, but none has advanced a step for `alerts.stall_seconds` -> restore; or they started more than
  `alerts.startup_grace_seconds` ago and have reached no step since (hung while joining) -> restore. The
  rule is trainguard/decide/stall.py, which `replay` runs too. Before the restore, the culprit is named
  (agent/culprit.py) and, with `restore.evict`, its node kept out instead.

With Prometheus running too, the `CostBudget*` and `TrainingStalled` alerts see the same things a little
later; the ledger makes each cost tier act once whichever path saw it first, and joins a second restore
within the cooldown to the first.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Callable

from trainguard import rundir, safe_read
from trainguard import actions
from trainguard import log as tglog
from trainguard.agent import restore
from trainguard.agent.stop_signal import StopSignal
from trainguard.decide import stall
from trainguard.decide.decision import Decision
from trainguard.decide.embedded import cost_notice
from trainguard.decide.ledger import FIRING, Notice
from trainguard.node import node_name
from trainguard.tls import format_timestamp, parse_timestamp

class DecisionHandler:
    """The agent's decision handler: cost tier decisions into the executor."""

    def __init__(self, submit: Callable[[list[Notice]], object]):
        self.submit = submit
        self.log = tglog.get("agent.embedded")

    def __call__(self, decision: Decision) -> None:
        if decision.action not in actions.COST_ORDER:
            self.log.warning("embedded decision without a remote action ignored", action=decision.action,
                             reason=decision.reason)
            return
        self.submit([cost_notice(decision)])


class StallWatchdog:
    """restore when this node's live ranks have not advanced a step for `stall_seconds` (decide/stall.py).

    Before the restore is submitted, `investigate` (agent/culprit.py) gathers the evidence and names the
    culprit; it returns the notice to submit (the usual restore), or None when the culprit's node is
    being kept out instead (eviction) and nothing else must be ended here.
    """

    def __init__(self, run_dir: str | Path, stall_seconds: float, submit: Callable[[list[Notice]], object],
                 host: str | None = None, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, startup_grace_seconds: float = 900.0,
                 investigate: Callable[[stall.Stall, list], Notice | None] | None = None):
        self.run_dir = Path(run_dir)
        self.stall_seconds, self.startup_grace_seconds = stall_seconds, startup_grace_seconds
        self.submit, self.clock, self.monotonic = submit, clock, monotonic
        self.investigate = investigate
        # Per rank: (step, when this watchdog's monotonic clock would have seen it reached). Idle time is
        # measured on that clock, so a step of the wall clock (NTP) is no stall.
        self._seen: dict[int, tuple[int | None, float | None, float | None]] = {}   # + the record's time
        self.host = host or node_name()
        self.interval = max(0.5, min(5.0, stall_seconds / 4))
        self._stop = StopSignal()
        self._thread: threading.Thread | None = None
        self._last_key: str | None = None     # one notice per stall, not one per check
        self._rank_files = restore.host_rank_files(self.run_dir, self.host)   # shared with the actions
        self.log = tglog.get("agent.stall_watchdog")

    def progress(self) -> list[tuple[stall.RankProgress, object]]:
        """Each live local rank's progress on the monotonic clock, with its rank file info."""
        live = restore.local_ranks(self._rank_files.read(), self.host)
        now, monotonic = self.clock(), self.monotonic()
        out = []
        for info, _ in live:
            step, at, ended_at = rank_progress(rundir.rank_log(self.run_dir, info.rank))
            if ended_at is not None and ended_at >= info.started_at:
                continue        # this attempt has finished (or was stopped) and is leaving: not stalled
            seen = self._seen.get(info.rank)
            if seen is None or seen[0] != step:
                seen = (step, None if at is None else monotonic - max(0.0, now - at), at)
                self._seen[info.rank] = seen
            started = monotonic - max(0.0, now - info.started_at)
            out.append((stall.RankProgress(info.rank, seen[0], seen[1], started), info))
        return out

    def check(self) -> Notice | None:
        """The restore notice if the node is stalled now, else None (the decision: decide/stall.py)."""
        progress = self.progress()
        found = stall.decide([p for p, _ in progress], self.monotonic(), self.stall_seconds,
                             self.startup_grace_seconds)
        if found is None:
            return None
        if found.step is None:      # hung while starting: keyed by the newest start, on the wall clock
            since = max(info.started_at for _, info in progress)
            return _restore(f"embedded:startup@{format_timestamp(since)}", self.clock(), found.reason)
        # keyed by the newest step record as the rank wrote it: the same stall gives the same key
        newest = max((p for p, _ in progress if p.advanced_at is not None), key=lambda p: p.advanced_at)
        written = self._seen[newest.rank][2] or 0.0
        return _restore(f"embedded:stall@{format_timestamp(written)}", self.clock(), found.reason)

    def _stalled(self, notice: Notice) -> None:
        """A new stall: name the culprit first (evidence before anything is ended), then act."""
        if self.investigate is not None:
            live = [info for _, info in self.progress()]
            notice = self.investigate(notice, live)
        if notice is not None:
            self.submit([notice])

    def start(self) -> "StallWatchdog":
        self._thread = threading.Thread(target=self._loop, name="stall-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                notice = self.check()
                if notice is not None and notice.key != self._last_key:
                    self._last_key = notice.key
                    self._stalled(notice)
            except Exception as exc:   # the watchdog must outlive one bad read
                self.log.error("stall check failed", error=f"{type(exc).__name__}: {exc}")


TAIL_BYTES = 64 * 1024


def last_step(path: Path) -> tuple[int | None, float | None]:
    """(step, timestamp) of the newest step record (one with `metrics`) in the tail of a rank's TLS log."""
    step, at, _ = rank_progress(path)
    return step, at


def rank_progress(path: Path) -> tuple[int | None, float | None, float | None]:
    """(step, timestamp, ended_at) from the tail of a rank's TLS log: the newest step record, and when a
    ``run_end`` or ``stop`` event came after it (the rank is leaving: not a stall), else None."""
    try:
        with safe_read.open_file(path, what="log file") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - TAIL_BYTES))
            lines = handle.read(TAIL_BYTES).splitlines()
    except FileNotFoundError:
        return None, None, None
    ended_at = None
    for raw in reversed(lines):
        try:
            record = json.loads(raw)
        except ValueError:
            continue        # the first line of the tail is usually cut, the last may be half-written
        if not isinstance(record, dict):
            continue
        event = record.get("event")
        if isinstance(event, dict) and event.get("type") in stall.ENDED_EVENTS:
            try:
                ended_at = parse_timestamp(record.get("timestamp"))
            except (ValueError, TypeError):
                ended_at = None
        if isinstance(record.get("metrics"), dict) and "step" in record:
            try:
                return int(record["step"]), parse_timestamp(record.get("timestamp")), ended_at
            except (ValueError, TypeError):
                return int(record["step"]), None, ended_at
    return None, None, ended_at


def _restore(key: str, now: float, reason: str) -> Notice:
    """The watchdog's restore notice (one per `key`: the loop submits a key once)."""
    return Notice(alertname=actions.ALERT_OF[actions.RESTORE], status=FIRING, action=actions.RESTORE, key=key,
                  starts_at=now, source="embedded", reason=reason)
