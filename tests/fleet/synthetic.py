"""A synthetic shared run directory: N nodes x R ranks of the trainer's step records, and their registrations.

What a thousand-node run leaves in RUN/tls/ and RUN/control/ranks/, written in a second or two, so the
agent's per-node cost can be tested and measured against the number of nodes (tests/fleet, bench/bench_fleet.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from trainguard import rundir, tls

T0 = 1_700_000_000.0


def node_name(index: int) -> str:
    return f"node-{index:04d}"


def step_line(step: int, rank: int, node: str, run_id: str = "fleet", step_time: float = 1.0) -> bytes:
    record = tls.make_record(step=step, timestamp=T0 + step, run_id=run_id, node=node, rank=rank,
                             metrics={"loss": 3.0 - step * 1e-3, "grad_norm": 1.2, "learning_rate": 3e-4,
                                      "tokens_per_second": 5000.0, "step_time_seconds": step_time,
                                      "data_wait_seconds": 0.01, "comm_seconds": 0.05, "mfu": 0.4},
                             system={"gpu_count": 8})
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


def write_fleet(run_dir: Path, nodes: int, ranks_per_node: int = 8, steps: int = 2, *, register: bool = True,
                first_step: int = 1) -> None:
    """rank-<r>.jsonl for every rank of every node (rank r on node r // ranks_per_node), each `steps` records."""
    (run_dir / "tls").mkdir(parents=True, exist_ok=True)
    for rank in range(nodes * ranks_per_node):
        node = node_name(rank // ranks_per_node)
        with open(run_dir / "tls" / f"rank-{rank}.jsonl", "ab") as handle:
            handle.write(b"".join(step_line(s, rank, node) for s in range(first_step, first_step + steps)))
        if register and first_step == 1:
            register_rank(run_dir, rank, node)


def register_rank(run_dir: Path, rank: int, host: str) -> None:
    """A rank's registration as runtime/control.py writes it (the fields the agent's ownership reads)."""
    rundir.write_rank_file(run_dir, rank, {"rank": rank, "pid": 10_000_000 + rank, "host": host, "started_at": T0})


def append_steps(run_dir: Path, ranks: range, node: str, step: int) -> None:
    for rank in ranks:
        with open(run_dir / "tls" / f"rank-{rank}.jsonl", "ab") as handle:
            handle.write(step_line(step, rank, node))


@contextmanager
def fast_dir(fallback: Path):
    """A directory in memory (/dev/shm) when there is one: creating 16,000 files on this machine's loaded
    disk takes a minute, in tmpfs a few seconds. Falls back to `fallback` (pytest's tmp_path)."""
    if not os.access("/dev/shm", os.W_OK):
        yield fallback
        return
    path = Path(tempfile.mkdtemp(prefix="trainguard-fleet-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
