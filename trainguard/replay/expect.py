"""``--expect FILE``: what a replay must find, as a regression test of an incident.

    # tests/incidents/loss-spike/expect.yml
    actions:
      - {action: skip_step, step: [300, 302]}       # step, or an inclusive [from, to]
      - {action: rollback, step: [302, 310], reason: repeated_loss_spike, count: 1}
    alerts:                                          # checked when replay runs with --rules
      - {alertname: GPUOverheating, time: ["+2m", "+6m"], labels: {gpu: "0"}}
    strict: true        # the default: an action or alert that no entry expects is a mismatch
    replay: {hold: 150, scrape_interval: 15}   # how the incident is replayed, when the command line does not say

    recorded:                                        # what the live run did, as its log says (every source)
      - {alert: TrainingStalled, source: embedded}   # the agent's verdict on an alert
      - {action: restore, source: agent+control}     # the agent's action; the request in RUN/control
      - {action: restart, step: 20}                  # a rank resumed from step 20
    # (recorded entries are checked only when the file has them; strict applies to them too)

    # a healthy run: no action and no alert at all
    none: true

An entry matches the actions (alerts) of its kind whose step, start time, reason and labels fall within
what it states; with ``count`` exactly that many must match, else at least one. ``time`` bounds are
offsets from the first record (``"+90s"``, ``"+2m30s"``, or a number of seconds) or RFC 3339 times.
Anything else in the file is an error naming the file and the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard import safe_read, tls

_DURATION = re.compile(r"^\+?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?(?:(\d+(?:\.\d+)?)s)?$")
_ACTION_KEYS = {"action", "step", "time", "reason", "count"}
_ALERT_KEYS = {"alertname", "time", "labels", "severity", "count"}
_RECORDED_KEYS = {"action", "alert", "step", "time", "reason", "source", "count"}
REPLAY_OPTIONS = ("hold", "scrape_interval")


class ExpectError(ValueError):
    pass


@dataclass(frozen=True)
class Entry:
    kind: str                               # "action" | "alert"
    name: str
    where: str                              # "actions[2]": for messages
    step: tuple[int, int] | None = None
    time: tuple[Any, Any] | None = None     # offsets (float) or absolute (str), resolved against the log
    reason: str | None = None
    severity: str | None = None
    labels: dict = field(default_factory=dict)
    count: int | None = None

    def describe(self, origin: float | None) -> str:
        parts = [self.name]
        if self.step is not None:
            lo, hi = self.step
            parts.append(f"step {lo}" if lo == hi else f"step {lo}..{hi}")
        if self.time is not None:
            lo, hi = (offset_text(_resolve(b, origin), origin) for b in self.time)
            parts.append(f"time {lo}..{hi}")
        return "  ".join(parts + _qualifiers(self.reason, self.severity, self.labels))


def _qualifiers(reason: str | None, severity: str | None, labels: dict) -> list[str]:
    """The reason, severity and labels of an expected or found entry, as `describe` shows them."""
    parts = [f"reason {reason}"] if reason else []
    if severity:
        parts.append(f"severity {severity}")
    if labels:
        parts.append("labels " + ",".join(f"{k}={v}" for k, v in sorted(labels.items())))
    return parts


@dataclass(frozen=True)
class Expected:
    source: str
    none: bool = False
    strict: bool = True
    entries: tuple[Entry, ...] = ()
    replay: dict = field(default_factory=dict)     # {"hold": s, "scrape_interval": s}

    @property
    def wants_alerts(self) -> bool:
        return any(entry.kind == "alert" for entry in self.entries)

    @property
    def wants_recorded(self) -> bool:
        return any(entry.kind.startswith("recorded_") for entry in self.entries)


# -------------------------------------------------------------------------------------------- load

def load(path: str | Path) -> Expected:
    import yaml   # only a replay with --expect reads YAML: the others start without it

    source = str(path)
    try:
        data = safe_read.read_yaml(path, what="expectation file")
    except FileNotFoundError:
        raise ExpectError(f"{source}: no such expectation file") from None
    except OSError as exc:      # a FIFO, a device, a directory, too large: named by safe_read
        raise ExpectError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise ExpectError(f"{source}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise ExpectError(f"{source}: not valid YAML: {exc}") from None
    return parse({} if data is None else data, source)


def parse(data: Any, source: str) -> Expected:
    """An expectation from its data (what the YAML file holds); `source` names it in errors."""
    if not isinstance(data, dict):
        raise ExpectError(f"{source}: expected a mapping with actions, alerts, none or strict")
    unknown = set(data) - {"actions", "alerts", "recorded", "none", "strict", "description", "replay"}
    if unknown:
        raise ExpectError(f"{source}: {sorted(unknown)[0]}: unknown key (known: actions, alerts, recorded, none, "
                          "strict, replay, description)")
    none, strict = _flag(data, "none", False, source), _flag(data, "strict", True, source)
    entries = [_entry(item, "action", f"actions[{i}]", source) for i, item in enumerate(_list(data, "actions", source))]
    entries += [_entry(item, "alert", f"alerts[{i}]", source) for i, item in enumerate(_list(data, "alerts", source))]
    entries += [_recorded_entry(item, f"recorded[{i}]", source)
                for i, item in enumerate(_list(data, "recorded", source))]
    if none and entries:
        raise ExpectError(f"{source}: none: true cannot be combined with expected actions or alerts")
    if not none and not entries:
        raise ExpectError(f"{source}: expects nothing; say `none: true` for a run that must do nothing")
    return Expected(source, none, strict, tuple(entries), _replay_options(data.get("replay"), source))


def _replay_options(value: Any, source: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ExpectError(f"{source}: replay: expected a mapping with hold and/or scrape_interval")
    options = {}
    for key, item in value.items():
        if key not in REPLAY_OPTIONS:
            raise ExpectError(f"{source}: replay.{key}: unknown key (known: {', '.join(REPLAY_OPTIONS)})")
        if isinstance(item, bool) or not isinstance(item, (int, float)) or item < 0:
            raise ExpectError(f"{source}: replay.{key}: expected seconds (a number >= 0), got {item!r}")
        options[key] = float(item)
    return options


def _flag(data: dict, key: str, default: bool, source: str) -> bool:
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise ExpectError(f"{source}: {key}: expected true or false, got {value!r}")
    return value


def _list(data: dict, key: str, source: str) -> list:
    value = data.get(key) or []
    if not isinstance(value, list):
        raise ExpectError(f"{source}: {key}: expected a list")
    return value


def _entry(item: Any, kind: str, where: str, source: str) -> Entry:
    name_key, known = ("action", _ACTION_KEYS) if kind == "action" else ("alertname", _ALERT_KEYS)
    if not isinstance(item, dict) or not isinstance(item.get(name_key), str):
        raise ExpectError(f"{source}: {where}: expected a mapping with a string {name_key!r}")
    unknown = set(item) - known
    if unknown:
        raise ExpectError(f"{source}: {where}.{sorted(unknown)[0]}: unknown key (known: {', '.join(sorted(known))})")
    labels = item.get("labels") or {}
    if not isinstance(labels, dict):
        raise ExpectError(f"{source}: {where}.labels: expected a mapping of label to value")
    count = item.get("count")
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 0):
        raise ExpectError(f"{source}: {where}.count: expected a whole number, got {count!r}")
    return Entry(kind, item[name_key], where, step=_step_range(item.get("step"), f"{source}: {where}.step"),
                 time=_time_range(item.get("time"), f"{source}: {where}.time"), reason=item.get("reason"),
                 severity=item.get("severity"), labels={str(k): str(v) for k, v in labels.items()}, count=count)


def _recorded_entry(item: Any, where: str, source: str) -> Entry:
    """`{action: NAME}` or `{alert: NAME}`, with step, time, reason, source (trainer, agent, control,
    embedded, alertmanager; joined with + when several saw it) and count."""
    if not isinstance(item, dict) or sum(isinstance(item.get(k), str) for k in ("action", "alert")) != 1:
        raise ExpectError(f"{source}: {where}: expected a mapping with a string 'action' or 'alert'")
    unknown = set(item) - _RECORDED_KEYS
    if unknown:
        raise ExpectError(f"{source}: {where}.{sorted(unknown)[0]}: unknown key (known: "
                          f"{', '.join(sorted(_RECORDED_KEYS))})")
    kind = "action" if isinstance(item.get("action"), str) else "alert"
    count = item.get("count")
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 0):
        raise ExpectError(f"{source}: {where}.count: expected a whole number, got {count!r}")
    labels = {"source": str(item["source"])} if item.get("source") is not None else {}
    return Entry(f"recorded_{kind}", item[kind], where, step=_step_range(item.get("step"), f"{source}: {where}.step"),
                 time=_time_range(item.get("time"), f"{source}: {where}.time"), reason=item.get("reason"),
                 labels=labels, count=count)


def _step_range(value: Any, where: str) -> tuple[int, int] | None:
    if value is None:
        return None
    bounds = value if isinstance(value, list) else [value, value]
    if len(bounds) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
        raise ExpectError(f"{where}: expected a step or [from, to], got {value!r}")
    return bounds[0], bounds[1]


def _time_range(value: Any, where: str) -> tuple[Any, Any] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2:
        raise ExpectError(f"{where}: expected [from, to], got {value!r}")
    bounds = []
    for bound in value:
        try:
            bounds.append(_bound(bound))
        except ValueError as exc:
            raise ExpectError(f"{where}: {exc}") from None
    return bounds[0], bounds[1]


def _bound(value: Any) -> float | str:
    """An offset in seconds (float), or an RFC 3339 time kept as text until the log's origin is known."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        match = _DURATION.match(value.strip())
        if match and any(match.groups()):
            hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
            return hours * 3600 + minutes * 60 + seconds
        tls.parse_timestamp(value)      # raises TLSError (a ValueError) naming the problem
        return value
    raise ValueError(f"expected an offset like '+90s' or an RFC 3339 time, got {value!r}")


def _resolve(bound: float | str, origin: float | None) -> float:
    if isinstance(bound, str):
        return tls.parse_timestamp(bound)
    return (origin or 0.0) + bound


# ----------------------------------------------------------------------------------------- compare

@dataclass(frozen=True)
class Found:
    """One action or alert of the replay, in the terms an entry can match."""

    kind: str
    name: str
    step: int | None
    time: float
    reason: str | None = None
    severity: str | None = None
    labels: dict = field(default_factory=dict)

    def describe(self, origin: float | None) -> str:
        parts = [self.name]
        if self.step is not None:
            parts.append(f"step {self.step}")
        parts.append(f"at {offset_text(self.time, origin)}")
        return "  ".join(parts + _qualifiers(self.reason, self.severity, self.labels))


def matches(entry: Entry, found: Found, origin: float | None) -> bool:
    """Whether `found` is an action (alert) that `entry` states."""
    return _matches(entry, found, origin)


def _matches(entry: Entry, found: Found, origin: float | None) -> bool:
    if entry.kind != found.kind or entry.name != found.name:
        return False
    if entry.step is not None and (found.step is None or not entry.step[0] <= found.step <= entry.step[1]):
        return False
    if entry.time is not None:
        lo, hi = (_resolve(bound, origin) for bound in entry.time)
        if not lo <= found.time <= hi:
            return False
    if entry.reason is not None and entry.reason != found.reason:
        return False
    if entry.severity is not None and entry.severity != found.severity:
        return False
    return all(found.labels.get(key) == value for key, value in entry.labels.items())


def compare(expected: Expected, found: list[Found], origin: float | None, *, alerts_evaluated: bool) -> list[str]:
    """The differences, one readable line each ('-' missing, '+' unexpected); empty when they agree."""
    diff: list[str] = []
    if expected.wants_alerts and not alerts_evaluated:
        diff.append("! alerts are expected but were not evaluated: give --rules DIR")
    claimed: set[int] = set()
    for entry in expected.entries:
        if entry.kind == "alert" and not alerts_evaluated:
            continue
        hits = [i for i, item in enumerate(found) if _matches(entry, item, origin)]
        claimed.update(hits)
        if entry.count is None and not hits:
            diff.append(f"- {entry.kind:6} {entry.describe(origin)}   (expected by {entry.where}; none found)")
        elif entry.count is not None and len(hits) != entry.count:
            diff.append(f"- {entry.kind:6} {entry.describe(origin)}   (expected by {entry.where}: "
                        f"{entry.count}, found {len(hits)})")
    if expected.none or expected.strict:
        for index, item in enumerate(found):
            if index not in claimed:
                diff.append(f"+ {item.kind:6} {item.describe(origin)}   (unexpected)")
    return diff


def offset_text(when: float, origin: float | None) -> str:
    """'+1h2m3.5s' from the first record (the RFC 3339 time when there is no origin)."""
    if origin is None:
        return tls.format_timestamp(when)
    seconds = round(when - origin, 3)
    sign = "-" if seconds < 0 else "+"
    hours, rest = divmod(abs(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    text = (f"{int(hours)}h" if hours else "") + (f"{int(minutes)}m" if minutes or hours else "")
    return sign + text + f"{round(secs, 3):g}s"
