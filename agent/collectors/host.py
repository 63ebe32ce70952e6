"""host: CPU, memory and load of the node, the trainer processes, and the software versions.

CPU, memory and load are parsed from the procfs root (so fixture trees work), with the values node_exporter
reports: under its names for CPU and load (`node_cpu_seconds_total`, `node_load1` ...), under
`trainguard_host_memory_*` for memory (its camelCase meminfo names fail `promtool check metrics`).

The trainer's ranks (pids from RUN/control/ranks/rank-<r>.json, those on this host) are read from
<procfs>/<pid>/stat, one read each rather than psutil's three: the same numbers, a third of the syscalls,
and the procfs root is honoured (a container with the host's /proc at /host/proc and hostPID sees them).

`trainguard_node_info` carries torch, CUDA, NCCL, driver, kernel and Python versions, looked up once
without importing torch (agent/versions.py), so an alert can catch a node that differs from the others.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from prometheus_client.core import InfoMetricFamily

from trainguard.agent.collector import Collector, Context, Sample, register
from trainguard.agent.collectors.options import options
from trainguard.metrics.families import LabelCache, Spec
from trainguard.metrics.node import rank_families
from trainguard.agent.procfs import RankPids, read_pid_stat, read_small
from trainguard.agent.versions import software_versions

USER_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
CPU_MODES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
_PAREN = re.compile(r"\((.*)\)")


# ------------------------------------------------------------------------------------------- procfs

def parse_stat(text: str) -> dict:
    """/proc/stat: per-CPU jiffies by mode, and the counters node_exporter's stat collector exports."""
    cpus: dict[str, list[int]] = {}
    counters: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts:
            continue
        key = parts[0]
        if key.startswith("cpu"):
            cpus["total" if key == "cpu" else key[3:]] = [int(v) for v in parts[1:11]]
        elif key in ("ctxt", "btime", "processes", "procs_running", "procs_blocked", "intr"):
            counters[key] = int(parts[1])
    return {"cpus": cpus, "counters": counters}


def parse_meminfo(text: str) -> dict[str, float]:
    """/proc/meminfo as node_exporter names it: `Active(anon)` -> `Active_anon_bytes`; kB -> bytes."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 2 or not parts[0].endswith(":"):
            continue
        key = parts[0][:-1]
        if "(" in key:
            key = _PAREN.sub(r"_\1", key)
        if len(parts) == 3 and parts[2] == "kB":
            out[f"{key}_bytes"] = float(parts[1]) * 1024
        else:
            out[key] = float(parts[1])
    return out


def parse_loadavg(text: str) -> tuple[float, float, float]:
    one, five, fifteen = text.split()[:3]
    return float(one), float(five), float(fifteen)


# ---------------------------------------------------------------------------------------- collector

@register
class HostCollector(Collector):
    name = "host"
    interval = 5.0
    timeout = 5.0

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.opts = options(ctx.options, self.name, nccl_from_torch=True)
        self._last_cpu: tuple[int, int] | None = None       # (busy, total) jiffies at the last update
        self._started: dict[int, tuple[int, int]] = {}       # rank -> (pid, start time) of its process
        self._rank_pids = RankPids(ctx.run_dir, ctx.node)
        self._info = None           # trainguard_node_info: versions found once, so one family for good

    def update(self) -> Sample:
        procfs = self.ctx.procfs
        stat = parse_stat(_read(procfs, "stat"))
        memory = parse_meminfo(_read(procfs, "meminfo"))
        load = parse_loadavg(_read(procfs, "loadavg"))
        if self._info is None:
            versions = software_versions(self.ctx, ask_torch=self.opts["nccl_from_torch"])
            self._info = _info_family(self.ctx.node, versions)
        ranks = self._rank_processes()
        families = [*_cpu_families(stat), *_memory_families(memory), *_load_families(load),
                    *rank_families(ranks), self._info]
        return Sample(families, tls=self._tls(stat, memory, load, ranks))

    def _tls(self, stat: dict, memory: dict, load: tuple, ranks: dict) -> dict:
        system = {"load1": load[0], "mem_total_bytes": memory.get("MemTotal_bytes"),
                  "mem_available_bytes": memory.get("MemAvailable_bytes")}
        if ranks:
            system["trainer_rss_bytes"] = sum(r["rss"] for r in ranks.values() if r["up"])
        fragment = {"system": {k: v for k, v in system.items() if v is not None}}
        total = stat["cpus"].get("total")
        if total:
            busy, whole = sum(total[:8]) - total[3] - total[4], sum(total[:8])
            if self._last_cpu is not None and whole > self._last_cpu[1]:
                fragment["hardware"] = {"cpu_percent": round(
                    100.0 * (busy - self._last_cpu[0]) / (whole - self._last_cpu[1]), 2)}
            self._last_cpu = (busy, whole)
        return fragment

    # ------------------------------------------------------------------------------------ trainer

    def _rank_processes(self) -> dict[int, dict]:
        """This node's ranks (RUN/control/ranks) with their process's CPU, RSS and threads, or up=False."""
        out = {}
        pids = self._rank_pids.get()
        for rank in set(self._started) - set(pids):
            del self._started[rank]
        for rank, pid in pids.items():
            process = read_process(self.ctx.procfs, pid)
            known = self._started.get(rank)
            if process is not None and (known is None or known[0] != pid):
                self._started[rank] = known = (pid, process["start"])   # a new (or restarted) rank process
            # The same pid with another start time is a process the kernel gave that pid since: not the rank.
            alive = process is not None and known == (pid, process["start"])
            out[rank] = process if alive else {"up": False}
        return out


def _read(procfs: Path, name: str) -> str:
    return read_small(os.path.join(procfs, name)).decode("ascii", "replace")


def read_process(procfs: Path, pid: int) -> dict | None:
    """CPU, RSS and threads of a process from one read of <procfs>/<pid>/stat; None if gone or a zombie."""
    fields = read_pid_stat(procfs, pid)     # after "pid (comm)": field 3 (state) is fields[0]
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    return {"up": True, "user": int(fields[11]) / USER_HZ, "system": int(fields[12]) / USER_HZ,
            "threads": int(fields[17]), "start": int(fields[19]), "rss": int(fields[21]) * PAGE_SIZE}


# ----------------------------------------------------------------------------------------- families

_CPU_LABELS = LabelCache(["cpu", "mode"])
CPU_SECONDS = Spec("counter", "node_cpu_seconds_total", "Seconds the CPUs spent in each mode.", ["cpu", "mode"])
CPU_GUEST = Spec("counter", "node_cpu_guest_seconds_total", "Seconds the CPUs spent in guests (VMs) for each mode.",
                 ["cpu", "mode"])
# /proc/stat line -> its family (node_exporter's stat collector)
STAT_COUNTERS = (
    ("ctxt", Spec("counter", "node_context_switches_total", "Total number of context switches.")),
    ("processes", Spec("counter", "node_forks_total", "Total number of forks.")),
    ("intr", Spec("counter", "node_intr_total", "Total number of interrupts serviced.")),
    ("btime", Spec("gauge", "node_boot_time_seconds", "Node boot time, in unixtime.")),
    ("procs_running", Spec("gauge", "node_procs_running", "Number of processes in runnable state.")),
    ("procs_blocked", Spec("gauge", "node_procs_blocked", "Number of processes blocked waiting for I/O to complete.")),
)


def _cpu_families(stat: dict) -> list:
    seconds, guest = [], []
    for cpu, jiffies in sorted(((c, j) for c, j in stat["cpus"].items() if c != "total"), key=lambda i: int(i[0])):
        seconds += [(_CPU_LABELS.get(cpu, mode), value / USER_HZ) for mode, value in zip(CPU_MODES, jiffies)]
        if len(jiffies) >= 10:
            guest += [(_CPU_LABELS.get(cpu, "user"), jiffies[8] / USER_HZ),
                      (_CPU_LABELS.get(cpu, "nice"), jiffies[9] / USER_HZ)]
    counters = stat["counters"]
    return [CPU_SECONDS.family(seconds), CPU_GUEST.family(guest),
            *(spec.value(counters[key]) for key, spec in STAT_COUNTERS if key in counters)]


# meminfo field -> trainguard name. node_exporter's names (node_memory_MemTotal_bytes) fail `promtool check
# metrics` (camelCase), so the fields that matter get snake_case names of our own.
MEMORY_FIELDS = {
    "MemTotal_bytes": "total_bytes", "MemFree_bytes": "free_bytes", "MemAvailable_bytes": "available_bytes",
    "Buffers_bytes": "buffers_bytes", "Cached_bytes": "cached_bytes", "Shmem_bytes": "shared_bytes",
    "SwapTotal_bytes": "swap_total_bytes", "SwapFree_bytes": "swap_free_bytes", "Dirty_bytes": "dirty_bytes",
    "Writeback_bytes": "writeback_bytes", "AnonPages_bytes": "anon_bytes", "Mapped_bytes": "mapped_bytes",
    "Slab_bytes": "slab_bytes", "Committed_AS_bytes": "committed_bytes", "CommitLimit_bytes": "commit_limit_bytes",
    "Hugepagesize_bytes": "hugepage_size_bytes", "HugePages_Total": "hugepages",
    "HugePages_Free": "hugepages_free",
}
_MEMORY_SPECS = [(field, Spec("gauge", f"trainguard_host_memory_{name}", f"/proc/meminfo {field.split('_bytes')[0]}."))
                 for field, name in MEMORY_FIELDS.items()]
_LOAD_SPECS = [Spec("gauge", f"node_load{window}", f"{window}m load average.") for window in (1, 5, 15)]


def _memory_families(memory: dict[str, float]) -> list:
    return [spec.value(memory[field]) for field, spec in _MEMORY_SPECS if field in memory]


def _load_families(load: tuple[float, float, float]) -> list:
    return [spec.value(value) for spec, value in zip(_LOAD_SPECS, load)]


def _info_family(node: str, versions: dict[str, str]) -> InfoMetricFamily:
    info = InfoMetricFamily("trainguard_node", "Software versions on the node (compare across nodes).")
    info.add_metric([], {"node": node, **versions})
    return info
