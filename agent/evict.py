"""Keeping a node out: its cordon file, and the agent's ending of this node's launcher.

    RUN/control/cordon/<host>            {"host", "incident", "reason", "cordoned_at", "by"}
    RUN/control/launchers/<host>.json    {"host", "pid", "started_at", "min_nodes", "max_nodes"} (the launcher's)

A cordoned node's launcher refuses to join the job (trainer/launch.py) until ``trainguard uncordon RUN
HOST`` removes the file. When the culprit of a hang is on this node, the agent ends this node's launcher
(torchrun's elastic agent): its ranks die with it (they asked Linux to, trainer/train.py), the other
nodes' ranks see their peers gone and fail, and their launchers re-form the job without this node
through the elastic rendezvous (``--nnodes MIN:MAX``), resuming from the newest verified checkpoint.

Ending a launcher needs proof, the same proof as ending a rank (agent/restore.py `prove_rank`): one of
this node's ranks proves its claim (start time to the clock tick, uid, worker entry point naming this
run directory), and the launcher is its identified ancestor (torchrun or ``trainguard train``) that the
rank registered (``launcher_pid``, ``launcher_create_time``). Nothing else is ever signalled. SIGTERM first (the elastic agent stops its workers and
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
from trainguard import rundir
from trainguard.agent import restore

HOST_NAME_BAD = ("/", "\0")


cordon_dir = rundir.cordon_dir


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

launchers_dir = rundir.launchers_dir


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


def proven_launchers(run_dir: str | os.PathLike, host: str,
                     trust: restore.Trust | None = None) -> tuple[list[psutil.Process], list[str]]:
    """This host's launcher processes, each proven as agent/restore.py proves a rank (`prove_rank`: the
    rank's start time, uid, entry point, run directory, and the launcher it registered), and why each
    other rank's launcher was refused."""
    trust = trust or restore.Trust.for_run(run_dir)
    infos, problems = restore.read_ranks(run_dir)
    found: dict[int, psutil.Process] = {}
    refused = list(problems)
    for info in infos:
        if info.host != host:
            continue
        try:
            proof = restore.prove_rank(info, trust)
        except restore.Refused as refusal:
            refused.append(f"rank {info.rank} (pid {info.pid}): {refusal.reason}: {refusal.detail}")
            continue
        if proof is not None:
            found[proof.launcher.pid] = proof.launcher
    return list(found.values()), refused


def end_launcher(run_dir: str | os.PathLike, host: str, grace_seconds: float = 5.0,
                 trust: restore.Trust | None = None) -> dict:
    """End this host's proven launcher(s): SIGTERM, SIGKILL after `grace_seconds`. Returns what was done."""
    log = tglog.get("agent.evict", host=host)
    launchers, refused = proven_launchers(run_dir, host, trust)
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
