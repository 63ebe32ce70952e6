"""The agent's configuration: a YAML file, then command-line flags on top.

    listen: 127.0.0.1:9655
    run_dir: /data/runs/gpt-7b
    node: gpu-node-01            # default: the host name
    procfs: /proc                # roots, for fixtures and containers (/host/proc in a DaemonSet)
    sysfs: /sys
    devfs: /dev
    policy: /etc/trainguard/policy.yaml   # cost policy (trainguard/policy.py); default: built-in
    interval: 5                  # default sampling interval of every collector
    http: {max_body_bytes: 1MiB, max_connections: 16, request_timeout: 10}
    nodelog: {enabled: true, interval: 10, max_bytes: 64MiB, keep: 5}
    collectors:
      gpu: {enabled: true, interval: 1, timeout: 5}   # other keys: the collector's own options
      ib: {enabled: false}
    webhook: {...}               # read by agent/webhook.py
    runs_root: /data/runs        # instead of run_dir: follow the runs of this node as they come (agent/discovery.py)
    discovery: {interval: 10, end_grace_seconds: 120}
    coexist: auto                # auto | off | on: leave out what dcgm-exporter and node_exporter export here
    # or: coexist: {mode: auto, dcgm_exporter: 127.0.0.1:9400, node_exporter: 127.0.0.1:9100}  (agent/coexist.py)

An unknown key or a value of the wrong type is an error naming the file and the key.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from trainguard.policy import read_yaml
from trainguard.tls import TLSError, parse_quantity

DEFAULT_LISTEN = "127.0.0.1:9655"   # not 9400: dcgm-exporter's (docs/agent.md, "The port")
RUNNER_KEYS = ("enabled", "interval", "timeout")   # the rest of a collector's section is its options


class ConfigError(ValueError):
    """A bad configuration value; the message names the file (or flag) and the key."""


@dataclass(frozen=True)
class CollectorConfig:
    enabled: bool | None = None        # None: the collector's default_enabled
    interval: float | None = None      # None: the global interval, else the collector's own default
    timeout: float | None = None
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeLogConfig:
    enabled: bool = True
    interval: float = 10.0
    max_bytes: int = 64 * 2**20
    keep: int = 5


@dataclass(frozen=True)
class HTTPConfig:
    max_body_bytes: int = 2**20
    max_connections: int = 16
    request_timeout: float = 10.0      # a request must arrive whole within this many seconds of its first byte


@dataclass(frozen=True)
class DiscoveryConfig:
    interval: float = 10.0             # seconds between looks at the runs root
    end_grace_seconds: float = 120.0   # a followed run with no live rank here for this long has ended


@dataclass(frozen=True)
class AgentConfig:
    listen: str = DEFAULT_LISTEN
    run_dir: Path | None = None
    node: str = field(default_factory=socket.gethostname)
    procfs: Path = Path("/proc")
    sysfs: Path = Path("/sys")
    devfs: Path = Path("/dev")
    policy: Path | None = None
    interval: float | None = None      # overrides every collector's default interval
    only: tuple[str, ...] | None = None     # --collectors: exactly these are on
    disabled: tuple[str, ...] = ()          # --disable: these are off
    collectors: Mapping[str, CollectorConfig] = field(default_factory=dict)
    nodelog: NodeLogConfig = field(default_factory=NodeLogConfig)
    http: HTTPConfig = field(default_factory=HTTPConfig)
    webhook: Mapping[str, Any] = field(default_factory=dict)
    runs_root: Path | None = None
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    coexist: str = "auto"
    coexist_addresses: Mapping[str, str] = field(default_factory=dict)   # dcgm_exporter, node_exporter: HOST:PORT

    @property
    def listen_address(self) -> tuple[str, int]:
        return parse_listen(self.listen, "listen")

    def collector(self, name: str) -> CollectorConfig:
        return self.collectors.get(name, CollectorConfig())

    def is_enabled(self, name: str, default: bool) -> bool:
        if self.only is not None:
            return name in self.only
        if name in self.disabled:
            return False
        chosen = self.collector(name).enabled
        return default if chosen is None else chosen

    def interval_of(self, name: str, default: float) -> float:
        own = self.collector(name).interval
        return own if own is not None else self.interval if self.interval is not None else default

    def timeout_of(self, name: str, default: float) -> float:
        own = self.collector(name).timeout
        return own if own is not None else default


# --------------------------------------------------------------------------------------------- values

def parse_listen(value: Any, where: str) -> tuple[str, int]:
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(f"{where}: expected HOST:PORT, got {value!r}")
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{where}: port must be 0..65535, got {port!r}")
    if not host:   # ":9655" would mean every interface; the webhook can stop training, so say it outright
        raise ConfigError(f"{where}: give the host: 127.0.0.1:{port} for this node only, "
                          f"0.0.0.0:{port} for every interface (the webhook still needs its token)")
    return host, int(port)


def _number(value: Any, where: str, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if positive and not value > 0:
        raise ConfigError(f"{where}: must be > 0, got {value!r}")
    return float(value)


def _size(value: Any, where: str) -> int:
    try:
        number = parse_quantity(value, where)
    except TLSError as exc:
        raise ConfigError(f"{where}: expected a size such as 64MiB, got {value!r} ({exc.message})") from None
    if not number >= 1:
        raise ConfigError(f"{where}: must be at least 1 byte, got {value!r}")
    return int(number)


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def _mapping(value: Any, where: str) -> Mapping:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _check_keys(values: Mapping, known: tuple[str, ...], where: str) -> None:
    for key in values:
        if key not in known:
            prefix = f"{where}." if where else ""
            raise ConfigError(f"{prefix}{key}: unknown key (known: {', '.join(known)})")


# ---------------------------------------------------------------------------------------------- build

def _collectors(values: Mapping, known: set[str] | None) -> dict[str, CollectorConfig]:
    out = {}
    for name, section in _mapping(values, "collectors").items():
        where = f"collectors.{name}"
        if known is not None and name not in known:
            raise ConfigError(f"{where}: unknown collector (known: {', '.join(sorted(known))})")
        section = _mapping(section, where)
        out[name] = CollectorConfig(
            enabled=_bool(section["enabled"], f"{where}.enabled") if "enabled" in section else None,
            interval=_number(section["interval"], f"{where}.interval") if "interval" in section else None,
            timeout=_number(section["timeout"], f"{where}.timeout") if "timeout" in section else None,
            options={k: v for k, v in section.items() if k not in RUNNER_KEYS})
    return out


def _nodelog(values: Mapping) -> NodeLogConfig:
    _check_keys(values, ("enabled", "interval", "max_bytes", "keep"), "nodelog")
    base = NodeLogConfig()
    keep = values.get("keep", base.keep)
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"nodelog.keep: expected an integer >= 1, got {keep!r}")
    return NodeLogConfig(
        enabled=_bool(values.get("enabled", base.enabled), "nodelog.enabled"),
        interval=_number(values.get("interval", base.interval), "nodelog.interval"),
        max_bytes=_size(values.get("max_bytes", base.max_bytes), "nodelog.max_bytes"),
        keep=keep)


def _http(values: Mapping) -> HTTPConfig:
    _check_keys(values, ("max_body_bytes", "max_connections", "request_timeout"), "http")
    base = HTTPConfig()
    connections = values.get("max_connections", base.max_connections)
    if isinstance(connections, bool) or not isinstance(connections, int) or connections < 1:
        raise ConfigError(f"http.max_connections: expected an integer >= 1, got {connections!r}")
    return HTTPConfig(max_body_bytes=_size(values.get("max_body_bytes", base.max_body_bytes), "http.max_body_bytes"),
                      max_connections=connections,
                      request_timeout=_number(values.get("request_timeout", base.request_timeout), "http.request_timeout"))


def _path(value: Any, where: str) -> Path:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a path, got {value!r}")
    return Path(value)


TOP_KEYS = ("listen", "run_dir", "node", "procfs", "sysfs", "devfs", "policy", "interval", "http", "nodelog",
            "collectors", "webhook", "runs_root", "discovery", "coexist")
COEXIST = ("auto", "on", "off")


def _discovery(values: Mapping) -> DiscoveryConfig:
    _check_keys(values, ("interval", "end_grace_seconds"), "discovery")
    base = DiscoveryConfig()
    return DiscoveryConfig(interval=_number(values.get("interval", base.interval), "discovery.interval"),
                           end_grace_seconds=_number(values.get("end_grace_seconds", base.end_grace_seconds),
                                                     "discovery.end_grace_seconds"))


def _coexist(value: Any, where: str) -> str:
    if isinstance(value, bool):      # YAML 1.1 reads an unquoted on/off as a boolean
        return "on" if value else "off"
    if value not in COEXIST:
        raise ConfigError(f"{where}: expected one of {', '.join(COEXIST)}, got {value!r}")
    return value


def check_run_source(config: AgentConfig, where: str = "") -> AgentConfig:
    if config.run_dir is not None and config.runs_root is not None:
        raise ConfigError(f"{where}run_dir and runs_root: give one (a fixed run, or the root the runs appear under)")
    return config


def from_mapping(values: Mapping, known_collectors: set[str] | None = None) -> AgentConfig:
    """An AgentConfig from a decoded YAML mapping (raises ConfigError naming the key)."""
    values = _mapping(values, "config")
    _check_keys(values, TOP_KEYS, "")
    config = AgentConfig()
    changes: dict[str, Any] = {}
    if "listen" in values:
        parse_listen(values["listen"], "listen")
        changes["listen"] = values["listen"]
    for key in ("run_dir", "procfs", "sysfs", "devfs", "policy", "runs_root"):
        if values.get(key) is not None:
            changes[key] = _path(values[key], key)
    changes["discovery"] = _discovery(_mapping(values.get("discovery"), "discovery"))
    if isinstance(values.get("coexist"), Mapping):
        section = values["coexist"]
        _check_keys(section, ("mode", "dcgm_exporter", "node_exporter"), "coexist")
        changes["coexist"] = _coexist(section.get("mode", "auto"), "coexist.mode")
        for key in ("dcgm_exporter", "node_exporter"):
            if key in section:
                parse_listen(section[key], f"coexist.{key}")
        changes["coexist_addresses"] = {k: section[k] for k in ("dcgm_exporter", "node_exporter") if k in section}
    elif "coexist" in values:
        changes["coexist"] = _coexist(values["coexist"], "coexist")
    if "node" in values:
        if not isinstance(values["node"], str) or not values["node"]:
            raise ConfigError(f"node: expected a name, got {values['node']!r}")
        changes["node"] = values["node"]
    if "interval" in values:
        changes["interval"] = _number(values["interval"], "interval")
    changes["http"] = _http(_mapping(values.get("http"), "http"))
    changes["nodelog"] = _nodelog(_mapping(values.get("nodelog"), "nodelog"))
    changes["collectors"] = _collectors(values.get("collectors"), known_collectors)
    changes["webhook"] = dict(_mapping(values.get("webhook"), "webhook"))
    return check_run_source(replace(config, **changes))


def load(path: str | Path | None, known_collectors: set[str] | None = None) -> AgentConfig:
    """The defaults, or the YAML file at `path`; errors are prefixed with the file name."""
    if path is None:
        return AgentConfig()
    source = str(path)
    try:
        data = read_yaml(path, "config file") or {}
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        return from_mapping(data, known_collectors)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def with_flags(config: AgentConfig, **flags: Any) -> AgentConfig:
    """Flags given on the command line (None: not given) override the file."""
    changes = {key: value for key, value in flags.items() if value is not None}
    if "listen" in changes:
        parse_listen(changes["listen"], "--listen")
    if "interval" in changes:
        _number(changes["interval"], "--interval")
    for key in ("run_dir", "procfs", "sysfs", "devfs", "policy", "runs_root"):
        if key in changes:
            changes[key] = Path(changes[key])
    if "coexist" in changes:
        _coexist(changes["coexist"], "--coexist")
    if "run_dir" in changes and "runs_root" not in changes:
        changes["runs_root"] = None          # --run-dir on the command line wins over the file's runs_root
    if "runs_root" in changes and "run_dir" not in changes:
        changes["run_dir"] = None
    if "nodelog_max_bytes" in changes:
        size = _size(changes.pop("nodelog_max_bytes"), "--nodelog-max-bytes")
        changes["nodelog"] = replace(changes.get("nodelog", config.nodelog), max_bytes=size)
    return check_run_source(replace(config, **changes), "flags: ")
