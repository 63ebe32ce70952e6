"""The run's checkpoint HMAC key as the signing key of cordon files (trainguard/cordon.py, docs/incidents.md).

The key lives where the trainer resolves it (trainer/checkpoint/keys.py: ``--key-file``, else
``$TRAINGUARD_CHECKPOINT_KEY``, else ``$XDG_CONFIG_HOME/trainguard/checkpoint.key``), outside the run
directory. Writers of cordons (the agent's eviction, the replica check) create it where the trainer would,
as the trainer's first start does; readers (the launcher, the CLI, the agent's metrics) never create it: a
key only the reader held would honour nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trainguard import cordon, paths
from trainguard.trainer.checkpoint import keys
from trainguard.trainer.checkpoint.manifest import CheckpointError


def signing_key(key_file: str | os.PathLike | None = None, create: bool = False) -> tuple[bytes | None, str]:
    """(the key, its path), or (None, why it cannot be used)."""
    path = keys.resolve_key_path(key_file)
    try:
        if path.exists():
            paths.regular_file(path, "checkpoint key file")   # a FIFO would block the read
        return keys.load_key(path, create=create), str(path)
    except (CheckpointError, OSError) as exc:
        return None, str(exc)


def write_cordon(run_dir: str | os.PathLike, host: str, key: bytes, **fields: Any) -> Path:
    """The host's cordon signed with `key`, carrying the key's public id (the one checkpoint manifests carry)."""
    return cordon.write(run_dir, host, key, key_id=keys.key_id(key), **fields)
