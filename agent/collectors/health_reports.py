"""health_reports: the health verdicts other tools leave on the node, for Prometheus and for the node's
timeline: the last `dcgmi diag -j` result, NCCL's RAS client output and the kernel log's NVRM lines, read with
the parsers of trainguard/health_reports.py and trainguard/nccl_ras.py.

Off unless configured (`default_enabled = False`), and it reads only the paths its options name:

    collectors:
      health_reports:
        enabled: true
        dcgm_diag: /var/lib/dcgm/diag.json       # what `dcgmi diag -r 2 -j > ...` wrote (any DCGM 1.x-4.x shape)
        kernel_log: /var/log/kern.log            # a kernel log the node keeps or an export (dmesg, journalctl -k)
        nccl_ras: /var/lib/nccl/ras.txt          # what `ncclras -v > ...` (or `ncclras -f json`) saved
        nccl_ras_monitor: /var/log/nccl-ras.log  # what `ncclras -m >> ...` keeps appending (NCCL 2.29+)
        addresses: []                            # this node's IPs as RAS names them (default: from procfs)

Enabled with none of the four paths set it is disabled (CollectorDisabled, one line). A file that is not there
yet gives none of its series and no error; a file that is not what it claims fails the update with one line
naming the file (the runner's failure count), and touches no other collector. A report written in the last
WRITING_SECONDS that is cut off or does not parse is read again next update instead (`ncclras` streams).

New findings become `health_check` events on the node's timeline (the node log writes them; agent/
health_timeline.py keeps them once each across restarts, bounded, and says whose they are): a new
diag document's failed and warned results and its summary, each new RAS finding and a changed RAS summary, each
NVRM line added to the kernel log, and each PEER_* trouble line added to the RAS monitor log, after the agent
first saw the file (its history is not replayed; both logs are followed like the kernel log below). The
counts the node-risk rule reads ride in the fragment's `system` section (health_diag_isolate,
health_diag_failures, health_ras_not_responding): cumulative, and kept across restarts.

A line or finding that names another host (a forwarded syslog line, a RAS rank on another node) keeps its `host`,
is marked `this_node: false` and counts for nothing here (neither in the node-risk counts nor in the kernel
series).

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
    trainguard_health_nccl_ras_result{result}               1 for the last RAS report's worst result (pass|warn|fail)
    trainguard_health_nccl_ras_findings{test}               findings of the last RAS report, by kind
    trainguard_health_nccl_ras_timestamp_seconds            when the RAS report was written (its mtime)
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from trainguard import health_reports, log, nccl_ras, rundir, safe_read, xid_catalog
from trainguard.agent import health_timeline as timeline
from trainguard.agent.collector import Collector, CollectorDisabled, Context, Sample, register
from trainguard.agent.collectors.options import options

DIAG_BYTES = 16 * 1024 * 1024      # a dcgmi diag -j of 8 GPUs is ~30 KB
RAS_BYTES = 16 * 1024 * 1024       # ncclras -v of a 1,000-node job with every rank listed is a few MB
READ_BYTES = 16 * 1024 * 1024      # of the kernel log per update; the rest is read by the next updates
MAX_TESTS = 64                     # DCGM 4.x has ~15 tests: a document with more names is cut, not exported whole
RESULTS = (health_reports.PASS, health_reports.WARN, health_reports.FAIL)
TEST_RESULTS = RESULTS + (health_reports.SKIP,)
# A report written this recently that is cut off or does not parse may still be being written (`ncclras > file`
# writes the job summary first and the communicators seconds later): read again next update, not an error yet.
WRITING_SECONDS = 30.0
RAS_TESTS = ("process_missing", "process_dead", "ranks_missing", "rank_errors", "mismatch", "timeout")
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


def ras_families(events: list[dict], mtime: float) -> list:
    """The families of one NCCL RAS report (its events from nccl_ras.events, the summary last)."""
    result = GaugeMetricFamily("trainguard_health_nccl_ras_result", "1 for the worst result of the last NCCL RAS "
                               "report on this node (pass, warn or fail), 0 for the others.", labels=["result"])
    for name in RESULTS:
        result.add_metric([name], 1 if events[-1]["status"] == name else 0)
    by_test = Counter(str(e.get("test")) for e in events[:-1])
    findings = GaugeMetricFamily("trainguard_health_nccl_ras_findings", "Findings of the last NCCL RAS report, by "
                                 "kind (ranks or processes not responding, dead, rank errors, mismatches, "
                                 "timeouts).", labels=["test"])
    for test in RAS_TESTS:
        findings.add_metric([test], by_test.get(test, 0))
    when = GaugeMetricFamily("trainguard_health_nccl_ras_timestamp_seconds", "When the last NCCL RAS report was "
                             "written (its file's mtime, Unix time).", value=mtime)
    return [result, findings, when]


class LogFollower:
    """A log file read incrementally, like `tail -F` (inode and offset kept; see the module doc): each poll's
    complete new lines through `parse` (lines in, events with their 1-based `line` out), as (offset of the
    line in the file, event)."""

    def __init__(self, path: Path, parse: Callable[[Iterable[str]], list[dict]], what: str):
        self.path, self.parse, self.what = path, parse, what
        self.inode: tuple[int, int] | None = None    # (st_dev, st_ino) of the file read
        self.offset = 0
        self.size = 0                                 # the file's size at the last poll

    def poll(self) -> list[tuple[int, dict]]:
        """The complete lines added since the last poll as (offset of the line, event); FileNotFoundError when
        there is no file."""
        fd, st = safe_read.open_fd(self.path, what=self.what)
        try:
            if self.inode != (st.st_dev, st.st_ino) or st.st_size < self.offset:
                self.inode, self.offset = (st.st_dev, st.st_ino), 0      # new file, or truncated: from the top
            self.size = st.st_size
            if st.st_size == self.offset:
                return []
            os.lseek(fd, self.offset, os.SEEK_SET)
            data = _read_some(fd)
        finally:
            os.close(fd)
        end = data.rfind(b"\n") + 1
        if end == 0:
            if len(data) >= READ_BYTES:            # one line longer than a whole read: pass over it
                self.offset += len(data)
            return []
        start, self.offset = self.offset, self.offset + end
        lines = data[:end].split(b"\n")[:-1]
        starts = [start]
        for line in lines[:-1]:
            starts.append(starts[-1] + len(line) + 1)
        found = [(starts[event["line"] - 1], event)
                 for event in self.parse(line.decode("utf-8", "replace") for line in lines)]
        for _, event in found:
            self.count(event)
        return found

    def count(self, event: dict) -> None:
        """What a subclass keeps of each event (for /metrics)."""


class KernelLogFollower(LogFollower):
    """The kernel log's NVRM lines: counts for /metrics from the file's top (this node's lines only)."""

    def __init__(self, path: Path, owns: Callable[[str | None], bool] = lambda host: True):
        super().__init__(path, health_reports.kernel_log, "kernel log")
        self.owns = owns                              # a line naming another host counts for nothing here
        self.xids: Counter = Counter()                # xid code -> lines seen
        self.fallen = 0

    def count(self, event: dict) -> None:
        if not self.owns(event.get("host")):
            return
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
        opts = options(ctx.options, self.name, dcgm_diag="", kernel_log="", nccl_ras="", nccl_ras_monitor="",
                       addresses=[])
        if not any(opts[key] for key in ("dcgm_diag", "kernel_log", "nccl_ras", "nccl_ras_monitor")):
            raise CollectorDisabled("health_reports: none of collectors.health_reports.dcgm_diag, .kernel_log, "
                                    ".nccl_ras, .nccl_ras_monitor is set")
        self.this_node = timeline.ThisNode(ctx.node, opts["addresses"] or timeline.local_addresses(ctx.procfs))
        self.diag = WatchedReport(Path(opts["dcgm_diag"]), DIAG_BYTES) if opts["dcgm_diag"] else None
        self.ras = WatchedReport(Path(opts["nccl_ras"]), RAS_BYTES) if opts["nccl_ras"] else None
        self.kernel = KernelLogFollower(Path(opts["kernel_log"]), self.this_node.owns) if opts["kernel_log"] else None
        self.monitor = (LogFollower(Path(opts["nccl_ras_monitor"]), nccl_ras.monitor_events, "NCCL RAS monitor log")
                        if opts["nccl_ras_monitor"] else None)
        self.state = timeline.HealthState(rundir.health_state_path(ctx.run_dir, ctx.node) if ctx.run_dir else None)
        self.outbox = timeline.Outbox(ctx.node)
        if self.state.load_error:
            log.get("agent.collector", collector=self.name).warning(
                "health findings state unreadable: starting again (findings may be put on the timeline twice, "
                "the node-risk counts restart at 0)", error=self.state.load_error)

    def update(self) -> Sample:
        now = time.time()
        families: list = []
        errors: list[Exception] = []
        self.outbox.start_update()
        for key, follower in (("kernel_log", self.kernel), ("nccl_ras_monitor", self.monitor)):
            if follower is None:
                continue
            try:
                self._followed_events(key, follower, follower.poll(), now)
            except FileNotFoundError:
                pass                                   # not there (yet): the counts stay as they are
            except (OSError, ValueError) as exc:
                errors.append(_naming(exc, follower.path))
        if self.kernel is not None:
            families += self.kernel.families()
        for report, read in ((self.diag, self._read_diag), (self.ras, self._read_ras)):
            if report is not None:
                try:
                    families += report.families(read, now)
                except (OSError, ValueError) as exc:
                    errors.append(_naming(exc, report.path))
        self.outbox.finish_update(now)
        self.state.save()
        if errors:
            raise errors[0]      # after every source was read: the kernel log's offset has moved on
        return Sample(families, tls={"system": dict(self.state.counts), "events": self.outbox.fragment()})

    def _followed_events(self, key: str, follower: LogFollower, found: list[tuple[int, dict]], now: float) -> None:
        """A followed log's new lines onto the timeline: past the offset the state says events were made up to
        (the first time the agent sees a file, its lines so far are history, not news)."""
        if follower.inode is None:
            return                                     # no file read yet
        dev, ino = follower.inode
        known = self.state.offsets.get(key)
        if known is None:
            since = follower.size                      # never seen: from the end the file has now
        elif (known["dev"], known["ino"]) == (dev, ino) and known["offset"] <= follower.size:
            since = known["offset"]
        else:
            since = 0                                  # replaced or truncated since: its lines are new
        for offset, event in found:
            if offset < since:
                continue
            event = {**{k: v for k, v in event.items() if k != "line"}, "offset": offset}
            ident = timeline.digest(key, dev, ino, offset)
            if follower is self.kernel:                # a forwarded line is labelled with its own host
                host = event.get("host")
                self.outbox.add({**event, "this_node": False} if not self.this_node.owns(host) else event, ident,
                                now)
            else:
                self._ras_finding(event, ident, now)
        self.state.set_offset(key, dev, ino, max(since, follower.offset))

    def _read_diag(self, data: bytes, mtime: float, now: float) -> list:
        document = _json(data)
        events = health_reports.dcgm_diag(document)
        report_id = "diag:" + hashlib.sha256(data).hexdigest()[:16]
        if self.state.is_new(report_id):
            self.state.remember(report_id)
            for index, event in enumerate(events):
                if event["status"] == health_reports.FAIL and event.get("test") != "summary":
                    drain = event.get("action_class") == xid_catalog.DRAIN
                    self.state.count(timeline.DIAG_ISOLATE if drain else timeline.DIAG_FAILURES)
                extra = {"written_at": mtime} if event.get("test") == "summary" else {}
                self.outbox.add({**event, **extra}, timeline.digest(report_id, index), now)
        return diag_families(events, document, mtime)

    def _read_ras(self, data: bytes, mtime: float, now: float) -> list:
        report = nccl_ras.parse(data)
        if not report.complete and now - mtime < WRITING_SECONDS:
            raise StillWriting()
        events = nccl_ras.events(report)
        for event in events[:-1]:
            finding = "ras:" + timeline.digest(event.get("test"), event.get("comm_hash"), event.get("count"),
                                               event.get("ranks"))
            if self.state.is_new(finding):
                self.state.remember(finding)
                self._ras_finding(event, finding[4:], now)
        summary = events[-1]
        key = timeline.digest(summary["status"], summary.get("findings"), summary.get("complete", True))
        if key != self.state.ras_summary:
            self.state.set_ras_summary(key)
            self.outbox.add({**summary, "written_at": mtime}, timeline.digest("ras summary", data), now)
        return ras_families(events, mtime)

    def _ras_finding(self, event: dict, ident: str, now: float) -> None:
        """A RAS finding (a report's or a monitor line's) onto this node's timeline: RAS speaks for the whole job,
        and its IPs do not say which host name's log a finding about another node belongs in, so it stays here,
        marked `this_node`; only this node's ranks not answering are counted for the node-risk rule."""
        hosts = event.get("hosts") or []
        mine = any(self.this_node.owns(h) for h in hosts)
        if mine and nccl_ras.not_responding(event):
            self.state.count(timeline.RAS_NOT_RESPONDING)
        self.outbox.add({**event, "this_node": mine} if hosts else event, ident, now)


class StillWriting(Exception):
    """A report cut off or unreadable that was written moments ago: read it again at the next update."""


class WatchedReport:
    """A report file parsed again only when it changes (inode, mtime, size); its families kept till then. A file
    modified within WRITING_SECONDS that is cut off or does not parse is taken as still being written: the
    previous families stay and it is read again next update; after that it is an error naming the file."""

    def __init__(self, path: Path, limit: int):
        self.path, self.limit = path, limit
        self.seen: tuple[int, int, int] | None = None
        self.cached: list = []

    def families(self, read: Callable[[bytes, float, float], list], now: float) -> list:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self.seen, self.cached = None, []
            return []
        if (st.st_ino, st.st_mtime_ns, st.st_size) != self.seen:
            data = safe_read.read_bytes(self.path, self.limit, "health report")
            try:
                self.cached = read(data, st.st_mtime, now)
            except StillWriting:
                return self.cached
            except ValueError:
                if now - st.st_mtime < WRITING_SECONDS:
                    return self.cached
                self.seen, self.cached = None, []
                raise
            self.seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        return self.cached


def _json(data: bytes):
    try:
        return json.loads(data)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc.msg} (line {exc.lineno})") from None
    except RecursionError:
        raise ValueError("not JSON this reader accepts: nested too deeply") from None


def _naming(exc: Exception, path: Path) -> Exception:
    """`exc` as one line that names `path` (a JSON or format error does not)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if str(path) in text:
        return exc
    if isinstance(exc, json.JSONDecodeError):
        return ValueError(f"{path}: not JSON: {exc.msg} (line {exc.lineno})")
    return ValueError(f"{path}: {text}")
