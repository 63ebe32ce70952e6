"""Async saves: the same bytes as a sync save, immune to training going on, visible only once durable."""

from __future__ import annotations

import json
import threading

import torch

from tests.checkpoint.helpers import assert_same, training_state
from trainguard.runtime.checkpoint import CheckpointManager, sharded, store


def _files(manager: CheckpointManager, step: int) -> dict:
    """The manifest's entries but DCP's .metadata (it names the directory written and a save id)."""
    files = json.loads((manager.root / f"step_{step}" / "manifest.json").read_text())["files"]
    return {name: entry for name, entry in files.items() if name != ".metadata"}


def test_async_save_is_durable_and_byte_identical_to_a_sync_save(tmp_path, key_file):
    state, _, _ = training_state()
    events = []
    sync = CheckpointManager(tmp_path / "sync", key_file=key_file)
    async_ = CheckpointManager(tmp_path / "async", key_file=key_file, async_save=True,
                               on_event=lambda kind, **f: events.append((kind, f)))
    sync.save(5, state, stable=True)
    handle = async_.save(5, state, stable=True)
    async_.wait()

    assert handle.done() and handle.error is None
    assert _files(async_, 5) == _files(sync, 5)  # same sha256 and size for every file
    ckpt, restored = async_.load_latest()
    assert ckpt.step == 5
    assert_same(restored, state)
    saved = next(f for kind, f in events if kind == "checkpoint_saved")
    assert saved["async"] is True and saved["blocking_seconds"] == handle.blocking_seconds
    assert saved["seconds"] == handle.seconds and handle.blocking_seconds <= handle.seconds


def test_training_that_goes_on_after_save_returns_does_not_change_the_checkpoint(tmp_path, key_file):
    state, model, optim = training_state()
    expected = {name: t.clone() for name, t in model.state_dict().items()}
    release = threading.Event()
    real_write = sharded._WrittenStream.write   # the writer of DCP's shards, on its upload thread

    def slow_write(self, data):  # hold the worker until training has changed the weights in place
        release.wait(30)
        return real_write(self, data)

    manager = CheckpointManager(tmp_path, key_file=key_file, async_save=True)
    sharded._WrittenStream.write = slow_write
    try:
        manager.save(3, state, stable=False)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)  # the next optimizer steps, in place, on the very tensors of `state`
        release.set()
        manager.wait()
    finally:
        sharded._WrittenStream.write = real_write
    _, restored = manager.load_latest()
    assert_same(restored["model"], expected)
    assert not torch.equal(restored["model"]["lm_head.weight"], model.lm_head.weight)


def test_latest_moves_only_once_the_async_checkpoint_is_durable(tmp_path, key_file):
    manager = CheckpointManager(tmp_path, key_file=key_file, async_save=True)
    manager.save(1, {"model": {"w": torch.ones(4)}}, stable=True)
    manager.wait()
    writing, release = threading.Event(), threading.Event()
    real_write_bytes = store.write_bytes

    def hold_after_manifest(path, data):  # every file and the manifest written; hold before the rename
        real_write_bytes(path, data)
        writing.set()
        release.wait(30)

    store.write_bytes = hold_after_manifest
    try:
        handle = manager.save(2, {"model": {"w": torch.zeros(4)}}, stable=False)
        assert writing.wait(30)
        assert not handle.done() and not (manager.root / "step_2").exists()
        assert manager.latest_verified().step == 1
        release.set()
        manager.wait()
    finally:
        store.write_bytes = real_write_bytes
        release.set()
    assert handle.done() and manager.latest_verified().step == 2


def test_one_save_in_flight_a_second_waits_for_the_first(tmp_path, key_file):
    manager = CheckpointManager(tmp_path, key_file=key_file, async_save=True, keep_last=5)
    first = manager.save(1, {"model": {"w": torch.ones(4)}}, stable=False)
    second = manager.save(2, {"model": {"w": torch.ones(4)}}, stable=False)
    assert first.done()  # save() finished the previous one before starting
    manager.wait()
    assert second.done() and manager.steps() == [1, 2]
