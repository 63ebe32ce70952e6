"""Save, verify and restore a real training state; the key; retention; what a state may hold."""

from __future__ import annotations

import hashlib
import json
import os
import stat

import numpy as np
import pytest
import torch

from tests.checkpoint.helpers import assert_same, training_state
from trainguard.runtime.checkpoint import CheckpointError, CheckpointManager, verify
from trainguard.runtime.checkpoint import keys, store
from trainguard.runtime.checkpoint import manifest as mf
from trainguard.trainer.config import ModelConfig
from trainguard.trainer.model import GPT


FILES = {"dcp": [".metadata", "__0_0.distcp", "extra.pt", "manifest.json"],        # format /2
         "files": ["extra.pt", "manifest.json", "model.pt", "optim.pt"]}                # format /1, still read


@pytest.mark.parametrize("engine", list(FILES))
def test_round_trip_restores_every_part_and_the_manifest_describes_the_files(tmp_path, key_file, engine):
    state, model, optim = training_state()
    events = []
    manager = CheckpointManager(tmp_path / "run", key_file=key_file, engine=engine,
                                on_event=lambda k, **f: events.append((k, f)))
    handle = manager.save(7, state, stable=True, meta={"val_loss": 2.5})

    path = tmp_path / "run" / "checkpoints" / "step_7"
    assert handle.done() and handle.error is None and handle.path == path
    assert sorted(os.listdir(path)) == FILES[engine]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == {"dcp": mf.FORMAT, "files": mf.FORMAT_V1}[engine]
    assert manifest["step"] == 7 and manifest["stable"] is True and manifest["world_size"] == 1
    assert manifest["versions"]["torch"] == torch.__version__ and manifest["versions"]["python"]
    assert manifest["meta"] == {"val_loss": 2.5} and manifest["signature"]["algorithm"] == "HMAC-SHA256"
    for name, entry in manifest["files"].items():  # hashed while written == hashed afterwards
        data = (path / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert handle.bytes == sum(f.stat().st_size for f in path.iterdir())
    assert manifest["key_id"] == keys.key_id(keys.load_key(key_file))   # the signing key's fingerprint

    result = verify(path, key_file=key_file)
    assert result.ok and result.code == "ok" and result.step == 7

    ckpt, restored = manager.load_latest()
    assert ckpt.step == 7 and ckpt.stable
    assert_same(restored, state)
    if engine == "files":   # torch.save keeps tied weights one storage; DCP stores each name (equal values)
        tied = restored["model"]["lm_head.weight"], restored["model"]["transformer.wte.weight"]
        assert tied[0].untyped_storage().data_ptr() == tied[1].untyped_storage().data_ptr()

    fresh = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    fresh.load_state_dict(restored["model"])
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh_optim.load_state_dict(restored["optim"])
    idx = torch.randint(0, 64, (2, 16))
    assert torch.equal(fresh(idx, idx)[1], model(idx, idx)[1])
    torch.set_rng_state(restored["rng"]["torch"])
    first = torch.rand(3)
    torch.set_rng_state(state["rng"]["torch"])
    assert torch.equal(first, torch.rand(3))

    kinds = [kind for kind, _ in events]
    assert kinds == ["checkpoint_saved", "checkpoint_restored"]
    saved = events[0][1]
    assert saved["step"] == 7 and saved["stable"] is True and saved["bytes"] == handle.bytes
    assert saved["path"] == str(path) and saved["seconds"] >= 0 and saved["blocking_seconds"] == saved["seconds"]
    assert events[1][1]["step"] == 7


def test_latest_verified_is_the_newest_and_stable_only_skips_unstable(tmp_path, key_file):
    manager = CheckpointManager(tmp_path, key_file=key_file, keep_last=5)
    state, _, _ = training_state()
    for step, stable in ((10, True), (20, False), (30, False)):
        manager.save(step, state, stable=stable)
    assert manager.latest_verified().step == 30
    assert manager.latest_verified(stable_only=True).step == 10
    assert manager.load_latest(stable_only=True)[0].step == 10
    rows = [(i.step, i.stable, i.ok) for i in manager.list()]
    assert rows == [(10, True, True), (20, False, True), (30, False, True)]


def test_key_file_is_created_0600_once_and_reused(tmp_path, key_file):
    old_umask = os.umask(0)  # the 0600 must not depend on the caller's umask
    try:
        first = CheckpointManager(tmp_path / "a", key_file=key_file)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert len(key_file.read_bytes().strip()) == 64
    first.save(1, {"model": {"w": torch.ones(3)}}, stable=True)
    key_before = key_file.read_bytes()
    second = CheckpointManager(tmp_path / "b", key_file=key_file)
    assert key_file.read_bytes() == key_before
    assert second.verify_step(1).ok is False  # run b has no step 1 ...
    assert verify(tmp_path / "a" / "checkpoints" / "step_1", key_file=key_file).ok  # ... but a's verifies


def test_ranks_creating_the_key_at_once_agree_on_one(tmp_path, key_file):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        found = set(pool.map(lambda _: keys.load_key(key_file), range(8)))
    assert found == {key_file.read_bytes().strip()}
    assert [p.name for p in key_file.parent.iterdir()] == [key_file.name]  # no private leftovers


def test_key_location_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(keys.ENV_VAR, str(tmp_path / "from-env.key"))
    manager = CheckpointManager(tmp_path / "run")
    assert manager.key_path == tmp_path / "from-env.key" and manager.key_path.exists()
    monkeypatch.delenv(keys.ENV_VAR)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    assert keys.default_key_path() == tmp_path / "config" / "trainguard" / "checkpoint.key"


def test_a_key_others_can_read_is_refused(tmp_path, key_file):
    CheckpointManager(tmp_path, key_file=key_file)
    key_file.chmod(0o644)
    with pytest.raises(CheckpointError, match="chmod 600"):
        CheckpointManager(tmp_path, key_file=key_file)


def test_verify_never_creates_a_key(tmp_path, key_file):
    CheckpointManager(tmp_path, key_file=key_file).save(1, {"model": {}}, stable=False)
    with pytest.raises(CheckpointError, match="no checkpoint key"):
        verify(tmp_path / "checkpoints" / "step_1", key_file=tmp_path / "missing.key")
    assert not (tmp_path / "missing.key").exists()


def test_another_key_is_told_apart_from_tampering(tmp_path, key_file):
    CheckpointManager(tmp_path, key_file=key_file).save(1, {"model": {"w": torch.ones(2)}}, stable=False)
    other = tmp_path / "other.key"
    keys.load_key(other)  # created
    result = verify(tmp_path / "checkpoints" / "step_1", key_file=other)
    assert not result.ok and result.code == "wrong_key" and "signed with key" in result.reason


def test_retention_keeps_the_last_n_and_the_newest_stable(tmp_path, key_file):
    events = []
    manager = CheckpointManager(tmp_path, key_file=key_file, keep_last=2,
                                on_event=lambda kind, **f: events.append((kind, f.get("step"))))
    state = {"model": {"w": torch.ones(4)}}
    manager.save(1, state, stable=True)
    for step in (2, 3, 4):
        manager.save(step, state, stable=False)
    assert manager.steps() == [1, 3, 4]  # 2 went; 1 is the newest stable
    manager.save(5, state, stable=True)
    assert manager.steps() == [4, 5]  # 5 is the newest stable now, so 1 may go
    assert ("checkpoint_deleted", 2) in events and ("checkpoint_deleted", 1) in events
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


def test_retention_never_deletes_or_counts_a_checkpoint_it_cannot_verify(tmp_path, key_file):
    """One that does not verify is moved to checkpoints/invalid/ with its reason, reported,
    never counted toward keep_last; before, retention deleted it."""
    events = []
    manager = CheckpointManager(tmp_path, key_file=key_file, keep_last=1,
                                on_event=lambda kind, **f: events.append((kind, f)))
    state = {"model": {"w": torch.ones(4)}}
    manager.save(1, state, stable=False)
    manager.save(2, state, stable=False)
    (tmp_path / "checkpoints" / "step_2" / "__0_0.distcp").write_bytes(b"truncated")
    manager.save(3, state, stable=False)
    assert manager.steps() == [3]   # 1 went (verified, older than the one kept); 2 was set aside
    invalid = tmp_path / "checkpoints" / "invalid"
    (moved,) = invalid.iterdir()
    assert moved.name.startswith("step_2-") and (moved / "__0_0.distcp").read_bytes() == b"truncated"
    reason = json.loads((moved / "reason.json").read_text())
    assert reason["code"] == "size_mismatch" and reason["step"] == 2 and "__0_0.distcp" in reason["reason"]
    assert [f["code"] for kind, f in events if kind == "checkpoint_quarantined"] == ["size_mismatch"]
    (tmp_path / "checkpoints" / "step_3" / "manifest.json").write_text("{}")
    manager.save(4, state, stable=False)
    assert manager.steps() == [4] and len(list(invalid.iterdir())) == 2


def test_saving_a_step_again_replaces_it(tmp_path, key_file):
    manager = CheckpointManager(tmp_path, key_file=key_file)
    manager.save(3, {"model": {"w": torch.zeros(2)}}, stable=False)
    manager.save(3, {"model": {"w": torch.ones(2)}}, stable=True)
    ckpt, state = manager.load_latest()
    assert ckpt.stable and torch.equal(state["model"]["w"], torch.ones(2))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["status.json", "step_3"]


def test_supersede_after_a_rollback_sets_newer_checkpoints_aside(tmp_path, key_file):
    manager = CheckpointManager(tmp_path, key_file=key_file, keep_last=5)
    for step in (1, 2, 3):
        manager.save(step, {"model": {"w": torch.full((2,), float(step))}}, stable=step == 1)
    moved = manager.supersede_after(1)
    assert [p.name.split("-")[0] for p in moved] == ["step_3", "step_2"]
    assert all(p.parent == tmp_path / "checkpoints" / "superseded" for p in moved)
    assert manager.steps() == [1] and manager.latest_verified().step == 1


def test_a_state_weights_only_cannot_load_is_refused_when_saved(tmp_path, key_file):
    manager = CheckpointManager(tmp_path, key_file=key_file)
    state = {"model": {"w": torch.ones(2)}, "rng": {"numpy": np.random.get_state()}}
    with pytest.raises(CheckpointError, match=r"\['rng'\]\['numpy'\]\[1\]: a numpy.ndarray"):
        manager.save(1, state, stable=False)
    with pytest.raises(CheckpointError, match="meta must be JSON"):
        manager.save(1, {"model": {}}, stable=False, meta={"when": object()})
    assert manager.steps() == []


def test_stale_temporaries_of_dead_processes_are_removed_at_start(tmp_path, key_file):
    root = tmp_path / "checkpoints"
    root.mkdir()
    host = store.host_tag()
    dead = root / f".tmp-step_9-{host}-{2**22 + 12345}"  # above pid_max's default: nobody has it
    alive = root / f".tmp-step_8-{host}-1"               # pid 1 is alive: another process's save
    for path in (dead, alive):
        path.mkdir()
        (path / "model.pt").write_bytes(b"partial")
    CheckpointManager(tmp_path, key_file=key_file)
    assert not dead.exists() and alive.exists()


@pytest.mark.parametrize("async_save", [False, True], ids=["sync-concurrent-files", "async-one-thread"])
def test_hashing_on_a_second_thread_and_inline_give_the_same_checkpoint(tmp_path, key_file, monkeypatch, async_save):
    """Hosts with 4+ CPUs hash beside the writer, smaller ones inline; a sync save writes its files at once,
    an async one in turn: every path, the same bytes, the same hashes."""
    state = {"model": {"w": torch.randn(3 << 20), "b": torch.randn(10)},  # a 12 MiB write, and small ones
             "optim": {"m": torch.randn(1 << 20)}, "data": {"position": [7]}}
    manifests = {}
    for parallel in (True, False):
        monkeypatch.setattr(store, "PARALLEL_HASH", parallel)
        manager = CheckpointManager(tmp_path / f"{parallel}", key_file=key_file, async_save=async_save)
        manager.save(1, state, stable=True)
        manager.wait()
        assert verify(manager.root / "step_1", key_file=key_file).ok
        _, restored = manager.load_latest()
        assert_same(restored, state)
        files = json.loads((manager.root / "step_1" / "manifest.json").read_text())["files"]
        manifests[parallel] = {name: entry for name, entry in files.items() if name != ".metadata"}  # names its dir
    assert manifests[True] == manifests[False]


def test_concurrent_files_wait_for_every_writer_and_raise_the_first_error(tmp_path, monkeypatch):
    """One file failing while the others are written: save_files returns only once all writers are done,
    raising the error of the first part that failed, so the caller removes a directory nobody writes to."""
    real_save, finished = store.save_file, []

    def failing_for_optim(path, obj, parallel_hash=None):
        if path.name == "optim.pt":
            raise OSError(28, "No space left on device")
        entry = real_save(path, obj, parallel_hash)
        finished.append(path.name)
        return entry

    monkeypatch.setattr(store, "save_file", failing_for_optim)
    monkeypatch.setattr(store, "CPUS", 2)
    parts = {"model.pt": {"w": torch.randn(1 << 20)}, "optim.pt": {"m": torch.randn(10)}, "extra.pt": {"x": 1}}
    with pytest.raises(OSError, match="No space left"):
        store.save_files(tmp_path, parts, concurrent=True)
    assert sorted(finished) == ["extra.pt", "model.pt"]

