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

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from prometheus_client.core import CounterMetricFamily

from trainguard import actions, rundir, safe_read, signed, tls
from trainguard import log as tglog
from trainguard.agent import claims, restore
from trainguard.runtime import cordon_key
from trainguard.runtime.checkpoint import keys
from trainguard.node import node_name
from trainguard.decide.ledger import ACT, ESCALATED, Ledger, Limits, Notice, Verdict, job_level

DEFAULT_GRACE_SECONDS = 0.0     # SIGKILL at once: see agent/restore.py
RETRY_SECONDS = 5.0             # an embedded decision that could not be recorded is tried again this often
REDO_WAIT_SECONDS = 30.0        # a restore to redo at start waits this long for the agent's Investigator


class ActionNotDone(OSError):
    """A decision could not be recorded or carried out; the ledger is as it was, so a retry acts."""


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


# -------------------------------------------------------------------------------------- durable files

ACTIONS_LOG_PURPOSE = "agent-actions/1"    # each record of RUN/tls/node-<node>-actions.jsonl, signed


class EventLog:
    """Appends TLS records and fsyncs them: what is written here survives a crash of the agent.

    With a key (the run's checkpoint key), each record is signed (purpose ``agent-actions/1``, bound to this
    node): `recover()` redoes what the log says was decided and not done, so a line anyone appended there
    (a ``cost_stop`` "decided before a restart") would otherwise be carried out, signed, at the next start.
    `events` gives only the records that check; the others are counted in `refused`."""

    def __init__(self, path: Path, key: bytes | None = None, node: str = ""):
        self.path = path
        self.key, self.node = key, node
        self.refused: dict[str, int] = {}
        path.parent.mkdir(parents=True, exist_ok=True)

    def _line(self, record: dict) -> bytes:
        line = tls.encode(record)
        if self.key is None:
            return line
        # signed as it is stored (tls.encode writes the timestamp as text), so that the reader checks the
        # very fields it reads back
        stored = json.loads(line)
        stored = signed.sign(self.key, ACTIONS_LOG_PURPOSE, {**stored, "recorded_by": self.node})
        return json.dumps(stored, separators=(",", ":")).encode() + b"\n"

    def append(self, records: Iterable[dict]) -> None:
        """Write whole records or raise OSError; a partial write (disk full) is cut back off the file."""
        data = b"".join(self._line(record) for record in records)
        if not data:
            return
        fd = safe_read.open_rw_fd(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "actions log")
        try:
            size = os.fstat(fd).st_size
            try:
                written = os.write(fd, data)
                if written != len(data):
                    raise OSError(28, f"wrote {written} of {len(data)} bytes")
                os.fsync(fd)
            except OSError as exc:
                rundir.cut_back(fd, size)   # a partial record must not glue onto the next one
                raise OSError(exc.errno, f"{self.path}: {exc.strerror or exc} ({len(data)} bytes needed)") from None
        finally:
            os.close(fd)

    def events(self) -> list[dict]:
        """Every event recorded so far that proves this agent recorded it (a malformed line, e.g. torn by a
        crash, is skipped; one that is not signed with the key for this node is skipped and counted)."""
        try:
            handle = safe_read.open_file(self.path, safe_read.LEDGER_BYTES, "actions log")
        except FileNotFoundError:
            return []
        found = []
        with handle:
            for raw in safe_read.lines(handle, self.path):
                try:
                    stored = json.loads(raw)
                except ValueError:
                    continue          # torn by a crash, or not a record
                if not isinstance(stored, dict) or not isinstance(stored.get("event"), dict):
                    continue
                reason = signed.check(self.key, ACTIONS_LOG_PURPOSE, stored, {"recorded_by": self.node})
                if reason is not None:
                    self.refused[reason] = self.refused.get(reason, 0) + 1
                    continue
                found.append(stored["event"])
        return found


def request_id(verdict: Verdict) -> str:
    """Stable per incident: a cost tier acts once per run, any other action once per ledger key."""
    if verdict.action in actions.COST_ORDER:
        return f"cost-{verdict.action}"
    digest = hashlib.sha1(f"{verdict.notice.key}|{verdict.action}".encode()).hexdigest()[:16]
    return f"{verdict.action}-{digest}"


# -------------------------------------------------------------------------------------------- executor

class Executor:
    def __init__(self, run_dir: str | os.PathLike, node: str, ledger: Ledger, *, host: str | None = None,
                 restore_grace_seconds: float = DEFAULT_GRACE_SECONDS, clock: Callable[[], float] = time.time,
                 entry_points: tuple[str, ...] = (), launchers: tuple[str, ...] = (),
                 claim_secret: bytes | None = None, claim_timeout_seconds: float = claims.DEFAULT_TIMEOUT_SECONDS,
                 checkpoint_key_file: str | os.PathLike | None = None, awaits_investigator: bool = False):
        self.run_dir = Path(run_dir)
        self.checkpoint_key_file = checkpoint_key_file   # signs cordons (agent/culprit.py, trainguard/cordon/__init__.py)
        self.entry_points, self.launchers = entry_points, launchers   # beyond the bundled ones (restore.Trust)
        self.node, self.host = node, host or node_name()
        self.ledger, self.clock = ledger, clock
        self.grace = restore_grace_seconds
        self.records = EventLog(rundir.node_actions_log(self.run_dir, node),
                                cordon_key.signing_key(checkpoint_key_file, create=True)[0], node)
        self.log = tglog.get("agent.executor", node=node)
        self.claims = claims.Claims(self.run_dir, node, claim_secret, timeout_seconds=claim_timeout_seconds,
                                    log=self.log)
        self._lock = threading.Lock()
        self.outcomes: dict[str, int] = {}
        self.executed: dict[str, int] = {}
        self.shadowed: dict[str, int] = {}        # shadow mode: actions decided and recorded, not carried out
        self.refused: dict[str, int] = {}         # restore refusals by reason
        self.failures = 0                         # decisions not done: a write or the action failed
        self._failing: str | None = None          # the failure being reported (logged once until it clears)
        self._retry: list[Notice] = []            # embedded notices waiting for a retry
        self._investigations: list[threading.Thread] = []   # restores gathering evidence (tests join them)
        self._retry_timer: threading.Timer | None = None
        # agent/culprit.py Investigator, set by the agent (agent/app.py build_investigator): an Alertmanager
        # restore then gathers the incident's evidence before ranks are ended, as the embedded watchdog's
        # does. `awaits_investigator`: the agent installs one right after building this executor, so a
        # restore `recover` redoes waits for it (`_awaiting_evidence`) instead of ending ranks unseen.
        self._awaits_investigator = awaits_investigator
        self._awaiting_evidence: list[Verdict] = []
        self._redone: set[str] = set()            # request ids redone after a restart (marked in their record)
        self._investigator: Callable[..., Notice | None] | None = None
        self.recover()

    @classmethod
    def for_agent(cls, config, policy, settings, claim_secret: bytes | None = None) -> "Executor":
        """`claim_secret`: the webhook token, which every agent behind the job's Alertmanager route holds."""
        ledger = Ledger(Limits.from_policy(policy), shadow=policy.shadow or settings.shadow)
        return cls(config.run_dir, config.node, ledger, restore_grace_seconds=settings.restore_grace_seconds,
                   entry_points=settings.restore_entry_points, launchers=settings.restore_launchers,
                   claim_secret=claim_secret, claim_timeout_seconds=settings.claim_timeout_seconds,
                   checkpoint_key_file=settings.checkpoint_key_file, awaits_investigator=True)

    @property
    def investigator(self) -> Callable[..., Notice | None] | None:
        return self._investigator

    @investigator.setter
    def investigator(self, investigator: Callable[..., Notice | None] | None) -> None:
        """Installed by the agent; restores waiting to be redone (a crash before they were done) go on now,
        their evidence gathered again first."""
        self._investigator = investigator
        waiting, self._awaiting_evidence = self._awaiting_evidence, []
        for verdict in waiting:
            self._redo_restore(verdict)

    # ------------------------------------------------------------------------------------- submit
    def submit(self, notices: list[Notice]) -> list[Verdict]:
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

    def _decide_and_act(self, notices: list[Notice], now: float) -> list[Verdict]:
        verdicts = self.ledger.decide_all(notices, now)
        shadowed = [v for v in verdicts if v.would_execute and v.shadow]
        self.records.append([self._alert_record(v, now) for v in verdicts]
                            + [self._shadow_record(v, now) for v in shadowed])
        for verdict in shadowed:
            self.shadowed[str(verdict.action)] = self.shadowed.get(str(verdict.action), 0) + 1
        for verdict in verdicts:
            self._log_verdict(verdict)
        later = [v for v in verdicts if v.executes and self._needs_evidence(v)]
        results = [self._execute(v, now) for v in verdicts if v.executes and v not in later]
        self.records.append(results)
        failed = [r for r in results if r.get("outcome") == "failed"]
        if failed:
            raise OSError(failed[0].get("errno") or 0, failed[0]["error"])
        for verdict in verdicts:
            self.outcomes[verdict.outcome] = self.outcomes.get(verdict.outcome, 0) + 1
        for verdict in later:
            self._restore_after_evidence(verdict)
        return verdicts

    # ------------------------------------------------------------- restore: evidence before ending
    def _needs_evidence(self, verdict: Verdict) -> bool:
        """An Alertmanager restore while this node has live ranks it would end: the embedded watchdog's
        gathered the evidence before it was submitted; this one must gather it here, before anything is
        ended. (With no such rank here there is nothing to take stacks of and nothing to end: it is carried
        out at once.)"""
        return self._may_need_evidence(verdict) and self.investigator is not None and bool(self._live(verdict))

    @staticmethod
    def _may_need_evidence(verdict: Verdict) -> bool:
        return verdict.action == actions.RESTORE and verdict.notice.source != "embedded" and not verdict.shadow

    def _live(self, verdict: Verdict) -> list:
        """This node's live ranks the restore would end: those started before the alert began (a rank the
        elastic launcher restarted since, after a crash of this agent, is spared, and no evidence of it is
        taken: it is not the hang's)."""
        started_before = verdict.notice.starts_at
        return [info for info, _ in restore.local_ranks(restore.host_ranks(self.run_dir, self.host)[0], self.host)
                if started_before is None or info.started_at < started_before]

    def _restore_after_evidence(self, verdict: Verdict) -> None:
        """Gather the incident's evidence, then carry out the restore, on a thread of its own: the webhook
        answers as soon as the decision is on disk (Alertmanager's notify timeout is 10 s, evidence takes up
        to `restore.evidence_seconds` and more), and the time it takes is bounded by the Investigator's
        waits (py-spy's timeout, the Flight Recorder and verdict waits). The decision is already recorded:
        an agent that dies meanwhile redoes the restore at its next start (`recover`)."""
        thread = threading.Thread(target=self._investigate_and_restore, args=(verdict,),
                                  name="restore-evidence", daemon=True)
        thread.start()
        self._investigations = [t for t in self._investigations if t.is_alive()] + [thread]

    def _investigate_and_restore(self, verdict: Verdict) -> None:
        assert self.investigator is not None
        live = self._live(verdict)
        self.log.warning("restore: gathering evidence before ending ranks", alertname=verdict.notice.alertname,
                         id=request_id(verdict), ranks=[info.rank for info in live],
                         redone_after_restart=request_id(verdict) in self._redone)
        after = self.investigator(verdict.notice, live, fallback=lambda notice: self._finish(verdict, notice))
        self._finish(verdict, after)

    def _finish(self, verdict: Verdict, after: Notice | None, attempts: int = 12) -> None:
        """Record the restore's result: carried out, or (`after` None) the culprit's node kept out instead
        (agent/culprit.py ended its launcher, or will restore here if the ranks outlive it)."""
        for _ in range(attempts):
            with self._lock:
                now = self.clock()
                try:
                    if after is None:
                        result = self._kept_out(verdict, now)
                    else:
                        result = self._execute(verdict, now)
                    self.records.append([result])
                    if result.get("outcome") != "failed":
                        return
                except OSError as exc:
                    result = {"error": str(exc)}
                self.failures += 1
                self.log.error("restore after evidence not done; will retry", error=result.get("error"),
                               id=request_id(verdict))
            time.sleep(RETRY_SECONDS)

    def _kept_out(self, verdict: Verdict, now: float) -> dict:
        n = verdict.notice
        result = {"id": request_id(verdict), "action": verdict.action, "alertname": n.alertname,
                  "reason": verdict.reason, "key": n.key, "source": n.source, "issued_at": now,
                  "outcome": "kept_out", "why": "the incident's culprit node is kept out (agent/culprit.py)"}
        self.log.warning("restore not needed here: the culprit's node is kept out", id=result["id"])
        return {**tls.event("action", timestamp=now, **result), "node": self.node}

    def _not_done(self, notices: list[Notice], exc: OSError) -> None:
        """Report a failure once (until writes work again); queue the embedded notices for a retry."""
        self.failures += 1
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

    def _alert_record(self, verdict: Verdict, now: float) -> dict:
        event = verdict.as_event()
        event.pop("type")
        step = event.pop("step", None)
        if verdict.executes:
            event["request_id"] = request_id(verdict)
        return {**tls.event("alert", step=step, timestamp=now, **event), "node": self.node}

    def _shadow_record(self, verdict: Verdict, now: float) -> dict:
        """Shadow mode: the action this verdict would carry out, with its evidence; nothing is carried out
        (no control request, no rank ended, no claim taken)."""
        n = verdict.notice
        evidence: dict[str, Any] = {"alertname": n.alertname, "id": request_id(verdict), "key": n.key,
                                    "outcome": verdict.outcome, "requested": n.action}
        if n.starts_at is not None:
            evidence["starts_at"] = n.starts_at
        if n.labels:
            evidence["labels"] = dict(n.labels)
        if verdict.detail:
            evidence["detail"] = dict(verdict.detail)
        event = actions.shadow_event(str(verdict.action), verdict.reason, n.source, **evidence)
        return {**tls.event(actions.SHADOW_ACTION, step=n.step, timestamp=now, **event), "node": self.node}

    def _log_verdict(self, verdict: Verdict) -> None:
        n = verdict.notice
        fields = dict(alertname=n.alertname, status=n.status, outcome=verdict.outcome, action=verdict.action,
                      requested=n.action, reason=verdict.reason, key=n.key, source=n.source, shadow=verdict.shadow)
        if verdict.action == actions.PAGE:
            self.log.error("escalated to a human: rate limit reached", **fields)
        elif verdict.outcome in (ACT, ESCALATED):
            self.log.warning("shadow: would have acted" if verdict.shadow else "acting on alert", **fields)
        else:
            self.log.info("alert recorded", **fields)

    # ------------------------------------------------------------------------------------ execute
    def _execute(self, verdict: Verdict, now: float) -> dict:
        n = verdict.notice
        request = rundir.request(verdict.action, request_id(verdict), alertname=n.alertname,
                                 reason=verdict.reason, issued_at=now)
        result: dict[str, Any] = {"id": request["id"], "action": verdict.action, "alertname": n.alertname,
                                  "reason": verdict.reason, "key": n.key, "source": n.source, "issued_at": now}
        if request["id"] in self._redone:
            result["redone_after_restart"] = True
        try:
            claim = self._claim(verdict, request["id"], now)
            if claim is not None and not claim.mine:
                result.update(outcome="claimed", claimed_by=claim.node, generation=claim.generation)
                self.log.info("job-level action carried out by another agent", action=verdict.action,
                              alertname=n.alertname, claimed_by=claim.node, id=request["id"])
                if not claim.done:
                    self._watch_claim(verdict, claim, now)
                return {**tls.event("action", timestamp=now, **result), "node": self.node}
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
        self.executed[verdict.action] = self.executed.get(verdict.action, 0) + 1
        self.log.warning("action issued", **{k: v for k, v in result.items() if k != "issued_at"})
        return {**tls.event("action", timestamp=now, **result), "node": self.node}

    def _carry_out(self, verdict: Verdict, request: dict, result: dict) -> None:
        """The control request, and for a restore the ending of this node's proven ranks; sets `outcome`."""
        result["appended"] = rundir.append_request(self.run_dir, self._signed(request))
        if verdict.action == actions.RESTORE:
            result.update(restore.end_local_ranks(self.run_dir, self.host, started_before=verdict.notice.starts_at,
                                                grace_seconds=self.grace, trust=self._trust()))
            for refusal in result["refused"]:
                self.refused[refusal["reason"]] = self.refused.get(refusal["reason"], 0) + 1
            if "paged" in result:
                self.refused["no_restarts_left"] = self.refused.get("no_restarts_left", 0) + 1
        result["outcome"] = "paged" if "paged" in result else "issued"

    def _signed(self, request: dict) -> dict:
        """The request signed with the run's checkpoint key (runtime/control.py refuses any other); created
        where the trainer would create it, as a cordon's signer does. No key: not done (named)."""
        key, where = cordon_key.signing_key(self.checkpoint_key_file, create=True)
        if key is None:
            raise ActionNotDone(f"cannot sign the control request {request['id']}: no checkpoint key ({where}; "
                                f"set webhook.checkpoint_key_file to the trainer's key)")
        return rundir.sign_request(key, request, self.run_dir, by=f"agent:{self.node}", key_id=keys.key_id(key))

    def _claim(self, verdict: Verdict, request_id: str, now: float) -> claims.Claim | None:
        """Who carries out a job-level verdict (agent/claims.py: a signed claim in RUN/control/claims/);
        None for any other: this agent acts."""
        if not job_level(verdict.notice):
            return None
        return self.claims.take(request_id, now)

    def _watch_claim(self, verdict: Verdict, claim: claims.Claim, now: float) -> None:
        """Look again once another agent's claim may be taken over: if it is still not done, its claimant
        is taken to have died, and one of the agents (O_EXCL on the next generation's name) acts."""
        timer = threading.Timer(self.claims.check_after(claim, now), self._claim_check, (verdict,))
        timer.daemon = True
        timer.start()

    def _claim_check(self, verdict: Verdict) -> None:
        with self._lock:
            now = self.clock()
            try:
                claim = self.claims.take(request_id(verdict), now)
                if claim.mine:
                    self.records.append([self._execute(verdict, now)])
                elif not claim.done:
                    self._watch_claim(verdict, claim, now)
            except OSError as exc:   # a full disk: the next start's recovery redoes what this agent decided
                self.failures += 1
                self.log.error("could not check or take over a job-level claim", error=str(exc),
                               id=request_id(verdict))

    def _trust(self) -> restore.Trust:
        """Built at each restore: the run directory (whose owner root trusts) may appear after the agent."""
        return restore.Trust.for_run(self.run_dir, self.entry_points, self.launchers)

    # ----------------------------------------------------------------------------------- recovery
    def recover(self) -> int:
        """Rebuild the ledger from the record; redo an action decided but not recorded as done (a crash);
        watch again the claims of other agents this agent recorded as ``claimed`` and saw no end of
        (the watching lived in the process that ended)."""
        events = self.records.events()
        if self.records.refused:
            self.log.error("lines of the actions log not signed by this agent: not redone, not remembered",
                           path=str(self.records.path), **self.records.refused)
        done = {e.get("id") for e in events if e.get("type") == "action" and e.get("outcome") != "failed"}
        claimed = {e.get("id") for e in events if e.get("type") == "action" and e.get("outcome") == "claimed"}
        carried_out = {e.get("id") for e in events if e.get("type") == "action" and e.get("outcome") != "claimed"}
        pending, decided = [], {}
        for event in events:
            if event.get("type") != "alert":
                continue
            self.ledger.remember(event)
            if event.get("request_id"):
                decided[event["request_id"]] = event
                if event["request_id"] not in done:
                    pending.append(event)
        for event in pending:
            if event["request_id"] in done:
                continue
            self.log.warning("redoing an action decided before a restart", action=event.get("action"),
                             alertname=event.get("alertname"), id=event["request_id"])
            self._redone.add(event["request_id"])
            verdict = self._verdict_of(event)
            if self._awaits_investigator and self.investigator is None and self._may_need_evidence(verdict):
                self._await_investigator(verdict)
            elif self._may_need_evidence(verdict):
                self._redo_restore(verdict)
            else:
                self._redo(verdict)
            done.add(event["request_id"])       # one redo per request, however often it was decided
        for request in sorted(claimed - carried_out):
            if request in decided:
                self._watch_again(self._verdict_of(decided[request]))
        return len(pending)

    @staticmethod
    def _verdict_of(event: dict) -> Verdict:
        """The verdict an ``alert`` record of this log holds (as decided before a restart)."""
        notice = Notice(alertname=event.get("alertname", ""), status="firing", action=event.get("requested"),
                        key=event["key"], starts_at=event.get("starts_at"), source=event.get("source", ""),
                        labels=dict(event.get("labels") or {}))
        return Verdict(notice, event["outcome"], event["action"], event.get("reason", ""),
                       float(event.get("decided_at") or 0.0))

    def _redo(self, verdict: Verdict) -> None:
        try:
            self.records.append([self._execute(verdict, self.clock())])
        except OSError as exc:     # a full disk at start: the next start (or record) redoes it
            self.log.error("could not record a redone action", error=str(exc), id=request_id(verdict))

    def _redo_restore(self, verdict: Verdict) -> None:
        """A restore decided before a restart: its evidence is gathered again from the ranks it would end
        (the first life's gathering may be cut short, and nothing of it names this restore), then it is
        carried out (its record says ``redone_after_restart``)."""
        if self._needs_evidence(verdict):
            self._restore_after_evidence(verdict)
            return
        with self._lock:
            self._redo(verdict)

    def _await_investigator(self, verdict: Verdict) -> None:
        """Until the agent installs its Investigator (at once, agent/app.py); past REDO_WAIT_SECONDS without
        one, the restore is carried out without evidence rather than never."""
        self._awaiting_evidence.append(verdict)

        def give_up() -> None:
            if verdict in self._awaiting_evidence:
                self._awaiting_evidence.remove(verdict)
                self.log.error("no investigator to gather a redone restore's evidence; restoring without it",
                               id=request_id(verdict), waited_seconds=REDO_WAIT_SECONDS)
                with self._lock:
                    self._redo(verdict)

        timer = threading.Timer(REDO_WAIT_SECONDS, give_up)
        timer.daemon = True
        timer.start()

    def _watch_again(self, verdict: Verdict) -> None:
        """A claim another agent held when this one last ran: look at it now (done: nothing to do; still
        renewed: watch it; neither for the timeout: take it over, agent/claims.py)."""
        self.log.info("watching again a job-level claim recorded before a restart", id=request_id(verdict))
        timer = threading.Timer(0.0, self._claim_check, (verdict,))
        timer.daemon = True
        timer.start()

    # ------------------------------------------------------------------------------------ metrics
    def families(self) -> list:
        verdicts = CounterMetricFamily("trainguard_alert_verdicts", "Alerts and embedded decisions the ledger "
                                       "decided, by outcome (act, duplicate, coalesced, escalated ...).",
                                       labels=["outcome"])
        for outcome, count in sorted(self.outcomes.items()):
            verdicts.add_metric([outcome], count)
        executed = CounterMetricFamily("trainguard_actions_executed", "Actions the agent carried out on the run.",
                                       labels=["action"])
        for action, count in sorted(self.executed.items()):
            executed.add_metric([action], count)
        shadowed = CounterMetricFamily("trainguard_actions_shadowed", "Shadow mode: actions the agent decided "
                                       "and recorded as shadow_action events, and did not carry out.",
                                       labels=["action"])
        for action, count in sorted(self.shadowed.items()):
            shadowed.add_metric([action], count)
        refused = CounterMetricFamily("trainguard_restore_refused", "Rank processes a restore did not end, by "
                                      "reason (not a proven rank of this run; no_restarts_left: a human paged).",
                                      labels=["reason"])
        for reason in restore.REFUSALS:
            refused.add_metric([reason], self.refused.get(reason, 0))
        not_done = CounterMetricFamily("trainguard_actions_not_done", "Decisions that could not be recorded or "
                                       "carried out (a full disk); the ledger was left as it was, to retry.")
        not_done.add_metric([], self.failures)
        claims_refused = CounterMetricFamily("trainguard_claims_refused", "Claim files of job-level actions that "
                                             "did not prove themselves (not signed with the job's token, or copied "
                                             "from another request), by reason: ignored, the action went on.",
                                             labels=["reason"])
        for reason, count in sorted(self.claims.refused.items()):
            claims_refused.add_metric([reason], count)
        taken_over = CounterMetricFamily("trainguard_claims_taken_over", "Job-level actions this agent carried out "
                                         "after their claimant did not record them done within "
                                         "webhook.claim_timeout_seconds.")
        taken_over.add_metric([], self.claims.taken_over)
        records_refused = CounterMetricFamily("trainguard_action_records_refused", "Lines of this agent's actions "
                                              "log (RUN/tls/node-<node>-actions.jsonl) it did not rebuild from or "
                                              "redo at start: not signed by it with the run's checkpoint key.",
                                              labels=["reason"])
        for reason, count in sorted(self.records.refused.items()):
            records_refused.add_metric([reason], count)
        return [verdicts, executed, shadowed, refused, not_done, claims_refused, taken_over, records_refused]
