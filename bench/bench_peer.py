"""Snapshot replication and peer recovery, measured: 2 simulated nodes x 2 ranks (4 forked processes, gloo on
loopback), the trainer's model (trainer/model.py GPT) and its AdamW state, on CPU.

    .venv/bin/python bench/bench_peer.py                              # the bench's tiny model (64 wide, 2 layers)
    .venv/bin/python bench/bench_peer.py --n-embd 256 --n-layer 4     # a 40 MB state

Per snapshot, on every rank (runtime/resilience/snapshot.py + replicate.py):

  step blocked, beside   what `Snapshotter.take` costs the step: the copy into host buffers; serializing,
                         writing and replicating run on the snapshot's thread
  step blocked, if sync  the same snapshot taken and replicated before the step goes on (take + wait)
  replication            the `snapshot_replicated` event: bytes sent to the peer and seconds (connect,
                         stream, the peer's verification and commit, its answer)

Then the restore, on every rank, of the newest snapshot after ranks 2 and 3 (node 1) lost theirs
(runtime/resilience/restore.py's `after_failure`, the fingerprint check included): from the rank's own
tmpfs (ranks 0, 1) and from its peer over the process group (ranks 2, 3), against every rank loading the
same state from the durable checkpoint (runtime/checkpoint CheckpointManager.load_latest: verified, then
loaded into the model and the optimizer).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORLD, LOCAL = 4, 2
KEY = b"bench-peer-key-0123456789abcdef!"


class Log:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class StepState:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}


class Loader:
    """What restore.py asks of the Protector: its state, events, loading the parts."""

    def __init__(self, model, optimizer):
        from trainguard.protect import TrainState

        self.model, self.optimizer = model, optimizer
        self.state = TrainState(step=99, last_saved_step=None)
        self.events: list = []
        self.log = Log()

    def event(self, kind, **fields):
        self.events.append((kind, fields))

    def restore(self, **kwargs):
        return None

    def load_states(self, parts):
        self.model.load_state_dict(parts["model"])
        self.optimizer.load_state_dict(parts["optim"])
        self.state.step = parts["trainer"]["step"]


def _rank(rank: int, folder: str, port: int, args: dict) -> None:
    import torch
    import torch.distributed as dist

    from trainguard import event_types
    from trainguard.runtime.checkpoint import CheckpointManager
    from trainguard.runtime.resilience import replicate, restore
    from trainguard.runtime.resilience.snapshot import SnapshotStore, Snapshotter
    from trainguard.trainer.config import ModelConfig
    from trainguard.trainer.fingerprint import Fingerprinter
    from trainguard.trainer.model import GPT

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    job = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", job), rank=rank, world_size=WORLD)
    root = Path(folder)
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_embd=args["n_embd"], n_layer=args["n_layer"], n_head=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(2, 8, dtype=torch.long))[0].float().mean().backward()
    optimizer.step()                                   # AdamW's moments exist: the state a snapshot holds
    events: list = []
    emit = lambda kind, **fields: events.append((kind, fields))   # noqa: E731
    shm = root / "shm"
    shm.mkdir(mode=0o700, exist_ok=True)
    local = SnapshotStore(shm, root / "run", rank=rank, world_size=WORLD, key=KEY, key_id="bench")
    assert local.prepare() is None
    replicator = replicate.Replicator.build(local, job, rank=rank, world_size=WORLD, local_world_size=LOCAL,
                                            emit=emit, log=Log())
    replicator.start()
    steps = StepState()
    snaps = Snapshotter(local, {"model": model, "optim": optimizer, "trainer": steps}, every=1, emit=emit,
                        log=Log(), replicator=replicator)
    dist.barrier()
    beside, synchronous = [], []
    for _ in range(args["runs"]):
        steps.step += 1
        began = time.perf_counter()
        snaps.take(steps.step, base_step=None)      # the step goes on while it is written and replicated
        beside.append(time.perf_counter() - began)
        snaps.wait()
        replicator.wait()
        dist.barrier()
        steps.step += 1
        began = time.perf_counter()
        snaps.take(steps.step, base_step=None)
        snaps.wait()                                 # as if the step waited for the copy and the replica
        replicator.wait()
        synchronous.append(time.perf_counter() - began)
        dist.barrier()
    replicated = [f for k, f in events if k == event_types.SNAPSHOT_REPLICATED]
    saved = [f for k, f in events if k == event_types.SNAPSHOT_SAVED]

    # The durable checkpoint of the same state (rank 0 writes; every rank verifies and loads it).
    manager = CheckpointManager(root / "run", keep_last=1)
    if rank == 0:
        manager.save(steps.step, {"model": model.state_dict(), "optim": optimizer.state_dict()}, stable=True)
        manager.wait()
    dist.barrier()
    checkpoint_seconds = []
    for _ in range(args["runs"]):
        began = time.perf_counter()
        found = manager.load_latest(map_location="cpu")
        assert found is not None
        model.load_state_dict(found[1]["model"])
        optimizer.load_state_dict(found[1]["optim"])
        checkpoint_seconds.append(time.perf_counter() - began)
    dist.barrier()

    prints = Fingerprinter()
    restore_seconds, received = [], 0
    for _ in range(args["runs"]):
        if rank >= LOCAL:                              # node 1 lost its tmpfs
            local.clear()
        dist.barrier()
        loader = Loader(model, optimizer)
        began = time.perf_counter()
        loaded = restore.after_failure(loader, local, device="cpu", world_size=WORLD, held=replicator.held,
                                       fingerprint=lambda t: int(prints.fingerprint(t)))
        restore_seconds.append(time.perf_counter() - began)
        assert loaded["source"] == ("peer" if rank >= LOCAL else "snapshot"), loaded
        received = loaded["bytes_received"]
        dist.barrier()
    snaps.close(completed=True)
    result = {"rank": rank, "bytes": saved[0]["bytes"], "beside": beside, "sync": synchronous,
              "replicate_seconds": [f["seconds"] for f in replicated], "replicated_bytes": replicated[0]["bytes"],
              "checkpoint_seconds": checkpoint_seconds, "restore_seconds": restore_seconds, "received": received}
    (root / f"result-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    args = parser.parse_args(argv)
    import torch.multiprocessing as tmp

    with tempfile.TemporaryDirectory(prefix="bench-peer-") as folder:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        tmp.start_processes(_rank, args=(folder, port, vars(args)), nprocs=WORLD, start_method="fork")
        results = [json.loads((Path(folder) / f"result-{rank}.json").read_text()) for rank in range(WORLD)]

    def median(key: str, ranks=range(WORLD)) -> float:
        return statistics.median(value for rank in ranks for value in results[rank][key])

    mb = results[0]["bytes"] / 1e6
    print(f"## Snapshot replication and peer recovery\n\n`.venv/bin/python bench/bench_peer.py --runs {args.runs} "
          f"--n-embd {args.n_embd} --n-layer {args.n_layer}`: 2 simulated nodes x 2 ranks on loopback (gloo), the "
          f"trainer's GPT ({args.n_layer} layers, {args.n_embd} wide) with its AdamW state, {mb:.2f} MB a rank's "
          f"snapshot; medians over {args.runs} runs x 4 ranks (restores: x 2 ranks each)\n")
    print("| measure | seconds |\n|---|---:|")
    print(f"| step blocked by a snapshot, replicated beside training | {median('beside'):.4f} |")
    print(f"| step blocked by a snapshot taken and replicated synchronously | {median('sync'):.4f} |")
    print(f"| replication of one snapshot ({results[0]['replicated_bytes'] / 1e6:.2f} MB to the peer) | "
          f"{median('replicate_seconds'):.4f} |")
    print(f"| restore from the rank's own snapshot (ranks 0, 1) | {median('restore_seconds', (0, 1)):.4f} |")
    print(f"| restore from the peer ({results[2]['received'] / 1e6:.2f} MB received, ranks 2, 3) | "
          f"{median('restore_seconds', (2, 3)):.4f} |")
    print(f"| restore from the durable checkpoint (verified, loaded; every rank) | {median('checkpoint_seconds'):.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
