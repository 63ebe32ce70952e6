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
logs/**/*.log, which covers torchrun's per-rank log directories under RUN/logs); `rescan_seconds`: how
often the globs are walked again for new directories (default 30; files already followed are read every
update).
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import time
from pathlib import Path

from prometheus_client.core import Metric

from ..collector import Collector, Sample, register
from trainguard import rundir
from trainguard.metrics.families import LabelCache, Spec
from ..procfs import RankPids, process_start, read_environ
from ..tail import Follower
from .options import options

# Kinds, first match wins. PyTorch repeats a failure's message in the exception it raises and again in
# `what():` when the process dies, so each pattern matches the one line that reports the event: the glog
# line of ProcessGroupNCCL.cpp for the watchdog, the Python exception line for an NCCL error.
EVENT_KINDS = (
    ("watchdog_timeout", re.compile(rb"\.cpp:\d+\] (?:\[[^\]]*\] )?Watchdog caught collective operation timeout")),
    ("watchdog_stuck", re.compile(rb"\.cpp:\d+\] (?:\[[^\]]*\] )?ProcessGroupNCCL's watchdog got stuck for")),
    ("error", re.compile(rb"^(?:\[[^\]]*\]:)?\s*(?:torch\.distributed\.)?DistBackendError: ")),
    # NCCL 2.21 and later name the calling function first (ncclCommInitRank, from 2.23 also
    # ncclCommInitRankConfig, ncclCommSplit ...): "NCCL INFO ncclCommInitRank comm 0x... - Init COMPLETE".
    ("abort", re.compile(rb"NCCL INFO (?:nccl\w+ )?comm 0x[0-9a-f]+ .*- Abort COMPLETE")),
    ("init", re.compile(rb"NCCL INFO (?:nccl\w+ )?comm 0x[0-9a-f]+ .*- Init COMPLETE")),
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
DEFAULT_LOGS = [f"{rundir.LOGS_DIR}/**/*.log"]
# The globs walk the whole log tree (torchrun adds a directory per restart attempt and rank), so new
# directories are looked for this often, not every update. A follower found late reads its files from the
# start: nothing is lost, a new rank's first lines are only counted up to this much later.
RESCAN_SECONDS = 30.0


def classify(line: bytes) -> str | None:
    for kind, pattern in EVENT_KINDS:
        if pattern.search(line):
            return kind
    return None


class LogSet:
    """Followers for every directory the globs reach: one Follower per (directory, file glob), as it keys files
    by name (torchrun writes a stderr.log per rank directory). Globs that overlap would count a line twice.

    `own_directories` (optional) returns the directories this node's ranks write into, or None: then every
    directory the globs reach is followed. On a run directory other nodes share, RUN/logs holds a
    directory per node's launcher, none naming its host: walking and following them all cost 264 ms a
    poll at 1,000 nodes and counted every node's NCCL lines as this node's (docs/scale.md)."""

    def __init__(self, patterns: list[str], rescan_seconds: float = RESCAN_SECONDS, clock=time.monotonic,
                 own_directories=None):
        self.patterns = [(os.path.dirname(p) or ".", os.path.basename(p)) for p in patterns]
        self.followers: dict[tuple[str, str], Follower] = {}
        self.rescan_seconds, self.clock = rescan_seconds, clock
        self.own_directories = own_directories
        self.refresh(start_at_end=True)

    def refresh(self, start_at_end: bool = False) -> None:
        self._scanned_at = self.clock()
        own = None if self.own_directories is None else self.own_directories()
        if own is not None:     # shared: what was followed before the other nodes registered is let go
            self.followers = {key: f for key, f in self.followers.items() if os.path.realpath(key[0]) in own}
        for directory_glob, name_glob in self.patterns:
            if own is None:
                found = glob.glob(directory_glob, recursive=True)
            else:               # /proc names real paths; fnmatch's * also spans '/', as ** does
                pattern = os.path.realpath(directory_glob)
                found = [d for d in own if fnmatch.fnmatchcase(d, pattern)]
            for directory in sorted(found):
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
        if self.clock() - self._scanned_at >= self.rescan_seconds:
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
        opts = options(ctx.options, self.name, logs=list(DEFAULT_LOGS), rescan_seconds=RESCAN_SECONDS)
        # relative globs are under the run directory; without one, only absolute globs are followed
        patterns = [p if os.path.isabs(p) else str(Path(ctx.run_dir) / p) for p in opts["logs"]
                    if os.path.isabs(p) or ctx.run_dir is not None]
        self.counts = dict.fromkeys(KINDS, 0)
        self.rank_pids = RankPids(ctx.run_dir, ctx.node)
        self.outputs = RankOutputs(ctx.procfs, self.rank_pids)
        self.logs = LogSet(patterns, float(opts["rescan_seconds"]), own_directories=self.outputs)
        self.environments = RankEnvironments(ctx.procfs)

    def update(self) -> Sample:
        if self.outputs.changed():
            self.logs.refresh()       # a rank restarted: its new attempt's directory, before it can fail
        for line in self.logs.lines():
            kind = classify(line)
            if kind is not None:
                self.counts[kind] += 1
        families = [EVENTS.family((_KIND_LABELS[kind], count) for kind, count in self.counts.items()),
                    LOG_FILES.value(self.logs.files), *self._environment_families()]
        return Sample(families=families, tls={"system": {"nccl_events": dict(self.counts)}})

    def _environment_families(self) -> list[Metric]:
        """trainguard_nccl_env_info per rank whose environment was read, and how many could not be; [] without ranks."""
        ranks = self.rank_pids.get()
        self.environments.keep(ranks.values())
        if not ranks:
            return []
        environments = [(rank, self.environments.get(pid)) for rank, pid in ranks.items()]
        info = ENV_INFO.family((_ENV_LABELS.get(str(rank), *values), 1) for rank, values in environments
                               if values is not None)
        unreadable = sum(values is None for _, values in environments)
        return [f for f in (info, ENV_UNREADABLE.value(unreadable)) if f.samples]


EVENTS = Spec("counter", "trainguard_nccl_events_total", "NCCL and PyTorch process-group events in the trainer's "
              "logs, by kind.", ["kind"])
_KIND_LABELS = {kind: EVENTS.labels(kind) for kind in KINDS}
LOG_FILES = Spec("gauge", "trainguard_nccl_log_files", "Log files the nccl collector follows.")
ENV_INFO = Spec("gauge", "trainguard_nccl_env_info", "NCCL/torch error-handling environment of each rank (empty: "
                "not set), from /proc/<pid>/environ.", ["rank", *(v.lower() for v in ENV_VARS)])
ENV_UNREADABLE = Spec("gauge", "trainguard_nccl_env_unreadable_ranks", "Ranks listed in RUN/control/ranks whose "
                      "environment could not be read (gone, or another user's).")
_ENV_LABELS = LabelCache(ENV_INFO.label_names)


class RankOutputs:
    """The directories this node's ranks write their output into, on a run directory shared with other nodes.

    A rank started by torchrun with --log-dir writes its stdout and stderr straight into its files
    (<log dir>/<run id>_<random>/attempt_<n>/<local rank>/), so /proc/<pid>/fd/1 and 2 name them. A
    directory seen once is kept (a rank that died is read to its end), so this grows with this node's
    restarts only. None (follow every directory the globs reach) while no other host registered a rank:
    a run on one machine, or nodes sharing one host name, read everything as they always did.
    """

    def __init__(self, procfs: Path, rank_pids: RankPids):
        self.procfs, self.rank_pids = procfs, rank_pids
        self.seen: set[str] = set()
        self._pids: dict | None = None       # the RankPids mapping last looked at

    def changed(self) -> bool:
        """This node's ranks are other processes than at the last call (a restart)."""
        pids = self.rank_pids.get()
        changed, self._pids = pids is not self._pids and self._pids is not None, pids
        return changed and self.rank_pids.shared()

    def __call__(self) -> set[str] | None:
        pids = self.rank_pids.get()
        if not self.rank_pids.shared():
            return None
        self.seen |= output_directories(self.procfs, pids.values())
        return self.seen


def output_directories(procfs: Path, pids) -> set[str]:
    """The directories the processes `pids` write their stdout and stderr into (/proc/<pid>/fd/1 and 2,
    when they name files); a process gone, or another user's, names none."""
    found = set()
    for pid in pids:
        for fd in (1, 2):
            try:
                target = os.readlink(procfs / str(pid) / "fd" / str(fd))
            except OSError:
                continue
            if os.path.isabs(target) and os.path.isfile(target):
                found.add(os.path.dirname(target))
    return found


class RankEnvironments:
    """The ENV_VARS of each rank's process (label values), read from /proc/<pid>/environ once per process.

    environ is the block a process was started with, so it is read again only for another process behind
    the pid: another start time in /proc/<pid>/stat (the kernel gave the pid to someone else). Where there is
    no start time to tell (a procfs fixture without <pid>/stat), it is read every time.
    """

    def __init__(self, procfs: Path):
        self.procfs = procfs
        self._known: dict[int, tuple[int, tuple[str, ...]]] = {}    # pid -> (start time, values)

    def get(self, pid: int) -> tuple[str, ...] | None:
        """The values of ENV_VARS ("" when unset, cut to MAX_LABEL_CHARS), or None when unreadable."""
        start = process_start(self.procfs, pid)
        known = self._known.get(pid)
        if start is not None and known is not None and known[0] == start:
            return known[1]
        env = read_environ(self.procfs, pid)
        if env is None:
            self._known.pop(pid, None)
            return None
        values = tuple(env.get(name, "")[:MAX_LABEL_CHARS] for name in ENV_VARS)
        if start is not None:
            self._known[pid] = (start, values)
        return values

    def keep(self, pids) -> None:
        """Forget the processes that are no rank any more."""
        for pid in set(self._known) - set(pids):
            del self._known[pid]
