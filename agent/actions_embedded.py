"""The embedded default: the agent acts on its own, without Prometheus or Alertmanager.

Two sources feed the same executor (and so the same ledger) as the webhook:

- the cost meter the training collector runs on the lead rank's steps (trainguard.decide.cost): each
  tier decision (cost_warn, cost_throttle, cost_stop) arrives through the agent's decision handlers;
- a stall watchdog: this node's ranks are alive (RUN/control/ranks) and have written since they started,
  but none has written a TLS record for `alerts.stall_seconds` -> restore; or they started more than
  `alerts.startup_grace_seconds` ago and have written nothing since (hung while joining) -> restore.

With Prometheus running too, the `CostBudget*` and `TrainingStalled` alerts see the same things a little
later; the ledger makes each cost tier act once whichever path saw it first, and joins a second restore
within the cooldown to the first.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Callable

from trainguard import actions
from trainguard import log as tglog
from trainguard.agent import restore
from trainguard.agent.stop_signal import StopSignal
from trainguard.decide.decision import Decision
from trainguard.decide.ledger import FIRING, Notice
from trainguard.tls import format_timestamp

# The alert each embedded decision stands in for: the records name it, as an alert's would.
ALERT_OF = {actions.COST_WARN: "CostBudgetWarn", actions.COST_THROTTLE: "CostBudgetThrottle",
            actions.COST_STOP: "CostBudgetStop", actions.RESTORE: "TrainingStalled"}


def cost_notice(decision: Decision) -> Notice:
    """A cost meter decision as a notice; its key is the tier, which acts once per run."""
    return Notice.from_decision(decision, ALERT_OF[decision.action], key=f"embedded:{decision.action}")


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
    """restore when this node's live ranks have gone `stall_seconds` without a TLS write."""

    def __init__(self, run_dir: str | Path, stall_seconds: float, submit: Callable[[list[Notice]], object],
                 host: str | None = None, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, startup_grace_seconds: float = 900.0):
        self.run_dir = Path(run_dir)
        self.stall_seconds, self.startup_grace_seconds = stall_seconds, startup_grace_seconds
        self.submit, self.clock, self.monotonic = submit, clock, monotonic
        # The newest write seen (its mtime) and when, on the monotonic clock, this watchdog would have seen
        # it: idle time is measured on that clock from there, so a step of the wall clock (NTP) is no stall.
        self._seen: tuple[float, float] | None = None
        self.host = host or socket.gethostname()
        self.interval = max(0.5, min(5.0, stall_seconds / 4))
        self._stop = StopSignal()
        self._thread: threading.Thread | None = None
        self._last_key: str | None = None     # one notice per stall, not one per check
        self._rank_files = restore.RankFiles(self.run_dir)
        self.log = tglog.get("agent.stall_watchdog")

    def check(self) -> Notice | None:
        """The restore notice if the node is stalled now, else None."""
        live = restore.local_ranks(self._rank_files.read(), self.host)
        if not live:
            return None
        last = self._last_write([info.rank for info, _ in live])
        started = max(info.started_at for info, _ in live)
        if last is None or last < started:
            return self._hung_starting(started)
        now = self.clock()
        idle = self._idle_seconds(last, now)
        if idle <= self.stall_seconds:
            return None
        return _restore(f"embedded:stall@{format_timestamp(last)}", now,
                        f"no TLS record from this node's ranks for {idle:.0f}s")

    def _hung_starting(self, started: float) -> Notice | None:
        """Ranks that have not written since they started are starting (imports, rendezvous, resume), until
        the start-up grace is over: a rank hung while joining would otherwise wait out the join timeout."""
        now = self.clock()
        waiting = now - started
        if waiting <= self.startup_grace_seconds:
            return None
        return _restore(f"embedded:startup@{format_timestamp(started)}", now,
                        f"this node's ranks started {waiting:.0f}s ago and have written no TLS record since")

    def _idle_seconds(self, last: float, now: float) -> float:
        """Seconds since the ranks' newest write. A write first seen now is dated by the wall clock (how old
        the file already is, never less than 0); from then on the monotonic clock counts."""
        monotonic = self.monotonic()
        if self._seen is None or self._seen[0] != last:
            self._seen = (last, monotonic - max(0.0, now - last))
        return monotonic - self._seen[1]

    def _last_write(self, rank_ids: list[int]) -> float | None:
        times = []
        for rank in rank_ids:
            try:
                times.append((self.run_dir / "tls" / f"rank-{rank}.jsonl").stat().st_mtime)
            except FileNotFoundError:
                continue
        return max(times) if times else None

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
                    self.submit([notice])
            except Exception as exc:   # the watchdog must outlive one bad read
                self.log.error("stall check failed", error=f"{type(exc).__name__}: {exc}")


def _restore(key: str, now: float, reason: str) -> Notice:
    """The watchdog's restore notice (one per `key`: the loop submits a key once)."""
    return Notice(alertname=ALERT_OF[actions.RESTORE], status=FIRING, action=actions.RESTORE, key=key,
                  starts_at=now, source="embedded", reason=reason)


def install(agent, executor, policy, config) -> StallWatchdog:
    """Wire the embedded path into a running agent; returns the (started) watchdog."""
    agent.add_decision_handler(DecisionHandler(executor.submit))
    watchdog = StallWatchdog(config.run_dir, policy.alerts.stall_seconds, executor.submit,
                             startup_grace_seconds=policy.alerts.startup_grace_seconds).start()
    tglog.get("agent.embedded", node=config.node).info(
        "embedded actions on", cost="training collector's meter", stall_seconds=policy.alerts.stall_seconds)
    return watchdog
