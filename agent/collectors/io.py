"""Disk and network IO from <procfs>/diskstats and <procfs>/net/dev, and the checkpoint filesystem's space.

Disk and NIC series carry node_exporter's names, labels, units and device filters (diskstats and netdev
collectors), so `node_disk_*` / `node_network_*` queries and dashboards work unchanged; counters stay raw and
rates are PromQL's job. tests/agent/test_node_exporter_crosscheck.py compares both with the real
prometheus-node-exporter on the same roots. What node_exporter cannot know is the run: the space left where
checkpoints go (trainguard_checkpoint_fs_*), and the disk await the TLS node record carries.

The three sources fail apart, as node_exporter's diskstats and netdev collectors do: a missing or
unparsable ``net/dev`` costs the network series only, never the disks (and the other way round);
``trainguard_io_source_success{source}`` says which read, and a failure is logged once per streak.
"""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client.core import Metric

from trainguard import rundir
from ..collector import Collector, Sample, register
from trainguard.metrics.families import LabelCache, Labels, Spec
from trainguard.metrics.node import DEVICE as _DEVICE
from trainguard.metrics.node import DiskStats, disk_families
from ..procfs import read_diskstats, read_net_dev
from .options import DeviceFilter, options

# node_exporter's diskstats default: partitions, ram/zram, loop and floppy devices are not disks of their own
DISK_EXCLUDE_DEFAULT = r"^(z?ram|loop|fd|(h|s|v|xv)d[a-z]|nvme\d+n\d+p)\d+$"
@register
class IOCollector(Collector):
    name = "io"
    interval = 5.0
    timeout = 10.0

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        opts = options(ctx.options, self.name, device_exclude=None, device_include=None,
                       netdev_device_exclude=None, netdev_device_include=None, checkpoint_dir=None)
        # as node_exporter: the default exclusion applies unless an include pattern is given instead
        exclude = opts["device_exclude"] or (None if opts["device_include"] else DISK_EXCLUDE_DEFAULT)
        self.disks = DeviceFilter(self.name, exclude, opts["device_include"])
        self.nics = DeviceFilter(self.name, opts["netdev_device_exclude"], opts["netdev_device_include"],
                                 prefix="netdev_device")
        checkpoints = opts["checkpoint_dir"] or (rundir.checkpoints_dir(ctx.run_dir) if ctx.run_dir else None)
        self.checkpoint_fs = CheckpointFilesystem(Path(checkpoints)) if checkpoints else None
        self._previous: dict[str, DiskStats] = {}
        self._failed: dict[str, str] = {}      # source -> its error, while it fails

    def update(self) -> Sample:
        disks = self._source("diskstats", lambda: [d for d in read_diskstats(self.ctx.procfs)
                                                  if not self.disks.ignored(d.device)])
        nics = self._source("netdev", lambda: {name: stats for name, stats in read_net_dev(self.ctx.procfs).items()
                                               if not self.nics.ignored(name)})
        result = (disk_families(disks) if disks is not None else []) + (
            network_families(nics) if nics is not None else [])
        if self.checkpoint_fs is not None:
            result += self._source("checkpoint_fs", self.checkpoint_fs.families) or []
        result.append(self._success_family())
        tls = {}
        if disks is not None:
            await_ms = disk_await_ms(self._previous, disks)
            if await_ms is not None:
                tls["hardware"] = {"disk_await_ms": await_ms}
            self._previous = {d.device: d for d in disks}
        return Sample(families=result, tls=tls)

    def _source(self, name: str, read):
        """`read()`, or None when it fails (logged once per streak): one source never takes the others down."""
        try:
            value = read()
        except (OSError, ValueError, IndexError, KeyError) as exc:
            if self._failed.get(name) is None:
                _log().warning("io source failed; the others go on", source=name, error=f"{type(exc).__name__}: {exc}")
            self._failed[name] = str(exc)
            return None
        if self._failed.pop(name, None) is not None:
            _log().info("io source back", source=name)
        return value

    def _success_family(self) -> Metric:
        sources = ["diskstats", "netdev"] + (["checkpoint_fs"] if self.checkpoint_fs is not None else [])
        return _SOURCE_SUCCESS.family([(_SOURCE.get(name), 0.0 if name in self._failed else 1.0) for name in sources])


_SOURCE = LabelCache(["source"])
_SOURCE_SUCCESS = Spec("gauge", "trainguard_io_source_success",
                       "Whether the io collector's source (diskstats, netdev, checkpoint_fs) was read at the last update.",
                       ["source"])


def _log():
    from trainguard import log

    return log.get("agent.collector", collector="io")
_NETWORK_SPECS: dict[str, Spec] = {}  # /proc/net/dev column -> its family (columns come from the file's header)


def network_families(nics: dict[str, dict[str, int]]) -> list[Metric]:
    """node_exporter's netdev series from /proc/net/dev: node_network_<column>_total{device}."""
    samples: dict[str, list] = {}
    for device, stats in nics.items():
        labels = _DEVICE.get(device)
        for key, value in stats.items():
            samples.setdefault(key, []).append((labels, value))
    return [_network_spec(key).family(samples[key]) for key in sorted(samples)]


def _network_spec(column: str) -> Spec:
    spec = _NETWORK_SPECS.get(column)
    if spec is None:
        spec = _NETWORK_SPECS[column] = Spec("counter", f"node_network_{column}",
                                             f"Network device statistic {column}.", ["device"])
    return spec


_CHECKPOINT_FS = (
    ("avail_bytes", "Bytes free for unprivileged users on the checkpoint filesystem.", "f_bavail"),
    ("free_bytes", "Bytes free on the checkpoint filesystem (root's reserve included).", "f_bfree"),
    ("size_bytes", "Size of the checkpoint filesystem in bytes.", "f_blocks"),
)
_CHECKPOINT_SPECS = [(Spec("gauge", f"trainguard_checkpoint_fs_{suffix}", help_, ["mountpoint"]), blocks)
                     for suffix, help_, blocks in _CHECKPOINT_FS]


class CheckpointFilesystem:
    """Space of the filesystem checkpoints go to (the nearest existing parent if the directory is not made yet).

    Finding the mount point walks up the tree; it is found again only when the filesystem under the path
    changes (another st_dev: something was mounted or unmounted above it).
    """

    def __init__(self, directory: Path):
        self.directory = os.path.abspath(directory)
        self._mount: tuple[str, int, Labels] | None = None    # (existing path, its st_dev, mountpoint labels)

    def families(self) -> list[Metric]:
        existing = _existing(self.directory)
        stat = os.statvfs(existing)
        device = os.stat(existing).st_dev
        if self._mount is None or self._mount[:2] != (existing, device):
            self._mount = (existing, device, Labels(["mountpoint"], [_mountpoint(Path(existing))]))
        labels = self._mount[2]
        return [spec.family([(labels, getattr(stat, blocks) * stat.f_frsize)]) for spec, blocks in _CHECKPOINT_SPECS]


def _existing(path: str) -> str:
    while not os.path.exists(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    return path


def _mountpoint(path: Path) -> str:
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return str(path)


def disk_await_ms(previous: dict[str, DiskStats], current: list[DiskStats]) -> float | None:
    """The worst per-disk await (ms per completed read or write) since the last update, as iostat's r/w_await.

    The worst disk, not an average: one saturated checkpoint or dataset disk stalls the run while the others idle.
    None when no disk completed an I/O in the interval (await is undefined, not zero).
    """
    worst = None
    for disk in current:
        before = previous.get(disk.device)
        if before is None:
            continue
        ops = _delta(disk, before, "reads_completed") + _delta(disk, before, "writes_completed")
        if ops <= 0:
            continue
        waited = _delta(disk, before, "read_ms") + _delta(disk, before, "write_ms")
        value = waited / ops
        worst = value if worst is None else max(worst, value)
    return None if worst is None else round(worst, 3)


def _delta(now: DiskStats, before: DiskStats, field: str) -> int:
    # A counter going back means the device was replaced or the counter wrapped: count from zero.
    change = now.stats[field] - before.stats[field]
    return change if change >= 0 else now.stats[field]
