"""The in-memory snapshot tier (runtime/resilience/snapshot.py): written signed and hashed, loaded only once
verified, kept newest-first within bounds, and never trusted from a directory someone else could write."""

from __future__ import annotations

import json
import os

import pytest
import torch

from trainguard import event_types, signed
from trainguard.runtime.resilience.snapshot import (PURPOSE, SnapshotRefused, SnapshotStore, Snapshotter,
                                                    snapshot_root)

KEY, OTHER_KEY = b"k" * 32, b"x" * 32


def store_at(tmp_path, rank=0, key=KEY, **kwargs) -> SnapshotStore:
    (tmp_path / "shm").mkdir(exist_ok=True)     # the tmpfs root (/dev/shm) is there; what is under it is ours
    store = SnapshotStore(tmp_path / "shm", tmp_path / "run", rank=rank, world_size=2, key=key, key_id="kid",
                          **kwargs)
    assert store.prepare() is None
    return store


def payload(value: float = 1.0) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save({"model": {"w": torch.full((4,), value)}, "trainer": {"step": 7}}, buffer)
    return buffer.getvalue()


def test_a_written_snapshot_loads_back_verified(tmp_path):
    store = store_at(tmp_path)
    store.write(10, payload(2.0), base_step=5)
    manifest, state = store.load(10)
    assert torch.equal(state["model"]["w"], torch.full((4,), 2.0)) and state["trainer"] == {"step": 7}
    assert manifest["base_step"] == 5 and manifest["step"] == 10 and manifest["rank"] == 0
    assert oct(os.stat(store.path(10, ".snap")).st_mode & 0o777) == "0o600"


def test_a_changed_payload_is_refused_by_its_hash(tmp_path):
    store = store_at(tmp_path)
    store.write(10, payload(), base_step=None)
    data = bytearray(store.path(10, ".snap").read_bytes())
    data[len(data) // 2] ^= 0xFF
    store.path(10, ".snap").write_bytes(bytes(data))
    with pytest.raises(SnapshotRefused) as refused:
        store.load(10)
    assert refused.value.reason == "hash"


def test_a_forged_manifest_is_refused_before_the_payload_is_read(tmp_path):
    """A stranger who can write the directory replaces state and manifest, hash and all: not signed with
    the run's key, so nothing of it is loaded."""
    store = store_at(tmp_path)
    store.write(10, payload(), base_step=None)
    forged = payload(666.0)
    import hashlib

    record = json.loads(store.path(10, ".json").read_text())
    record.update(bytes=len(forged), sha256=hashlib.sha256(forged).hexdigest())
    store.path(10, ".snap").write_bytes(forged)
    store.path(10, ".json").write_text(json.dumps(signed.sign(OTHER_KEY, PURPOSE, record)))
    with pytest.raises(SnapshotRefused) as refused:
        store.load(10)
    assert refused.value.reason == signed.BAD_SIGNATURE
    del record["signature"]
    store.path(10, ".json").write_text(json.dumps(record))
    with pytest.raises(SnapshotRefused) as refused:
        store.load(10)
    assert refused.value.reason == signed.UNSIGNED


def test_another_ranks_snapshot_copied_here_is_refused(tmp_path):
    mine, theirs = store_at(tmp_path, rank=0), store_at(tmp_path, rank=1)
    theirs.write(10, payload(), base_step=None)
    for suffix in (".snap", ".json"):
        mine.path(10, suffix).write_bytes(theirs.path(10, suffix).read_bytes())
    with pytest.raises(SnapshotRefused) as refused:
        mine.load(10)
    assert refused.value.reason == signed.NOT_BOUND


def test_a_payload_larger_than_its_manifest_is_not_read_whole(tmp_path):
    store = store_at(tmp_path)
    store.write(10, payload(), base_step=None)
    store.path(10, ".snap").write_bytes(payload() + b"\0" * 4096)
    with pytest.raises(SnapshotRefused) as refused:
        store.load(10)
    assert refused.value.reason == "unreadable"


def test_a_directory_others_can_write_or_a_link_is_refused(tmp_path):
    store = SnapshotStore(tmp_path / "shm", tmp_path / "run", rank=0, world_size=1, key=KEY, key_id="kid")
    assert "cannot be created" in store.prepare()        # no tmpfs root: no snapshots, and why
    for level in (tmp_path / "shm", store.base.parent, store.base):
        level.mkdir(mode=0o700)
    os.chmod(store.base, 0o777)
    assert "mode 777" in store.prepare()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.chmod(store.base, 0o700)
    store.dir.symlink_to(elsewhere)
    assert "not a directory" in store.prepare()


def test_the_directory_name_needs_the_key(tmp_path):
    assert snapshot_root(tmp_path / "run", KEY, tmp_path) != snapshot_root(tmp_path / "run", OTHER_KEY, tmp_path)
    assert snapshot_root(tmp_path / "run", KEY, tmp_path) != snapshot_root(tmp_path / "run2", KEY, tmp_path)


def test_retention_keeps_the_newest_and_a_rollback_drops_the_abandoned(tmp_path):
    store, other = store_at(tmp_path, keep=2), store_at(tmp_path, rank=1)
    other.write(5, payload(), base_step=None)
    for step in (5, 10, 15):
        store.write(step, payload(), base_step=None)
        store.retain()
    assert store.steps() == [15, 10]
    assert store.discard_after(10) == [15] and store.steps() == [10]
    store.clear()
    assert store.steps() == [] and store.dir.is_dir()
    assert other.steps() == [5]               # another rank's snapshots are never touched
    store.clear(directories=True)
    assert not store.dir.exists() and other.steps() == [5]


class Counter:
    def __init__(self):
        self.value = torch.zeros(3)

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value.copy_(state["value"])


class Log:
    def warning(self, *args, **kwargs):
        pass


def test_snapshotter_takes_every_n_steps_and_a_step_back_drops_newer(tmp_path):
    store = store_at(tmp_path, keep=5)
    counter = Counter()
    seen = []
    taker = Snapshotter(store, {"c": counter}, every=2, emit=lambda kind, **f: seen.append((kind, f)), log=Log())
    for step in range(1, 7):
        counter.value.fill_(step)
        taker.after_step(step, base_step=None)
    taker.wait()
    assert store.steps() == [6, 4, 2]
    assert torch.equal(store.load(4)[1]["c"]["value"], torch.full((3,), 4.0))   # the copy, not the live tensor
    saved = [f for kind, f in seen if kind == event_types.SNAPSHOT_SAVED]
    assert [f["step"] for f in saved] == [2, 4, 6] and all(f["blocking_seconds"] >= 0 for f in saved)
    taker.after_step(3, base_step=None)        # rolled back to step 3: 4 and 6 are another timeline
    taker.wait()
    assert store.steps() == [2]
    taker.close(completed=True)
    assert not store.dir.exists()


def test_a_snapshot_over_the_bound_is_not_written_and_says_so(tmp_path):
    store = store_at(tmp_path, max_bytes=100)
    seen = []
    taker = Snapshotter(store, {"c": Counter()}, every=1, emit=lambda kind, **f: seen.append((kind, f)), log=Log())
    taker.after_step(1, base_step=None)
    taker.close(completed=False)
    assert store.steps() == []
    assert [(kind, f["reason"]) for kind, f in seen] == [(event_types.SNAPSHOT_SKIPPED, "too_large")]


class Unstageable:
    def state_dict(self):
        raise RuntimeError("no state today")


def test_a_snapshot_that_cannot_be_staged_never_stops_training(tmp_path):
    seen = []
    taker = Snapshotter(store_at(tmp_path), {"x": Unstageable()}, every=1,
                        emit=lambda kind, **f: seen.append((kind, f)), log=Log())
    taker.after_step(1, base_step=None)             # no exception
    taker.close(completed=False)
    assert [(kind, f["reason"]) for kind, f in seen] == [(event_types.SNAPSHOT_SKIPPED, "error")]
