"""Health findings onto the node's timeline, once each: what the health_reports collector hands the node log.

The collector (agent/collectors/health_reports.py) turns a new `dcgmi diag -j` result, new NCCL RAS findings and
new NVRM kernel lines into `health_check` events. This module keeps them honest:

- **once**: every event carries an `id`; `HealthState` remembers the ids of reports and findings already put on
  the timeline, and how far into which file each followed log (kernel log, RAS monitor log) was read, in
  RUN/agent/health-<node>.json, so a restarted agent
  adds only what is new (a cron job rewriting the same RAS finding every minute is one event, not sixty);
- **bounded**: `Outbox` holds the last EVENTS_KEPT records for the node log (which writes each id once,
  agent/nodelog.py), at most MAX_EVENTS_PER_UPDATE an update (an XID storm of thousands of lines is the first
  ones and a count of the rest), and the state keeps the last SEEN_KEPT ids;
- **whose**: `ThisNode` says whether a host a finding names is this node (its name, or one of its addresses:
  NCCL RAS names nodes by IP), so another node's finding keeps its own `host`, is marked `this_node: false` and
  counts for nothing here (it stays in this node's log: that node's own agent speaks for it).

The counts (`COUNTS`) are cumulative and survive restarts with the state: they are what the node-risk rule reads
from the node record (system.health_*), so an agent restart is not a counter reset (a reset starts its settle
period). A state file lost or unreadable starts from zero (and the rule settles once).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
from collections import deque
from pathlib import Path
from typing import Any, Iterable

from trainguard import event_types, safe_read

EVENTS_KEPT = 256             # records the collector's fragment holds for the node log
MAX_EVENTS_PER_UPDATE = 64    # events made in one update; the rest are counted in one `more_findings` event
SEEN_KEPT = 4096              # report and finding ids remembered (across restarts)
STATE_BYTES = 1024 * 1024     # the state file: ~4096 ids of 20 bytes, two log offsets, the counts
# What the node-risk rule reads (trainguard/decide/node_risk.py NODE_COUNTERS), cumulative across restarts.
DIAG_ISOLATE = "health_diag_isolate"          # failed dcgmi diag results whose severity is ISOLATE (node_drain)
DIAG_FAILURES = "health_diag_failures"        # other failed dcgmi diag results
RAS_NOT_RESPONDING = "health_ras_not_responding"   # NCCL RAS findings: this node's ranks or processes not answering
COUNTS = (DIAG_ISOLATE, DIAG_FAILURES, RAS_NOT_RESPONDING)


def digest(*parts: Any) -> str:
    """A short stable id of what `parts` say (16 hex digits of SHA-256 over their JSON)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


class HealthState:
    """What this node's agent already put on the timeline; saved atomically when it changes."""

    def __init__(self, path: Path | None):
        self.path = path
        self.seen: dict[str, None] = {}                       # insertion-ordered: the oldest go first
        # per followed log (its option's name): {"dev", "ino", "offset"}, events made up to there
        self.offsets: dict[str, dict[str, int]] = {}
        self.counts: dict[str, int] = {name: 0 for name in COUNTS}
        self.ras_summary: str | None = None                   # the last RAS summary put on the timeline
        self.load_error: str | None = None
        self._dirty = False
        if path is not None:
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            data = safe_read.read_json(path, STATE_BYTES, "health reports state")
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            self.load_error = f"{path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            return                      # starts from nothing: old findings may be put on the timeline again
        if not isinstance(data, dict):
            self.load_error = f"{path}: not a JSON object"
            return
        self.seen = {str(i): None for i in data.get("seen") or () if isinstance(i, str)}
        offsets = data.get("offsets") if isinstance(data.get("offsets"), dict) else {}
        for name, where in offsets.items():
            if isinstance(where, dict) and all(isinstance(where.get(k), int) for k in ("dev", "ino", "offset")):
                self.offsets[str(name)] = {k: int(where[k]) for k in ("dev", "ino", "offset")}
        counts = data.get("counts") if isinstance(data.get("counts"), dict) else {}
        for name in COUNTS:
            value = counts.get(name)
            if isinstance(value, int) and value >= 0:
                self.counts[name] = value
        self.ras_summary = data.get("ras_summary") if isinstance(data.get("ras_summary"), str) else None

    def is_new(self, ident: str) -> bool:
        return ident not in self.seen

    def remember(self, ident: str) -> None:
        self.seen[ident] = None
        while len(self.seen) > SEEN_KEPT:
            del self.seen[next(iter(self.seen))]
        self._dirty = True

    def count(self, name: str, by: int = 1) -> None:
        if by:
            self.counts[name] += by
            self._dirty = True

    def set_offset(self, log: str, dev: int, ino: int, offset: int) -> None:
        if self.offsets.get(log) != {"dev": dev, "ino": ino, "offset": offset}:
            self.offsets[log] = {"dev": dev, "ino": ino, "offset": offset}
            self._dirty = True

    def set_ras_summary(self, key: str) -> None:
        self.ras_summary = key
        self._dirty = True

    def save(self) -> None:
        """Write the state if it changed (a temporary file renamed over it: a crash leaves the old or the new)."""
        if not self._dirty or self.path is None:
            return
        document = {"version": 1, "seen": list(self.seen), "offsets": self.offsets, "counts": self.counts,
                    "ras_summary": self.ras_summary}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(document))
        os.replace(tmp, self.path)
        self._dirty = False


class Outbox:
    """The records the node log is to write (`{"timestamp", "node", "event"}`, the event with its `id`)."""

    def __init__(self, node: str):
        self.node = node
        self.records: deque[dict[str, Any]] = deque(maxlen=EVENTS_KEPT)
        self._budget = MAX_EVENTS_PER_UPDATE
        self._over = 0

    def start_update(self) -> None:
        self._budget, self._over = MAX_EVENTS_PER_UPDATE, 0

    def add(self, event: dict[str, Any], ident: str, now: float) -> None:
        """Put `event` on this node's timeline (its own fields say which host it is about)."""
        if self._budget <= 0:
            self._over += 1
            return
        self._budget -= 1
        self.records.append({"timestamp": now, "node": self.node, "event": {**event, "id": ident}})

    def finish_update(self, now: float) -> None:
        """One event for the findings past this update's budget: how many there were."""
        if self._over:
            event = {"type": event_types.HEALTH_CHECK, "tool": "trainguard", "status": "warn",
                     "test": "more_findings", "count": self._over,
                     "message": f"{self._over} more findings this update than the {MAX_EVENTS_PER_UPDATE} "
                                "put on the timeline"}
            self.records.append({"timestamp": now, "node": self.node,
                                 "event": {**event, "id": digest("more", now, self._over)}})
        self._over = 0

    def fragment(self) -> list[dict[str, Any]]:
        return list(self.records)


class ThisNode:
    """Whether a host a report names is this node: its name (or short name), or one of its addresses."""

    def __init__(self, node: str, addresses: Iterable[str]):
        self.names = {node.lower(), node.split(".")[0].lower()}
        self.addresses = {_normal(a) for a in addresses}

    def owns(self, host: str | None) -> bool:
        if not host:
            return True                          # a line that names no host is the node's own log's
        lowered = host.lower()
        return lowered in self.names or lowered.split(".")[0] in self.names and not _is_ip(lowered) \
            or _normal(lowered) in self.addresses


def local_addresses(procfs: Path) -> set[str]:
    """This node's IP addresses from procfs: IPv4 `/32 host LOCAL` entries of net/fib_trie, IPv6 of
    net/if_inet6 (what a RAS report's `on node 172.16.64.213` is compared with)."""
    found: set[str] = set()
    try:
        previous = ""
        for line in safe_read.read_text(procfs / "net" / "fib_trie", 8 * 1024 * 1024, "fib_trie").splitlines():
            if "/32 host LOCAL" in line and previous.strip().startswith("|--"):
                found.add(previous.strip()[3:].strip())
            previous = line
    except (OSError, ValueError):
        pass
    try:
        for line in safe_read.read_text(procfs / "net" / "if_inet6", 1024 * 1024, "if_inet6").splitlines():
            raw = line.split()[0] if line.split() else ""
            if len(raw) == 32:
                found.add(str(ipaddress.IPv6Address(bytes.fromhex(raw))))
    except (OSError, ValueError):
        pass
    return {_normal(a) for a in found}


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _normal(address: str) -> str:
    try:
        return str(ipaddress.ip_address(address.strip()))
    except ValueError:
        return address.strip().lower()
