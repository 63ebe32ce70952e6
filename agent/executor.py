"""The executor: the ledger's verdicts carried out on the run, each one recorded durably first.

For every notice (an Alertmanager alert, or a decision of the agent's embedded path):

1. the ledger (trainguard/decide/ledger.py) decides: act, duplicate, superseded, coalesced, escalated ...;
2. the verdict is appended to ``RUN/tls/node-<node>-actions.jsonl`` as a TLS ``alert`` event and fsynced,
   and logged (structlog) - the intent, before anything happens;
3. an action is executed: ``rollback`` and ``cost_*`` become a request line in ``RUN/control/actions.jsonl``
   (fsynced; the trainer's control channel, runtime/control.py, makes every rank act on the same step);
   ``restore`` also ends this node's ranks (``RUN/control/ranks/rank-*.json``) so torch's elastic launcher
   starts them again from the latest verified checkpoint;
4. the result is appended as a TLS ``action`` event (fsynced) carrying the request ``id``.

Only then does the webhook answer 2xx. An action is done only once all of that is on disk: when a write
or the action fails (a full disk), the ledger is put back as it was before the decision, the failure is
reported once (the file and the bytes it needed), the webhook answers 500 so Alertmanager retries, and a
decision of the embedded path is retried every `RETRY_SECONDS`; the retry then acts exactly once.

``restore`` ends only processes that prove they are ranks of this run (agent/restore.py `prove_rank`);
refusals are recorded in the action event and counted in ``trainguard_restore_refused_total{reason}``.

Request ids are derived from the incident (the ledger key, or
the cost tier), and a request whose id is already in the control file is not appended again, so
re-executing after a crash between 2 and 4 (``recover()`` does, at start) or from a second agent on a
shared run directory never makes the trainer act twice.

A job-level alert (no `instance`: the global tier's, the run-wide cost tiers; ledger.job_level) reaches
every agent of the job. Before carrying one out, an agent claims it (agent/claims.py): a claim signed with
the webhook token every agent of the route holds, created with O_EXCL in ``RUN/control/claims/``. The
agent that created it acts; the others record the action as ``claimed`` by that node, so a job-level
``restore`` ends one node's ranks (torch's elastic rendezvous then restarts every node's workers) rather
than every node's at once. A claim that does not prove itself is ignored (logged once, counted in
``trainguard_claims_refused_total{reason}``); the claimant renews its claim while it acts, and a claim
neither done nor renewed for ``webhook.claim_timeout_seconds`` is taken over by exactly one other agent. An
agent that crashed after claiming finds its own claim and acts on recovery; one that had recorded
``claimed`` watches that claim again. A restore redone on recovery gathers its evidence again first.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from trainguard import actions, rundir, tls
from trainguard import log as tglog
from trainguard.agent import claims
from trainguard.agent.action_log import ActionLog, alert_record, request_id, shadow_record, verdict_of
from trainguard.agent.action_metrics import ActionCounts
from trainguard.agent.dispatch import ActionNotDone, ClaimWatch, NodeActions
from trainguard.agent.evidence_first import EvidenceFirst, Investigator
from trainguard.runtime import cordon_key
from trainguard.node import node_name
from trainguard.decide.ledger import ACT, ESCALATED, Ledger, Limits, Notice, NoticeVerdict

__all__ = ["ActionNotDone", "Executor", "WebhookSettings", "request_id"]

DEFAULT_GRACE_SECONDS = 0.0     # SIGKILL at once: see agent/restore.py
RETRY_SECONDS = 5.0             # an embedded decision that could not be recorded is tried again this often


# ------------------------------------------------------------------------------------------- settings

@dataclass(frozen=True)
class WebhookSettings:
    """The agent config's ``webhook:`` section, checked (a bad value names ``webhook.<key>``)."""

    token_file: Path
    default_token_file: Path
    shadow: bool = False             # every action recorded as a shadow_action, none carried out
    max_body_bytes: int = 2**20
    embedded: bool = True
    restore_grace_seconds: float = DEFAULT_GRACE_SECONDS
    restore_entry_points: tuple[str, ...] = ()   # worker programs besides trainguard's (docs/agent.md)
    restore_launchers: tuple[str, ...] = ()      # launcher programs besides torchrun and `trainguard train`
    claim_timeout_seconds: float = claims.DEFAULT_TIMEOUT_SECONDS   # a job-level claim not done by then is taken over
    checkpoint_key_file: Path | None = None      # the trainer's checkpoint key, to sign cordons (default: its default)

    KEYS = ("token_file", "shadow", "dry_run", "max_body_bytes", "embedded", "restore_grace_seconds",
            "restore_entry_points", "restore_launchers", "claim_timeout_seconds", "checkpoint_key_file")

    @classmethod
    def from_config(cls, config) -> "WebhookSettings":
        from trainguard.agent.config import ConfigError

        values: Mapping[str, Any] = dict(config.webhook or {})
        unknown = sorted(set(values) - set(cls.KEYS))
        if unknown:
            raise ConfigError(f"webhook.{unknown[0]}: unknown key (known: {', '.join(cls.KEYS)})")
        run_dir = Path(config.run_dir) if config.run_dir is not None else Path(".")
        default = rundir.webhook_token_path(run_dir)
        kwargs: dict[str, Any] = {"token_file": Path(values.get("token_file") or default),
                                  "default_token_file": default}
        for key in ("shadow", "dry_run", "embedded"):
            if key in values:
                if not isinstance(values[key], bool):
                    raise ConfigError(f"webhook.{key}: expected true or false, got {values[key]!r}")
                # dry_run: the older name of shadow (either one on turns it on)
                name = "shadow" if key == "dry_run" else key
                kwargs[name] = kwargs.get(name, False) or values[key]
        if "max_body_bytes" in values:
            kwargs["max_body_bytes"] = _size(values["max_body_bytes"])
        for key, low in (("restore_grace_seconds", 0.0), ("claim_timeout_seconds", 1.0)):
            if key in values:
                seconds = values[key]
                if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not low <= seconds < 1e9:
                    raise ConfigError(f"webhook.{key}: expected seconds >= {low:g}, got {seconds!r}")
                kwargs[key] = float(seconds)
        if values.get("checkpoint_key_file") is not None:
            if not isinstance(values["checkpoint_key_file"], str) or not values["checkpoint_key_file"].strip():
                raise ConfigError(f"webhook.checkpoint_key_file: expected a path, got {values['checkpoint_key_file']!r}")
            kwargs["checkpoint_key_file"] = Path(values["checkpoint_key_file"]).expanduser()
        for key in ("restore_entry_points", "restore_launchers"):
            if key in values:
                kwargs[key] = _names(values[key], f"webhook.{key}")
        return cls(**kwargs)


def _names(value: Any, where: str) -> tuple[str, ...]:
    from trainguard.agent.config import ConfigError

    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ConfigError(f"{where}: expected a list of module names or script paths, got {value!r}")
    return tuple(v.strip() for v in value)


def _size(value: Any) -> int:
    from trainguard.agent.config import ConfigError

    try:
        size = int(tls.parse_quantity(value, "webhook.max_body_bytes"))
    except tls.TLSError as exc:
        raise ConfigError(str(exc)) from None
    if size <= 0:
        raise ConfigError(f"webhook.max_body_bytes: must be positive, got {value!r}")
    return size


# -------------------------------------------------------------------------------------------- executor

def actions_log(run_dir: str | os.PathLike, node: str, checkpoint_key_file: str | os.PathLike | None = None
                ) -> ActionLog:
    """RUN/tls/node-<node>-actions.jsonl, its records signed with the run's checkpoint key (created where the
    trainer would create it)."""
    key = cordon_key.signing_key(checkpoint_key_file, create=True)[0]
    return ActionLog(rundir.node_actions_log(Path(run_dir), node), key, node)


class Executor:
    """Decide, record, carry out, record (the module's docstring). A new executor first recovers from its
    actions log (`recover`): restores decided before a restart gather their evidence again through
    `investigator`, which the agent builds before the executor and passes in."""

    def __init__(self, run_dir: str | os.PathLike, node: str, ledger: Ledger, *, host: str | None = None,
                 restore_grace_seconds: float = DEFAULT_GRACE_SECONDS, clock=time.time,
                 entry_points: tuple[str, ...] = (), launchers: tuple[str, ...] = (),
                 claim_secret: bytes | None = None, claim_timeout_seconds: float = claims.DEFAULT_TIMEOUT_SECONDS,
                 checkpoint_key_file: str | os.PathLike | None = None, investigator: Investigator | None = None,
                 records: ActionLog | None = None, recovery: Any = None):
        self.run_dir, self.node, self.ledger, self.clock = Path(run_dir), node, ledger, clock
        self.records = records or actions_log(run_dir, node, checkpoint_key_file)
        self.log = tglog.get("agent.executor", node=node)
        self.claims = claims.Claims(self.run_dir, node, claim_secret, timeout_seconds=claim_timeout_seconds,
                                    log=self.log)
        self.counts = ActionCounts(self.claims, self.records)
        self.node_actions = NodeActions(run_dir, node, host or node_name(), self.claims, self.counts,
                                        grace_seconds=restore_grace_seconds, entry_points=entry_points,
                                        launchers=launchers, checkpoint_key_file=checkpoint_key_file, clock=clock,
                                        recovery=recovery)
        self._lock = threading.Lock()
        self.claim_watch = ClaimWatch(self.node_actions, self.records, self._lock, clock, self.counts)
        self.evidence = EvidenceFirst(self.node_actions, self.records, investigator, self._lock, self.counts,
                                      self.claim_watch)
        self._failing: str | None = None          # the failure being reported (logged once until it clears)
        self._retry: list[Notice] = []            # embedded notices waiting for a retry
        self._retry_timer: threading.Timer | None = None
        self.recover()

    @classmethod
    def for_agent(cls, config, policy, settings, claim_secret: bytes | None = None,
                  investigator: Investigator | None = None, records: ActionLog | None = None) -> "Executor":
        """`claim_secret`: the webhook token, which every agent behind the job's Alertmanager route holds."""
        ledger = Ledger(Limits.from_policy(policy), shadow=policy.shadow or settings.shadow)
        return cls(config.run_dir, config.node, ledger, restore_grace_seconds=settings.restore_grace_seconds,
                   entry_points=settings.restore_entry_points, launchers=settings.restore_launchers,
                   claim_secret=claim_secret, claim_timeout_seconds=settings.claim_timeout_seconds,
                   checkpoint_key_file=settings.checkpoint_key_file, investigator=investigator, records=records,
                   recovery=policy.recovery)

    # ------------------------------------------------------------------------------------- submit
    def submit(self, notices: list[Notice]) -> list[NoticeVerdict]:
        """Decide, record, execute, record: returns when every decision is on disk and carried out.

        Raises `ActionNotDone` (the ledger as it was) when something could not be written or done.
        """
        with self._lock:
            now = self.clock()
            before = self.ledger.snapshot()
            try:
                verdicts = self._decide_and_act(notices, now)
            except OSError as exc:
                self.ledger.restore(before)
                self._not_done(notices, exc)
                raise ActionNotDone(exc.errno, str(exc)) from None
            if self._failing is not None:
                self.log.warning("actions are recorded again", after=self._failing)
                self._failing = None
            return verdicts

    def _decide_and_act(self, notices: list[Notice], now: float) -> list[NoticeVerdict]:
        verdicts = self.ledger.decide_all(notices, now)
        shadowed = [v for v in verdicts if v.would_execute and v.shadow]
        self.records.append([alert_record(v, now, self.node) for v in verdicts]
                            + [shadow_record(v, now, self.node) for v in shadowed])
        for verdict in shadowed:
            self.counts.shadowed_one(str(verdict.action))
        for verdict in verdicts:
            self._log_verdict(verdict)
        later = [v for v in verdicts if v.executes and self.evidence.needed(v)]
        results = [self.node_actions.execute(v, now, self.claim_watch.watch)
                   for v in verdicts if v.executes and v not in later]
        self.records.append(results)
        failed = [r for r in results if r.get("outcome") == "failed"]
        if failed:
            raise OSError(failed[0].get("errno") or 0, failed[0]["error"])
        for verdict in verdicts:
            self.counts.outcome(verdict.outcome)
        for verdict in later:
            self.evidence.start(verdict)
        return verdicts

    def _log_verdict(self, verdict: NoticeVerdict) -> None:
        n = verdict.notice
        fields = dict(alertname=n.alertname, status=n.status, outcome=verdict.outcome, action=verdict.action,
                      requested=n.action, reason=verdict.reason, key=n.key, source=n.source, shadow=verdict.shadow)
        if verdict.action == actions.PAGE:
            self.log.error("escalated to a human: rate limit reached", **fields)
        elif verdict.outcome in (ACT, ESCALATED):
            self.log.warning("shadow: would have acted" if verdict.shadow else "acting on alert", **fields)
        else:
            self.log.info("alert recorded", **fields)

    # -------------------------------------------------------------------------------- not done: retry
    def _not_done(self, notices: list[Notice], exc: OSError) -> None:
        """Report a failure once (until writes work again); queue the embedded notices for a retry."""
        self.counts.failed_one()
        if self._failing is None:
            self._failing = str(exc)
            self.log.error("action not done: could not record or carry it out; nothing acted, will retry",
                           error=str(exc), alerts=[n.alertname for n in notices])
        embedded = [n for n in notices if n.source == "embedded"]
        if embedded:
            self._retry.extend(n for n in embedded if n not in self._retry)
            if self._retry_timer is None:
                self._retry_timer = threading.Timer(RETRY_SECONDS, self._retry_now)
                self._retry_timer.daemon = True
                self._retry_timer.start()

    def _retry_now(self) -> None:
        """Alertmanager retries its own notices on a 5xx; the embedded path's are retried here."""
        with self._lock:
            notices, self._retry, self._retry_timer = self._retry, [], None
        try:
            self.submit(notices)
        except OSError:
            pass      # queued again by submit

    # ----------------------------------------------------------------------------------- recovery
    def recover(self) -> int:
        """Rebuild the ledger from the actions log; redo each action decided but not recorded as done (a
        crash), a restore gathering its evidence again first; watch again the claims of other agents this
        agent recorded as ``claimed`` and saw no end of. Returns how many actions were redone."""
        found = self.records.recovery()
        if self.records.refused:
            self.log.error("lines of the actions log not signed by this agent: not redone, not remembered",
                           path=str(self.records.path), **self.records.refused)
        for event in found.alerts:
            self.ledger.remember(event)
        for event in found.redo:
            self.log.warning("redoing an action decided before a restart", action=event.get("action"),
                             alertname=event.get("alertname"), id=event["request_id"])
            self.node_actions.redone.add(event["request_id"])
            verdict = verdict_of(event)
            if self.evidence.needed(verdict):
                self.evidence.start(verdict)
            else:
                self._redo(verdict)
        for event in found.watch:
            self.claim_watch.watch_again(verdict_of(event))
        return len(found.redo)

    def _redo(self, verdict: NoticeVerdict) -> None:
        with self._lock:
            try:
                self.records.append([self.node_actions.execute(verdict, self.clock(), self.claim_watch.watch)])
            except OSError as exc:     # a full disk at start: the next start (or record) redoes it
                self.log.error("could not record a redone action", error=str(exc), id=request_id(verdict))

    # ------------------------------------------------------------------------------------ metrics
    def families(self) -> list:
        return list(self.counts.collect())
