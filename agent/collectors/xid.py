"""XID errors, from two sources that see the same events: NVML's event set, and the kernel log (/dev/kmsg).

The driver reports every XID in the kernel log (`NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off
the bus.`), and to NVML event sets registered for nvmlEventTypeXidCriticalError. Neither is enough alone: NVML
misses what happens while a GPU is lost or NVML is being re-initialised, and /dev/kmsg is readable only with
CAP_SYSLOG (root, or a DaemonSet granted it). Counting both would count each XID twice, so each source keeps
its own count per (GPU, XID) and the exported count is the larger of the two: monotonic, never doubled, and
complete whenever either source saw everything.

Both sources start at "now": XIDs from before the agent started are not replayed, so a restarted agent does
not make old XIDs look new to `increase()`.
"""

from __future__ import annotations

import errno
import os
import re
from collections import Counter
from pathlib import Path

_KMSG_XID = re.compile(rb"NVRM: Xid \(PCI:([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)(?:\.[0-9a-fA-F]+)?\): (\d+)")
KMSG_READ_BYTES = 8192          # one /dev/kmsg record per read; a buffer too small makes the read fail (EINVAL)
MAX_READS_PER_POLL = 4096        # bounds one update's work after a flood of kernel messages
MAX_EVENTS_PER_POLL = 4096
MAX_PARTIAL_LINE = 65536


def pci_key(domain: int, bus: int, device: int) -> str:
    """The one spelling of a GPU's PCI address that kmsg and NVML are both mapped to: '0000:3b:00'."""
    return f"{domain:04x}:{bus:02x}:{device:02x}"


def pci_key_from_bus_id(bus_id: str) -> str:
    """NVML's '00000000:3B:00.0' -> '0000:3b:00'."""
    domain, bus, rest = bus_id.split(":")
    return pci_key(int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16))


def parse_kmsg_xid(line: bytes) -> tuple[str, int] | None:
    """(pci key, xid) of an 'NVRM: Xid (PCI:...): N, ...' kernel message, or None for any other line."""
    match = _KMSG_XID.search(line)
    if not match:
        return None
    domain, bus, device, xid = match.groups()
    return pci_key(int(domain, 16), int(bus, 16), int(device, 16)), int(xid)


class KmsgSource:
    """Non-blocking reader of <devfs>/kmsg from its end; `available` is False (with `reason`) when unreadable."""

    name = "kmsg"

    def __init__(self, devfs: Path):
        self.path = Path(devfs) / "kmsg"
        self.fd: int | None = None
        self.reason = ""
        self._partial = b""
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            os.lseek(self.fd, 0, os.SEEK_END)
        except OSError as exc:
            self.reason = f"{self.path}: {exc.strerror or exc}"
            self.close()

    @property
    def available(self) -> bool:
        return self.fd is not None

    def poll(self) -> list[tuple[str, int]]:
        """XIDs logged since the last poll."""
        if self.fd is None:
            return []
        chunks = []
        for _ in range(MAX_READS_PER_POLL):
            try:
                chunk = os.read(self.fd, KMSG_READ_BYTES)
            except BlockingIOError:          # nothing more for now
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:   # records overwritten before we read them; go on from the oldest left
                    continue
                raise
            if not chunk:                      # end of a regular file (a fixture)
                break
            chunks.append(chunk)
        data = self._partial + b"".join(chunks)
        lines = data.split(b"\n")
        self._partial = lines.pop()[-MAX_PARTIAL_LINE:]
        return [xid for xid in map(parse_kmsg_xid, lines) if xid is not None]

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class NvmlEventSource:
    """An NVML event set registered for XIDs on every GPU that supports it, polled with a zero timeout."""

    name = "nvml"

    def __init__(self, nvml, handles: dict[str, object]):
        """`handles`: {pci key: NVML handle}."""
        self.nvml = nvml
        self.reason = ""
        self.registered: set[str] = set()
        self.event_set = None
        self._by_index: dict[int, str] = {}
        try:
            self.event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            self.reason = f"nvmlEventSetCreate: {exc}"
            return
        for key, handle in handles.items():
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self.event_set)
                self._by_index[nvml.nvmlDeviceGetIndex(handle)] = key
                self.registered.add(key)
            except nvml.NVMLError as exc:   # NOT_SUPPORTED on some boards: kmsg still covers them
                self.reason = f"nvmlDeviceRegisterEvents({key}): {exc}"

    @property
    def available(self) -> bool:
        return bool(self.registered)

    def poll(self) -> list[tuple[str, int]]:
        if not self.registered:
            return []
        xids = []
        for _ in range(MAX_EVENTS_PER_POLL):
            try:
                event = _wait(self.nvml, self.event_set)
            except self.nvml.NVMLError as exc:
                if exc.value != self.nvml.NVML_ERROR_TIMEOUT:
                    self.reason = f"nvmlEventSetWait: {exc}"
                break
            if event.eventType & self.nvml.nvmlEventTypeXidCriticalError:
                key = self._key(event.device)
                if key is not None:
                    xids.append((key, int(event.eventData)))
        return xids

    def _key(self, handle) -> str | None:
        try:
            return self._by_index.get(self.nvml.nvmlDeviceGetIndex(handle))
        except self.nvml.NVMLError:
            return None

    def close(self) -> None:
        if self.event_set is not None:
            try:
                self.nvml.nvmlEventSetFree(self.event_set)
            except self.nvml.NVMLError:
                pass     # NVML already shut down or the GPU gone: the set went with it
            self.event_set = None
        self.registered.clear()


def _wait(nvml, event_set):
    wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
    return wait(event_set, 0)


class XidCounts:
    """Per-source counts per (pci key, xid); `merged()` takes the larger of the sources (see the module doc)."""

    def __init__(self) -> None:
        self.by_source: dict[str, Counter] = {}
        self.last: dict[str, int] = {}          # pci key -> the last XID seen (DCGM_FI_DEV_XID_ERRORS)

    def add(self, source: str, xids: list[tuple[str, int]]) -> None:
        counts = self.by_source.setdefault(source, Counter())
        for key, xid in xids:
            counts[(key, xid)] += 1
            self.last[key] = xid

    def merged(self) -> dict[tuple[str, int], int]:
        out: dict[tuple[str, int], int] = {}
        for counts in self.by_source.values():
            for key, count in counts.items():
                out[key] = max(out.get(key, 0), count)
        return dict(sorted(out.items()))
