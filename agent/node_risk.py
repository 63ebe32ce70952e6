"""The agent's side of node risk: its node's readings through decide/node_risk.py, on /metrics, and each flag to
the action that drains the node at the next checkpoint.

Every `interval` a daemon thread joins the collectors' latest TLS fragments exactly as the node log does
(nodelog.join_fragments: the gpu collector's hardware.gpus, the ib collector's system.ib_*), reads them with
`reading_from_tls` (the same function replay uses on the recorded node log) and feeds the rule. A flagged
verdict goes to `on_flag` (the composition root wires the drain action there); the fleet's circuit breaker
counts the flags other agents made, which `known_flags` reads (the signed node-risk cordons of the last hour).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Mapping

from prometheus_client.core import Metric

from trainguard import log as tglog
from trainguard.agent.nodelog import join_fragments
from trainguard.agent.stop_signal import StopSignal
from trainguard.decide.node_risk import SIGNALS, NodeRisk, NodeRiskPolicy, RiskVerdict, reading_from_tls
from trainguard.metrics.families import LabelCache, Spec

SCORE = Spec("gauge", "trainguard_node_risk_score", "This node's hardware risk score (0-1) from its GPU, ECC, "
             "PCIe, NVLink, InfiniBand and thermal trends (decide/node_risk.py).")
SIGNAL = Spec("gauge", "trainguard_node_risk_signal", "Each signal's weighted contribution to the node's risk "
              "score now (0 when it contributes nothing).", ["signal"])
AT_RISK = Spec("gauge", "trainguard_node_at_risk", "1 while the node is at risk: its score at or above the "
               "threshold for the configured number of readings in a row.")
STREAK = Spec("gauge", "trainguard_node_risk_streak", "Readings in a row with the score at or above the threshold.")
SETTLING = Spec("gauge", "trainguard_node_risk_settling", "1 while the rule ignores the soft signals after a "
                "restart, a gap in readings or a GPU back from lost (a reboot's transient).")
FLAGS = Spec("counter", "trainguard_node_risk_flags", "Times this node was flagged at risk (each asks for a drain "
             "at the next checkpoint).")
SUPPRESSED = Spec("counter", "trainguard_node_risk_suppressed", "Times this node was at risk but not flagged: the "
                  "fleet's budget of flags per hour was spent (circuit breaker).")


class NodeRiskWatch:
    """The rule over this node's joined fragments, a reading every `interval` seconds."""

    def __init__(self, fragments: Callable[[], Mapping[str, dict]], node: str, policy: NodeRiskPolicy, *,
                 interval: float = 10.0, on_flag: Callable[[RiskVerdict], None] | None = None,
                 known_flags: Callable[[], Iterable[float]] | None = None, clock: Callable[[], float] = time.time):
        self.fragments, self.node, self.interval = fragments, node, interval
        self.rule = NodeRisk(policy)
        self.on_flag, self.known_flags, self.clock = on_flag, known_flags, clock
        self.last: RiskVerdict | None = None
        self.flags = self.suppressed = 0
        self._log = tglog.get("agent.node_risk", node=node)
        self._stop = StopSignal()
        self._thread: threading.Thread | None = None
        self._signal_labels = LabelCache(["signal"])

    def observe_once(self, now: float | None = None) -> RiskVerdict | None:
        """One reading through the rule; None when no collector reports GPU or IB health here."""
        now = self.clock() if now is None else now
        record = join_fragments(self.fragments(), self.node, now)
        record["timestamp"] = now
        reading = reading_from_tls(record)
        if reading is None:
            return None
        self._seed_breaker(now)
        verdict = self.last = self.rule.observe(reading)
        if verdict.suppressed:
            self.suppressed += 1
            self._log.warning("node at risk, not flagged: the fleet's flags of this hour are spent",
                              **verdict.evidence())
        if verdict.flagged:
            self.flags += 1
            self._log.error("node at risk: drain at the next checkpoint", **verdict.evidence())
            if self.on_flag is not None:
                self.on_flag(verdict)
        return verdict

    def _seed_breaker(self, now: float) -> None:
        """The fleet's flags of the last hour (other agents' cordons) into the rule's circuit breaker."""
        if self.known_flags is None:
            return
        mine = set(self.rule.flags)
        for when in self.known_flags():
            if now - 3600.0 < when <= now and when not in mine:
                self.rule.note_flag(when)
        self.rule.flags = type(self.rule.flags)(sorted(self.rule.flags))

    def start(self) -> "NodeRiskWatch":
        self._thread = threading.Thread(target=self._loop, name="agent-node-risk", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.observe_once()
            except Exception as exc:     # the watch must never take the agent down; it says so and goes on
                self._log.error("node risk reading failed", error=f"{type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def families(self) -> list[Metric]:
        verdict = self.last
        out = [FLAGS.value(self.flags), SUPPRESSED.value(self.suppressed)]
        if verdict is None:
            return out
        signals = verdict.signals
        return out + [SCORE.value(verdict.score), AT_RISK.value(1 if verdict.at_risk else 0),
                      STREAK.value(verdict.streak), SETTLING.value(1 if verdict.settling else 0),
                      SIGNAL.family((self._signal_labels.get(name), signals.get(name, 0.0)) for name in SIGNALS)]


class Drain:
    """What a flag sets going on this node: the drain request through the executor (its ledger, its shadow
    gate, its signed request), then, once rank 0 has acknowledged that request (signed) and a checkpoint
    saved after it verifies under the run's key, this node's signed cordon and the end of its launcher
    (agent/evict.py: the elastic launchers re-form the job without it, from that checkpoint).

    In shadow mode the executor records the drain as a ``shadow_action`` and writes no request, so no rank
    acknowledges it and nothing here is ever cordoned or ended: the one gate is the executor's."""

    def __init__(self, run_dir, host: str, submit: Callable[[list], list], request_id: Callable[[object], str],
                 *, key_file=None, wait_seconds: float = 900.0, poll_seconds: float = 0.2,
                 grace_seconds: float = 5.0, clock: Callable[[], float] = time.time):
        self.run_dir, self.host, self.submit, self.request_id = run_dir, host, submit, request_id
        self.key_file, self.wait_seconds, self.poll_seconds = key_file, wait_seconds, poll_seconds
        self.grace_seconds, self.clock = grace_seconds, clock
        self.done: list[dict] = []          # what each follow-up did (the test's and /healthz's view)
        self._log = tglog.get("agent.node_risk", node=host)
        self._threads: list[threading.Thread] = []

    def __call__(self, verdict: RiskVerdict) -> None:
        from trainguard.decide.ledger import FIRING, Notice

        notice = Notice(alertname="NodeAtRisk", status=FIRING, action=verdict.action, source="embedded",
                        key=f"node_risk:{verdict.node}@{verdict.timestamp:.3f}", starts_at=verdict.timestamp,
                        reason="node_risk", labels={"node": verdict.node})
        for decided in self.submit([notice]) or ():
            if getattr(decided, "action", None) != verdict.action or getattr(decided, "shadow", False):
                continue            # refused or escalated by the ledger, or only recorded (shadow): no request
            thread = threading.Thread(target=self.follow, args=(self.request_id(decided), self.clock()),
                                      name="agent-drain", daemon=True)
            self._threads.append(thread)
            thread.start()

    def follow(self, request_id: str, issued_at: float) -> dict:
        """Wait for the ranks' checkpoint of `request_id`, then cordon this node and end its launcher."""
        from trainguard import rundir
        from trainguard.agent import evict
        from trainguard.runtime import cordon_key

        key, where = cordon_key.signing_key(self.key_file)
        outcome: dict = {"id": request_id, "host": self.host}
        deadline = self.clock() + self.wait_seconds
        checkpoint = None
        while self.clock() < deadline:
            if request_id in rundir.read_acked(self.run_dir, key):
                checkpoint = self._checkpoint_after(issued_at, key)
                if checkpoint is not None:
                    break
            time.sleep(self.poll_seconds)
        if checkpoint is None:
            outcome["outcome"] = "no_checkpoint"
            self._log.error("drain: no verified checkpoint of the request in time; the node is not cordoned",
                            id=request_id, waited_seconds=self.wait_seconds, key=where)
            self.done.append(outcome)
            return outcome
        outcome["checkpoint_step"] = checkpoint
        try:
            outcome["cordon_file"] = str(evict.cordon(self.run_dir, self.host, incident=None, reason="node_risk",
                                                 by=self.host, key_file=self.key_file))
            outcome.update(evict.end_launcher(self.run_dir, self.host, grace_seconds=self.grace_seconds))
            outcome["outcome"] = "drained"
        except (OSError, evict.CannotCordon) as exc:
            outcome.update(outcome="failed", error=str(exc))
        self._log.warning("drain at checkpoint", **{k: v for k, v in outcome.items() if k != "id"}, id=request_id)
        self.done.append(outcome)
        return outcome

    def _checkpoint_after(self, issued_at: float, key: bytes | None) -> int | None:
        """The step of the last save when it succeeded after `issued_at` and its checkpoint verifies."""
        from trainguard import rundir, tls
        from trainguard.runtime.checkpoint import keys
        from trainguard.runtime.checkpoint.verification import verify_dir

        status = rundir.read_checkpoint_status(self.run_dir)
        if not isinstance(status, dict) or status.get("ok") is not True or key is None:
            return None
        try:
            saved_at = tls.parse_timestamp(status.get("time"))
            step, path = int(status["step"]), Path(str(status["path"]))
        except (KeyError, TypeError, ValueError, tls.TLSError):
            return None
        if saved_at + 1.0 < issued_at:      # a save from before the request (1 s: the two clocks' rounding)
            return None
        if path.parent.resolve() != rundir.checkpoints_dir(self.run_dir).resolve():
            return None                     # the status is not signed: it may only point into this run
        result = verify_dir(path, key, keys.key_id(key), deep=False)    # the manifest's signature, its step
        return step if result.ok and result.step == step else None

    def join(self, timeout: float = 5.0) -> None:
        for thread in self._threads:
            thread.join(timeout)
