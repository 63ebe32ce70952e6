"""Which run this node's agent follows, when runs come and go under one root (`trainguard agent --runs-root`).

A DaemonSet lives longer than any job: each job writes its own run directory under a root every node
mounts (ROOT/<job>/tls, ROOT/<job>/control/ranks, ...). Every `interval` the agent lists the root and looks
into the run directories whose RUN/control/ranks changed since its last look (a new or restarted rank
registers there; the first look reads them all): a run is this node's when one of its registrations is a
live process here, by host name or, for a rank in a pod, by PID namespace (agent/procfs.py
`PidNamespaces`). The agent follows the newest such run; a run whose ranks here have all been gone for
`end_grace_seconds` has ended, and is dropped.

Bounded: nothing is kept per run directory under the root or per node of the cluster. What is kept is the
run followed, the time of the last look, and the names (at most MAX_OTHERS) of other runs seen with live
ranks here, for the warning: one node running ranks of two jobs at once is followed for the newest only.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from trainguard import log as tglog
from trainguard import rundir
from trainguard.agent import procfs

MAX_OTHERS = 8


@dataclass(frozen=True)
class Found:
    run_dir: Path
    started_at: float          # the newest live local rank's registration time


class Discovery:
    def __init__(self, root: Path, node: str, *, end_grace_seconds: float = 120.0, procfs_root: str = "/proc"):
        self.root, self.node = Path(root), node
        self.end_grace_seconds, self.procfs_root = end_grace_seconds, procfs_root
        self.current: Found | None = None
        self._last_look: float | None = None
        self._gone_since: float | None = None
        self._others: dict[str, float] = {}
        self._current_files: rundir.RankFiles | None = None     # the followed run's, read incrementally
        self._log = tglog.get("agent.discovery", node=node, root=str(root))

    def poll(self, now: float | None = None) -> Path | None:
        """The run directory to follow now (None: no run of this node's under the root)."""
        now = time.time() if now is None else now
        since, self._last_look = self._last_look, now
        found = self._look(since)
        if self.current is not None:
            if self._has_live_ranks(self.current.run_dir):
                self._gone_since = None
            else:
                self._gone_since = self._gone_since or now
                if now - self._gone_since >= self.end_grace_seconds:
                    self._log.info("run ended: no rank of it alive here", run_dir=str(self.current.run_dir),
                                   for_seconds=round(now - self._gone_since, 1))
                    self.current, self._gone_since = None, None
        for candidate in found:
            if self.current is None or (candidate.run_dir != self.current.run_dir and self._gone_since is not None):
                if self.current is None or candidate.started_at > self.current.started_at:
                    self.current, self._gone_since = candidate, None
                    self._log.info("following run", run_dir=str(candidate.run_dir))
            elif candidate.run_dir != self.current.run_dir and str(candidate.run_dir) not in self._others:
                if len(self._others) < MAX_OTHERS:
                    self._others[str(candidate.run_dir)] = now
                self._log.error("this node runs ranks of another run too; the agent follows one run per node "
                                "(the first found) and not this one", run_dir=str(candidate.run_dir),
                                following=str(self.current.run_dir))
        return self.current.run_dir if self.current else None

    def status(self) -> dict:
        return {"root": str(self.root), "following": str(self.current.run_dir) if self.current else None,
                "not_followed": sorted(self._others)}

    def _look(self, since: float | None) -> list[Found]:
        """The run directories whose ranks changed since `since` (all at the first look) with live ranks here."""
        found = []
        try:
            scan = os.scandir(self.root)
        except OSError as exc:
            self._log.error("cannot list the runs root", error=exc.strerror or str(exc))
            return found
        with scan:
            for entry in scan:
                if entry.name.startswith(".") or not entry.is_dir():
                    continue
                try:
                    changed = os.stat(rundir.ranks_dir(entry.path)).st_mtime
                except OSError:
                    continue           # no registration yet
                if since is not None and changed < since - rundir.RankFiles.RACY_SECONDS:
                    continue
                newest = self._newest_live_rank(Path(entry.path))
                if newest is not None:
                    found.append(Found(Path(entry.path), newest))
        return sorted(found, key=lambda f: f.started_at)

    def _local_ranks(self, run_dir: Path) -> list[rundir.RankInfo]:
        matcher = procfs.PidNamespaces(run_dir, self.node, procfs=self.procfs_root)
        return rundir.RankFiles(run_dir, {self.node, socket.gethostname()}, adopt=matcher.adopt).read()

    def _newest_live_rank(self, run_dir: Path) -> float | None:
        live = [info.started_at for info in self._local_ranks(run_dir) if _alive(info)]
        return max(live, default=None)

    def _has_live_ranks(self, run_dir: Path) -> bool:
        if self._current_files is None or self._current_files.run_dir != run_dir:
            matcher = procfs.pid_namespaces(run_dir, self.node)
            self._current_files = rundir.RankFiles(run_dir, {self.node, socket.gethostname()}, adopt=matcher.adopt)
        return any(_alive(info) for info in self._current_files.read())


def _alive(info: rundir.RankInfo) -> bool:
    """The registered process runs (the same one: its start time is the registered one, when there is one)."""
    try:
        process = psutil.Process(info.pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return info.create_time is None or abs(process.create_time() - procfs.registered_start(
            info.create_time, info.boot_time, psutil.boot_time())) <= 0.05
    except psutil.Error:
        return False
