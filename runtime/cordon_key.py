"""The run's checkpoint HMAC key as the signing key of cordon files (trainguard/cordon/__init__.py, docs/incidents.md).

The key lives where the trainer resolves it (runtime/checkpoint/keys.py: ``--key-file``, else
``$TRAINGUARD_CHECKPOINT_KEY``, else ``$XDG_CONFIG_HOME/trainguard/checkpoint.key``), outside the run
directory. Writers of cordons (the agent's eviction, the replica check) create it where the trainer would,
as the trainer's first start does; readers (the launcher, the CLI, the agent's metrics) never create it: a
key only the reader held would honour nothing. The revocations `trainguard uncordon` recorded live beside
the key (``<key file>.revoked``, trainguard/cordon/__init__.py): `checker` gives both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trainguard import cordon, paths
from trainguard.runtime.checkpoint import keys
from trainguard.runtime.checkpoint.manifest import CheckpointError


def signing_key(key_file: str | os.PathLike | None = None, create: bool = False) -> tuple[bytes | None, str]:
    """(the key, its path), or (None, why it cannot be used)."""
    path = keys.resolve_key_path(key_file)
    try:
        if path.exists():
            paths.regular_file(path, "checkpoint key file")   # a FIFO would block the read
        return keys.load_key(path, create=create), str(path)
    except (CheckpointError, OSError) as exc:
        return None, str(exc)


def checker(key_file: str | os.PathLike | None = None, create: bool = False) -> cordon.CordonKey:
    """The key (or why none) and the revocation list beside it: what a cordon is checked against."""
    key, where = signing_key(key_file, create)
    if key is None:
        return cordon.CordonKey(None, where)
    revocations = cordon.revocations_path(keys.resolve_key_path(key_file))
    revoked, problem = cordon.load_revocations(revocations, key)
    return cordon.CordonKey(key, where, revoked, problem, revocations)


def write_cordon(run_dir: str | os.PathLike, host: str, key: bytes, key_file: str | os.PathLike | None = None,
                 **fields: Any) -> Path:
    """The host's cordon signed with `key` (found at `key_file`, whose revocation list tells whether the
    cordon there stands), carrying the key's public id (the one checkpoint manifests carry)."""
    signer = checker(key_file)
    if signer.key != key:      # `key` was not read from `key_file`: nothing known revoked under it
        signer = cordon.CordonKey(key, signer.where)
    return cordon.write(run_dir, host, signer, key_id=keys.key_id(key), **fields)
