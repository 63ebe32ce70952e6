"""The agent's action log, ``RUN/tls/node-<node>-actions.jsonl``: every decision and its result, durable and
signed, and what a restarted agent must redo from it.

Records are TLS events: an ``alert`` per ledger verdict (the intent, written before anything happens), a
``shadow_action`` per action shadow mode would have carried out, an ``action`` per result (carried out,
claimed by another agent, kept out, failed). Each is fsynced before the webhook answers, and signed with the
run's checkpoint key (purpose ``agent-actions/1``, bound to this node): `recovery()` redoes what the log says
was decided and not done, so a line anyone appended there (a ``cost_stop`` "decided before a restart")
would otherwise be carried out, signed, at the next start.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from trainguard import actions, event_types, rundir, safe_read, signed, tls
from trainguard.decide.ledger import Notice, NoticeVerdict

ACTIONS_LOG_PURPOSE = "agent-actions/1"    # each record of RUN/tls/node-<node>-actions.jsonl, signed


def request_id(verdict: NoticeVerdict) -> str:
    """Stable per incident: a cost tier acts once per run, any other action once per ledger key."""
    if verdict.action in actions.COST_ORDER:
        return f"cost-{verdict.action}"
    digest = hashlib.sha1(f"{verdict.notice.key}|{verdict.action}".encode()).hexdigest()[:16]
    return f"{verdict.action}-{digest}"


@dataclass
class Recovery:
    """What a restarted agent finds in its log."""

    alerts: list[dict] = field(default_factory=list)    # every verdict, in order: the ledger remembers them
    redo: list[dict] = field(default_factory=list)      # verdicts decided and not done (one per request id)
    watch: list[dict] = field(default_factory=list)     # job-level verdicts another agent claimed, no end seen


class ActionLog:
    """Appends TLS records and fsyncs them: what is written here survives a crash of the agent.

    With a key (the run's checkpoint key), each record is signed, bound to this node; `events` gives only
    the records that check, the others are counted in `refused`."""

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

    def recovery(self) -> Recovery:
        """The verdicts to remember, the actions decided and not recorded as done (a crash between the
        intent and the result), and the claims of other agents recorded as ``claimed`` with no end seen
        (the watching lived in the process that ended)."""
        events = self.events()
        results = [e for e in events if e.get("type") == event_types.ACTION]
        done = {e.get("id") for e in results if e.get("outcome") != "failed"}
        claimed = {e.get("id") for e in results if e.get("outcome") == "claimed"}
        carried_out = {e.get("id") for e in results if e.get("outcome") != "claimed"}
        found, decided = Recovery(), {}
        for event in events:
            if event.get("type") != event_types.ALERT:
                continue
            found.alerts.append(event)
            request = event.get("request_id")
            if request:
                decided[request] = event
                if request not in done:
                    found.redo.append(event)
                    done.add(request)       # one redo per request, however often it was decided
        found.watch = [decided[request] for request in sorted(claimed - carried_out) if request in decided]
        return found


def verdict_of(event: dict) -> NoticeVerdict:
    """The verdict an ``alert`` record of this log holds (as decided before a restart)."""
    notice = Notice(alertname=event.get("alertname", ""), status="firing", action=event.get("requested"),
                    key=event["key"], starts_at=event.get("starts_at"), source=event.get("source", ""),
                    labels=dict(event.get("labels") or {}))
    return NoticeVerdict(notice, event["outcome"], event["action"], event.get("reason", ""),
                   float(event.get("decided_at") or 0.0))


def alert_record(verdict: NoticeVerdict, now: float, node: str) -> dict:
    """The intent: the ledger's verdict, with the request id it will carry out (if it executes)."""
    event = verdict.as_event()
    event.pop("type")
    step = event.pop("step", None)
    if verdict.executes:
        event["request_id"] = request_id(verdict)
    return {**tls.event(event_types.ALERT, step=step, timestamp=now, **event), "node": node}


def shadow_record(verdict: NoticeVerdict, now: float, node: str) -> dict:
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
    return {**tls.event(actions.SHADOW_ACTION, step=n.step, timestamp=now, **event), "node": node}
