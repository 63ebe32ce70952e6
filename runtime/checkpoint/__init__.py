"""Verified checkpoints: atomic, hashed while written, HMAC-signed; restore picks the newest that verifies.

    from trainguard.runtime.checkpoint import CheckpointManager, verify

Layout: `manager` (CheckpointManager: save, verify, keep, restore, composed of `saving`, `status`,
`retention`, `restore`, `directory`, `group`, `events`; `archive`: the commands' set aside, import, export), `manifest` (pure: manifest, signature, reasons),
`keys` (the signing key), `store` (files on disk: hashing writer, atomic publish), `verification` (the one
verification), `sharded` / `sharded_load` (DCP shards written hashed / read verified and resharded),
`state` (what goes in which file, copy off the device), `compress`. User guide: docs/checkpoints.md.
"""

from __future__ import annotations

import os
from pathlib import Path

from trainguard.runtime.checkpoint import keys, verification
from trainguard.runtime.checkpoint.manager import (Checkpoint, CheckpointInfo, CheckpointManager, SaveHandle,
                                                   info_of)
from trainguard.runtime.checkpoint.manifest import CheckpointError, VerifyResult

__all__ = ["Checkpoint", "CheckpointError", "CheckpointInfo", "CheckpointManager", "SaveHandle", "VerifyResult",
           "info_of", "verify"]


def verify(path: str | os.PathLike, *, key_file: str | os.PathLike | None = None,
           deep: bool = True) -> VerifyResult:
    """Check one checkpoint directory: manifest, signature, step, and each file's size and SHA-256.

    Never creates a key: without the key that signed it, a checkpoint cannot be verified.
    """
    key = keys.load_key(keys.resolve_key_path(key_file), create=False)
    return verification.verify_dir(Path(path), key, keys.key_id(key), deep=deep)
