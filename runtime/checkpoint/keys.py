"""The HMAC key that signs checkpoint manifests: where it lives, how it is created, how it is read.

The key signs what a run writes so that a restore can tell "written by this trainguard setup and untouched
since" from "modified, swapped or half-written". It therefore lives outside the run directory by default
(someone who can write checkpoints should not also find the key beside them):

1. the `key_file` argument (`--key-file` on the command line), else
2. the path in the environment variable ``TRAINGUARD_CHECKPOINT_KEY``, else
3. ``$XDG_CONFIG_HOME/trainguard/checkpoint.key`` (``~/.config/trainguard/checkpoint.key``).

It is created on first use with mode 0600: 32 random bytes, hex-encoded, one line. Any file of at
least 32 bytes (after stripping whitespace) is accepted as a key, so a cluster can distribute its own.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import stat
from pathlib import Path

from trainguard import safe_read
from trainguard.runtime.checkpoint.manifest import CheckpointError
from trainguard.runtime.checkpoint.store import fsync_dir

ENV_VAR = "TRAINGUARD_CHECKPOINT_KEY"
MIN_KEY_BYTES = 32


def default_key_path() -> Path:
    configured = os.environ.get(ENV_VAR)
    if configured:
        return Path(configured).expanduser()
    config_home = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config_home) / "trainguard" / "checkpoint.key"


def resolve_key_path(key_file: str | os.PathLike | None = None) -> Path:
    return Path(key_file).expanduser() if key_file else default_key_path()


def key_id(key: bytes) -> str:
    """A short public fingerprint of the key, so a manifest signed with another key is told apart from a
    modified one. It reveals nothing usable about the key."""
    return hashlib.sha256(b"trainguard-checkpoint-key-id\0" + key).hexdigest()[:16]


def load_key(path: str | os.PathLike, *, create: bool = True) -> bytes:
    """The key at `path`; created (0600) when missing and `create` is true."""
    path = Path(path)
    try:
        return _read_key(path)
    except FileNotFoundError:
        if not create:
            raise CheckpointError(
                f"{path}: no checkpoint key here; checkpoints are signed with the key of the run that wrote "
                f"them (pass --key-file or set {ENV_VAR})") from None
    _create_key(path)
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    try:
        fd, info = safe_read.open_fd(path, what="checkpoint key")     # a FIFO is refused, never waited on
    except safe_read.RunFileError:
        raise CheckpointError(f"{path}: the checkpoint key must be a regular file") from None
    try:
        if info.st_mode & 0o077:
            raise CheckpointError(
                f"{path}: the checkpoint key is readable or writable by others "
                f"(mode {stat.S_IMODE(info.st_mode):04o}); run: chmod 600 {path}")
        key = _read_all(fd).strip()
    finally:
        os.close(fd)
    if len(key) < MIN_KEY_BYTES:
        raise CheckpointError(f"{path}: a checkpoint key needs at least {MIN_KEY_BYTES} bytes, found {len(key)}")
    return key


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    return b"".join(chunks)


def _create_key(path: Path) -> None:
    """Write the new key under a private name, then hard-link it into place: readers never see a half-written
    key, and when several ranks start at once the first link wins and the others read that key."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = secrets.token_hex(MIN_KEY_BYTES).encode() + b"\n"
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    _write_private(tmp, key, os.O_TRUNC)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    except OSError:  # a filesystem without hard links: an exclusive create still lets only one rank win
        try:
            _write_private(path, key, os.O_EXCL)
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)
    fsync_dir(path.parent)


def _write_private(path: Path, data: bytes, mode_flag: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | mode_flag, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode is filtered by the umask; 0600 is the contract.
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
