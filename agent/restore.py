"""The `restore` action's hands: find this node's trainer ranks and end them.

Each rank describes itself in ``RUN/control/ranks/rank-<r>.json`` (pid, host, started_at; written by
trainer/control.py). Ending the ranks is all the agent does: torch's elastic launcher (torchrun, started
by ``trainguard train --nproc K --max-restarts R``) sees its workers fail, starts them again, and they
resume from the newest verified checkpoint.

Only processes that are provably the ranks that were running when the trouble began are signalled:
- on this host (`host` in the rank file);
- started before the alert began (`started_before`), so a rank the launcher has already restarted is
  never ended by a late or repeated alert;
- the pid still belongs to that rank: the process was created no later than the rank file says it
  started (a reused pid belongs to a younger process).

SIGKILL by default. A rank hung inside a collective never returns to the interpreter, so it cannot run
a SIGTERM handler, and a signalled rank that lingers while the launcher already starts the next attempt
can break that attempt's rendezvous (seen here with gloo: the new ranks fail to connect, or hang).
Nothing is lost: every TLS record is on disk as it is written, and the ranks resume from the latest
verified checkpoint. With a grace period (``webhook.restore_grace_seconds``), SIGTERM first and SIGKILL
after it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from trainguard import log as tglog

CREATE_TIME_SLACK = 1.0     # seconds between process creation and the rank file, rounding included


@dataclass(frozen=True)
class RankInfo:
    rank: int
    pid: int
    host: str
    started_at: float
    path: Path


def read_ranks(run_dir: str | Path) -> tuple[list[RankInfo], list[str]]:
    """Every readable rank file, and a message for each unreadable one (file and field named)."""
    found, problems = [], []
    for path in sorted((Path(run_dir) / "control" / "ranks").glob("rank-*.json")):
        try:
            data = json.loads(path.read_text())
            found.append(RankInfo(int(data["rank"]), int(data["pid"]), str(data["host"]),
                                  float(data["started_at"]), path))
        except FileNotFoundError:
            continue    # replaced between the listing and the read: the launcher is restarting it
        except (ValueError, KeyError, TypeError) as exc:
            problems.append(f"{path}: {type(exc).__name__}: {exc}")
    return found, problems


class RankFiles:
    """`read_ranks`, read again only when RUN/control/ranks changes (collectors and the watchdog ask often).

    A rank replaces its file atomically (trainer/control.py), which changes the directory's mtime. Two
    changes within the filesystem's timestamp granularity could share one mtime, so a directory changed
    less than RACY_SECONDS before it was read is read again next time (git's "racily clean" rule).
    `read()` returns the same list object until the files change: read it, do not change it.
    """

    RACY_SECONDS = 2.0

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self._directory = str(self.run_dir / "control" / "ranks")
        self._version: tuple[int, int] | None = None     # (inode, mtime_ns) of the directory when read
        self._infos: list[RankInfo] = []

    def read(self) -> list[RankInfo]:
        try:
            st = os.stat(self._directory)
        except OSError:
            self._version, self._infos = None, []
            return self._infos
        version = (st.st_ino, st.st_mtime_ns)
        if version != self._version:
            self._infos, _ = read_ranks(self.run_dir)
            settled = time.time() - st.st_mtime > self.RACY_SECONDS
            self._version = version if settled else None
        return self._infos


def live_process(info: RankInfo) -> psutil.Process | None:
    """The rank's process if it is still the one the rank file describes, else None."""
    try:
        process = psutil.Process(info.pid)
        if process.create_time() > info.started_at + CREATE_TIME_SLACK:
            return None    # the pid was reused by a younger process
        return process
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def local_ranks(infos: list[RankInfo], host: str) -> list[tuple[RankInfo, psutil.Process]]:
    """This host's ranks (of the rank files `infos`) whose processes are alive."""
    return [(info, process) for info in infos if info.host == host
            for process in [live_process(info)] if process is not None]


def end_local_ranks(run_dir: str | Path, host: str, started_before: float | None = None,
                    grace_seconds: float = 0.0) -> dict:
    """End this host's ranks that started before `started_before`: SIGKILL, or SIGTERM and SIGKILL after a grace."""
    log = tglog.get("agent.restore", host=host)
    infos, problems = read_ranks(run_dir)
    ended, skipped = [], []
    victims: list[psutil.Process] = []
    for info in infos:
        why = _reason_to_spare(info, host, started_before)
        process = None if why else live_process(info)
        if why is None and process is None:
            why = "not running"
        if why:
            skipped.append({"rank": info.rank, "pid": info.pid, "why": why})
            continue
        try:
            process.kill() if grace_seconds <= 0 else process.terminate()
        except psutil.NoSuchProcess:
            skipped.append({"rank": info.rank, "pid": info.pid, "why": "exited"})
            continue
        victims.append(process)
        ended.append({"rank": info.rank, "pid": info.pid})
    if victims and grace_seconds > 0:
        timer = threading.Timer(grace_seconds, _kill_survivors, (victims, log))
        timer.daemon = True
        timer.start()
    for problem in problems:
        log.warning("rank file unreadable", error=problem)
    return {"ended": ended, "skipped": skipped, **({"problems": problems} if problems else {})}


def _reason_to_spare(info: RankInfo, host: str, started_before: float | None) -> str | None:
    if info.host != host:
        return f"on host {info.host}"
    if started_before is not None and info.started_at >= started_before:
        return "started after the alert began"
    return None


def _kill_survivors(victims: list[psutil.Process], log) -> None:
    for process in victims:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                process.kill()     # psutil checks the pid still names the same process
                log.warning("rank ignored SIGTERM; killed", pid=process.pid)
        except psutil.Error:
            continue
