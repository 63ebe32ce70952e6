"""Carrying out one verdict on this node: the claim of a job-level action, the signed control request, the
action's handler (agent/handlers.py), and the result as the ``action`` record of the actions log.

A job-level alert (no `instance`: the global tier's, the run-wide cost tiers; ledger.job_level) reaches
every agent of the job. Before carrying one out, an agent claims it (agent/claims.py): a claim signed with
the webhook token every agent of the route holds, created with O_EXCL in ``RUN/control/claims/``. The
agent that created it acts; the others record the action as ``claimed`` by that node, so a job-level
``restore`` ends one node's ranks (torch's elastic rendezvous then restarts every node's workers) rather
than every node's at once. The claimant renews its claim while it acts, and a claim neither done nor
renewed for ``webhook.claim_timeout_seconds`` is taken over by exactly one other agent (`ClaimWatch`).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from trainguard import event_types, rundir, tls
from trainguard import log as tglog
from trainguard.agent import claims, handlers, restore
from trainguard.agent.action_log import ActionLog, request_id
from trainguard.agent.action_metrics import ActionCounts
from trainguard.decide.ledger import NoticeVerdict, job_level
from trainguard.runtime import cordon_key
from trainguard.runtime.checkpoint import keys


class ActionNotDone(OSError):
    """A decision could not be recorded or carried out; the ledger is as it was, so a retry acts."""


class NodeActions:
    """What carrying out an action may touch on this node: its run directory, host, restore settings."""

    def __init__(self, run_dir: str | os.PathLike, node: str, host: str, claims_: claims.Claims,
                 counts: ActionCounts, *, grace_seconds: float = 0.0, entry_points: tuple[str, ...] = (),
                 launchers: tuple[str, ...] = (), checkpoint_key_file: str | os.PathLike | None = None,
                 redone: set[str] | None = None, clock: Callable[[], float] = time.time, recovery: Any = None):
        self.run_dir, self.node, self.host, self.clock = Path(run_dir), node, host, clock
        self.claims, self.counts = claims_, counts
        self.grace = grace_seconds
        self.entry_points, self.launchers = entry_points, launchers   # beyond the bundled ones (restore.Trust)
        self.checkpoint_key_file = checkpoint_key_file   # signs requests and cordons (trainguard/cordon/__init__.py)
        self.redone = redone if redone is not None else set()   # request ids redone after a restart
        self.recovery = recovery     # the policy's `recovery` section: a restore in-process (agent/recover_in_process.py)
        self.log = tglog.get("agent.executor", node=node)

    def execute(self, verdict: NoticeVerdict, now: float, watch: Callable[[NoticeVerdict, claims.Claim, float], None]) -> dict:
        """The ``action`` record of carrying `verdict` out here (or of another agent's claim on it, which
        `watch` looks at again later). A failure is the record's ``outcome: failed``, never raised."""
        n = verdict.notice
        request = rundir.request(verdict.action, request_id(verdict), alertname=n.alertname,
                                 reason=verdict.reason, issued_at=now)
        result: dict[str, Any] = {"id": request["id"], "action": verdict.action, "alertname": n.alertname,
                                  "reason": verdict.reason, "key": n.key, "source": n.source, "issued_at": now}
        if request["id"] in self.redone:
            result["redone_after_restart"] = True
        try:
            claim = self.claims.take(request["id"], now) if job_level(n) else None   # None: this agent acts
            if claim is not None and not claim.mine:
                result.update(outcome="claimed", claimed_by=claim.node, generation=claim.generation)
                self.log.info("job-level action carried out by another agent", action=verdict.action,
                              alertname=n.alertname, claimed_by=claim.node, id=request["id"])
                if not claim.done:
                    watch(verdict, claim, now)
                return self.record(result, now)
            held = None if claim is None else self.claims.hold(request["id"], claim)   # renewed while acting
            try:
                self._carry_out(verdict, request, result)
            finally:
                if held is not None and result.get("outcome") is None:
                    held.stop()                   # not carried out: a retry, or a takeover, does it
            if held is not None:
                held.done(self.clock())
        except OSError as exc:
            result.update(outcome="failed", error=f"{type(exc).__name__}: {exc}", errno=exc.errno)
            self.log.error("action failed", action=verdict.action, alertname=n.alertname, error=result["error"])
        self.counts.executed_one(str(verdict.action))
        self.log.warning("action issued", **{k: v for k, v in result.items() if k != "issued_at"})
        return self.record(result, now)

    def _carry_out(self, verdict: NoticeVerdict, request: dict, result: dict) -> None:
        """The signed control request, then the action's own handler on this node; sets `outcome`."""
        result["appended"] = rundir.append_request(self.run_dir, self._signed(request))
        handler = handlers.HANDLERS.get(str(verdict.action))
        if handler is not None:
            handler.carry_out(self, verdict, result)
        result["outcome"] = "paged" if "paged" in result else "issued"

    def _signed(self, request: dict) -> dict:
        """The request signed with the run's checkpoint key (runtime/control.py refuses any other); created
        where the trainer would create it, as a cordon's signer does. No key: not done (named)."""
        key, where = cordon_key.signing_key(self.checkpoint_key_file, create=True)
        if key is None:
            raise ActionNotDone(f"cannot sign the control request {request['id']}: no checkpoint key ({where}; "
                                f"set webhook.checkpoint_key_file to the trainer's key)")
        return rundir.sign_request(key, request, self.run_dir, by=f"agent:{self.node}", key_id=keys.key_id(key))

    def kept_out(self, verdict: NoticeVerdict, now: float) -> dict:
        """The record of a restore not carried out here: the incident's culprit node is kept out instead."""
        n = verdict.notice
        result = {"id": request_id(verdict), "action": verdict.action, "alertname": n.alertname,
                  "reason": verdict.reason, "key": n.key, "source": n.source, "issued_at": now,
                  "outcome": "kept_out", "why": "the incident's culprit node is kept out (agent/culprit.py)"}
        self.log.warning("restore not needed here: the culprit's node is kept out", id=result["id"])
        return self.record(result, now)

    def record(self, result: dict, now: float) -> dict:
        return {**tls.event(event_types.ACTION, timestamp=now, **result), "node": self.node}

    def trust(self) -> restore.Trust:
        """Built at each restore: the run directory (whose owner root trusts) may appear after the agent."""
        return restore.Trust.for_run(self.run_dir, self.entry_points, self.launchers)

    def live(self, verdict: NoticeVerdict) -> list:
        """This node's live ranks a restore would end: those started before the alert began (a rank the
        elastic launcher restarted since, after a crash of this agent, is spared, and no evidence of it is
        taken: it is not the hang's)."""
        started_before = verdict.notice.starts_at
        return [info for info, _ in restore.local_ranks(restore.host_ranks(self.run_dir, self.host)[0], self.host)
                if started_before is None or info.started_at < started_before]

    def count_refusal(self, reason: str) -> None:
        self.counts.refused_one(reason)


class ClaimWatch:
    """Another agent's claim on a job-level action, looked at again once it may be taken over: if it is
    still not done, its claimant is taken to have died, and one of the agents (O_EXCL on the next
    generation's name) acts."""

    def __init__(self, node_actions: NodeActions, records: ActionLog, lock: threading.Lock,
                 clock: Callable[[], float], counts: ActionCounts):
        self.node_actions, self.records, self.lock, self.clock, self.counts = node_actions, records, lock, clock, counts
        self.log = node_actions.log

    def watch(self, verdict: NoticeVerdict, claim: claims.Claim, now: float) -> None:
        self._after(self.node_actions.claims.check_after(claim, now), verdict)

    def watch_again(self, verdict: NoticeVerdict) -> None:
        """A claim another agent held when this one last ran: look at it now (done: nothing to do; still
        renewed: watch it; neither for the timeout: take it over, agent/claims.py)."""
        self.log.info("watching again a job-level claim recorded before a restart", id=request_id(verdict))
        self._after(0.0, verdict)

    def _after(self, seconds: float, verdict: NoticeVerdict) -> None:
        timer = threading.Timer(seconds, self._check, (verdict,))
        timer.daemon = True
        timer.start()

    def _check(self, verdict: NoticeVerdict) -> None:
        with self.lock:
            now = self.clock()
            try:
                claim = self.node_actions.claims.take(request_id(verdict), now)
                if claim.mine:
                    self.records.append([self.node_actions.execute(verdict, now, self.watch)])
                elif not claim.done:
                    self.watch(verdict, claim, now)
            except OSError as exc:   # a full disk: the next start's recovery redoes what this agent decided
                self.counts.failed_one()
                self.log.error("could not check or take over a job-level claim", error=str(exc),
                               id=request_id(verdict))
