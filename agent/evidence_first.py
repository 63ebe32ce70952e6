"""Evidence before ending: an Alertmanager restore gathers the incident's evidence, then ends ranks.

The embedded watchdog gathers a stall's evidence before it submits its restore (agent/actions_embedded.py);
an Alertmanager restore arrives with none, so while this node has live ranks it would end, the agent's
Investigator (agent/culprit.py, given to the executor when it is built) gathers it here first, on a thread
of its own: the webhook answers as soon as the decision is on disk (Alertmanager's notify timeout is 10 s,
evidence takes up to `restore.evidence_seconds` and more). The decision is already recorded: an agent
that dies meanwhile redoes the restore at its next start, and gathers the evidence again first.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from trainguard.agent import handlers
from trainguard.agent.action_log import ActionLog, request_id
from trainguard.agent.action_metrics import ActionCounts
from trainguard.agent.dispatch import ClaimWatch, NodeActions
from trainguard.decide.ledger import Notice, NoticeVerdict

RETRY_SECONDS = 5.0             # a result that could not be recorded is tried again this often

Investigator = Callable[..., "Notice | None"]


class EvidenceFirst:
    def __init__(self, node_actions: NodeActions, records: ActionLog, investigator: Investigator | None,
                 lock: threading.Lock, counts: ActionCounts, claim_watch: ClaimWatch):
        self.node_actions, self.records, self.investigator = node_actions, records, investigator
        self.lock, self.counts, self.claim_watch = lock, counts, claim_watch
        self.log = node_actions.log
        self.threads: list[threading.Thread] = []   # restores gathering evidence (tests join them)

    @staticmethod
    def may_need(verdict: NoticeVerdict) -> bool:
        """An action that ends processes (its handler `gathers_evidence`), not decided by the embedded
        watchdog (which gathered the evidence before deciding), carried out (not shadowed)."""
        return handlers.gathers_evidence(verdict.action) and verdict.notice.source != "embedded" and not verdict.shadow

    def needed(self, verdict: NoticeVerdict) -> bool:
        """With no live rank here there is nothing to take stacks of and nothing to end: carried out at once."""
        return self.may_need(verdict) and self.investigator is not None and bool(self.node_actions.live(verdict))

    def start(self, verdict: NoticeVerdict) -> None:
        """Gather, then carry out, on a thread: the time it takes is bounded by the Investigator's waits
        (py-spy's timeout, the Flight Recorder and verdict waits)."""
        thread = threading.Thread(target=self._investigate_and_restore, args=(verdict,),
                                  name="restore-evidence", daemon=True)
        thread.start()
        self.threads = [t for t in self.threads if t.is_alive()] + [thread]

    def _investigate_and_restore(self, verdict: NoticeVerdict) -> None:
        assert self.investigator is not None
        live = self.node_actions.live(verdict)
        self.log.warning("restore: gathering evidence before ending ranks", alertname=verdict.notice.alertname,
                         id=request_id(verdict), ranks=[info.rank for info in live],
                         redone_after_restart=request_id(verdict) in self.node_actions.redone)
        after = self.investigator(verdict.notice, live, fallback=lambda notice: self._finish(verdict, notice))
        self._finish(verdict, after)

    def _finish(self, verdict: NoticeVerdict, after: Notice | None, attempts: int = 12) -> None:
        """Record the restore's result: carried out, or (`after` None) the culprit's node kept out instead
        (agent/culprit.py ended its launcher, or will restore here if the ranks outlive it)."""
        for _ in range(attempts):
            with self.lock:
                now = self.node_actions.clock()
                try:
                    if after is None:
                        result = self.node_actions.kept_out(verdict, now)
                    else:
                        result = self.node_actions.execute(verdict, now, self.claim_watch.watch)
                    self.records.append([result])
                    if result.get("outcome") != "failed":
                        return
                except OSError as exc:
                    result = {"error": str(exc)}
                self.counts.failed_one()
                self.log.error("restore after evidence not done; will retry", error=result.get("error"),
                               id=request_id(verdict))
            time.sleep(RETRY_SECONDS)
