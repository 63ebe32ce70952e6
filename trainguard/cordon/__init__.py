"""Cordon files: ``RUN/control/cordon/<host>`` keeps a node out of the job, when it proves who wrote it.

A cordon stops a node from training (its launcher refuses to join, trainer/launch.py), so it is an
action that needs proof: anyone who can write the run directory could otherwise evict any node. A cordon
is signed (trainguard/signed.py, purpose ``cordon/1``, bound to its host) with the run's checkpoint HMAC
key (runtime/cordon_key.py finds it where runtime/checkpoint/keys.py does) — the key the ranks already hold (trainer/replica_check.py writes a
cordon after a second replica mismatch) and the agent is given (``webhook.checkpoint_key_file``, by
default the same place the trainer looks: ``$TRAINGUARD_CHECKPOINT_KEY`` or
``$XDG_CONFIG_HOME/trainguard/checkpoint.key``), and that lives outside the run directory.

A cordon that is not signed, signed with another key, changed since, or copied from another host's is
*not honoured*: the launcher joins and says so (stderr, a ``cordon_ignored`` TLS event in
``RUN/tls/node-<host>-launcher.jsonl``, which `trainguard status` shows), the agent exports it
(``trainguard_cordon_refused{node,reason}``), `trainguard incidents` lists it. Cordons written before cordons were
signed carry no signature: they are not honoured either (docs/incidents.md). `trainguard uncordon` removes either kind.

**An uncordon cannot be rolled back from the run directory.** Whoever can write RUN/ can put back a copy
of a genuine cordon after `trainguard uncordon` removed it, and can delete anything kept in RUN/. So each
cordon carries a random ``cordon_id`` and ``expires_at`` in its signed body, and `uncordon` records the
revoked id in a signed revocation list kept beside the key, outside RUN/ (``<key file>.revoked``, 0600,
purpose ``cordon-revocations/1``): a revoked cordon is refused (``revoked``) wherever it reappears, and a
list that does not prove itself honours no cordon (``revocations_unreadable``) rather than a revoked one.
A cordon past ``expires_at`` (``DEFAULT_LIFETIME_SECONDS`` after it was written) is refused (``expired``):
an old copy carried into this or another run with the same key keeps no node out for ever, and the list
forgets revocations of cordons that expired. Round-2 cordons (signed, no id) are revoked by their
signature and never expire. The threat model: docs/incidents.md "An uncordon cannot be rolled back".
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard import event_types, rundir, safe_read, signed, tls

PURPOSE = "cordon/1"
REVOCATIONS_PURPOSE = "cordon-revocations/1"
HOST_NAME_BAD = ("/", "\0")
DEFAULT_LIFETIME_SECONDS = 30 * 86400.0   # a cordon keeps its node out this long, unless renewed or uncordoned

# Why a signed cordon is still refused (besides trainguard/signed.py's reasons).
REVOKED = "revoked"                       # `trainguard uncordon` revoked it: a copy put back
EXPIRED = "expired"                       # past its expires_at
REVOCATIONS_UNREADABLE = "revocations_unreadable"   # the revocation list does not prove itself
REASONS = (*signed.REASONS, REVOKED, EXPIRED, REVOCATIONS_UNREADABLE)


@dataclass(frozen=True)
class CordonKey:
    """What a cordon is checked (and signed) with: the run's checkpoint key and the revocations kept beside it."""
    key: bytes | None
    where: str                                    # the key's path, or why there is no key
    revoked: frozenset[str] = frozenset()         # ids of cordons `trainguard uncordon` revoked
    problem: str | None = None                    # the revocation list does not prove itself: why
    revocations: Path | None = None               # where the revocation list lives


def as_checker(key: "CordonKey | bytes | None") -> CordonKey:
    """A bare key checks signatures only (nothing known revoked under it): tests, and callers without a path."""
    return key if isinstance(key, CordonKey) else CordonKey(key, "the key given" if key else "no key given")


@dataclass(frozen=True)
class Cordon:
    host: str
    path: Path
    record: dict
    refused: str | None       # None: signed with the key, for this host, not revoked, not expired — honoured
    detail: str = ""          # what the reason refers to (the revocation list, the expiry time)

    @property
    def honoured(self) -> bool:
        return self.refused is None

    def why_refused(self) -> str:
        assert self.refused is not None
        what = f"the cordon file {self.path}"
        if self.refused == REVOKED:
            return f"{what} was revoked by `trainguard uncordon` ({self.detail}): a copy put back is refused"
        if self.refused == EXPIRED:
            return f"{what} expired ({self.detail})"
        if self.refused == REVOCATIONS_UNREADABLE:
            return f"{what} cannot be honoured: {self.detail}"
        return signed.refusal_message(self.refused, what)

    @property
    def ident(self) -> str:
        return cordon_ident(self.record)


def cordon_ident(record: dict) -> str:
    """A cordon's id: its ``cordon_id``, or for a round-2 cordon (none) its signature, unique to its body."""
    return str(record.get("cordon_id") or f"sig:{str(record.get(signed.SIGNATURE, ''))[:32]}")


def check_host(host: str) -> str:
    if not host or host.startswith(".") or any(c in host for c in HOST_NAME_BAD) or len(host) > 253:
        raise ValueError(f"host {host!r}: not a node name")
    return host


# ------------------------------------------------------------------------------------- read, write

def write(run_dir: str | os.PathLike, host: str, signer: CordonKey | bytes, key_id: str | None = None,
          lifetime_seconds: float = DEFAULT_LIFETIME_SECONDS, **fields: Any) -> Path:
    """Write the host's signed cordon (atomic), with a fresh random id and its expiry. An honoured cordon
    already there is kept (the first verdict's reasons); one that is not honoured (forged, unsigned,
    revoked, expired) is replaced by this one."""
    signer = as_checker(signer)
    assert signer.key is not None
    path = rundir.cordon_path(run_dir, check_host(host))
    existing = read_one(run_dir, host, signer)
    if existing is not None and existing.honoured:
        return path
    at = fields.pop("cordoned_at", None) or time.time()
    record = signed.sign(signer.key, PURPOSE, {**fields, "host": host, "cordon_id": os.urandom(16).hex(),
                                               "cordoned_at": at, "expires_at": at + lifetime_seconds},
                         key_id=key_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{host}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read_one(run_dir: str | os.PathLike, host: str, checker: CordonKey | bytes | None,
             now: float | None = None) -> Cordon | None:
    """The host's cordon checked against the key and its revocations, or None when it has none."""
    checker = as_checker(checker)
    path = rundir.cordon_path(run_dir, check_host(host))
    try:
        if not path.is_file():
            return None if not path.exists() else Cordon(host, path, {}, signed.UNREADABLE)
        record: Any = safe_read.read_json(path, safe_read.CONTROL_BYTES, "cordon")
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return Cordon(host, path, {}, signed.UNREADABLE)
    if not isinstance(record, dict):
        return Cordon(host, path, {}, signed.UNREADABLE)
    refused = signed.check(checker.key, PURPOSE, record, {"host": host})
    if refused is not None:
        return Cordon(host, path, record, refused)
    return Cordon(host, path, record, *_still_valid(record, checker, time.time() if now is None else now))


def _still_valid(record: dict, checker: CordonKey, now: float) -> tuple[str | None, str]:
    """(None, "") for a genuine cordon that stands; else (reason, detail): revoked, expired, or no way to tell."""
    if checker.problem is not None:
        return REVOCATIONS_UNREADABLE, checker.problem
    if cordon_ident(record) in checker.revoked:
        return REVOKED, f"id {cordon_ident(record)}, in {checker.revocations}"
    if _expired(record.get("expires_at"), now):
        return EXPIRED, f"at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(record['expires_at']))}"
    return None, ""


def read_all(run_dir: str | os.PathLike, checker: CordonKey | bytes | None) -> dict[str, Cordon]:
    """host -> its cordon, each checked against the key and its revocations (honoured or why not)."""
    directory = rundir.cordon_dir(run_dir)
    if not directory.is_dir():
        return {}
    out = {}
    for path in sorted(directory.iterdir()):
        if path.name.startswith("."):
            continue
        try:
            found = read_one(run_dir, path.name, checker)
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


# ------------------------------------------------------------------------------ the revocation list

def revocations_path(key_path: str | os.PathLike) -> Path:
    """Beside the key, outside the run directory: who can rewrite it can read the key anyway."""
    return Path(f"{key_path}.revoked")


def load_revocations(path: Path, key: bytes) -> tuple[frozenset[str], str | None]:
    """(revoked cordon ids, None), or (empty, why the list does not prove itself). No file: none revoked."""
    entries, problem = _read_revocations(path, key)
    return frozenset(str(e.get("cordon_id")) for e in entries), problem


def revoke(checker: CordonKey, run_dir: str | os.PathLike, found: Cordon, by: str, now: float | None = None) -> Path:
    """Record `found`'s id in the signed revocation list (atomic, under a lock: two uncordons at once keep
    both). Entries of cordons that have expired are dropped (an expired cordon is refused anyway).
    Raises ValueError naming the list when it does not prove itself (nothing is rewritten then)."""
    assert checker.key is not None and checker.revocations is not None
    now = time.time() if now is None else now
    path = checker.revocations
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(path.with_name(path.name + ".lock"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries, problem = _read_revocations(path, checker.key)
        if problem is not None:
            raise ValueError(problem)
        kept = [e for e in entries if not _expired(e.get("expires_at"), now)]
        kept.append({"cordon_id": found.ident, "host": found.host, "revoked_at": now, "by": by,
                     "expires_at": found.record.get("expires_at"), "run_dir": str(Path(run_dir).resolve())})
        _write_private(path, json.dumps(signed.sign(checker.key, REVOCATIONS_PURPOSE, {"revoked": kept}),
                                        indent=1) + "\n")
    finally:
        os.close(lock)             # and with it the lock
    return path


def _read_revocations(path: Path, key: bytes) -> tuple[list[dict], str | None]:
    try:
        if path.exists() and not path.is_file():
            return [], f"the revocation list {path} is not a regular file"
        record: Any = safe_read.read_json(path, 16 << 20, "revocation list")
    except FileNotFoundError:
        return [], None
    except (OSError, ValueError) as exc:
        return [], f"the revocation list {path} is unreadable ({exc})"
    reason = signed.check(key, REVOCATIONS_PURPOSE, record, {})
    if reason is not None:
        return [], f"the revocation list {path}: {signed.refusal_message(reason, 'it')}; move it away only if " \
                   f"no uncordon is to be kept"
    entries = record.get("revoked")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        return [], f"the revocation list {path}: field revoked: expected a list of entries"
    return entries, None


def _expired(expires: Any, now: float) -> bool:
    return isinstance(expires, (int, float)) and not isinstance(expires, bool) and now >= expires


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)     # the revocation survives a crash right after `uncordon` answered
    finally:
        os.close(directory)


# ------------------------------------------------------------------------- the launcher's record

_IGNORED_MARK = b'"%s"' % event_types.CORDON_IGNORED.encode()


def record_ignored(run_dir: str | os.PathLike, found: Cordon, key_path: str) -> int:
    """Append a ``cordon_ignored`` event; returns how many times this node's launchers ignored one."""
    path = rundir.launcher_log(run_dir, found.host)     # a node log: `status` and `replay` read it with the others
    count = 1 + sum(1 for line in _lines(path) if _IGNORED_MARK in line)
    record = {**tls.event(event_types.CORDON_IGNORED, host=found.host, reason=found.refused, path=str(found.path),
                          key_file=key_path, key_id=found.record.get(signed.KEY_ID), ignored_total=count,
                          why=found.why_refused()), "node": found.host}
    rundir.append_launcher_log(run_dir, found.host, tls.encode(record))
    return count


def _lines(path: Path) -> list[bytes]:
    try:
        return safe_read.read_bytes(path, safe_read.LEDGER_BYTES, "launcher log").splitlines()
    except FileNotFoundError:
        return []
