"""The io collector on the fixture procfs tree: node_exporter's disk and network series, its device filter and
units, the checkpoint filesystem's space, and the disk await of the TLS record."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.agent.exposition import series, values
from trainguard.agent.collector import Context
from trainguard.agent.collectors.io import IOCollector, disk_await_ms
from trainguard.agent.config import ConfigError
from trainguard.agent.procfs import DiskStats, ParseError, read_diskstats, read_net_dev

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def collect(procfs: Path = FIXTURES / "proc", run_dir: Path | None = None, **options):
    return IOCollector(Context(procfs=procfs, sysfs=FIXTURES / "sys", run_dir=run_dir, options=options))


def disks_of(v) -> set[str]:
    return {dict(labels)["device"] for name, labels in v if name == "node_disk_reads_completed_total"}


def test_disk_series_in_node_exporter_units():
    v = values(collect().update().families)
    nvme = {"device": "nvme0n1"}
    assert v[series("node_disk_reads_completed_total", **nvme)] == 93841203
    assert v[series("node_disk_read_bytes_total", **nvme)] == 48201837312 * 512        # 512-byte sectors, always
    assert v[series("node_disk_written_bytes_total", **nvme)] == 987123456789 * 512
    assert v[series("node_disk_read_time_seconds_total", **nvme)] == pytest.approx(19283.746)   # ms -> s
    assert v[series("node_disk_write_time_seconds_total", **nvme)] == pytest.approx(2384756.123)
    assert v[series("node_disk_io_now", **nvme)] == 3
    assert v[series("node_disk_io_time_seconds_total", **nvme)] == pytest.approx(81726.354)
    assert v[series("node_disk_discarded_sectors_total", **nvme)] == 9823645120                # sectors, as NE
    assert v[series("node_disk_flush_requests_total", **nvme)] == 12938475


def test_device_filter_is_node_exporters():
    """Partitions, loop and zram devices are left out; whole disks, dm, md and sr devices stay."""
    assert disks_of(values(collect().update().families)) == {"nvme0n1", "nvme1n1", "sda", "dm-0", "md0", "sr0"}
    assert disks_of(values(collect(device_include=r"^nvme\d+n\d+$").update().families)) == {"nvme0n1", "nvme1n1"}
    assert "loop0" in disks_of(values(collect(device_exclude="^sd").update().families))
    with pytest.raises(ConfigError, match="mutually exclusive"):
        collect(device_exclude="^a", device_include="^b")
    with pytest.raises(ConfigError, match="collectors.io.device_exclude: not a regular expression"):
        collect(device_exclude="(")


def test_older_kernels_give_fewer_series():
    """md0 has the 11 fields of kernels before 4.18, sda the 15 of 4.18-5.4: no discard or flush series."""
    v = values(collect().update().families)
    assert series("node_disk_io_time_weighted_seconds_total", device="md0") in v
    assert series("node_disk_discards_completed_total", device="md0") not in v
    assert series("node_disk_discards_completed_total", device="sda") in v
    assert series("node_disk_flush_requests_total", device="sda") not in v


def test_network_series():
    v = values(collect().update().families)
    assert v[series("node_network_receive_bytes_total", device="eth0")] == 98765432109
    assert v[series("node_network_transmit_drop_total", device="eth0")] == 2
    assert v[series("node_network_receive_frame_total", device="eth0")] == 1
    assert v[series("node_network_transmit_colls_total", device="eth0")] == 0
    assert v[series("node_network_receive_bytes_total", device="ens1f0np0")] == 1827364512837465
    devices = {dict(labels)["device"] for name, labels in v if name == "node_network_receive_bytes_total"}
    assert devices == {"lo", "eth0", "ens1f0np0", "ib0", "docker0"}
    v = values(collect(netdev_device_exclude="^(lo|docker.*)$").update().families)
    assert series("node_network_receive_bytes_total", device="lo") not in v
    assert series("node_network_receive_bytes_total", device="ib0") in v


def test_checkpoint_filesystem_space(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    v = values(collect(run_dir=run).update().families)     # checkpoints/ not made yet: the fs it will be on
    stat = os.statvfs(run)
    mountpoint = [dict(l)["mountpoint"] for n, l in v if n == "trainguard_checkpoint_fs_avail_bytes"][0]
    assert os.path.ismount(mountpoint) and str(run.resolve()).startswith(mountpoint)
    assert v[series("trainguard_checkpoint_fs_size_bytes", mountpoint=mountpoint)] == stat.f_blocks * stat.f_frsize
    avail = v[series("trainguard_checkpoint_fs_avail_bytes", mountpoint=mountpoint)]
    assert abs(avail - stat.f_bavail * stat.f_frsize) < 64 * 2**20      # others write to /tmp meanwhile
    assert not any(name.startswith("trainguard_checkpoint") for name, _ in values(collect().update().families))


def write_diskstats(procfs: Path, reads: int, read_ms: int, writes: int, write_ms: int) -> None:
    (procfs / "diskstats").write_text(
        f" 259 0 nvme0n1 {reads} 0 8 {read_ms} {writes} 0 8 {write_ms} 0 10 20 0 0 0 0 0 0\n"
        f"   8 0 sda 100 0 8 1000 100 0 8 1000 0 10 20 0 0 0 0\n")


def test_disk_await_in_tls_from_deltas(tmp_path):
    procfs = tmp_path / "proc"
    (procfs / "net").mkdir(parents=True)
    shutil.copy(FIXTURES / "proc" / "net" / "dev", procfs / "net" / "dev")
    write_diskstats(procfs, reads=1000, read_ms=500, writes=2000, write_ms=3000)
    collector = collect(procfs)
    assert "hardware" not in collector.update().tls            # one reading: no interval yet
    write_diskstats(procfs, reads=1100, read_ms=900, writes=2300, write_ms=5600)
    # nvme0n1: (400 + 2600) ms over 400 I/Os = 7.5 ms; sda did no I/O and does not count as 0
    assert collector.update().tls == {"hardware": {"disk_await_ms": 7.5}}
    assert "hardware" not in collector.update().tls            # no I/O at all: undefined, not 0


def test_await_counts_a_reset_counter_from_zero():
    """A device replaced (or its counters wrapped) between updates: its new counts are the interval's."""
    def disk(reads: int, read_ms: int) -> DiskStats:
        return DiskStats(259, 0, "nvme0n1", {"reads_completed": reads, "read_ms": read_ms,
                                             "writes_completed": 0, "write_ms": 0})

    assert disk_await_ms({"nvme0n1": disk(10_000, 90_000)}, [disk(40, 200)]) == 5.0


def test_bad_input_names_file_line_and_field(tmp_path):
    (tmp_path / "diskstats").write_text(" 259 0 nvme0n1 1 2 3 4 5 6 7 8 9 10 11\n 8 0 sda 1 2 x 4 5 6 7 8 9 10 11\n")
    with pytest.raises(ParseError, match=r"diskstats:2: field 'sectors_read' expected an integer, got 'x'"):
        read_diskstats(tmp_path)
    (tmp_path / "diskstats").write_text(" 259 0 nvme0n1 1 2 3\n")
    with pytest.raises(ParseError, match=r"diskstats:1: expected 14 to 20 fields, got 6"):
        read_diskstats(tmp_path)
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "dev").write_text("Inter-|\n face bytes\n")
    (tmp_path / "diskstats").write_text("")
    with pytest.raises(ParseError, match=r"net/dev:2: missing the 'face \|bytes"):
        read_net_dev(tmp_path)
    v = values(collect(tmp_path).update().families)        # the collector goes on without the network
    assert v[series("trainguard_io_source_success", source="netdev")] == 0.0


@pytest.mark.parametrize("damage", ["missing", "unparsable"])
def test_a_broken_net_dev_costs_the_network_series_only(tmp_path, damage):
    """node_exporter keeps diskstats and netdev apart; so does the io collector."""
    procfs = tmp_path / "proc"
    shutil.copytree(FIXTURES / "proc", procfs, symlinks=True)
    net_dev = procfs / "net" / "dev"
    if net_dev.is_symlink() or net_dev.exists():
        net_dev.unlink()
    if damage == "unparsable":
        net_dev.write_text("Inter-|   Receive\n face |bytes\n  eth0: not numbers at all\n")
    collector = collect(procfs)
    v = values(collector.update().families)
    assert disks_of(v)                                                      # the disks are still there
    assert not any(name.startswith("node_network_") for name, _ in v)
    assert v[series("trainguard_io_source_success", source="netdev")] == 0.0
    assert v[series("trainguard_io_source_success", source="diskstats")] == 1.0
