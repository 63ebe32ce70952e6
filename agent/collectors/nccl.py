"""NCCL health from the trainer's logs, and the NCCL/torch error-handling environment of its ranks.

Communication failures show in the ranks' stderr long before a step's time shows them: NCCL WARN lines,
communicators being initialised (again, after a restart) or aborted, and PyTorch's watchdog giving up on a
collective. The collector follows the log files (agent/tail.py: rotation, truncation, bounded reads) and counts
those lines by kind in trainguard_nccl_events_total{kind}. Files that exist when the agent starts are followed
from their end, so an agent restart does not count old lines again; files that appear later are read whole.

Whether a hang ends as an error at all depends on the ranks' environment (TORCH_NCCL_ASYNC_ERROR_HANDLING,
TORCH_NCCL_BLOCKING_WAIT, ...), read from /proc/<pid>/environ of the rank pids in RUN/control/ranks/ and
exported as trainguard_nccl_env_info, one series per rank, so an alert can catch ranks or nodes that differ.

Options (collectors.nccl.*): `logs`: globs, relative to the run directory unless absolute (default
logs/**/*.log, which covers torchrun's per-rank log directories under RUN/logs).
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..collector import Collector, Sample, register
from ..procfs import read_environ, read_rank_pids
from ..tail import Follower
from .options import options

# Kinds, first match wins. PyTorch repeats a failure's message in the exception it raises and again in
# `what():` when the process dies, so each pattern matches the one line that reports the event: the glog
# line of ProcessGroupNCCL.cpp for the watchdog, the Python exception line for an NCCL error.
EVENT_KINDS = (
    ("watchdog_timeout", re.compile(rb"\.cpp:\d+\] (?:\[[^\]]*\] )?Watchdog caught collective operation timeout")),
    ("watchdog_stuck", re.compile(rb"\.cpp:\d+\] (?:\[[^\]]*\] )?ProcessGroupNCCL's watchdog got stuck for")),
    ("error", re.compile(rb"^(?:\[[^\]]*\]:)?\s*(?:torch\.distributed\.)?DistBackendError: ")),
    ("abort", re.compile(rb"NCCL INFO comm 0x[0-9a-f]+ .*- Abort COMPLETE")),
    ("init", re.compile(rb"NCCL INFO comm 0x[0-9a-f]+ .*- Init COMPLETE")),
    ("warn", re.compile(rb" NCCL WARN ")),
)
KINDS = tuple(kind for kind, _ in EVENT_KINDS)

# The environment that decides how NCCL failures surface (and over which network); label = lower-cased name.
ENV_VARS = (
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT",
    "NCCL_BLOCKING_WAIT", "TORCH_NCCL_ENABLE_MONITORING", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC",
    "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT",
)
MAX_LABEL_CHARS = 64          # an environment value is the user's: keep the label bounded
DEFAULT_LOGS = ["logs/**/*.log"]


def classify(line: bytes) -> str | None:
    for kind, pattern in EVENT_KINDS:
        if pattern.search(line):
            return kind
    return None


class LogSet:
    """Followers for every directory the globs reach: one Follower per (directory, file glob), as it keys files
    by name (torchrun writes a stderr.log per rank directory). Globs that overlap would count a line twice."""

    def __init__(self, patterns: list[str]):
        self.patterns = [(os.path.dirname(p) or ".", os.path.basename(p)) for p in patterns]
        self.followers: dict[tuple[str, str], Follower] = {}
        self.refresh(start_at_end=True)

    def refresh(self, start_at_end: bool = False) -> None:
        for directory_glob, name_glob in self.patterns:
            for directory in sorted(glob.glob(directory_glob, recursive=True)):
                key = (os.path.normpath(directory), name_glob)
                if key in self.followers or not os.path.isdir(directory):
                    continue
                # bounded: at most 1 MiB per file per update, lines cut at 64 KiB
                follower = Follower(directory, name_glob, max_read_bytes=1 << 20, max_line_bytes=64 << 10)
                if start_at_end:
                    follower.restore(_positions_at_end(Path(directory), name_glob))
                self.followers[key] = follower

    @property
    def files(self) -> int:
        return sum(len(f.positions) for f in self.followers.values())

    def lines(self):
        self.refresh()
        for follower in self.followers.values():
            for chunk in follower.poll():
                yield chunk.data


def _positions_at_end(directory: Path, name_glob: str) -> dict:
    state = {}
    for path in directory.glob(name_glob):
        try:
            st = path.stat()
        except OSError:
            continue
        if path.is_file():
            state[path.name] = {"inode": st.st_ino, "device": st.st_dev, "offset": st.st_size}
    return state


@register
class NCCLCollector(Collector):
    name = "nccl"
    interval = 5.0
    timeout = 10.0

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        opts = options(ctx.options, self.name, logs=list(DEFAULT_LOGS))
        # relative globs are under the run directory; without one, only absolute globs are followed
        patterns = [p if os.path.isabs(p) else str(Path(ctx.run_dir) / p) for p in opts["logs"]
                    if os.path.isabs(p) or ctx.run_dir is not None]
        self.logs = LogSet(patterns)
        self.counts = dict.fromkeys(KINDS, 0)

    def update(self) -> Sample:
        for line in self.logs.lines():
            kind = classify(line)
            if kind is not None:
                self.counts[kind] += 1
        events = CounterMetricFamily("trainguard_nccl_events_total", "NCCL and PyTorch process-group events in the "
                                     "trainer's logs, by kind.", labels=["kind"])
        for kind in KINDS:
            events.add_metric([kind], self.counts[kind])
        files = GaugeMetricFamily("trainguard_nccl_log_files", "Log files the nccl collector follows.",
                                  value=self.logs.files)
        families = [events, files, *self._environment()]
        return Sample(families=[f for f in families if f.samples],
                      tls={"system": {"nccl_events": dict(self.counts)}})

    def _environment(self) -> list[Metric]:
        ranks = read_rank_pids(self.ctx.run_dir, self.ctx.node)
        if not ranks:
            return []
        info = GaugeMetricFamily("trainguard_nccl_env_info", "NCCL/torch error-handling environment of each rank "
                                 "(empty: not set), from /proc/<pid>/environ.",
                                 labels=["rank", *(v.lower() for v in ENV_VARS)])
        unreadable = 0
        for rank, pid in ranks.items():
            env = read_environ(self.ctx.procfs, pid)
            if env is None:
                unreadable += 1
                continue
            info.add_metric([str(rank), *(env.get(v, "")[:MAX_LABEL_CHARS] for v in ENV_VARS)], 1)
        gauge = GaugeMetricFamily("trainguard_nccl_env_unreadable_ranks", "Ranks listed in RUN/control/ranks whose "
                                  "environment could not be read (gone, or another user's).", value=unreadable)
        return [info, gauge]
