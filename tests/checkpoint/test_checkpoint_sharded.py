"""Sharded checkpoints for real, in one torchrun launch of 2 gloo ranks (dist_child.py): FSDP2 (sync) and
DDP (async) saved by every rank and restored into 2 ranks with equal weights and optimizer moments, each
rank hashing only the files its load reads; FSDP2's gradient norms equal DDP's. Then, in this process, the
2-rank FSDP2 checkpoint resharded into 1 process, DDP's read whole, and a tampered rank-1 shard refused."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoint.dist_child import CONFIG
from trainguard.trainer import parallel
from trainguard.runtime.checkpoint import CheckpointManager, verify
from trainguard.trainer.model import GPT

CHILD = Path(__file__).with_name("dist_child.py")
REPO = Path(__file__).resolve().parents[2]


def torchrun(nproc: int, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", str(CHILD), *args],
                          capture_output=True, text=True, timeout=400, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _hashed(output: str, mode: str) -> dict[int, set[str]]:
    found = re.findall(rf"RESTORED {mode} step=2 rank=(\d) hashed=(\[[^\]\n]*\])", output)   # not greedy: a rank's line may run on into another's
    return {int(rank): set(json.loads(names)) for rank, names in found}


@pytest.mark.slow
def test_saved_by_two_ranks_restores_into_one_and_two_with_equal_weights(tmp_path, key_file):
    output = torchrun(2, str(tmp_path), str(key_file))
    assert "NORMS OK" in output, output
    for mode in (parallel.FSDP2, parallel.DDP):
        step = tmp_path / mode / "checkpoints" / "step_2"
        manifest = json.loads((step / "manifest.json").read_text())
        assert manifest["format"] == "trainguard-checkpoint/2" and manifest["world_size"] == 2
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "extra.pt"} <= set(manifest["files"])  # each rank
        hashed = _hashed(output, mode)
        assert set(hashed) == {0, 1}, output
        stored = set(manifest["files"]) - {"manifest.json", "extra.pt"}
        for names in hashed.values():   # the metadata and the rank's plan's shards, nothing else
            assert {".metadata"} <= names <= stored
        if mode == parallel.FSDP2:      # a rank that holds its own shards reads (and hashes) only those
            assert min(len(names) for names in hashed.values()) < len(stored), hashed
        assert verify(step, key_file=key_file).ok

    # FSDP2, 2 ranks -> 1 plain process: DCP reshards the DTensor shards into whole tensors
    run = tmp_path / parallel.FSDP2
    expected = torch.load(run / "expected.pt", weights_only=True)
    torch.manual_seed(1)
    model = GPT(CONFIG)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _, state = CheckpointManager(run, key_file=key_file).load_latest(into=parallel.train_state(model, optim))
    parallel.load_train_state(model, optim, state)
    for name, tensor in expected["weights"].items():
        assert torch.equal(model.state_dict()[name], tensor), name
    restored = parallel.OptimizerState(model, optim, by_name=True).state_dict()["state"]
    for name, tensor in expected["exp_avg"].items():
        assert torch.equal(restored[name]["exp_avg"], tensor), name

    # DDP: the whole state in a plain process, as a single-GPU resume or an export reads it
    run = tmp_path / parallel.DDP
    expected = torch.load(run / "expected.pt", weights_only=True)
    _, whole = CheckpointManager(run, key_file=key_file).load_latest()
    for name, tensor in expected["weights"].items():
        assert torch.equal(whole["model"][name], tensor), name

    step = tmp_path / parallel.FSDP2 / "checkpoints" / "step_2"
    _flip_byte(step / "__1_0.distcp")   # rank 1's shard: refused like any other file
    result = verify(step, key_file=key_file)
    assert result.code == "hash_mismatch" and "__1_0.distcp" in result.reason
    assert CheckpointManager(tmp_path / parallel.FSDP2, key_file=key_file).load_latest(
        into=parallel.train_state(model, optim)) is None
