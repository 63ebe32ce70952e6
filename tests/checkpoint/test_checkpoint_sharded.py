"""Sharded checkpoints for real: 2 gloo ranks under torchrun, FSDP2 and DDP, saved by every rank and
restored into 1 and into 2 ranks with equal weights and optimizer moments (dist_child.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainguard.trainer.checkpoint import CheckpointManager, verify

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


@pytest.mark.slow
@pytest.mark.parametrize("mode, async_save", [("fsdp2", "sync"), ("ddp", "async")])
def test_saved_by_two_ranks_restores_into_one_and_two_with_equal_weights(tmp_path, key_file, mode, async_save):
    run = tmp_path / "run"
    saved = torchrun(2, "save", str(run), str(key_file), mode, async_save)   # and restores into 2 fresh ranks
    assert saved.count("SAVED OK") == 2 and saved.count("RESTORED OK step=2 world=2") == 2
    step = run / "checkpoints" / "step_2"
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["format"] == "trainguard-checkpoint/2" and manifest["world_size"] == 2
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "extra.pt"} <= set(manifest["files"])  # each rank wrote
    assert verify(step, key_file=key_file).ok

    if mode == "fsdp2":   # resharded into one rank's DTensors
        assert "RESTORED OK step=2 world=1" in torchrun(1, "load", str(run), str(key_file), mode)
    else:                 # the whole state in a plain process, as a single-GPU resume or an export reads it
        expected = torch.load(run / "expected.pt", weights_only=True)
        _, state = CheckpointManager(run, key_file=key_file).load_latest()
        for name, tensor in expected["weights"].items():
            assert torch.equal(state["model"][name], tensor), name

    _flip_byte(step / "__1_0.distcp")   # rank 1's shard: refused like any other file
    result = verify(step, key_file=key_file)
    assert result.code == "hash_mismatch" and "__1_0.distcp" in result.reason
