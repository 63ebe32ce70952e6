"""Auto-resume: a restarted run continues from the newest verified checkpoint and trains exactly as an
uninterrupted one would (CPU, fixed seed)."""

from __future__ import annotations

import json

import pytest

from tests.trainer.helpers import events, final_losses, records, train, train_subprocess


def test_resume_in_two_invocations_equals_uninterrupted(tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert train(whole, "--steps", "16", "--checkpoint-every", "8") == 0
    assert train(split, "--steps", "8", "--checkpoint-every", "8") == 0
    assert train(split, "--steps", "16", "--checkpoint-every", "8") == 0
    assert final_losses(split) == final_losses(whole)
    assert events(split, "run_start")[1]["resumed_from"] == 8


@pytest.mark.slow
def test_crash_restart_by_the_launcher_skips_a_corrupt_checkpoint_and_matches(tmp_path):
    """crash@25 kills the worker (SIGKILL); the elastic launcher restarts it; step_20 was corrupted on disk
    so the restart resumes from step_10; the crash does not fire again; the losses equal a clean run's
    (trained in this process: the same trainer, one thread as in the launcher's worker, tests/trainer/conftest.py)."""
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    flags = ["--steps", "30", "--checkpoint-every", "10"]
    assert train(clean, *flags) == 0
    # today's path (docs/recovery.md): no in-memory snapshot would let the restart skip steps 11-15
    policy = tmp_path / "policy.yaml"
    policy.write_text("recovery: {mode: restart}\n")
    result = train_subprocess(faulty, *flags, "--policy", str(policy), "--max-restarts", "1",
                              "--inject", "corrupt-checkpoint@20", "--inject", "crash@25")
    assert result.returncode == 0, result.stderr[-3000:]

    starts = events(faulty, "run_start")
    assert [(s["restart_count"], s["resumed_from"]) for s in starts] == [(0, None), (1, 10)]
    invalid = events(faulty, "checkpoint_invalid")
    assert invalid and invalid[0]["step"] == 20 and invalid[0]["code"] == "hash_mismatch"
    fired = [json.loads(line)["fault"] for line in (faulty / "control" / "faults-fired.jsonl").read_text().splitlines()]
    assert fired == ["corrupt-checkpoint@20:0", "crash@25:0"]
    steps = [r["step"] for r in records(faulty) if "metrics" in r]
    assert steps == list(range(1, 25)) + list(range(11, 31))       # killed in step 25, resumed at 10
    assert final_losses(faulty) == final_losses(clean)


def test_time_interval_and_async_saves_end_on_a_verified_checkpoint(tmp_path):
    from trainguard.runtime.checkpoint.manager import CheckpointManager

    run = tmp_path / "run"
    assert train(run, "--steps", "6", "--checkpoint-every-seconds", "1e-9", "--async-checkpoint",
                 "--keep-last", "2") == 0
    saved = events(run, "checkpoint_saved")
    assert [e["step"] for e in saved] == [2, 3, 4, 5, 6] and all(e["async"] for e in saved)
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_5", "step_6"]
    assert CheckpointManager(run).latest_verified().step == 6
