"""A full disk, the checkpoint half, through the CLI: a run whose checkpoints cannot be written trains on,
retries at every interval, reports the failure once with the path and the bytes needed, shows it in
`trainguard status`, and ends non-zero (4) without a durable final checkpoint. Before: exit 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.runtime.checkpoint.manager import EXIT_NO_DURABLE_CHECKPOINT, read_status

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_run_on_a_full_disk_retries_reports_once_shows_in_status_and_exits_4(tmp_path, small_tmpfs):
    disk = small_tmpfs("256k")   # room for the config and the records, not for a checkpoint
    run_dir = disk / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "trainguard.cli", "train", "--run-dir", str(run_dir),
                           "--steps", "3", "--checkpoint-every", "1", "--set", "model.n_layer=1",
                           "--set", "model.n_embd=32"], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == EXIT_NO_DURABLE_CHECKPOINT, done.stdout[-2000:] + done.stderr[-2000:]
    output = done.stdout + done.stderr
    assert output.count("\"checkpoint_save_failed\"") == 1      # reported once ...
    assert output.count("\"checkpoint_save_failed_again\"") == 2   # ... retried at every interval after it
    assert "run_ended_without_a_durable_checkpoint" in output and "Traceback" not in output

    saved = read_status(run_dir)
    assert saved["ok"] is False and saved["step"] == 3 and saved["failed_saves"] == 3
    assert saved["bytes_needed"] > saved["bytes_free"] and saved["durable_step"] is None
    assert str(run_dir / "checkpoints" / "step_3") == saved["path"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["status.json"]   # nothing half-written

    status = subprocess.run([sys.executable, "-m", "trainguard.cli", "status", str(run_dir), "--json"],
                            capture_output=True, text=True, timeout=120, env=env)
    attention = json.loads(status.stdout)["attention"]
    assert any("checkpoint step_3 failed (3 in a row; needs about" in line for line in attention), attention
