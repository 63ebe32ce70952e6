"""The checkpoint manifest reader and verifier on damaged checkpoints: verification fails with a reason,
no exception escapes, and nothing is loaded; an undamaged one still verifies and loads exactly.

Each example copies one real signed checkpoint (saved by CheckpointManager), damages its manifest or one
of its files, and asks both `verify` and `load_latest` about it, with `torch.load` watched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.property.conftest import examples
from tests.property.mutate import DEEP_ARRAY, DEEP_OBJECT, mutated_bytes, mutated_json
from trainguard.runtime.checkpoint import CheckpointManager, verify
from trainguard.runtime.checkpoint import manifest as mf

STEP = 40
CODES = {mf.MISSING_MANIFEST, mf.UNREADABLE_MANIFEST, mf.BAD_SIGNATURE, mf.WRONG_KEY, mf.STEP_MISMATCH,
         mf.MISSING_FILE, mf.SIZE_MISMATCH, mf.HASH_MISMATCH, mf.UNSAFE_CONTENT}
MANIFEST_VALUES = {"format": mf.FORMAT, "step": STEP, "stable": True, "world_size": 1, "key_id": "0" * 16,
                   "created_at": "2024-03-15T14:22:18.000000Z",
                   "signature": {"algorithm": mf.ALGORITHM, "value": "é" * 64},   # non-ASCII, as a forger may
                   "files": {"model.pt": {"sha256": "0" * 64, "bytes": 1}}}


def small_state() -> dict:
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(32), "b": torch.zeros(4, dtype=torch.int64)},
            "optim": {"state": {}, "param_groups": [{"lr": 3e-4}]},
            "data": {"position": [123, 456]}, "rng": {"python": [1, 2, 3]}}


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """One real checkpoint, signed with a key of this module's own; (run dir, key file, state)."""
    root = tmp_path_factory.mktemp("checkpoint-original")
    key_file = root / "keys" / "checkpoint.key"
    with mock.patch.dict(os.environ, {"TRAINGUARD_CHECKPOINT_KEY": str(key_file)}):
        manager = CheckpointManager(root / "run", key_file=key_file, world_size=1)
        manager.save(STEP, small_state(), stable=True)
    return root / "run", key_file


def fresh_copy(original, tmp_path_factory) -> tuple[Path, Path]:
    run, key_file = original
    copy = tmp_path_factory.mktemp("checkpoint-copy") / "run"
    shutil.copytree(run, copy)
    return copy, copy / "checkpoints" / f"step_{STEP}"


@contextlib.contextmanager
def watched_loads():
    """torch.load as usual, and the list of the files it was given."""
    loaded: list[Path] = []
    real = torch.load

    def load(handle, *args, **kwargs):
        # a file by name or handle; DCP's items come as views of shards already hashed (not files)
        name = getattr(handle, "name", handle)
        if isinstance(name, (str, os.PathLike)):
            loaded.append(Path(name))
        return real(handle, *args, **kwargs)

    with mock.patch("torch.load", load):
        yield loaded


def signed_content(manifest: dict) -> bytes:
    """What a verifier relies on: every signed byte, and the signature's algorithm and value (other keys
    a forger adds inside the signature object are neither signed nor read)."""
    body = {key: value for key, value in manifest.items() if key != "signature"}
    signature = manifest["signature"]
    return mf.canonical(body) + mf.canonical([signature["algorithm"], signature["value"]])


def damage(data, directory: Path) -> bool:
    """Damage the checkpoint in `directory` one way or another; True when it is unchanged in substance
    (the signed content and every file's bytes are what they were), so that it must still verify."""
    manifest_path = directory / mf.MANIFEST_NAME
    before = signed_content(json.loads(manifest_path.read_bytes()))
    files = sorted(p.name for p in directory.iterdir() if p.name != mf.MANIFEST_NAME)
    contents = {name: (directory / name).read_bytes() for name in files}
    kind = data.draw(st.sampled_from(["manifest bytes", "manifest json", "file bytes", "file replaced",
                                      "file removed", "manifest removed", "renamed", "extra file"]))
    name = data.draw(st.sampled_from(files))
    if kind == "manifest bytes":
        manifest_path.write_bytes(data.draw(mutated_bytes(manifest_path.read_bytes())))
    elif kind == "manifest json":
        manifest_path.write_text(json.dumps(data.draw(mutated_json(json.loads(manifest_path.read_bytes())))))
    elif kind == "file bytes":
        (directory / name).write_bytes(data.draw(mutated_bytes(contents[name])))
    elif kind == "file replaced":
        (directory / name).write_bytes(data.draw(st.binary(max_size=2048)))
    elif kind == "file removed":
        (directory / name).unlink()
    elif kind == "manifest removed":
        manifest_path.unlink()
    elif kind == "renamed":
        directory.rename(directory.with_name(f"step_{data.draw(st.integers(0, 10**6).filter(lambda s: s != STEP))}"))
        return False
    else:   # a file the manifest does not list is ignored (it is never loaded)
        (directory / "notes.pt").write_bytes(data.draw(st.binary(max_size=64)))
    try:
        after = signed_content(json.loads(manifest_path.read_bytes()))
    except (OSError, ValueError, RecursionError, TypeError, KeyError):
        return False
    return after == before and all((directory / n).exists() and (directory / n).read_bytes() == c
                                   for n, c in contents.items())


@settings(max_examples=examples(120))
@given(st.data())
def test_a_damaged_checkpoint_fails_verification_with_a_reason_and_is_never_loaded(original, tmp_path_factory,
                                                                                   data):
    run, directory = fresh_copy(original, tmp_path_factory)
    intact = damage(data, directory)
    directory = next((run / "checkpoints").glob("step_*"))
    result = verify(directory, key_file=original[1])
    assert isinstance(result.reason, str) and result.reason
    with watched_loads() as loaded:
        found = CheckpointManager(run, key_file=original[1], inspect_only=True).load_latest()
    if intact:
        assert result.ok, result.reason
        assert found is not None and found[0].step == STEP
        assert torch.equal(found[1]["model"]["w"], small_state()["model"]["w"])
        assert found[1]["data"] == {"position": [123, 456]}
    else:
        assert not result.ok and result.code in CODES, result
        assert result.reason.startswith(result.code.replace("_", " "))
        assert found is None, "a damaged checkpoint was restored"
        # Restore reads each file once, hashing it on the way in: a file whose bytes match the signed
        # manifest may be unpickled (weights_only) before a later file is found damaged; a damaged one never.
        originals = original[0] / "checkpoints" / f"step_{STEP}"
        for path in loaded:
            assert path.read_bytes() == (originals / path.name).read_bytes(), f"{path.name} was damaged and loaded"


@settings(max_examples=examples(120))
@given(st.one_of(st.binary(max_size=300),
                 st.builds(lambda d: json.dumps(d).encode(), mutated_json(MANIFEST_VALUES))))
@example(DEEP_ARRAY)
@example(DEEP_OBJECT)
@example(json.dumps(MANIFEST_VALUES).encode())
def test_any_manifest_bytes_are_refused_with_a_reason_never_an_exception(original, tmp_path_factory, manifest):
    """Whatever manifest.json holds, with whatever files beside it: a refusal naming why."""
    run, directory = fresh_copy(original, tmp_path_factory)
    (directory / mf.MANIFEST_NAME).write_bytes(manifest)
    try:
        mf.parse(manifest)
    except ValueError as error:
        assert str(error)
    result = verify(directory, key_file=original[1])
    assert not result.ok and result.code in CODES and result.reason, result
    with watched_loads() as loaded:
        assert CheckpointManager(run, key_file=original[1], inspect_only=True).load_latest() is None
    assert loaded == []
