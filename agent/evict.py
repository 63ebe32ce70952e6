"""Keeping a node out: its cordon file, and the agent's ending of this node's launcher.

    RUN/control/cordon/<host>            {"host", "incident", "reason", "cordoned_at", "by", "key_id", "signature"}
    RUN/control/launchers/<host>.json    {"host", "pid", "started_at", "min_nodes", "max_nodes"} (the launcher's)

A cordoned node's launcher refuses to join the job (trainer/launch.py) until ``trainguard uncordon RUN
HOST`` removes the file — when the cordon is signed with the run's checkpoint key (trainguard/cordon/__init__.py):
an unsigned or forged one is ignored, loudly. When the culprit of a hang is on this node, the agent ends this node's launcher
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

import os
import threading
from pathlib import Path

import psutil

from trainguard import log as tglog
from trainguard import cordon as cordon_mod
from trainguard import rundir, safe_read
from trainguard.agent import restore
from trainguard.runtime import cordon_key


class CannotCordon(RuntimeError):
    """The agent holds no checkpoint key, so it cannot sign a cordon any launcher would honour."""


def cordon(run_dir: str | os.PathLike, host: str, *, incident: str | None, reason: str, by: str,
           key_file: str | os.PathLike | None = None) -> Path:
    """Write the node's signed cordon (trainguard/cordon/__init__.py); an honoured cordon already there is kept.
    Raises CannotCordon when the key cannot be read (an unsigned cordon would be ignored anyway)."""
    key, where = cordon_key.signing_key(key_file, create=True)
    if key is None:
        raise CannotCordon(f"cannot cordon {host}: no checkpoint key to sign it with ({where}; set "
                           f"webhook.checkpoint_key_file to the trainer's key)")
    return cordon_key.write_cordon(run_dir, host, key, key_file, incident=incident, reason=reason, by=by)


def cordons(run_dir: str | os.PathLike, key_file: str | os.PathLike | None = None) -> dict[str, cordon_mod.Cordon]:
    """host -> its cordon, checked against the agent's key and its revocations (honoured, or why not)."""
    return cordon_mod.read_all(run_dir, cordon_key.checker(key_file))


def cordoned(run_dir: str | os.PathLike, key_file: str | os.PathLike | None = None) -> dict[str, dict]:
    """host -> its cordon record, for the honoured cordons only: a forged one keeps no node out, counts
    toward no eviction limit, and takes no node out of a verdict."""
    return {host: found.record for host, found in cordons(run_dir, key_file).items() if found.honoured}


def evictions_since(run_dir: str | os.PathLike, since: float, key_file: str | os.PathLike | None = None) -> int:
    """Honoured cordons written since `since` (the hourly limit counts them; an uncordoned node still
    counted through its incident's action)."""
    return sum(1 for record in cordoned(run_dir, key_file).values()
               if isinstance(record.get("cordoned_at"), (int, float)) and record["cordoned_at"] >= since)


# ------------------------------------------------------------------------------------ launchers

launchers_dir = rundir.launchers_dir


def read_launchers(run_dir: str | os.PathLike) -> dict[str, dict]:
    """host -> its launcher file (pid, started_at, min_nodes, max_nodes), the readable ones."""
    out = {}
    for path in sorted(launchers_dir(run_dir).glob("*.json")):
        try:
            data = safe_read.read_json(path, safe_read.CONTROL_BYTES, "launcher file")
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
    infos, problems = restore.host_ranks(run_dir, host)      # this node's ranks only
    found: dict[int, psutil.Process] = {}
    refused = list(problems)
    for info in infos:
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
