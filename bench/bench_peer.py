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

`--replaced-node`: the same through `trainguard train` (2 launchers x 2 ranks on loopback, tests/culprit/
cluster.py, checkpoint every 10, snapshot every 5): rank 3 SIGKILLed at step 18, and as soon as its
`fault_injected` event is written, node 1's tmpfs is emptied (its ranks' snapshot directories and the
replicas they held: a node that comes back empty, or a spare with the same rank numbers). torchrun restarts
every worker; node 1's ranks take their snapshot from node 0 (`snapshot_restored`, `source: peer`) with
`recovery.replicate: on`, and every rank goes back to the checkpoint with `off`. Per run: fault -> next step
(rank 3's `fault_injected` to rank 0's first step record after its restart), the restored step and the work
lost, the bytes node 1 received.

    .venv/bin/python bench/bench_peer.py --replaced-node
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


FAULT_RANK, FAULT_AT, STEPS = 3, 18, 24


def replaced_node_run(folder: Path, replicate: str) -> dict:
    """One 2 x 2 `trainguard train` run: rank 3 killed at FAULT_AT, node 1's tmpfs emptied; its measures."""
    import shutil

    import yaml

    from tests.culprit.cluster import Cluster
    from trainguard import event_types, tls

    run_dir, shm = folder / "run", folder / "shm"
    (run_dir / "tls").mkdir(parents=True)
    shm.mkdir(mode=0o700)
    policy = folder / "policy.yaml"
    # no warm standby: the killed rank's node comes back empty through torchrun's restart of every worker
    # (a standby would take the rank's place in-process: runtime/resilience/standby.py)
    policy.write_text(yaml.safe_dump({"recovery": {"mode": "in_process", "snapshot_every": 5, "snapshot_dir": str(shm),
                                                   "replicate": replicate, "standbys": 0}}))
    cluster = Cluster(folder, run_dir, policy)
    fault_log = run_dir / "tls" / f"rank-{FAULT_RANK}.jsonl"
    try:
        cluster.start_store()
        cluster.wait_store()
        args = ("--steps", str(STEPS), "--checkpoint-every", "10", "--device", "cpu",
                "--inject", f"crash@{FAULT_AT}:{FAULT_RANK}")
        launchers = [cluster.launch(node, *args, nnodes="2", nproc=2) for node in ("n1", "n2")]
        deadline = time.monotonic() + 600
        while not (fault_log.exists() and event_types.FAULT_INJECTED in fault_log.read_text()):
            if time.monotonic() > deadline or any(launcher.poll() is not None for launcher in launchers):
                raise RuntimeError(f"no fault in {fault_log}\n{cluster.diagnostics()}")
            time.sleep(0.05)
        # node 1 (ranks 2, 3) back empty: its ranks' own snapshots and the replicas of node 0 it held
        for rank_dir in [*shm.glob("*/*/rank-2"), *shm.glob("*/*/rank-3"), *shm.glob("*/*/replica-0"),
                         *shm.glob("*/*/replica-1")]:
            shutil.rmtree(rank_dir)
        codes = [launcher.wait(timeout=900) for launcher in launchers]
    finally:
        cluster.stop()
    if codes != [0, 0]:
        raise RuntimeError(f"replicate {replicate}: launchers exited {codes}\n{cluster.diagnostics()}")
    logs = {rank: tls.read_records(run_dir / "tls" / f"rank-{rank}.jsonl") for rank in range(4)}
    fault_time = next(r["timestamp"] for r in logs[FAULT_RANK]
                      if (r.get("event") or {}).get("type") == event_types.FAULT_INJECTED)
    sources, received = {}, {}
    for rank, records in logs.items():
        starts = 0
        for record in records:
            event = record.get("event") or {}
            starts += event.get("type") == event_types.RUN_START
            if starts > 1 and event.get("type") == event_types.SNAPSHOT_RESTORED:
                sources[rank], received[rank] = event.get("source"), event.get("bytes_received", 0)
            elif starts > 1 and event.get("type") == event_types.RUN_START:
                sources.setdefault(rank, "checkpoint")
    restored_steps = set()
    next_step = None
    starts = 0
    for record in logs[0]:
        event = record.get("event") or {}
        starts += event.get("type") == event_types.RUN_START
        if starts > 1 and event.get("type") == event_types.RUN_START:
            restored_steps.add(event.get("resumed_from") or 0)
        elif starts > 1 and event.get("type") == event_types.SNAPSHOT_RESTORED:
            restored_steps = {event["restored_step"]}
        elif starts > 1 and not event and "metrics" in record:
            next_step = record["timestamp"]
            break
    [restored_step] = restored_steps
    return {"replicate": replicate, "to_next_step": next_step - fault_time, "restored_step": restored_step,
            "work_lost": FAULT_AT - 1 - restored_step, "sources": sources, "received": received}


def replaced_node(runs: int) -> int:
    found = []
    with tempfile.TemporaryDirectory(prefix="bench-peer-node-") as folder:
        for run in range(runs):
            for replicate in ("on", "off"):
                place = Path(folder) / f"{replicate}-{run}"
                place.mkdir()
                found.append(replaced_node_run(place, replicate))
    print(f"## A node back empty after a kill\n\n`.venv/bin/python bench/bench_peer.py --replaced-node --runs {runs}`: "
          f"2 x 2 through `trainguard train`, rank 3 SIGKILLed at step {FAULT_AT}, node 1's tmpfs emptied; load "
          f"average {os.getloadavg()[0]:.1f}\n")
    print("| recovery.replicate | fault -> next step (s) | restored step | work lost (steps) | sources (rank: where) "
          "| bytes received (rank 2, 3) |\n|---|---:|---:|---:|---|---|")
    for r in found:
        print(f"| {r['replicate']} | {r['to_next_step']:.2f} | {r['restored_step']} | {r['work_lost']} | "
              f"{r['sources']} | {r['received'].get(2, 0)}, {r['received'].get(3, 0)} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--replaced-node", action="store_true",
                        help="through `trainguard train`: a node back empty after a kill, replicate on and off")
    args = parser.parse_args(argv)
    if args.replaced_node:
        return replaced_node(args.runs)
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
