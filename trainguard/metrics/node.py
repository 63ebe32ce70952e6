"""The node's families that both the agent and replay render: disks (node_exporter's diskstats names) and
the trainer's rank processes. Pure: what they are read from lives in agent/procfs.py.

`disk_families` is what the io collector exports for /proc/diskstats and what replay exports for a node
log's ``disk_await_ms``; `rank_families` is what the host collector exports for the rank processes and
(their liveness only) what replay exports for a rank's log.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.core import Metric

from trainguard.metrics.families import LabelCache, Spec

DEVICE = LabelCache(["device"])     # one label set per disk or NIC, shared by all their series


@dataclass(frozen=True)
class DiskStats:
    major: int
    minor: int
    device: str
    stats: dict[str, int]    # the DISKSTAT_FIELDS this kernel wrote, in order


UNIX_SECTOR_BYTES = 512.0   # diskstats sectors are always 512 bytes, whatever the device's block size
SECONDS_PER_MS = 1e-3

# diskstats field -> (node_disk_ name, help, scale, counter?) in node_exporter's order; a kernel writing fewer
# fields gives fewer series, as node_exporter does.
DISK_SERIES = (
    ("reads_completed", "reads_completed_total", "The total number of reads completed successfully.", 1, True),
    ("reads_merged", "reads_merged_total", "The total number of reads merged.", 1, True),
    ("sectors_read", "read_bytes_total", "The total number of bytes read successfully.", UNIX_SECTOR_BYTES, True),
    ("read_ms", "read_time_seconds_total", "The total number of seconds spent by all reads.", SECONDS_PER_MS, True),
    ("writes_completed", "writes_completed_total", "The total number of writes completed successfully.", 1, True),
    ("writes_merged", "writes_merged_total", "The number of writes merged.", 1, True),
    ("sectors_written", "written_bytes_total", "The total number of bytes written successfully.",
     UNIX_SECTOR_BYTES, True),
    ("write_ms", "write_time_seconds_total", "This is the total number of seconds spent by all writes.",
     SECONDS_PER_MS, True),
    ("ios_in_progress", "io_now", "The number of I/Os currently in progress.", 1, False),
    ("io_ms", "io_time_seconds_total", "Total seconds spent doing I/Os.", SECONDS_PER_MS, True),
    ("weighted_io_ms", "io_time_weighted_seconds_total", "The weighted # of seconds spent doing I/Os.",
     SECONDS_PER_MS, True),
    ("discards_completed", "discards_completed_total", "The total number of discards completed successfully.", 1, True),
    ("discards_merged", "discards_merged_total", "The total number of discards merged.", 1, True),
    ("sectors_discarded", "discarded_sectors_total", "The total number of sectors discarded successfully.", 1, True),
    ("discard_ms", "discard_time_seconds_total", "This is the total number of seconds spent by all discards.",
     SECONDS_PER_MS, True),
    ("flushes_completed", "flush_requests_total", "The total number of flush requests completed successfully", 1, True),
    ("flush_ms", "flush_requests_time_seconds_total",
     "This is the total number of seconds spent by all flush requests.", SECONDS_PER_MS, True),
)


_DISK_SPECS = [(field, Spec("counter" if is_counter else "gauge", f"node_disk_{name}", help_, ["device"]), scale)
               for field, name, help_, scale, is_counter in DISK_SERIES]


def disk_families(disks: list[DiskStats]) -> list[Metric]:
    labels = [(DEVICE.get(disk.device), disk.stats) for disk in disks]
    families = []
    for field, spec, scale in _DISK_SPECS:
        samples = [(device, stats[field] * scale) for device, stats in labels if field in stats]
        if samples:
            families.append(spec.family(samples))
    return families


_RANK = LabelCache(["rank"])
_RANK_MODE = LabelCache(["rank", "mode"])
RANK_UP = Spec("gauge", "trainguard_rank_process_up", "1 when the rank's process (from control/ranks) is alive.",
               ["rank"])
RANK_CPU = Spec("counter", "trainguard_rank_cpu_seconds", "CPU time of the rank's process, by mode.", ["rank", "mode"])
RANK_RSS = Spec("gauge", "trainguard_rank_resident_memory_bytes", "Resident memory of the rank's process.", ["rank"])
RANK_THREADS = Spec("gauge", "trainguard_rank_threads", "Threads of the rank's process.", ["rank"])


def rank_families(ranks: dict[int, dict]) -> list:
    up, cpu, rss, threads = [], [], [], []
    for rank, values in sorted(ranks.items()):
        label = _RANK.get(str(rank))
        up.append((label, 1 if values["up"] else 0))
        if values["up"]:
            cpu += [(_RANK_MODE.get(str(rank), "user"), values["user"]),
                    (_RANK_MODE.get(str(rank), "system"), values["system"])]
            rss.append((label, values["rss"]))
            threads.append((label, values["threads"]))
    return [RANK_UP.family(up), RANK_CPU.family(cpu), RANK_RSS.family(rss), RANK_THREADS.family(threads)]
