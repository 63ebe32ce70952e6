"""The executor: the ledger's verdicts carried out on the run, each one recorded durably first.

For every notice (an Alertmanager alert, or a decision of the agent's embedded path):

1. the ledger (trainguard/decide/ledger.py) decides: act, duplicate, superseded, coalesced, escalated ...;
2. the verdict is appended to ``RUN/tls/node-<node>-actions.jsonl`` as a TLS ``alert`` event and fsynced,
   and logged (structlog) - the intent, before anything happens;
3. an action is executed: ``rollback`` and ``cost_*`` become a request line in ``RUN/control/actions.jsonl``
   (fsynced; the trainer's control channel, trainer/control.py, makes every rank act on the same step);
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
every agent of the job. Before carrying one out, an agent claims it: ``RUN/control/claims/<request id>``
created with O_EXCL (atomic on local filesystems and NFSv3+), the one place every agent sees. The agent
that created it acts; the others record the action as ``claimed`` by that node and do nothing, so a
job-level ``restore`` ends one node's ranks (torch's elastic rendezvous then restarts every node's
workers) rather than every node's at once. An agent that crashed after claiming finds its own claim and
acts on recovery.
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

from trainguard import actions, rundir, tls
from trainguard import log as tglog
from trainguard.agent import restore
from trainguard.node import node_name
from trainguard.decide.ledger import ACT, ESCALATED, Ledger, Limits, Notice, Verdict, job_level

DEFAULT_GRACE_SECONDS = 0.0     # SIGKILL at once: see agent/restore.py
RETRY_SECONDS = 5.0             # an embedded decision that could not be recorded is tried again this often


class ActionNotDone(OSError):
    """A decision could not be recorded or carried out; the ledger is as it was, so a retry acts."""


# ------------------------------------------------------------------------------------------- settings

@dataclass(frozen=True)
class WebhookSettings:
    """The agent config's ``webhook:`` section, checked (a bad value names ``webhook.<key>``)."""

    token_file: Path
    default_token_file: Path
    dry_run: bool = False
    max_body_bytes: int = 2**20
    embedded: bool = True
    restore_grace_seconds: float = DEFAULT_GRACE_SECONDS
    restore_entry_points: tuple[str, ...] = ()   # worker programs besides trainguard's (docs/agent.md)
    restore_launchers: tuple[str, ...] = ()      # launcher programs besides torchrun and `trainguard train`

    KEYS = ("token_file", "dry_run", "max_body_bytes", "embedded", "restore_grace_seconds",
            "restore_entry_points", "restore_launchers")

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
        for key in ("dry_run", "embedded"):
            if key in values:
                if not isinstance(values[key], bool):
                    raise ConfigError(f"webhook.{key}: expected true or false, got {values[key]!r}")
                kwargs[key] = values[key]
        if "max_body_bytes" in values:
            kwargs["max_body_bytes"] = _size(values["max_body_bytes"])
        if "restore_grace_seconds" in values:
            grace = values["restore_grace_seconds"]
            if isinstance(grace, bool) or not isinstance(grace, (int, float)) or grace < 0:
                raise ConfigError(f"webhook.restore_grace_seconds: expected seconds >= 0, got {grace!r}")
            kwargs["restore_grace_seconds"] = float(grace)
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

class EventLog:
    """Appends TLS records and fsyncs them: what is written here survives a crash of the agent."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, records: Iterable[dict]) -> None:
        """Write whole records or raise OSError; a partial write (disk full) is cut back off the file."""
        data = b"".join(tls.encode(record) for record in records)
        if not data:
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
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
        """Every event recorded so far (a malformed line, e.g. torn by a crash, is skipped)."""
        if not self.path.exists():
            return []
        return [line.record["event"] for line in tls.iter_lines(self.path)
                if line.record is not None and isinstance(line.record.get("event"), dict)]


def claim(path: Path, node: str, now: float) -> str:
    """Create `path` naming `node` unless it exists (O_EXCL: exactly one creator); the claimant's node.

    A claim written but not yet readable (the creator between open and write) is retried briefly; one
    that stays unreadable is damaged, and its creator is taken to be another agent (never act twice).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"node": node, "claimed_at": now}).encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return _claimant(path)
    try:
        os.write(fd, body)
        os.fsync(fd)
    except OSError:
        os.close(fd)
        os.unlink(path)        # a claim nobody can read would block the job's action for good
        raise
    os.close(fd)
    return node


def _claimant(path: Path, attempts: int = 20) -> str:
    for _ in range(attempts):
        try:
            return str(json.loads(path.read_bytes())["node"])
        except (OSError, ValueError, KeyError, TypeError):
            time.sleep(0.05)
    return f"unreadable claim {path}"


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
                 entry_points: tuple[str, ...] = (), launchers: tuple[str, ...] = ()):
        self.run_dir = Path(run_dir)
        self.entry_points, self.launchers = entry_points, launchers   # beyond the bundled ones (restore.Trust)
        self.node, self.host = node, host or node_name()
        self.ledger, self.clock = ledger, clock
        self.grace = restore_grace_seconds
        self.records = EventLog(rundir.node_actions_log(self.run_dir, node))
        self.log = tglog.get("agent.executor", node=node)
        self._lock = threading.Lock()
        self.outcomes: dict[str, int] = {}
        self.executed: dict[str, int] = {}
        self.refused: dict[str, int] = {}         # restore refusals by reason
        self.failures = 0                         # decisions not done: a write or the action failed
        self._failing: str | None = None          # the failure being reported (logged once until it clears)
        self._retry: list[Notice] = []            # embedded notices waiting for a retry
        self._retry_timer: threading.Timer | None = None
        self.recover()

    @classmethod
    def for_agent(cls, config, policy, settings) -> "Executor":
        ledger = Ledger(Limits.from_policy(policy), dry_run=settings.dry_run)
        return cls(config.run_dir, config.node, ledger, restore_grace_seconds=settings.restore_grace_seconds,
                   entry_points=settings.restore_entry_points, launchers=settings.restore_launchers)

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
        self.records.append([self._alert_record(v, now) for v in verdicts])
        for verdict in verdicts:
            self._log_verdict(verdict)
        results = [self._execute(v, now) for v in verdicts if v.executes]
        self.records.append(results)
        failed = [r for r in results if r.get("outcome") == "failed"]
        if failed:
            raise OSError(failed[0].get("errno") or 0, failed[0]["error"])
        for verdict in verdicts:
            self.outcomes[verdict.outcome] = self.outcomes.get(verdict.outcome, 0) + 1
        return verdicts

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

    def _log_verdict(self, verdict: Verdict) -> None:
        n = verdict.notice
        fields = dict(alertname=n.alertname, status=n.status, outcome=verdict.outcome, action=verdict.action,
                      requested=n.action, reason=verdict.reason, key=n.key, source=n.source, dry_run=verdict.dry_run)
        if verdict.action == actions.PAGE:
            self.log.error("escalated to a human: rate limit reached", **fields)
        elif verdict.outcome in (ACT, ESCALATED):
            self.log.warning("dry run: would act" if verdict.dry_run else "acting on alert", **fields)
        else:
            self.log.info("alert recorded", **fields)

    # ------------------------------------------------------------------------------------ execute
    def _execute(self, verdict: Verdict, now: float) -> dict:
        n = verdict.notice
        request = rundir.request(verdict.action, request_id(verdict), alertname=n.alertname,
                                 reason=verdict.reason, issued_at=now)
        result: dict[str, Any] = {"id": request["id"], "action": verdict.action, "alertname": n.alertname,
                                  "reason": verdict.reason, "key": n.key, "source": n.source, "issued_at": now}
        try:
            claimant = self._claim(verdict, request["id"], now)
            if claimant != self.node:
                result.update(outcome="claimed", claimed_by=claimant)
                self.log.info("job-level action carried out by another agent", action=verdict.action,
                              alertname=n.alertname, claimed_by=claimant, id=request["id"])
                return {**tls.event("action", timestamp=now, **result), "node": self.node}
            result["appended"] = rundir.append_request(self.run_dir, request)
            if verdict.action == actions.RESTORE:
                result.update(restore.end_local_ranks(self.run_dir, self.host, started_before=n.starts_at,
                                                    grace_seconds=self.grace, trust=self._trust()))
                for refusal in result["refused"]:
                    self.refused[refusal["reason"]] = self.refused.get(refusal["reason"], 0) + 1
                if "paged" in result:
                    self.refused["no_restarts_left"] = self.refused.get("no_restarts_left", 0) + 1
            result["outcome"] = "paged" if "paged" in result else "issued"
        except OSError as exc:
            result.update(outcome="failed", error=f"{type(exc).__name__}: {exc}", errno=exc.errno)
            self.log.error("action failed", action=verdict.action, alertname=n.alertname, error=result["error"])
        self.executed[verdict.action] = self.executed.get(verdict.action, 0) + 1
        self.log.warning("action issued", **{k: v for k, v in result.items() if k != "issued_at"})
        return {**tls.event("action", timestamp=now, **result), "node": self.node}

    def _claim(self, verdict: Verdict, request_id: str, now: float) -> str:
        """The node that carries out this verdict: this one, unless the action is job-level and another
        agent claimed it first (RUN/control/claims/<request id>, created once with O_EXCL)."""
        if not job_level(verdict.notice):
            return self.node
        return claim(rundir.claim_path(self.run_dir, request_id), self.node, now)

    def _trust(self) -> restore.Trust:
        """Built at each restore: the run directory (whose owner root trusts) may appear after the agent."""
        return restore.Trust.for_run(self.run_dir, self.entry_points, self.launchers)

    # ----------------------------------------------------------------------------------- recovery
    def recover(self) -> int:
        """Rebuild the ledger from the record; redo an action decided but not recorded as done (a crash)."""
        events = self.records.events()
        done = {e.get("id") for e in events if e.get("type") == "action" and e.get("outcome") != "failed"}
        pending = []
        for event in events:
            if event.get("type") != "alert":
                continue
            self.ledger.remember(event)
            if event.get("request_id") and event["request_id"] not in done:
                pending.append(event)
        for event in pending:
            if event["request_id"] in done:
                continue
            self.log.warning("redoing an action decided before a restart", action=event.get("action"),
                             alertname=event.get("alertname"), id=event["request_id"])
            notice = Notice(alertname=event.get("alertname", ""), status="firing", action=event.get("requested"),
                            key=event["key"], starts_at=event.get("starts_at"), source=event.get("source", ""))
            verdict = Verdict(notice, event["outcome"], event["action"], event.get("reason", ""),
                              float(event.get("decided_at") or 0.0))
            try:
                self.records.append([self._execute(verdict, self.clock())])
            except OSError as exc:     # a full disk at start: the next start (or record) redoes it
                self.log.error("could not record a redone action", error=str(exc), id=event["request_id"])
            done.add(event["request_id"])       # one redo per request, however often it was decided
        return len(pending)

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
        refused = CounterMetricFamily("trainguard_restore_refused", "Rank processes a restore did not end, by "
                                      "reason (not a proven rank of this run; no_restarts_left: a human paged).",
                                      labels=["reason"])
        for reason in restore.REFUSALS:
            refused.add_metric([reason], self.refused.get(reason, 0))
        not_done = CounterMetricFamily("trainguard_actions_not_done", "Decisions that could not be recorded or "
                                       "carried out (a full disk); the ledger was left as it was, to retry.")
        not_done.add_metric([], self.failures)
        return [verdicts, executed, refused, not_done]
