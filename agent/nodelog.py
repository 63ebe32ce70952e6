"""The joined node log: one TLS record per interval in RUN/tls/node-<host>.jsonl.

Each record joins what every collector last reported (`Sample.tls` fragments): the training run's latest
step metrics, the hardware (GPUs, disks) and the system (host, checkpoint, cost) in one line, as the
design's TLS example shows. A background thread writes it; when the file would pass `max_bytes` it is
rotated to node-<host>.jsonl.1.gz (older segments shift to .2.gz ..., `keep` of them are kept).

A collector's fragment may also carry `events`: TLS records (`timestamp`, `node`, `event` with an `id`) the
collector wants on the timeline (agent/health_timeline.py: health findings). Each id is written once, as its
own record, before the joined record of that interval.

The log must never hurt the agent or the run: a write that fails (disk full, read-only filesystem) is
logged once per streak and counted, and the next interval tries again.
"""

from __future__ import annotations

import gzip
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from trainguard import rundir, safe_read
from trainguard import log as tglog
from trainguard import tls
from trainguard.agent.stop_signal import StopSignal

SECTIONS = ("metrics", "hardware", "system")
ENVELOPE = ("run_id", "step")
WRITTEN_KEPT = 4096     # event ids remembered as written (a fragment holds at most a few hundred)


def join_fragments(fragments: Mapping[str, dict], node: str, now: float) -> dict:
    """One TLS record from the collectors' fragments (by collector name; merged in name order)."""
    record: dict = {"schema": tls.SCHEMA_ID, "timestamp": tls.format_timestamp(now), "node": node}
    for name in sorted(fragments):
        fragment = fragments[name]
        for key in ENVELOPE:
            if key in fragment:
                record[key] = fragment[key]
        for section in SECTIONS:
            if fragment.get(section):
                record.setdefault(section, {}).update(fragment[section])
    return record


class RotatingFile:
    """Appends lines to `path`; past `max_bytes` it moves to path.1.gz and older segments shift up to `keep`."""

    def __init__(self, path: Path, max_bytes: int, keep: int):
        self.path, self.max_bytes, self.keep = Path(path), max_bytes, keep
        self.rotations = 0
        self._fd = -1
        self._size = 0
        self._broken_line = False   # a failed write may have left part of a line behind

    def _segment(self, index: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{index}.gz")

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = safe_read.open_rw_fd(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "node log")
        self._size = os.fstat(self._fd).st_size

    def write(self, line: bytes) -> None:
        if self._fd < 0:
            self.finish_interrupted_rotation()
            self._open()
        if self._size and self._size + len(line) > self.max_bytes:
            self.rotate()
        if self._broken_line:
            line = b"\n" + line   # end the partial line so it stays one malformed line, not two
        written = os.write(self._fd, line)
        self._size += written
        self._broken_line = written < len(line)
        if self._broken_line:
            raise OSError(f"short write to {self.path} ({written} of {len(line)} bytes)")

    def rotate(self) -> None:
        plain = self.path.with_name(f"{self.path.name}.1")
        os.close(self._fd)
        self._fd = -1
        self.finish_interrupted_rotation()   # a segment a failed rotation left plain must not be overwritten
        self._shift()
        os.replace(self.path, plain)
        self._open()            # the live file is back before the slow part
        self._compress(plain)
        self.rotations += 1

    def finish_interrupted_rotation(self) -> None:
        """A rotation cut short (agent killed while compressing) left path.1: compress it now."""
        plain = self.path.with_name(f"{self.path.name}.1")
        if plain.exists():
            self._shift()
            self._compress(plain)

    def _shift(self) -> None:
        self._segment(self.keep).unlink(missing_ok=True)
        for index in range(self.keep - 1, 0, -1):
            if self._segment(index).exists():
                os.replace(self._segment(index), self._segment(index + 1))

    def _compress(self, plain: Path) -> None:
        target = self._segment(1)
        tmp = target.with_name(target.name + ".tmp")
        with safe_read.open_file(plain, what="log file") as source, gzip.open(tmp, "wb", compresslevel=6) as sink:
            shutil.copyfileobj(source, sink, 1 << 20)
        os.replace(tmp, target)
        plain.unlink()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class NodeLog:
    """Writes the joined record every `interval` seconds from a daemon thread."""

    def __init__(self, fragments: Callable[[], Mapping[str, dict]], run_dir: str | os.PathLike, node: str, *,
                 interval: float = 10.0, max_bytes: int = 64 * 2**20, keep: int = 5):
        self.fragments, self.node, self.interval = fragments, node, interval
        self.file = RotatingFile(rundir.node_log(run_dir, node), max_bytes, keep)
        self.records = self.errors = 0
        self._written: dict[str, None] = {}       # ids of fragment events already written, oldest first
        self._failing = False
        self._log = tglog.get("agent.nodelog", path=str(self.file.path))
        self._stop = StopSignal()
        self._thread: threading.Thread | None = None

    def write_once(self, now: float | None = None) -> bool:
        """Join and append one record; False (logged once per streak, counted) when it could not be written."""
        try:
            fragments = self.fragments()
            for ident, record in self._new_events(fragments):
                self.file.write(tls.encode(record))
                self._written[ident] = None
                while len(self._written) > WRITTEN_KEPT:
                    del self._written[next(iter(self._written))]
            record = join_fragments(fragments, self.node, time.time() if now is None else now)
            self.file.write(tls.encode(record))
        except (OSError, ValueError, TypeError) as exc:
            self.errors += 1
            if not self._failing:
                self._failing = True
                self._log.error("node log write failed; will retry each interval", error=str(exc))
            return False
        self.records += 1
        if self._failing:
            self._failing = False
            self._log.info("node log writes recovered", failed_writes=self.errors)
        return True

    def _new_events(self, fragments: Mapping[str, dict]) -> list[tuple[str, dict]]:
        """The fragments' event records not written yet, as TLS records, oldest first."""
        found = []
        for name in sorted(fragments):
            for entry in fragments[name].get("events") or ():
                event = entry.get("event") if isinstance(entry, dict) else None
                ident = event.get("id") if isinstance(event, dict) else None
                if not isinstance(ident, str) or ident in self._written:
                    continue
                found.append((ident, {"schema": tls.SCHEMA_ID, "timestamp": tls.format_timestamp(entry["timestamp"]),
                                      "node": str(entry.get("node") or self.node), "event": event}))
        return sorted(found, key=lambda item: item[1]["timestamp"])

    def start(self) -> "NodeLog":
        self._thread = threading.Thread(target=self._loop, name="agent-nodelog", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.write_once()

    def stop(self) -> None:
        """Stop the thread and write one last record, so a short run or a clean shutdown leaves its end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self.write_once()
        self.file.close()

    def families(self) -> list:
        records = CounterMetricFamily("trainguard_nodelog_records", "Joined records written to the node TLS log.",
                                      value=self.records)
        errors = CounterMetricFamily("trainguard_nodelog_write_errors",
                                     "Node TLS log writes that failed (disk full, read-only ...).", value=self.errors)
        rotations = CounterMetricFamily("trainguard_nodelog_rotations", "Rotations of the node TLS log.",
                                        value=self.file.rotations)
        size = GaugeMetricFamily("trainguard_nodelog_size_bytes", "Size of the live node TLS log file.",
                                 value=self.file._size)
        return [records, errors, rotations, size]
