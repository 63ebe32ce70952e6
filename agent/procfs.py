"""Small parsers for the kernel files the host collectors read, and for the trainer's rank files.

Each reads one source under a root that is a parameter (``/proc``, ``/sys``, or a fixture tree), returns plain
data and raises :class:`ParseError` naming the file, the line and the field when the input is not what the
kernel writes. Units are left as the kernel gives them; the collectors convert, in one place each.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from trainguard import log as tglog
from trainguard import rundir
from trainguard.metrics.families import Spec
from trainguard.metrics.node import DiskStats   # read here, rendered there


class ParseError(ValueError):
    """A kernel or run-dir file that does not parse; the message names file, line and field."""

    def __init__(self, path: Path | str, message: str, line: int | None = None, field: str | None = None):
        where = f"{path}" + (f":{line}" if line is not None else "")
        what = f" field {field!r}" if field else ""
        super().__init__(f"{where}:{what} {message}")
        self.path, self.line, self.field = str(path), line, field


def _int(text: str, path: Path, line: int | None, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ParseError(path, f"expected an integer, got {text!r}", line, name) from None


def read_small(path: str | os.PathLike, size: int = 1 << 16) -> bytes:
    """A small kernel file, whole, in reads of `size` (one, for most): no Path objects, no text layer."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        parts = [os.read(fd, size)]
        while parts[-1]:
            parts.append(os.read(fd, size))
        return b"".join(parts)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------- /proc/diskstats

# Field names in kernel order (Documentation/admin-guide/iostats.rst). Kernels before 4.18 write the first 11,
# 4.18 adds 4 discard fields, 5.5 adds 2 flush fields; a line carries whatever its kernel knows.
DISKSTAT_FIELDS = (
    "reads_completed", "reads_merged", "sectors_read", "read_ms",
    "writes_completed", "writes_merged", "sectors_written", "write_ms",
    "ios_in_progress", "io_ms", "weighted_io_ms",
    "discards_completed", "discards_merged", "sectors_discarded", "discard_ms",
    "flushes_completed", "flush_ms",
)


def read_diskstats(procfs: Path) -> list[DiskStats]:
    path = Path(procfs) / "diskstats"
    disks = []
    for lineno, line in enumerate(read_small(path).decode("ascii", "replace").splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) < 3 + 11 or len(parts) > 3 + len(DISKSTAT_FIELDS):
            raise ParseError(path, f"expected 14 to {3 + len(DISKSTAT_FIELDS)} fields, got {len(parts)}", lineno)
        disks.append(DiskStats(_int(parts[0], path, lineno, "major"), _int(parts[1], path, lineno, "minor"),
                               parts[2], _numbers(DISKSTAT_FIELDS, parts[3:], path, lineno)))
    return disks


def _numbers(names: tuple[str, ...] | list[str], values: list[str], path: Path, lineno: int) -> dict[str, int]:
    """{name: int(value)}; a value that is no integer is a ParseError naming its field."""
    try:
        return dict(zip(names, map(int, values)))
    except ValueError:
        return {name: _int(value, path, lineno, name) for name, value in zip(names, values)}


# -------------------------------------------------------------------------------------- /proc/net/dev

def read_net_dev(procfs: Path) -> dict[str, dict[str, int]]:
    """{device: {"receive_bytes": n, ..., "transmit_colls": n}} with the names of the file's own header."""
    path = Path(procfs) / "net" / "dev"
    lines = read_small(path).decode("ascii", "replace").splitlines()
    if len(lines) < 2 or lines[1].count("|") != 2:
        raise ParseError(path, "missing the 'face |bytes ... |bytes ...' header", 2)
    _, receive, transmit = lines[1].split("|")
    names = [f"receive_{n}" for n in receive.split()] + [f"transmit_{n}" for n in transmit.split()]
    devices: dict[str, dict[str, int]] = {}
    for lineno, line in enumerate(lines[2:], 3):
        if not line.strip():
            continue
        device, sep, rest = line.partition(":")
        values = rest.split()
        if not sep or len(values) != len(names):
            raise ParseError(path, f"expected 'device: {len(names)} numbers'", lineno)
        devices[device.strip()] = _numbers(names, values, path, lineno)
    return devices


# --------------------------------------------------------------------------- /sys/class/infiniband

# port_rcv_data and port_xmit_data (and their _64 twins) count 32-bit words: "divided by 4 unconditionally"
# per the IBA spec and Mellanox, so bytes are four times the file. node_exporter (procfs) multiplies the same way.
IB_WORD_COUNTERS = frozenset({"port_rcv_data", "port_xmit_data", "port_rcv_data_64", "port_xmit_data_64"})
# hw_counters files that are settings, not counters
IB_HW_NOT_COUNTERS = frozenset({"lifespan"})


@dataclass
class IBPort:
    device: str
    port: int
    state: str
    state_id: int
    phys_state: str
    phys_state_id: int
    rate_bytes_per_second: int
    link_layer: str = ""
    counters: dict[str, int] = field(default_factory=dict)       # counters/ (bytes where IB_WORD_COUNTERS)
    counters_ext: dict[str, int] = field(default_factory=dict)   # counters_ext/ (kernels before 4.5)
    hw_counters: dict[str, int] = field(default_factory=dict)    # hw_counters/ (mlx5, irdma)


@dataclass
class IBDevice:
    name: str
    board_id: str
    firmware_version: str
    hca_type: str
    ports: list[IBPort]


def _sys_read(path: Path) -> str:
    return path.read_text(encoding="ascii", errors="replace").strip()


def _parse_state(path: Path) -> tuple[int, str]:
    """'4: ACTIVE' -> (4, 'ACTIVE')."""
    text = _sys_read(path)
    number, sep, name = text.partition(":")
    if not sep:
        raise ParseError(path, f"expected 'ID: NAME', got {text!r}", 1)
    return _int(number.strip(), path, 1, "id"), name.strip()


def _parse_rate(path: Path) -> int:
    """'400 Gb/sec (4X NDR)' -> bytes per second.

    The number goes through a 32-bit float, as procfs's ParseFloat(s, 32) does, so fractional rates such as
    '14.0625 Gb/sec' give node_exporter's bytes exactly.
    """
    text = _sys_read(path)
    number = text.split(" ", 1)[0]
    try:
        gbits = struct.unpack("f", struct.pack("f", float(number)))[0]
    except ValueError:
        raise ParseError(path, f"expected '<Gb/s> Gb/sec ...', got {text!r}", 1, "rate") from None
    return int(gbits * 125_000_000)


def _read_counter_dir(directory: Path, words: frozenset[str] = frozenset(),
                      strict: frozenset[str] = frozenset()) -> dict[str, int]:
    """Every regular file holding an unsigned integer; 'N/A (no PMA)' and unreadable files are skipped.

    A file in `strict` that holds something else is an error; any other such file is not a counter and is skipped.
    """
    counters: dict[str, int] = {}
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except FileNotFoundError:
        return counters
    for entry in entries:
        if not entry.is_file():
            continue
        try:
            text = read_small(entry.path, 4096).strip()
        except OSError:   # sysfs answers EINVAL/EOPNOTSUPP (or EACCES) for counters a port lacks
            continue
        if text.startswith(b"N/A"):
            continue
        if not text.isdigit():
            if entry.name in strict:
                raise ParseError(entry.path, f"expected an unsigned integer, got {text.decode(errors='replace')!r}",
                                 1, entry.name)
            continue
        value = int(text)
        counters[entry.name] = value * 4 if entry.name in words else value
    return counters


def _optional(path: Path) -> str:
    try:
        return _sys_read(path)
    except FileNotFoundError:
        return ""


def read_infiniband(sysfs: Path, strict: frozenset[str] = frozenset()) -> list[IBDevice]:
    """Every HCA under <sysfs>/class/infiniband with its ports, sorted by name; [] when there is none.

    `strict`: counter files whose content must be a number (the ones the caller exports by name).
    """
    base = Path(sysfs) / "class" / "infiniband"
    try:
        names = sorted(os.listdir(base))
    except FileNotFoundError:
        return []
    return [_read_ib_device(base / name, strict) for name in names]


def _read_ib_device(path: Path, strict: frozenset[str]) -> IBDevice:
    ports = []
    for port_name in sorted(os.listdir(path / "ports"), key=lambda p: int(p) if p.isdigit() else -1):
        if not port_name.isdigit():
            raise ParseError(path / "ports" / port_name, "port directory is not a number")
        ports.append(_read_ib_port(path.name, int(port_name), path / "ports" / port_name, strict))
    return IBDevice(name=path.name, board_id=_optional(path / "board_id"),
                    firmware_version=_sys_read(path / "fw_ver"), hca_type=_optional(path / "hca_type"), ports=ports)


def _read_ib_port(device: str, number: int, path: Path, strict: frozenset[str]) -> IBPort:
    state_id, state = _parse_state(path / "state")
    phys_id, phys = _parse_state(path / "phys_state")
    return IBPort(device=device, port=number, state=state, state_id=state_id, phys_state=phys,
                  phys_state_id=phys_id, rate_bytes_per_second=_parse_rate(path / "rate"),
                  link_layer=_optional(path / "link_layer"),
                  counters=_read_counter_dir(path / "counters", IB_WORD_COUNTERS, strict),
                  counters_ext=_read_counter_dir(path / "counters_ext", IB_WORD_COUNTERS, strict),
                  hw_counters={k: v for k, v in _read_counter_dir(path / "hw_counters").items()
                               if k not in IB_HW_NOT_COUNTERS})


# ------------------------------------------------------------------------ /proc/<pid>/stat, /environ

def read_pid_stat(procfs: Path | str, pid: int) -> list[bytes] | None:
    """The fields of <procfs>/<pid>/stat after "pid (comm)" (fields[0] is the state), or None when it is gone."""
    try:
        raw = read_small(f"{procfs}/{pid}/stat", 4096)
    except OSError:
        return None
    return raw.rpartition(b")")[2].split()


def process_start(procfs: Path | str, pid: int) -> int | None:
    """The process's start time (clock ticks after boot): a pid and its start time name one process for good."""
    fields = read_pid_stat(procfs, pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def read_environ(procfs: Path, pid: int) -> dict[str, str] | None:
    """The environment a process started with, or None when it is gone or not ours to read."""
    try:
        raw = read_small(f"{procfs}/{pid}/environ")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


# -------------------------------------------------------------------------- RUN/control/ranks/*.json

class RankPids:
    """{rank: pid} of the trainer ranks on this node, from RUN/control/ranks/rank-<r>.json (agent/restore.py).

    The trainer writes its host name; the agent's node name may be configured otherwise, so either matches,
    and a rank in a pod (its pod's host name, a pid of its PID namespace) is matched to this node by its
    process (`PidNamespaces`), its pid then the node's. Any other rank file (a shared run directory) is not
    ours. Collectors ask every update, so the files are read again only when they change
    (rundir.RankFiles). The mapping returned is shared: read it, do not change it.
    """

    def __init__(self, run_dir: Path | None, node: str):
        self.ours = {node, socket.gethostname()}
        self._files = None
        if run_dir is not None:
            self._files = rundir.RankFiles(run_dir, self.ours, adopt=pid_namespaces(run_dir, node).adopt)
        self._infos: list | None = None      # the RankFiles list the mapping was made from
        self._pids: dict[int, int] = {}

    def shared(self) -> bool:
        """Another host registered ranks in this run directory (as of the last `get`)."""
        return self._files is not None and self._files.others_registered()

    def get(self) -> dict[int, int]:
        if self._files is None:
            return self._pids
        infos = self._files.read()
        if infos is not self._infos:
            self._infos = infos
            self._pids = {info.rank: info.pid for info in infos}     # this node's, in rank order
        return self._pids


# ------------------------------------------------------------- ranks in pods: /proc/<pid>/status NSpid

def read_nspid(procfs: Path | str, pid: int) -> list[int] | None:
    """The pid of process `pid` in each PID namespace from procfs's own to its innermost (NSpid, Linux 4.1+);
    one number when it lives in procfs's namespace; None when it is gone."""
    try:
        raw = read_small(f"{procfs}/{pid}/status", 8192)
    except OSError:
        return None
    for line in raw.split(b"\n"):
        if line.startswith(b"NSpid:"):
            return [int(n) for n in line[6:].split()]
    return [pid]            # a kernel before NSpid: no nested namespaces can be told apart


def read_ppid(procfs: Path | str, pid: int) -> int | None:
    fields = read_pid_stat(procfs, pid)
    return int(fields[1]) if fields and len(fields) > 1 else None


TICKS = os.sysconf("SC_CLK_TCK")
MAX_UNPLACED = 64          # host names followed for the "ranks of no known node" warning; more are counted
MIN_REBUILD_SECONDS = 1.0  # between two walks of /proc for the PID-namespace index
MAX_CLOCK_SKEW_SECONDS = 5.0


def registered_start(create_time: float, recorded_boot: float | None, boot_now: float) -> float:
    """A registration's `create_time` on the wall clock whose boot time is `boot_now` (the kernel's btime:
    the wall clock less the uptime). A process's start time as psutil gives it is its start tick since boot
    plus that btime, so a wall clock stepped between the registration and now (NTP, a VM's resume) moves
    every start read now by the step: a registration that says the btime it read against
    (runtime/control.py `process_identity`) is moved with it, and compares to the tick with what is read
    now. One without is taken as written. (The suite saw a 2.00 s step leave a hung run's ranks unproven.)"""
    return create_time if recorded_boot is None else create_time - recorded_boot + boot_now


def boot_time(procfs: Path | str) -> float:
    for line in read_small(f"{procfs}/stat").split(b"\n"):
        if line.startswith(b"btime "):
            return float(line.split()[1])
    raise ParseError(f"{procfs}/stat", "no btime line")


class PidNamespaces:
    """The ranks of this node that registered from a pod: their own host name, a pid of their own namespace.

    A training pod is the user's: nothing is added to it, no TRAINGUARD_NODE, no downward API. Its ranks
    register as they do anywhere (runtime/control.py): the pod's host name, `os.getpid()` in the pod's PID
    namespace, the process's start time and the launcher's pid there. The agent sees the host's processes
    (hostPID), and for each of them the kernel lists its pid in every nested namespace (NSpid in
    /proc/<pid>/status) and its start time in clock ticks since boot, which no namespace changes. A
    registration of another host name is this node's when exactly one process here lives in a nested PID
    namespace with the registered pid innermost and the registered start time to the tick; its launcher
    is the ancestor of that process with the registered launcher pid innermost. `adopt` returns it with
    the node's pids and the node's name (so every reader, the collectors, restore and eviction, works as
    for a rank on the host itself), the pod's kept in `ns_pid`/`ns_host`. Two processes matching (two
    pods started the same pid in the same tick) are told apart by the pod's host name in their
    environment (HOSTNAME, which the kubelet sets); failing that the rank is kept with `ns_candidates`
    > 1 and `prove_rank` refuses it: never a guess before a signal.

    What is kept is this node's: the index of its processes in nested namespaces (rebuilt, at most once a
    second, when a registration names a process that started after it was built), the pod host names it claimed, and at most MAX_UNPLACED host names of
    registrations nobody has claimed yet. A pod host name matched here is claimed in RUN/agent/hosts/
    (`rundir.host_claim`), so that every agent can tell a rank of another node from a rank of no known node:
    a registration whose host is no node's (no node log, no claim) `grace_seconds` after it started is
    reported, loudly (an error log once per host, `trainguard_ranks_unplaced`, /healthz).
    """

    def __init__(self, run_dir: Path | str, node: str, procfs: Path | str = "/proc", grace_seconds: float = 60.0):
        self.run_dir, self.node, self.procfs = Path(run_dir), node, str(procfs)
        self.grace_seconds = grace_seconds
        self._lock = threading.Lock()
        self._index: dict[int, list[tuple[int, int]]] = {}    # innermost pid -> [(start ticks, node pid)]
        self._built_at = 0.0
        self._boot = 0.0
        self._claimed: set[str] = set()
        self._unplaced: dict[str, tuple[float, int]] = {}     # host -> (earliest started_at, ranks)
        self._unplaced_overflow = 0
        self._reported: set[str] = set()
        self._log = tglog.get("agent.ranks", node=node)

    # ---------------------------------------------------------------------------------- matching

    def adopt(self, info: rundir.RankInfo) -> rundir.RankInfo | None:
        """`info` (another host name's registration) as this node's rank, or None when it is not here."""
        if info.create_time is None:
            return None
        with self._lock:
            matches = self._matches(info)
            if not matches and self._may_be_missing(info):
                wait = self._built_at + MIN_REBUILD_SECONDS - time.time()
                if wait > 0:
                    time.sleep(wait)         # at most one /proc walk a second, however many registrations
                self._build()
                matches = self._matches(info)
            if not matches:
                self._note_unplaced(info)
                return None
            if len(matches) > 1:
                named = [pid for pid in matches if _environ_host(self.procfs, pid) == info.host]
                matches = named if len(named) == 1 else matches
            pid = matches[0]
            launcher = self._launcher(pid, info.launcher_pid) if info.launcher_pid is not None else None
            self._claim(info.host)
            self._unplaced.pop(info.host, None)
        return replace(info, pid=pid, host=self.node, ns_pid=info.pid, ns_host=info.host,
                       ns_candidates=len(matches),
                       launcher_pid=launcher if info.launcher_pid is not None else None)

    def _may_be_missing(self, info: rundir.RankInfo) -> bool:
        """The index may lack the process `info` registered: it started after the index was built (less a
        second: the tick and the clocks' rounding), and not in the future past MAX_CLOCK_SKEW (a skewed
        node's or a forged registration would make every read walk /proc again). A process started before
        the index was built is in it, or is not on this node: that miss is an answer. Never built: build."""
        if not self._built_at:
            return info.create_time <= time.time() + MAX_CLOCK_SKEW_SECONDS
        start = registered_start(info.create_time, info.boot_time, self._boot)
        return self._built_at - 1.0 < start <= time.time() + MAX_CLOCK_SKEW_SECONDS

    def _matches(self, info: rundir.RankInfo) -> list[int]:
        start = registered_start(info.create_time, info.boot_time, self._boot)
        ticks = (start - self._boot) * TICKS if self._index else 0
        return [pid for start, pid in self._index.get(info.pid, ()) if abs(start - ticks) <= 1.01]

    def _build(self) -> None:
        index: dict[int, list[tuple[int, int]]] = {}
        self._boot = boot_time(self.procfs)
        for name in os.listdir(self.procfs):
            if not name.isdigit():
                continue
            pid = int(name)
            nspid = read_nspid(self.procfs, pid)
            if not nspid or len(nspid) < 2:
                continue            # in procfs's own namespace: a rank there registers the node's pid itself
            start = process_start(self.procfs, pid)
            if start is not None:
                index.setdefault(nspid[-1], []).append((start, pid))
        self._index, self._built_at = index, time.time()

    def _launcher(self, pid: int, ns_launcher: int) -> int:
        """The node pid of the ancestor whose innermost pid is the registered launcher's; 0 (matches no
        process, so the proof refuses it) when no ancestor is."""
        for _ in range(8):
            parent = read_ppid(self.procfs, pid)
            if not parent:
                return 0
            nspid = read_nspid(self.procfs, parent)
            if nspid and len(nspid) > 1 and nspid[-1] == ns_launcher:
                return parent
            pid = parent
        return 0

    # ------------------------------------------------------------------------------ placing hosts

    def _claim(self, host: str) -> None:
        if host in self._claimed:
            return
        self._claimed.add(host)
        path = rundir.host_claim(self.run_dir, host)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"host": host, "node": self.node, "claimed_at": time.time()}))
            os.replace(tmp, path)
        except OSError as exc:
            self._log.warning("cannot claim a pod host name", host=host, error=exc.strerror or str(exc))
        self._log.info("ranks of a pod matched to this node", pod_host=host)

    def _known(self, host: str) -> bool:
        return host in self._claimed or rundir.host_claim(self.run_dir, host).exists() or \
            rundir.node_log(self.run_dir, host).exists()

    def _note_unplaced(self, info: rundir.RankInfo) -> None:
        if self._known(info.host):
            return
        if info.host in self._unplaced:
            since, ranks = self._unplaced[info.host]
            self._unplaced[info.host] = (min(since, info.started_at), ranks + 1)
        elif len(self._unplaced) < MAX_UNPLACED:
            self._unplaced[info.host] = (info.started_at, 1)
        else:
            self._unplaced_overflow += 1

    def unplaced(self, now: float | None = None) -> dict[str, int]:
        """{host: ranks} of registrations no node has claimed `grace_seconds` after they started."""
        now = time.time() if now is None else now
        with self._lock:
            for host in [h for h in self._unplaced if self._known(h)]:
                del self._unplaced[host]
            late = {host: ranks for host, (since, ranks) in self._unplaced.items()
                    if now - since > self.grace_seconds}
            for host in sorted(set(late) - self._reported):
                self._reported.add(host)
                self._log.error("ranks of no known node: their host is no node's and no agent found their "
                                "processes (a pod on a node without the agent? the agent without hostPID?)",
                                host=host, ranks=late[host], run_dir=str(self.run_dir))
        return late

    def status(self) -> dict:
        late = self.unplaced()
        return {"pod_hosts": sorted(self._claimed), "unplaced_hosts": late,
                "unplaced_not_followed": self._unplaced_overflow}

    def families(self) -> list:
        late = self.unplaced()
        return [UNPLACED.value(sum(late.values())), POD_HOSTS.value(len(self._claimed))]


UNPLACED = Spec("gauge", "trainguard_ranks_unplaced",
                "Registered ranks whose host is no known node's (no node log, no agent found their process).", [])
POD_HOSTS = Spec("gauge", "trainguard_ranks_pod_hosts",
                 "Pod host names whose ranks this agent matched to its node by PID namespace.", [])


def _environ_host(procfs: str, pid: int) -> str | None:
    env = read_environ(Path(procfs), pid)
    return None if env is None else env.get("HOSTNAME")


_NAMESPACES: dict[tuple[str, str], PidNamespaces] = {}
_NAMESPACES_LOCK = threading.Lock()
MAX_NAMESPACES = 8          # (run directory, node) pairs one process follows: one per run in an agent


def pid_namespaces(run_dir: Path | str, node: str) -> PidNamespaces:
    """This process's one matcher of `run_dir`'s pod ranks to `node` (shared by the collectors and restore)."""
    key = (os.path.abspath(run_dir), node)
    with _NAMESPACES_LOCK:
        matcher = _NAMESPACES.pop(key, None) or PidNamespaces(run_dir, node)
        _NAMESPACES[key] = matcher
        while len(_NAMESPACES) > MAX_NAMESPACES:
            del _NAMESPACES[next(iter(_NAMESPACES))]
    return matcher
