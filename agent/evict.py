"""Keeping a node out: its cordon file, and the agent's ending of this node's launcher.

    RUN/control/cordon/<host>            {"host", "incident", "reason", "cordoned_at", "by"}
    RUN/control/launchers/<host>.json    {"host", "pid", "started_at", "min_nodes", "max_nodes"} (the launcher's)

A cordoned node's launcher refuses to join the job (trainer/launch.py) until ``trainguard uncordon RUN
HOST`` removes the file. When the culprit of a hang is on this node, the agent ends this node's launcher
(torchrun's elastic agent): its ranks die with it (they asked Linux to, trainer/train.py), the other
nodes' ranks see their peers gone and fail, and their launchers re-form the job without this node
through the elastic rendezvous (``--nnodes MIN:MAX``), resuming from the newest verified checkpoint.

Ending a launcher needs proof, as ending a rank does (agent/restore.py): the process is the parent of
one of this node's live ranks (proven by its rank file), its pid is the one the rank file records as
``launcher_pid``, and it was created before that rank started (a reused pid belongs to a younger
process). Nothing else is ever signalled. SIGTERM first (the elastic agent stops its workers and
leaves the rendezvous), SIGKILL after `grace_seconds`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import psutil

from trainguard import log as tglog
from trainguard.agent import restore

HOST_NAME_BAD = ("/", "\0")


def cordon_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "control" / "cordon"


def check_host(host: str) -> str:
    if not host or host.startswith(".") or any(c in host for c in HOST_NAME_BAD) or len(host) > 253:
        raise ValueError(f"host {host!r}: not a node name")
    return host


def cordon(run_dir: str | os.PathLike, host: str, *, incident: str | None, reason: str, by: str) -> Path:
    """Write the node's cordon file (atomic); cordoning a cordoned node keeps the first file."""
    directory = cordon_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / check_host(host)
    if path.exists():
        return path
    tmp = directory / f".{host}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"host": host, "incident": incident, "reason": reason,
                               "cordoned_at": time.time(), "by": by}) + "\n")
    os.replace(tmp, path)
    return path


def cordoned(run_dir: str | os.PathLike) -> dict[str, dict]:
    """host -> its cordon record (an unreadable file still cordons: {"unreadable": why})."""
    directory = cordon_dir(run_dir)
    if not directory.is_dir():
        return {}
    out = {}
    for path in sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith(".")):
        try:
            out[path.name] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            out[path.name] = {"host": path.name, "unreadable": str(exc)}
    return out


def uncordon(run_dir: str | os.PathLike, host: str) -> bool:
    """Remove the node's cordon; False when it was not cordoned."""
    try:
        (cordon_dir(run_dir) / check_host(host)).unlink()
        return True
    except FileNotFoundError:
        return False


def evictions_since(run_dir: str | os.PathLike, since: float) -> int:
    """Cordons written since `since` (the hourly limit counts them; an uncordoned node still counted
    through its incident's action)."""
    return sum(1 for record in cordoned(run_dir).values()
               if isinstance(record.get("cordoned_at"), (int, float)) and record["cordoned_at"] >= since)


# ------------------------------------------------------------------------------------ launchers

def launchers_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "control" / "launchers"


def read_launchers(run_dir: str | os.PathLike) -> dict[str, dict]:
    """host -> its launcher file (pid, started_at, min_nodes, max_nodes), the readable ones."""
    out = {}
    for path in sorted(launchers_dir(run_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text())
            out[str(data["host"])] = data
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def proven_launchers(run_dir: str | os.PathLike, host: str) -> tuple[list[psutil.Process], list[str]]:
    """This host's launcher processes that are provably this run's (see the module docstring), and why
    each other candidate was refused."""
    infos, problems = restore.read_ranks(run_dir)
    found: dict[int, psutil.Process] = {}
    refused = list(problems)
    for info, process in restore.local_ranks(infos, host):
        launcher_pid = _launcher_pid(info)
        if launcher_pid is None:
            refused.append(f"rank {info.rank}: its rank file names no launcher_pid")
            continue
        try:
            parent = process.parent()
            if parent is None or parent.pid != launcher_pid:
                refused.append(f"rank {info.rank}: its parent is not pid {launcher_pid}")
                continue
            if parent.create_time() > info.started_at + restore.CREATE_TIME_SLACK:
                refused.append(f"rank {info.rank}: pid {launcher_pid} is younger than the rank")
                continue
        except psutil.Error as exc:
            refused.append(f"rank {info.rank}: {type(exc).__name__}")
            continue
        found[parent.pid] = parent
    return list(found.values()), refused


def _launcher_pid(info: restore.RankInfo) -> int | None:
    try:
        value = json.loads(info.path.read_text()).get("launcher_pid")
        return int(value) if value is not None else None
    except (OSError, ValueError, TypeError):
        return None


def end_launcher(run_dir: str | os.PathLike, host: str, grace_seconds: float = 5.0) -> dict:
    """End this host's proven launcher(s): SIGTERM, SIGKILL after `grace_seconds`. Returns what was done."""
    log = tglog.get("agent.evict", host=host)
    launchers, refused = proven_launchers(run_dir, host)
    ended = []
    for process in launchers:
        try:
            process.terminate()
            ended.append(process.pid)
        except psutil.NoSuchProcess:
            continue
    if ended:
        timer = threading.Timer(grace_seconds, restore._kill_survivors,   # SIGKILL what ignored SIGTERM
                                 ([p for p in launchers if p.pid in ended], log))
        timer.daemon = True
        timer.start()
    for why in refused:
        log.warning("launcher not ended: no proof", why=why)
    return {"launchers_ended": ended, **({"refused": refused} if refused else {})}
