"""POST /api/v1/alerts: Alertmanager's webhook (payload version 4) into the agent's executor.

    POST /api/v1/alerts
    Authorization: Bearer <the token in webhook.token_file>
    Content-Type: application/json
    {"version": "4", "status": "firing", "alerts": [{"status": "firing", "labels": {"alertname": ...,
     "action": "rollback"}, "annotations": {...}, "startsAt": "...", "endsAt": "...", "fingerprint": "..."}]}

A request is checked in this order, and any failure is a 4xx that executes nothing: the bearer token
(401, constant-time compare), the body size (413), the content type (415), the JSON (400), then every
field of the payload (422, naming the field: ``alerts[1].startsAt: not an RFC 3339 time``). Only a
payload that is valid as a whole reaches the executor, which records each decision durably before this
handler answers 2xx.

Configuration (the agent config's ``webhook:`` section):

    webhook:
      token_file: /etc/trainguard/webhook.token   # default RUN/agent/webhook.token, created (0600) if missing
      shadow: false           # decide and record, execute nothing (alias dry_run; the policy's actions.mode)
      max_body_bytes: 1MiB
      embedded: true          # the agent's own cost meter and stall watchdog act too (actions_embedded.py)
      restore_grace_seconds: 0   # SIGKILL the ranks at once (a hung rank cannot run a SIGTERM handler)
"""

from __future__ import annotations

import hmac
import json
import os
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Mapping

from trainguard import actions, rundir, safe_read
from trainguard import log as tglog
from trainguard.decide.ledger import FIRING, RESOLVED_STATUS, Notice
from trainguard.tls import format_timestamp

PATH = "/api/v1/alerts"
VERSION = "4"
STATUSES = (FIRING, RESOLVED_STATUS)
MAX_BODY_BYTES = 2**20
MAX_ALERTS = 1000
_FINGERPRINT = re.compile(r"^[0-9a-fA-F]{1,64}$")
_RFC3339 = re.compile(r"^(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")

Response = tuple[int, Mapping[str, str], bytes]


class PayloadError(ValueError):
    """A payload that is not Alertmanager's webhook v4; `field` names where (``alerts[0].labels``)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


# ------------------------------------------------------------------------------------------ parsing

def parse_time(value: Any, field: str) -> float:
    """RFC 3339 with any number of fraction digits (Alertmanager writes nanoseconds) as Unix seconds."""
    if not isinstance(value, str):
        raise PayloadError(field, f"expected an RFC 3339 time string, got {type(value).__name__}")
    match = _RFC3339.match(value)
    if not match:
        raise PayloadError(field, f"not an RFC 3339 time: {value!r}")
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    fraction, zone = match.group(7) or "", match.group(8)
    try:
        offset = timezone.utc if zone in "Zz" else timezone(
            (1 if zone[0] == "+" else -1) * timedelta(hours=int(zone[1:3]), minutes=int(zone[4:6])))
        moment = datetime(year, month, day, hour, minute, second, tzinfo=offset)
    except ValueError as exc:
        raise PayloadError(field, f"not a valid time: {value!r} ({exc})") from None
    return moment.timestamp() + (float("0" + fraction) if fraction else 0.0)


def _string_map(value: Any, field: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise PayloadError(field, f"expected an object of strings, got {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(item, str):
            raise PayloadError(f"{field}.{key}", f"expected a string, got {type(item).__name__}")
    return value


def _one_of(value: Any, allowed: tuple, field: str) -> str:
    if value not in allowed:
        raise PayloadError(field, f"expected one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def _alert(raw: Any, field: str) -> Notice:
    if not isinstance(raw, dict):
        raise PayloadError(field, f"expected an object, got {type(raw).__name__}")
    for name in ("status", "labels", "annotations", "startsAt", "endsAt", "fingerprint"):
        if name not in raw:
            raise PayloadError(f"{field}.{name}", "missing")
    status = _one_of(raw["status"], STATUSES, f"{field}.status")
    labels = _string_map(raw["labels"], f"{field}.labels")
    _string_map(raw["annotations"], f"{field}.annotations")
    alertname = labels.get("alertname")
    if not alertname:
        raise PayloadError(f"{field}.labels.alertname", "missing")
    action = labels.get("action")
    if action is not None and action not in actions.REMOTE_ACTIONS:
        raise PayloadError(f"{field}.labels.action",
                           f"unknown action {action!r} (one of {', '.join(actions.REMOTE_ACTIONS)})")
    fingerprint = raw["fingerprint"]
    if not isinstance(fingerprint, str) or not _FINGERPRINT.match(fingerprint):
        raise PayloadError(f"{field}.fingerprint", f"expected a hexadecimal fingerprint, got {fingerprint!r}")
    starts_at = parse_time(raw["startsAt"], f"{field}.startsAt")
    parse_time(raw["endsAt"], f"{field}.endsAt")
    if "generatorURL" in raw and not isinstance(raw["generatorURL"], str):
        raise PayloadError(f"{field}.generatorURL", "expected a string")
    # Alertmanager keeps startsAt across repeats of one alert: with the fingerprint it names the incident.
    key = f"{fingerprint.lower()}@{format_timestamp(starts_at)}"
    return Notice(alertname=alertname, status=status, action=action, key=key, starts_at=starts_at,
                  reason=alertname, labels=dict(labels))


def parse_payload(data: Any) -> list[Notice]:
    """Validate a decoded webhook body as a whole; the alerts as notices, or PayloadError naming the field."""
    if not isinstance(data, dict):
        raise PayloadError("body", f"expected a JSON object, got {type(data).__name__}")
    if "version" not in data:
        raise PayloadError("version", "missing")
    if data["version"] != VERSION:
        raise PayloadError("version", f"expected {VERSION!r} (Alertmanager webhook v4), got {data['version']!r}")
    if "status" not in data:
        raise PayloadError("status", "missing")
    _one_of(data["status"], STATUSES, "status")
    for name in ("receiver", "groupKey", "externalURL"):
        if name in data and not isinstance(data[name], str):
            raise PayloadError(name, f"expected a string, got {type(data[name]).__name__}")
    for name in ("groupLabels", "commonLabels", "commonAnnotations"):
        if name in data:
            _string_map(data[name], name)
    truncated = data.get("truncatedAlerts", 0)
    if not isinstance(truncated, int) or isinstance(truncated, bool) or truncated < 0:
        raise PayloadError("truncatedAlerts", f"expected a non-negative integer, got {truncated!r}")
    alerts = data.get("alerts")
    if not isinstance(alerts, list):
        raise PayloadError("alerts", "missing" if alerts is None else f"expected a list, got {type(alerts).__name__}")
    if len(alerts) > MAX_ALERTS:
        raise PayloadError("alerts", f"{len(alerts)} alerts, over the limit of {MAX_ALERTS}")
    return [_alert(raw, f"alerts[{index}]") for index, raw in enumerate(alerts)]


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def decode_json(body: bytes) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity literals."""
    try:
        return json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None


# ----------------------------------------------------------------------------------------- the token

def load_token(path: str | os.PathLike, create: bool = False) -> bytes:
    """The bearer token in `path` (surrounding blanks stripped); with `create`, a fresh one written 0600."""
    path = Path(path)
    if create and not path.exists():
        # Agents of several nodes start together on a shared run directory: one creates the token, every
        # other reads that one, and none reads it empty.
        rundir.create_whole(path, (secrets.token_urlsafe(32) + "\n").encode(), 0o600)
    info = path.stat()
    if info.st_uid not in (os.geteuid(), 0):
        # The default token lives in the run directory: a stranger who can write there could plant one they
        # know before the agent's first start, and then post any alert to it (and sign claims with it).
        raise ValueError(f"{path}: the webhook token file belongs to uid {info.st_uid}, not to this agent's user "
                         f"(uid {os.geteuid()}) or root: someone else wrote it; remove it, or give the agent a "
                         f"token file of its own (webhook.token_file)")
    mode = info.st_mode & 0o777
    if mode & 0o077:
        # Whoever reads the token can stop or restore the run, as whoever reads the checkpoint key can sign one.
        raise ValueError(f"{path}: the webhook token file is readable by others (mode {mode:04o}); "
                         f"make it private: chmod 600 {path}")
    token = safe_read.read_bytes(path, safe_read.CONTROL_BYTES, "webhook token file").strip()
    if not token:
        raise ValueError(f"{path}: the webhook token file is empty")
    return token


def _header(headers: Mapping[str, str], name: str) -> str:
    """A header by name, whatever its case (a plain dict from a test, or the server's Message)."""
    value = headers.get(name)
    if value is None and isinstance(headers, dict):
        value = next((v for k, v in headers.items() if k.lower() == name.lower()), None)
    return value or ""


def _json(status: int, payload: Any, headers: Mapping[str, str] | None = None) -> Response:
    return status, {"Content-Type": "application/json", **(headers or {})}, json.dumps(payload).encode() + b"\n"


# -------------------------------------------------------------------------------------------- handler

@dataclass
class Webhook:
    """The route handler: checks a request, hands the alerts to `executor.submit`, answers."""

    token: bytes
    executor: Any                     # agent/executor.py Executor: submit(list[Notice]) -> list[NoticeVerdict]
    max_body_bytes: int = MAX_BODY_BYTES

    def __post_init__(self) -> None:
        self.log = tglog.get("agent.webhook")
        self.requests: dict[str, int] = {}      # by HTTP status code

    def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Response:
        response = self._handle(method, headers, body)
        code = str(response[0])
        self.requests[code] = self.requests.get(code, 0) + 1
        return response

    def families(self) -> list:
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily("trainguard_webhook_requests", "Requests to POST /api/v1/alerts, by status code.",
                                     labels=["code"])
        for code, count in sorted(self.requests.items()):
            family.add_metric([code], count)
        return [family]

    def _handle(self, method: str, headers: Mapping[str, str], body: bytes) -> Response:
        if method != "POST":
            return _json(405, {"error": "use POST"}, {"Allow": "POST"})
        refusal = self._refuse(headers, body)
        if refusal is not None:
            status, message = refusal
            self.log.warning("webhook request refused", status=status, error=message)
            extra = {"WWW-Authenticate": 'Bearer realm="trainguard"'} if status == 401 else None
            return _json(status, {"error": message}, extra)
        try:
            notices = parse_payload(decode_json(body))
        except PayloadError as exc:
            self.log.warning("webhook payload invalid", status=422, error=str(exc), field=exc.field)
            return _json(422, {"error": str(exc), "field": exc.field})
        except ValueError as exc:
            self.log.warning("webhook body not JSON", status=400, error=str(exc))
            return _json(400, {"error": f"body: not valid JSON: {exc}"})
        try:
            verdicts = self.executor.submit(notices)
        except OSError as exc:     # executor.ActionNotDone: nothing acted, the ledger as it was; retry
            return _json(500, {"error": f"not done, retry: {exc}"})
        return _json(200, {"status": "ok", "verdicts": [
            {"alertname": v.notice.alertname, "status": v.notice.status, "outcome": v.outcome,
             "action": v.action, "shadow": v.shadow} for v in verdicts]})

    def _refuse(self, headers: Mapping[str, str], body: bytes) -> tuple[int, str] | None:
        scheme, _, credentials = _header(headers, "Authorization").strip().partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            return 401, "missing bearer token (Authorization: Bearer <token>)"
        if not hmac.compare_digest(credentials.strip().encode(), self.token):
            return 401, "invalid bearer token"
        if len(body) > self.max_body_bytes:
            return 413, f"body of {len(body)} bytes is over the limit of {self.max_body_bytes}"
        content_type = _header(headers, "Content-Type").split(";")[0].strip().lower()
        if content_type != "application/json":
            return 415, f"Content-Type must be application/json, got {content_type or 'none'!r}"
        return None

    def route(self, request) -> Response:
        """Adapter for agent/server.py's route table (a Request in, a Response out)."""
        return self.handle(request.method, request.path, request.headers, request.body)
