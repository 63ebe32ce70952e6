"""Checkpoints signed with another key stop a run instead of being silently replaced.

Before: `train` with another key started from step 0 (exit 0) and retention deleted the old checkpoints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainguard.runtime.checkpoint import CheckpointManager, keys
from trainguard.runtime.checkpoint.manager import KeyMismatchError

REPO = Path(__file__).resolve().parents[2]
TINY = ["--set", "model.n_layer=1", "--set", "model.n_embd=32", "--telemetry", "off"]


def _signed_run(run_dir: Path, key_file: Path, steps=(2, 4)) -> None:
    manager = CheckpointManager(run_dir, key_file=key_file)
    for step in steps:
        manager.save(step, {"model": {"w": torch.full((8,), float(step))}}, stable=True)


def test_a_manager_under_another_key_refuses_naming_both_keys_and_the_way_out(tmp_path):
    first, second = tmp_path / "k1" / "checkpoint.key", tmp_path / "k2" / "checkpoint.key"
    _signed_run(tmp_path / "run", first)
    with pytest.raises(KeyMismatchError) as info:
        CheckpointManager(tmp_path / "run", key_file=second, check_key=True)
    message = str(info.value)
    assert str(second) in message and keys.key_id(keys.load_key(first)) in message
    assert keys.key_id(keys.load_key(second)) in message and "--key-file" in message and "--start-over" in message
    assert info.value.code == "wrong_key"
    CheckpointManager(tmp_path / "run", key_file=first, check_key=True)   # the right key: no complaint
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["status.json", "step_2",
                                                                                   "step_4"]


def _train(run_dir: Path, config_home: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CONFIG_HOME": str(config_home), "PYTHONPATH": str(REPO)}
    env.pop("TRAINGUARD_CHECKPOINT_KEY", None)
    return subprocess.run([sys.executable, "-m", "trainguard.cli", "train", "--run-dir", str(run_dir),
                           "--steps", "2", "--checkpoint-every", "1", *TINY, *extra],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)


@pytest.mark.slow
def test_train_under_another_key_exits_2_and_keeps_the_checkpoints_unless_told_to_start_over(tmp_path):
    run_dir = tmp_path / "run"
    key1 = tmp_path / "k1" / "trainguard" / "checkpoint.key"
    _signed_run(run_dir, key1, steps=(20, 30, 40))

    refused = _train(run_dir, tmp_path / "k2")
    assert refused.returncode == 2, refused.stderr
    assert "Traceback" not in refused.stderr
    key2 = tmp_path / "k2" / "trainguard" / "checkpoint.key"
    assert str(key2) in refused.stderr and keys.key_id(keys.load_key(key1)) in refused.stderr
    assert "--start-over" in refused.stderr and "--key-file" in refused.stderr
    assert CheckpointManager(run_dir, key_file=key1).steps() == [20, 30, 40]   # nothing touched

    fresh = _train(run_dir, tmp_path / "k2", "--start-over")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    invalid = sorted(p.name.split("-")[0] for p in (run_dir / "checkpoints" / "invalid").iterdir())
    assert invalid == ["step_20", "step_30", "step_40"]   # set aside, not deleted: they still verify
    reason = json.loads(next((run_dir / "checkpoints" / "invalid").glob("step_40-*/reason.json")).read_text())
    assert reason["code"] == "wrong_key"
    moved = next((run_dir / "checkpoints" / "invalid").glob("step_40-*"))
    from trainguard.runtime.checkpoint import verify

    assert verify(moved.parent / moved.name, key_file=key1).code == "step_mismatch"   # intact, signed by key1
    assert CheckpointManager(run_dir, key_file=key2).steps() == [1, 2]
