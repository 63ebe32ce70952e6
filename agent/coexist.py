"""Beside dcgm-exporter and node_exporter: what the agent leaves out so no series is exported twice.

A GPU node of a cluster usually runs dcgm-exporter (DCGM_*) and node_exporter (node_*) already. The agent
exports the same names (so dashboards and PromQL habits carry over): both scraped, every GPU and disk is
two series, hosts appear twice in every dropdown and GPUOverheating fires once per source. `coexist`:

    off    export everything (a node with neither exporter)
    on     leave out every DCGM_* and node_* family: the peers export them (their addresses are not
           reachable from the agent, as in a Kubernetes pod without hostNetwork)
    auto   (default) ask each peer at its address (127.0.0.1:9400 and :9100 unless configured) every
           `PROBE_SECONDS`, and leave out exactly the families it exports now: the ones it lacks (a
           dcgm-exporter counters file without DCGM_FI_DEV_FB_TOTAL, say) the agent still exports,
           and when a peer stops answering its families come back at the next probe

The probe is a GET of /metrics with a short timeout, made from the agent's main loop (never from a
scrape), reading only `# TYPE` lines and at most PROBE_MAX_BYTES: a slow or odd peer costs one bounded
read a minute. What is left out is what /metrics serves; the node TLS log keeps every reading.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from trainguard import log as tglog
from trainguard.metrics.families import Spec

PROBE_SECONDS = 60.0
PROBE_TIMEOUT = 2.0
PROBE_MAX_BYTES = 8 << 20


@dataclass(frozen=True)
class Peer:
    name: str
    prefix: str
    address: str


DEFAULT_PEERS = (Peer("dcgm-exporter", "DCGM_", "127.0.0.1:9400"), Peer("node_exporter", "node_", "127.0.0.1:9100"))


def exported_families(address: str, prefix: str, timeout: float = PROBE_TIMEOUT) -> frozenset[str] | None:
    """The family names of `prefix` the exporter at `address` serves now, or None when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as response:
            names, read = set(), 0
            for line in response:
                read += len(line)
                if read > PROBE_MAX_BYTES:
                    break
                if line.startswith(b"# TYPE " + prefix.encode()):
                    names.add(line.split()[2].decode())
            return frozenset(names)
    except (OSError, urllib.error.URLError, ValueError):
        return None


class Coexistence:
    def __init__(self, mode: str = "auto", peers: tuple[Peer, ...] = DEFAULT_PEERS, probe=exported_families):
        self.mode, self.peers, self._probe = mode, peers, probe
        self._lock = threading.Lock()
        self._exported: dict[str, frozenset[str] | None] = {peer.name: None for peer in peers}
        self._left_out: frozenset[str] = frozenset()
        self._prefixes = tuple(peer.prefix for peer in peers) if mode == "on" else ()
        self._next_probe = 0.0
        self._log = tglog.get("agent.coexist")

    def left_out(self, family: str) -> bool:
        """Whether /metrics leaves `family` out (a peer exports it)."""
        return family in self._left_out or (bool(self._prefixes) and family.startswith(self._prefixes))

    def left_out_family(self, family) -> bool:
        """`left_out` for a client_python family, whose counters are named without `_total` (and infos
        without `_info`) while the exposition, and a peer's # TYPE line, has it."""
        suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
        return self.left_out(family.name) or bool(suffix) and self.left_out(family.name + suffix)

    def refresh(self, now: float | None = None) -> None:
        """Probe the peers when due (mode auto): call it from the main loop, not from a scrape."""
        now = time.monotonic() if now is None else now
        if self.mode != "auto" or now < self._next_probe:
            return
        self._next_probe = now + PROBE_SECONDS
        exported = {peer.name: self._probe(peer.address, peer.prefix) for peer in self.peers}
        with self._lock:
            for peer in self.peers:
                was, now_ = self._exported[peer.name], exported[peer.name]
                if (was is None) != (now_ is None):
                    self._log.info("peer exporter found: its families are left out" if now_ is not None else
                                   "peer exporter gone: its families are exported again",
                                   exporter=peer.name, address=peer.address, families=len(now_ or ()))
            self._exported = exported
            self._left_out = frozenset(name for names in exported.values() if names for name in names)

    def status(self) -> dict:
        return {"mode": self.mode,
                "peers": {peer.name: {"address": peer.address,
                                      "present": self.mode == "on" or self._exported[peer.name] is not None,
                                      "families_left_out": (f"{peer.prefix}*" if self.mode == "on" else
                                                            len(self._exported[peer.name] or ()))}
                          for peer in self.peers}}

    def families(self) -> list:
        present = [(PEER.labels(peer.name), 1 if self.mode == "on" or self._exported[peer.name] is not None else 0)
                   for peer in self.peers]
        return [PEER.family(present)]


PEER = Spec("gauge", "trainguard_coexist_peer_present",
            "1 when this peer exporter's families are left out of the agent's /metrics (coexist: on, or found "
            "by the auto probe).", ["exporter"])


def peers(addresses: dict) -> tuple[Peer, ...]:
    """The default peers at `addresses` ({"dcgm_exporter": "host:port", "node_exporter": ...}) where given."""
    keys = {"dcgm-exporter": "dcgm_exporter", "node_exporter": "node_exporter"}
    return tuple(Peer(p.name, p.prefix, addresses.get(keys[p.name], p.address)) for p in DEFAULT_PEERS)
