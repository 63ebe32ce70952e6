"""Snapshot replication to a peer node and peer recovery (runtime/resilience/replicate.py, peer.py).

The receiver's checks run in one process (two replicators talking over loopback); the replication and the
recovery of a rank without its snapshot run on a real gloo group of 4 processes (2 simulated nodes x 2
ranks), forked by torch.multiprocessing."""

from __future__ import annotations

import io
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from trainguard import event_types, signed
from trainguard.protect import TrainState
from trainguard.runtime.resilience import peer, replicate, restore
from trainguard.runtime.resilience.snapshot import SnapshotStore, Snapshotter
from trainguard.trainer.fingerprint import Fingerprinter

KEY = b"k" * 32
WORLD, LOCAL = 4, 2


class Log:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class Events(list):
    def __call__(self, kind, **fields):
        self.append((kind, fields))

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self]


def store_for(tmp_path: Path, rank: int, world: int = WORLD) -> SnapshotStore:
    (tmp_path / "shm").mkdir(exist_ok=True)
    store = SnapshotStore(tmp_path / "shm", tmp_path / "run", rank=rank, world_size=world, key=KEY, key_id="kid")
    assert store.prepare() is None
    return store


def payload(step: int) -> bytes:
    buffer = io.BytesIO()
    torch.save({"trainer": {"step": step}, "model": {"w": torch.full((4,), float(step))}}, buffer)
    return buffer.getvalue()


# --------------------------------------------------------------------------------- who holds whose
def test_each_rank_is_held_by_the_same_local_rank_on_the_next_node_and_one_node_has_no_replica():
    assert [replicate.peer_of(r, 4, 2) for r in range(4)] == [2, 3, 0, 1]
    assert [replicate.origin_of(r, 6, 2) for r in range(6)] == [4, 5, 0, 1, 2, 3]
    assert replicate.peer_of(0, 2, 2) is None and replicate.origin_of(1, 2, 2) is None   # one node
    assert replicate.peer_of(0, 5, 2) is None          # nodes of unequal sizes: no arithmetic to trust


def test_the_plan_takes_the_newest_step_every_rank_can_have_and_names_its_sender():
    listings = [{"local": [10, 5], "held": {2: {10: [300, 1000], 5: [300, 900]}}},
                {"local": [10, 5], "held": {}},
                {"local": [], "held": {}},                  # a replaced node: nothing of its own
                {"local": [5], "held": {}}]
    older = peer.plan(listings, max_bytes=10**6)       # rank 3 has no 10 and nobody holds it for it: 5
    assert older.step == 5 and older.sources == {2: 0} and older.sizes == {2: (300, 900)}
    listings[1]["held"] = {3: {10: [300, 1000]}}
    chosen = peer.plan(listings, max_bytes=10**6)
    assert chosen.step == 10 and chosen.sources == {2: 0, 3: 1} and chosen.sizes[2] == (300, 1000)
    assert peer.plan(listings, max_bytes=999).step == 5    # an offer over this rank's bound is not taken
    listings[0]["held"] = {0: {10: [300, 1000]}}           # a rank offering itself is no peer
    assert peer.plan(listings, max_bytes=10**6) is None


# ----------------------------------------------------------------------------- the receiver's checks
@pytest.fixture
def pair(tmp_path):
    """Rank 0 (origin) and rank 2 (its holder) of 2 nodes x 2, on one loopback; the job's store a HashStore."""
    job = dist.HashStore()
    events = Events()
    made = []
    for rank in (0, 2):
        local = store_for(tmp_path, rank)
        replicator = replicate.Replicator(local, replicate.held_store(local, (rank - LOCAL) % WORLD), job, rank=rank,
                                          peer=(rank + LOCAL) % WORLD, origin=(rank - LOCAL) % WORLD, emit=events,
                                          log=Log())
        assert replicator.held.prepare() is None
        replicator.start()
        made.append(replicator)
    yield made[0], made[1], events
    for replicator in made:
        replicator.close(completed=False)


def test_a_snapshot_is_held_by_its_peer_and_reads_back_verified(pair):
    origin, holder, events = pair
    origin.local.write(5, payload(5), base_step=None)
    assert origin.send(5, payload(5))
    assert holder.held.steps() == [5]
    record, state = holder.held.load(5)           # bound to rank 0, hashed, weights_only
    assert record["rank"] == 0 and state["trainer"] == {"step": 5}
    assert events.kinds() == [event_types.SNAPSHOT_REPLICATED] and events[0][1]["peer_rank"] == 2
    mode = os.stat(holder.held.dir).st_mode & 0o777
    assert mode == 0o700 and holder.held.dir.name == "replica-0"


def stream(port: int, manifest: bytes, body: bytes) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(replicate.MAGIC + replicate.LENGTH.pack(len(manifest)) + manifest
                     + replicate.LENGTH.pack(len(body)) + body)
        return replicate._read_line(conn)


def test_forged_copied_or_changed_replicas_are_refused_loudly_and_kept_nowhere(pair, tmp_path):
    origin, holder, events = pair
    port = int(holder._address(2).rpartition(":")[2])
    body = payload(5)
    good = json.loads(json.dumps(signed.sign(KEY, "snapshot/1", {
        "run": origin.local.run, "rank": 0, "world_size": WORLD, "step": 5, "bytes": len(body),
        "sha256": __import__("hashlib").sha256(body).hexdigest(), "base_step": None, "job": "", "created": 0})))
    forged = signed.sign(b"x" * 32, "snapshot/1", {k: v for k, v in good.items() if k != "signature"})
    other_rank = signed.sign(KEY, "snapshot/1", {**{k: v for k, v in good.items() if k != "signature"}, "rank": 1})
    assert stream(port, json.dumps(forged).encode(), body) == "refused bad_signature"
    assert stream(port, json.dumps(other_rank).encode(), body) == "refused not_bound"   # not this holder's origin
    changed = body[:-1] + bytes([body[-1] ^ 1])
    assert stream(port, json.dumps(good).encode(), changed) == "refused hash"
    assert stream(port, b"not json", body) == "refused unreadable"
    refused = [fields["reason"] for kind, fields in events if kind == event_types.REPLICA_REFUSED]
    assert refused == ["bad_signature", "not_bound", "hash", "unreadable"]
    assert holder.held.steps() == [] and not [p for p in holder.held.dir.iterdir()]     # nothing kept
    assert stream(port, json.dumps(good).encode(), body) == "ok" and holder.held.steps() == [5]


def test_an_unreachable_peer_is_said_and_training_goes_on(tmp_path):
    events = Events()
    local = store_for(tmp_path, 0)
    replicator = replicate.Replicator(local, replicate.held_store(local, 2), dist.HashStore(), rank=0, peer=2,
                                      origin=2, emit=events, log=Log())
    local.write(5, payload(5), base_step=None)
    assert not replicator.send(5, payload(5))            # the peer never published an address
    assert events.kinds() == [event_types.SNAPSHOT_REPLICA_FAILED] and "rank 2" in events[0][1]["why"]


# -------------------------------------------------------------------- a real group: 2 nodes x 2 ranks
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(8, 8)


class StepState:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}


class Protector:
    """What restore.py asks of the Protector, over a real model."""

    def __init__(self, model, steps: StepState, checkpoint_step: int):
        self.model, self.steps, self.checkpoint_step = model, steps, checkpoint_step
        self.state = TrainState(step=0, last_saved_step=None)
        self.events = Events()
        self.log = Log()

    def event(self, kind, **fields):
        self.events(kind, **fields)

    def restore(self, *, rollback, source="resume", **fields):
        self.state.step = self.checkpoint_step
        return self.checkpoint_step

    def load_states(self, parts):
        self.model.load_state_dict(parts["model"])
        self.state.step = parts["trainer"]["step"]


def _rank(rank: int, root: str, port: int, scenario: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    job = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=__import__("datetime").timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", job), rank=rank, world_size=WORLD)
    tmp_path = Path(root)
    events, model, steps = Events(), Model(), StepState()
    local = store_for(tmp_path, rank)
    replicator = replicate.Replicator.build(local, job, rank=rank, world_size=WORLD, local_world_size=LOCAL,
                                            emit=events, log=Log())
    replicator.start()
    dist.barrier()                        # every listener published before the first snapshot is sent
    snaps = Snapshotter(local, {"model": model, "trainer": steps}, every=5, emit=events, log=Log(),
                        replicator=replicator)
    prints = Fingerprinter()
    result: dict = {"rank": rank}

    def snapshot(step: int) -> None:
        steps.step = step
        snaps.after_step(step, base_step=None)
        snaps.wait()
        replicator.wait()
        dist.barrier()                    # every replica is committed on its holder (the send waits for it)

    def lose_node_1() -> None:            # ranks 2 and 3 come back with an empty /dev/shm
        if rank >= LOCAL:
            local.clear()
            replicator.held.clear()
        dist.barrier()

    def recover(checkpoint_step: int) -> Protector:
        with torch.no_grad():
            model.layer.weight.add_(1.0)  # what the failed step left: not the snapshot's weights
        protector = Protector(model, steps, checkpoint_step)
        protector.state.step = 99
        protector.loaded = restore.after_failure(protector, local, device="cpu", world_size=WORLD,
                                                 held=replicator.held,
                                                 fingerprint=lambda t: int(prints.fingerprint(t)))
        return protector

    if scenario == "restore":
        snapshot(5)
        result["held"] = replicator.held.steps()
        result["replicated"] = [f["step"] for k, f in events if k == event_types.SNAPSHOT_REPLICATED]
        lose_node_1()
        protector = recover(checkpoint_step=0)
        result["loaded"] = protector.loaded
        result["kinds"] = protector.events.kinds()
        result["restored"] = next(f for k, f in protector.events if k == event_types.SNAPSHOT_RESTORED)
        result["fingerprint"] = int(prints.fingerprint(list(model.state_dict().values())))
        result["local_again"] = local.steps()       # a received copy is this rank's own again
        snapshot(10)                                 # then node 1 comes back empty after torchrun's restart
        lose_node_1()
        resumed = Protector(model, steps, checkpoint_step=0)
        result["resumed"] = restore.after_resume(resumed, local, resumed_from=None, device="cpu", world_size=WORLD,
                                                 held=replicator.held,
                                                 fingerprint=lambda t: int(prints.fingerprint(t)))
    else:
        snapshot(5)
        lose_node_1()
        if rank == 1:                                # rank 1 holds rank 3's replica: a byte of it changes
            path = replicator.held.path(5, ".snap")
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 1
            path.write_bytes(bytes(data))
        dist.barrier()
        tampered = recover(checkpoint_step=0)
        result["tampered"] = {"kinds": tampered.events.kinds(), "loaded": tampered.loaded,
                              "why": [f for k, f in tampered.events if k == event_types.SNAPSHOT_FALLBACK]}
        if rank == 2:                                # rank 2's next snapshot holds other weights than its replicas
            with torch.no_grad():
                model.layer.bias.add_(1.0)
        snapshot(10)
        lose_node_1()
        mismatched = recover(checkpoint_step=0)
        result["mismatched"] = {"kinds": mismatched.events.kinds(), "loaded": mismatched.loaded,
                                "why": [f["why"] for k, f in mismatched.events if k == event_types.SNAPSHOT_FALLBACK]}
    snaps.close(completed=False)
    (tmp_path / f"result-{rank}.json").write_text(json.dumps(result, default=str))
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(tmp_path: Path, scenario: str) -> list[dict]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tmp.start_processes(_rank, args=(str(tmp_path), port, scenario), nprocs=WORLD, start_method="fork")
    return [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in range(WORLD)]


def test_a_node_that_lost_its_snapshots_restores_them_from_its_peers_verified(tmp_path):
    results = run_ranks(tmp_path, "restore")
    for found in results:
        assert found["replicated"] == [5] and found["held"] == [5]
        assert found["loaded"]["restored_step"] == 5
        assert event_types.SNAPSHOT_FALLBACK not in found["kinds"]
    for rank in (0, 1):          # node 0 still had its own
        assert results[rank]["loaded"]["source"] == restore.SNAPSHOT and results[rank]["loaded"]["bytes_received"] == 0
    for rank in (2, 3):          # node 1 received from the same local rank of node 0
        restored = results[rank]["restored"]
        assert results[rank]["loaded"]["source"] == restore.PEER and restored["peer_rank"] == rank - LOCAL
        assert restored["bytes_received"] > 1000 and results[rank]["local_again"] == [5]
    # a worker torchrun restarted on an empty node continues the same job's snapshot from its peer too
    assert [found["resumed"]["source"] for found in results] == ["snapshot", "snapshot", "peer", "peer"]
    assert {found["resumed"]["restored_step"] for found in results} == {10}
    assert len({found["fingerprint"] for found in results}) == 1     # every rank on the snapshot's weights


def test_a_changed_or_differing_peer_copy_falls_back_to_the_checkpoint_on_every_rank(tmp_path):
    results = run_ranks(tmp_path, "refused")
    for found in results:
        tampered = found["tampered"]
        assert tampered["loaded"]["source"] == restore.CHECKPOINT and event_types.SNAPSHOT_FALLBACK in tampered["kinds"]
        assert "rank(s) {3: 'hash'}" in tampered["why"][0]["why"]
        mismatched = found["mismatched"]
        assert mismatched["loaded"]["source"] == restore.CHECKPOINT
        assert event_types.SNAPSHOT_RESTORED not in mismatched["kinds"]
        assert "fingerprints differ" in mismatched["why"][0] and "rank(s) [2] differ from the majority" in mismatched["why"][0]
    assert event_types.SNAPSHOT_INVALID in results[3]["tampered"]["kinds"]      # the rank that refused says why


def test_the_switch_and_the_node_count_decide_whether_snapshots_are_replicated(tmp_path, monkeypatch):
    import dataclasses
    from types import SimpleNamespace

    from trainguard import policy
    from trainguard.runtime.resilience.component import Recovery

    (tmp_path / "shm").mkdir()
    events = Events()
    protector = SimpleNamespace(key=KEY, states={}, event=events, telemetry=SimpleNamespace(event=events))
    groups = SimpleNamespace(store=dist.HashStore(), close=lambda: None)
    monkeypatch.delenv("MASTER_ADDR", raising=False)     # the listener on the loopback

    def built(replicate_setting: str, local_world: int) -> Recovery:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
        settings = dataclasses.replace(policy.from_mapping({"recovery": {"replicate": replicate_setting}}).recovery,
                                       snapshot_dir=str(tmp_path / "shm"))
        return Recovery.build(settings, protector, run_dir=tmp_path / "run", rank=1, world_size=4, device="cpu",
                              groups=groups, log=Log())

    two_nodes = built("on", 2)
    replicator = two_nodes.snapshots.replicator
    assert (replicator.peer, replicator.origin) == (3, 3) and two_nodes._held().dir.name == "replica-3"
    assert groups.store.get("trainguard/replica/1").decode().startswith("127.0.0.1:")
    two_nodes.close(completed=True)
    assert built("on", 4).snapshots.replicator is None         # one node: nobody else to hold it
    assert built("off", 2).snapshots.replicator is None
    assert policy.from_mapping({"recovery": {"replicate": False}}).recovery.replicate == "off"   # YAML's bare off


def test_a_rollback_drops_the_replicas_of_the_abandoned_steps_and_a_completed_run_clears_them(pair):
    origin, holder, _ = pair
    for step in (5, 10):
        origin.local.write(step, payload(step), base_step=None)
        assert origin.send(step, payload(step))
    assert holder.held.steps() == [10, 5]
    snaps = Snapshotter(holder.local, {}, every=0, emit=Events(), log=Log(), replicator=holder)
    snaps.after_step(10, base_step=None)
    snaps.after_step(6, base_step=None)          # every rank rolled back to step 6: step 10 was abandoned
    assert holder.held.steps() == [5]
    snaps.close(completed=True)
    assert not holder.held.dir.exists()
