"""Signed run-directory records for tests, made as the agent makes them: with the checkpoint key the
trainer resolves (the test's `TRAINGUARD_CHECKPOINT_KEY`, or `key_file`)."""

from __future__ import annotations

import os
from pathlib import Path

from trainguard import rundir
from trainguard.runtime import cordon_key
from trainguard.runtime.checkpoint import keys


def key(key_file: str | os.PathLike | None = None) -> bytes:
    found, where = cordon_key.signing_key(key_file, create=True)
    assert found is not None, where
    return found


def request(run: Path, action: str, request_id: str, key_file: str | os.PathLike | None = None, **fields) -> dict:
    """A control request signed as the agent's executor signs it."""
    signer = key(key_file)
    return rundir.sign_request(signer, rundir.request(action, request_id, **fields), run, by="agent:test",
                               key_id=keys.key_id(signer))


def append(run: Path, action: str, request_id: str, **fields) -> bool:
    return rundir.append_request(run, request(run, action, request_id, **fields))
