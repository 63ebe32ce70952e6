"""Cordon files: ``RUN/control/cordon/<host>`` keeps a node out of the job, when it proves who wrote it.

A cordon stops a node from training (its launcher refuses to join, trainer/launch.py), so it is an
action that needs proof: anyone who can write the run directory could otherwise evict any node. A cordon
is signed (trainguard/signed.py, purpose ``cordon/1``, bound to its host) with the run's checkpoint HMAC
key (trainer/cordon_key.py finds it where trainer/checkpoint/keys.py does) — the key the ranks already hold (trainer/replica_check.py writes a
cordon after a second replica mismatch) and the agent is given (``webhook.checkpoint_key_file``, by
default the same place the trainer looks: ``$TRAINGUARD_CHECKPOINT_KEY`` or
``$XDG_CONFIG_HOME/trainguard/checkpoint.key``), and that lives outside the run directory.

A cordon that is not signed, signed with another key, changed since, or copied from another host's is
*not honoured*: the launcher joins and says so (stderr, a ``cordon_ignored`` TLS event in
``RUN/tls/node-<host>-launcher.jsonl``, which `trainguard status` shows), the agent exports it
(``trainguard_cordon_refused{node,reason}``), `trainguard incidents` lists it. Cordons of round 1 carry
no signature: they are not honoured either (docs/incidents.md). `trainguard uncordon` removes either kind.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard import rundir, signed, tls

PURPOSE = "cordon/1"
HOST_NAME_BAD = ("/", "\0")


@dataclass(frozen=True)
class Cordon:
    host: str
    path: Path
    record: dict
    refused: str | None       # None: signed with the key, for this host — honoured

    @property
    def honoured(self) -> bool:
        return self.refused is None

    def why_refused(self) -> str:
        assert self.refused is not None
        return signed.refusal_message(self.refused, f"the cordon file {self.path}")


def check_host(host: str) -> str:
    if not host or host.startswith(".") or any(c in host for c in HOST_NAME_BAD) or len(host) > 253:
        raise ValueError(f"host {host!r}: not a node name")
    return host


# ------------------------------------------------------------------------------------- read, write

def write(run_dir: str | os.PathLike, host: str, key: bytes, key_id: str | None = None, **fields: Any) -> Path:
    """Write the host's signed cordon (atomic). An honoured cordon already there is kept (the first
    verdict's reasons); one that is not honoured (forged, unsigned) is replaced by this one."""
    path = rundir.cordon_path(run_dir, check_host(host))
    existing = read_one(run_dir, host, key)
    if existing is not None and existing.honoured:
        return path
    record = signed.sign(key, PURPOSE, {**fields, "host": host, "cordoned_at": fields.get("cordoned_at", time.time())},
                         key_id=key_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{host}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read_one(run_dir: str | os.PathLike, host: str, key: bytes | None) -> Cordon | None:
    """The host's cordon checked against `key`, or None when it has none."""
    path = rundir.cordon_path(run_dir, check_host(host))
    try:
        if not path.is_file():
            return None if not path.exists() else Cordon(host, path, {}, signed.UNREADABLE)
        record: Any = json.loads(path.read_bytes()[:1 << 20])
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return Cordon(host, path, {}, signed.UNREADABLE)
    refused = signed.check(key, PURPOSE, record, {"host": host})
    return Cordon(host, path, record if isinstance(record, dict) else {}, refused)


def read_all(run_dir: str | os.PathLike, key: bytes | None) -> dict[str, Cordon]:
    """host -> its cordon, each checked against `key` (honoured or why not)."""
    directory = rundir.cordon_dir(run_dir)
    if not directory.is_dir():
        return {}
    out = {}
    for path in sorted(directory.iterdir()):
        if path.name.startswith("."):
            continue
        try:
            found = read_one(run_dir, path.name, key)
        except ValueError:
            continue
        if found is not None:
            out[path.name] = found
    return out


def remove(run_dir: str | os.PathLike, host: str) -> bool:
    """Remove the host's cordon, honoured or not; False when it had none."""
    try:
        rundir.cordon_path(run_dir, check_host(host)).unlink()
        return True
    except FileNotFoundError:
        return False


# ------------------------------------------------------------------------- the launcher's record

launcher_log = rundir.launcher_log     # a node log: `trainguard status` and `replay` read it with the others


def record_ignored(run_dir: str | os.PathLike, found: Cordon, key_path: str) -> int:
    """Append a ``cordon_ignored`` event; returns how many times this node's launchers ignored one."""
    path = launcher_log(run_dir, found.host)
    count = 1 + sum(1 for line in _lines(path) if b'"cordon_ignored"' in line)
    record = {**tls.event("cordon_ignored", host=found.host, reason=found.refused, path=str(found.path),
                          key_file=key_path, key_id=found.record.get(signed.KEY_ID), ignored_total=count,
                          why=found.why_refused()), "node": found.host}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, tls.encode(record))
    finally:
        os.close(fd)
    return count


def _lines(path: Path) -> list[bytes]:
    try:
        return path.read_bytes().splitlines()
    except FileNotFoundError:
        return []
