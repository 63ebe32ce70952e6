"""Every way a checkpoint can be damaged or forged is refused with its reason, and restore falls back."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch

from tests.checkpoint.helpers import assert_same, training_state
from trainguard.trainer.checkpoint import CheckpointError, CheckpointManager, verify
from trainguard.trainer.checkpoint import keys
from trainguard.trainer.checkpoint import manifest as mf


class Evil:
    """Runs a command when unpickled without weights_only."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def two_checkpoints(tmp_path, key_file):
    """step_1 (good, stable) and step_2 (the newest, to be damaged); the events seen while restoring."""
    events = []
    manager = CheckpointManager(tmp_path, key_file=key_file, keep_last=5,
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
    "flipped byte": ("model.pt", _flip_byte, "hash_mismatch", "model.pt has sha256"),
    "truncated file": ("optim.pt", _truncate, "size_mismatch", "optim.pt has"),
    "tampered manifest": ("manifest.json", _tamper_manifest, "bad_signature", "modified after it was signed"),
    "missing file": ("extra.pt", os.remove, "missing_file", "extra.pt is listed in the manifest but not there"),
    "unreadable manifest": ("manifest.json", lambda p: p.write_bytes(b"{\"format\": tru"), "unreadable_manifest",
                            "not valid JSON"),
    "no manifest": ("manifest.json", os.remove, "missing_manifest", "no manifest.json"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_is_refused_with_its_reason_and_restore_falls_back(two_checkpoints, key_file, damage):
    manager, good_state, newest, events = two_checkpoints
    name, damage_it, code, words = DAMAGE[damage]
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


def test_a_malicious_pickle_swapped_in_fails_the_hash_and_never_runs(two_checkpoints, key_file, tmp_path):
    manager, _, newest, events = two_checkpoints
    marker = tmp_path / "pwned"
    torch.save({"w": Evil(marker)}, newest / "model.pt")

    assert verify(newest, key_file=key_file).code in ("hash_mismatch", "size_mismatch")
    assert manager.load_latest()[0].step == 1
    assert not marker.exists()


def test_a_malicious_pickle_with_a_valid_signature_is_still_refused_by_weights_only(two_checkpoints, key_file,
                                                                                    tmp_path):
    """The key may leak; weights_only is the second wall. Forge a perfectly signed checkpoint around a
    pickle that runs a command, and check it is refused at load, with a reason, and never runs."""
    manager, good_state, newest, events = two_checkpoints
    marker = tmp_path / "pwned"
    torch.save({"w": Evil(marker)}, newest / "model.pt")
    manifest = json.loads((newest / "manifest.json").read_text())
    data = (newest / "model.pt").read_bytes()
    manifest["files"]["model.pt"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    body = {k: v for k, v in manifest.items() if k not in ("signature", "key_id")}
    key = keys.load_key(key_file)
    (newest / "manifest.json").write_bytes(mf.encode(mf.sign(body, key, keys.key_id(key))))

    assert verify(newest, key_file=key_file).ok  # signature and hashes are right: only the content is evil
    assert manager.latest_verified().step == 2
    with pytest.raises(CheckpointError, match=r"unsafe content: model\.pt: .*weights_only.*posix\.system") as info:
        manager.load(manager.latest_verified())
    assert info.value.code == "unsafe_content"

    ckpt, state = manager.load_latest()  # restore moves on to the next one
    assert ckpt.step == 1
    assert_same(state, good_state)
    assert any(kind == "checkpoint_invalid" and f["code"] == "unsafe_content" for kind, f in events)
    assert not marker.exists()


def test_a_checkpoint_copied_with_its_manifest_verifies_where_it_lands(two_checkpoints, key_file, tmp_path):
    """Nothing in the signature ties a checkpoint to a path: runs can be moved and checkpoints exported."""
    _, _, newest, _ = two_checkpoints
    moved = tmp_path / "elsewhere" / "step_2"
    shutil.copytree(newest, moved)
    assert verify(moved, key_file=key_file).ok
