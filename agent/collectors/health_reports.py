"""health_reports: the health verdicts other tools leave on the node, for Prometheus: the last `dcgmi diag -j`
result and the kernel log's NVRM lines, read with the parsers of trainguard/health_reports.py.

Off unless configured (`default_enabled = False`), and it reads only the paths its options name:

    collectors:
      health_reports:
        enabled: true
        dcgm_diag: /var/lib/dcgm/diag.json       # what `dcgmi diag -r 2 -j > ...` wrote (any DCGM 1.x-4.x shape)
        kernel_log: /var/log/kern.log            # a kernel log the node keeps or an export (dmesg, journalctl -k)

Enabled with neither option set it is disabled (CollectorDisabled, one line). A file that is not there yet
gives none of its series and no error; a file that is not what it claims fails the update with one line
naming the file (the runner's failure count), and touches no other collector.

The kernel log is followed like `tail -F`: the collector keeps the file's inode and the offset it read to, reads
only complete new lines (at most READ_BYTES an update), and starts again from the top of a file that was
replaced (another inode) or truncated, so a rotated log adds its new lines and nothing is counted twice. The
counts live in the collector: they are monotonic for the agent's lifetime and start at the file's first line.

    trainguard_health_dcgm_diag_result{result}              1 for the last diag's overall result (pass|warn|fail)
    trainguard_health_dcgm_diag_test_result{test, result}   1 for each diag test's result (pass|warn|fail|skip)
    trainguard_health_dcgm_diag_findings                    results of the last diag that did not pass
    trainguard_health_dcgm_diag_timestamp_seconds           when the diag file was written (its mtime)
    trainguard_health_kernel_xid_total{xid, xid_class}      NVRM Xid lines seen, by XID code
    trainguard_health_kernel_gpu_fallen_off_bus_total       NVRM "GPU has fallen off the bus" lines seen
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from trainguard import health_reports, safe_read, xid_catalog
from trainguard.agent.collector import Collector, CollectorDisabled, Context, Sample, register
from trainguard.agent.collectors.options import options

DIAG_BYTES = 16 * 1024 * 1024      # a dcgmi diag -j of 8 GPUs is ~30 KB
READ_BYTES = 16 * 1024 * 1024      # of the kernel log per update; the rest is read by the next updates
MAX_TESTS = 64                     # DCGM 4.x has ~15 tests: a document with more names is cut, not exported whole
RESULTS = (health_reports.PASS, health_reports.WARN, health_reports.FAIL)
TEST_RESULTS = RESULTS + (health_reports.SKIP,)
_SKIPPED = {"skip", "skipped", "not run", "not_run"}


def diag_families(events: list[dict], document: dict, mtime: float) -> list:
    """The families of one `dcgmi diag -j` document and the events `health_reports.dcgm_diag` made of it."""
    summary = events[-1]
    worst: dict[str, str] = {}
    for event in events[:-1]:
        test = str(event.get("test", ""))
        if worst.get(test) != health_reports.FAIL:
            worst[test] = event["status"]
    root = document.get("DCGM Diagnostic", document.get("DCGM GPU Diagnostic")) or {}
    per_test: dict[str, str] = {}
    for category in root.get("test_categories") or ():
        for test in (category.get("tests") or ()) if isinstance(category, dict) else ():
            if not isinstance(test, dict) or len(per_test) >= MAX_TESTS:
                continue
            name = str(test.get("name", ""))
            results = [r for r in test.get("results") or () if isinstance(r, dict)]
            skipped = bool(results) and all(str(r.get("status", "")).strip().lower() in _SKIPPED for r in results)
            per_test[name] = worst.get(name, health_reports.SKIP if skipped else health_reports.PASS)
    if "runtime" in worst:
        per_test["runtime"] = worst["runtime"]
    overall = GaugeMetricFamily("trainguard_health_dcgm_diag_result", "1 for the overall result of the last "
                                "dcgmi diag on this node (pass, warn or fail), 0 for the others.", labels=["result"])
    for result in RESULTS:
        overall.add_metric([result], 1 if summary["status"] == result else 0)
    tests = GaugeMetricFamily("trainguard_health_dcgm_diag_test_result", "1 for the result of each test of the "
                              "last dcgmi diag (pass, warn, fail or skip), 0 for the others.",
                              labels=["test", "result"])
    for name in sorted(per_test):
        for result in TEST_RESULTS:
            tests.add_metric([name, result], 1 if per_test[name] == result else 0)
    findings = GaugeMetricFamily("trainguard_health_dcgm_diag_findings", "Results of the last dcgmi diag that did "
                                 "not pass (one per test and GPU).", value=len(events) - 1)
    when = GaugeMetricFamily("trainguard_health_dcgm_diag_timestamp_seconds", "When the last dcgmi diag result "
                             "was written (its file's mtime, Unix time).", value=mtime)
    return [overall, tests, findings, when]


class KernelLogFollower:
    """The NVRM counts of a kernel log file read incrementally (inode and offset kept; see the module doc)."""

    def __init__(self, path: Path):
        self.path = path
        self.inode: tuple[int, int] | None = None    # (st_dev, st_ino) of the file read
        self.offset = 0
        self.xids: Counter = Counter()                # xid code -> lines seen
        self.fallen = 0

    def poll(self) -> None:
        """Count the complete lines added since the last poll; FileNotFoundError when there is no file."""
        fd, st = safe_read.open_fd(self.path, what="kernel log")
        try:
            if self.inode != (st.st_dev, st.st_ino) or st.st_size < self.offset:
                self.inode, self.offset = (st.st_dev, st.st_ino), 0      # new file, or truncated: from the top
            if st.st_size == self.offset:
                return
            os.lseek(fd, self.offset, os.SEEK_SET)
            data = _read_some(fd)
        finally:
            os.close(fd)
        end = data.rfind(b"\n") + 1
        if end == 0:
            if len(data) >= READ_BYTES:            # one line longer than a whole read: pass over it
                self.offset += len(data)
            return
        self.offset += end
        for event in health_reports.kernel_log(data[:end].decode("utf-8", "replace").splitlines()):
            if event.get("test") == "xid":
                self.xids[int(event["xid"])] += 1
            elif event.get("test") == "fallen_off_the_bus":
                self.fallen += 1

    def families(self) -> list:
        xid = CounterMetricFamily("trainguard_health_kernel_xid_total", "NVRM Xid lines seen in the configured "
                                  "kernel log, by XID code and the class of action it calls for.",
                                  labels=["xid", "xid_class"])
        for code in sorted(self.xids):
            xid.add_metric([str(code), xid_catalog.class_of(code)], self.xids[code])
        fallen = CounterMetricFamily("trainguard_health_kernel_gpu_fallen_off_bus_total", "NVRM 'GPU has fallen "
                                     "off the bus' lines seen in the configured kernel log.", value=self.fallen)
        return [xid, fallen]


def _read_some(fd: int) -> bytes:
    """At most READ_BYTES from the descriptor's offset (safe_read.read_fd refuses a file that grew; a log does)."""
    parts, total = [], 0
    while total < READ_BYTES and (chunk := os.read(fd, min(READ_BYTES - total, 1024 * 1024))):
        parts.append(chunk)
        total += len(chunk)
    return b"".join(parts)


@register
class HealthReportsCollector(Collector):
    name = "health_reports"
    default_enabled = False
    interval = 30.0
    timeout = 10.0

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        opts = options(ctx.options, self.name, dcgm_diag="", kernel_log="")
        if not opts["dcgm_diag"] and not opts["kernel_log"]:
            raise CollectorDisabled("health_reports: neither collectors.health_reports.dcgm_diag nor "
                                    "collectors.health_reports.kernel_log is set")
        self.diag_path = Path(opts["dcgm_diag"]) if opts["dcgm_diag"] else None
        self.kernel = KernelLogFollower(Path(opts["kernel_log"])) if opts["kernel_log"] else None
        self._diag_seen: tuple[int, int, int] | None = None     # (inode, mtime_ns, size) of the diag parsed
        self._diag_families: list = []

    def update(self) -> Sample:
        families: list = []
        error: Exception | None = None
        if self.kernel is not None:
            try:
                self.kernel.poll()
            except FileNotFoundError:
                pass                                   # not there (yet): the counts stay as they are
            except (OSError, ValueError) as exc:
                error = _naming(exc, self.kernel.path)
            families += self.kernel.families()
        if self.diag_path is not None:
            try:
                families += self._diag()
            except (OSError, ValueError) as exc:
                error = error or exc
        if error is not None:
            raise error          # after both sources were read: the kernel log's offset has moved on
        return Sample(families)

    def _diag(self) -> list:
        try:
            st = os.stat(self.diag_path)
        except FileNotFoundError:
            self._diag_seen, self._diag_families = None, []
            return []
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen != self._diag_seen:
            self._diag_seen, self._diag_families = None, []
            try:
                document = safe_read.read_json(self.diag_path, DIAG_BYTES, "dcgmi diag -j file")
                events = health_reports.dcgm_diag(document)
            except (OSError, ValueError) as exc:
                raise _naming(exc, self.diag_path) from None
            self._diag_families = diag_families(events, document, st.st_mtime)
            self._diag_seen = seen
        return self._diag_families


def _naming(exc: Exception, path: Path) -> Exception:
    """`exc` as one line that names `path` (a JSON or format error does not)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if str(path) in text:
        return exc
    if isinstance(exc, json.JSONDecodeError):
        return ValueError(f"{path}: not JSON: {exc.msg} (line {exc.lineno})")
    return ValueError(f"{path}: {text}")
