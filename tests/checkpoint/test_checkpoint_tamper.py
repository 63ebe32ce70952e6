"""Every way a checkpoint can be damaged or forged is refused with its reason, and restore falls back."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil

import pytest
import torch

from tests.checkpoint.helpers import assert_same, training_state
from trainguard.cli import main as cli_main
from trainguard.runtime.checkpoint import Checkpoint, CheckpointError, CheckpointManager, verify
from trainguard.runtime.checkpoint import keys
from trainguard.runtime.checkpoint import manifest as mf


class Evil:
    """Runs a command when unpickled without weights_only."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


# The file of each kind in either format: /2 (DCP shards, the default) and /1 (whole files, still read).
FILES = {
    "dcp": {"tensors": "__0_0.distcp", "other": "__0_0.distcp", "extra": "extra.pt", "index": ".metadata"},
    "files": {"tensors": "model.pt", "other": "optim.pt", "extra": "extra.pt", "index": "model.pt"},
}


@pytest.fixture(params=list(FILES))
def engine(request):
    return request.param


@pytest.fixture
def two_checkpoints(tmp_path, key_file, engine):
    """step_1 (good, stable) and step_2 (the newest, to be damaged); the events seen while restoring."""
    events = []
    manager = CheckpointManager(tmp_path, key_file=key_file, keep_last=5, engine=engine,
                                on_event=lambda kind, **f: events.append((kind, f)))
    state, _, _ = training_state()
    manager.save(1, state, stable=True)
    manager.save(2, training_state(seed=1)[0], stable=False)
    events.clear()
    return manager, state, tmp_path / "checkpoints" / "step_2", events


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path):
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 100)


def _tamper_manifest(path):
    manifest = json.loads(path.read_text())
    manifest["stable"] = True  # promote an unstable checkpoint; the signature stays the old one
    path.write_text(json.dumps(manifest))


DAMAGE = {
    "flipped byte": ("tensors", _flip_byte, "hash_mismatch", "{name} has sha256"),
    "truncated file": ("other", _truncate, "size_mismatch", "{name} has"),
    "flipped byte in the index": ("index", _flip_byte, "hash_mismatch", "{name} has sha256"),
    "tampered manifest": ("manifest.json", _tamper_manifest, "bad_signature", "modified after it was signed"),
    "missing file": ("extra", os.remove, "missing_file", "{name} is listed in the manifest but not there"),
    "unreadable manifest": ("manifest.json", lambda p: p.write_bytes(b"{\"format\": tru"), "unreadable_manifest",
                            "not valid JSON"),
    "no manifest": ("manifest.json", os.remove, "missing_manifest", "no manifest.json"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_is_refused_with_its_reason_and_restore_falls_back(two_checkpoints, key_file, damage,
                                                                             engine):
    manager, good_state, newest, events = two_checkpoints
    kind, damage_it, code, words = DAMAGE[damage]
    name = FILES[engine].get(kind, kind)
    words = words.format(name=name)
    damage_it(newest / name)

    result = verify(newest, key_file=key_file)
    assert not result.ok and result.code == code and words in result.reason
    assert result.reason.startswith(code.replace("_", " ") + ":")

    assert manager.latest_verified().step == 1
    ckpt, state = manager.load_latest()
    assert ckpt.step == 1
    assert_same(state, good_state)
    skipped = [f for kind, f in events if kind == "checkpoint_invalid"]
    assert len(skipped) == 2 and {f["code"] for f in skipped} == {code}  # once per search
    assert all(f["path"] == str(newest) and words in f["reason"] for f in skipped)
    rows = {info.step: info for info in manager.list()}
    assert rows[1].ok and not rows[2].ok and rows[2].code == code


def test_a_signed_checkpoint_renamed_to_another_step_is_refused(two_checkpoints, key_file):
    manager, _, newest, _ = two_checkpoints
    newest.rename(newest.with_name("step_9"))
    result = verify(newest.with_name("step_9"), key_file=key_file)
    assert result.code == "step_mismatch" and "manifest for step 2" in result.reason
    assert manager.latest_verified().step == 1


def test_a_malicious_pickle_swapped_in_fails_the_hash_and_never_runs(two_checkpoints, key_file, tmp_path, engine):
    manager, _, newest, events = two_checkpoints
    marker = tmp_path / "pwned"
    torch.save({"w": Evil(marker)}, newest / FILES[engine]["tensors"])

    assert verify(newest, key_file=key_file).code in ("hash_mismatch", "size_mismatch")
    assert manager.load_latest()[0].step == 1
    assert not marker.exists()


def _forge(newest, key_file, name, data):
    """Put `data` in `name` and sign the manifest again with the real key: only the content is evil."""
    (newest / name).write_bytes(data)
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    body = {k: v for k, v in manifest.items() if k not in ("signature", "key_id")}
    key = keys.load_key(key_file)
    (newest / "manifest.json").write_bytes(mf.encode(mf.sign(body, key, keys.key_id(key))))


def _evil_torch_file(marker) -> bytes:
    buffer = io.BytesIO()
    torch.save({"w": Evil(marker)}, buffer)
    return buffer.getvalue()


EVIL = {  # (file kind, how the evil bytes are made): a torch file and DCP's pickled index
    "torch file": ("extra", _evil_torch_file),
    "pickled index": ("index", lambda marker: pickle.dumps(Evil(marker))),
}


@pytest.mark.parametrize("evil", list(EVIL))
def test_a_malicious_pickle_with_a_valid_signature_is_refused_by_verify_restore_and_the_trainer_alike(
        two_checkpoints, key_file, tmp_path, engine, evil, capsys):
    """The key may leak; weights_only is the second wall. Forge a perfectly signed checkpoint around a
    pickle that runs a command: `checkpoint verify`, `restore` and the trainer's restore all refuse it
    with the same reason (one verification), and it never runs. Before, verify called it ok."""
    manager, good_state, newest, events = two_checkpoints
    marker = tmp_path / "pwned"
    kind, make = EVIL[evil]
    if engine == "files" and kind == "index":
        pytest.skip("format /1 has no pickled index")
    _forge(newest, key_file, FILES[engine][kind], make(marker))

    result = verify(newest, key_file=key_file)
    assert not result.ok and result.code == "unsafe_content", result.reason
    assert manager.latest_verified().step == 1
    with pytest.raises(CheckpointError) as info:
        manager.load(Checkpoint.of(verify(newest, key_file=key_file, deep=False)))
    assert info.value.code == "unsafe_content"

    ckpt, state = manager.load_latest()  # restore moves on to the next one
    assert ckpt.step == 1
    assert_same(state, good_state)
    assert any(kind == "checkpoint_invalid" and f["code"] == "unsafe_content" for kind, f in events)

    assert cli_main(["checkpoint", "verify", str(tmp_path), "--key-file", str(key_file)]) == 1
    assert "step_2: FAILED: unsafe content" in capsys.readouterr().out
    assert cli_main(["checkpoint", "restore", str(tmp_path), "--key-file", str(key_file)]) == 0
    assert "starts from step_1" in capsys.readouterr().out
    assert not marker.exists()


def test_a_checkpoint_copied_with_its_manifest_verifies_where_it_lands(two_checkpoints, key_file, tmp_path):
    """Nothing in the signature ties a checkpoint to a path: runs can be moved and checkpoints exported."""
    _, _, newest, _ = two_checkpoints
    moved = tmp_path / "elsewhere" / "step_2"
    shutil.copytree(newest, moved)
    assert verify(moved, key_file=key_file).ok
