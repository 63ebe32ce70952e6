"""The guard inside the loop: skip, rollback, stop, on the tiny model with injected faults (CPU, real torch)."""

from __future__ import annotations

import json

import torch

from tests.trainer.helpers import events, final_losses, step_records, train, write_policy
from trainguard.runtime.checkpoint.manager import CheckpointManager

# Small windows so a 40-step run exercises every path; the thresholds themselves are the defaults'.
GUARD = dict(spike_min_steps=10, spike_window=64, grad_min_steps=10, rollback_after=3, rollback_window=10,
             rewarmup_steps=5, rollback_lr_factor=0.5)


def _state(run_dir, step):
    manager = CheckpointManager(run_dir)
    checkpoint = next(c for c in [manager.latest_verified()] if c and c.step == step)
    return checkpoint, manager.load(checkpoint)


def test_injected_nan_is_skipped_and_leaves_weights_unchanged(tmp_path):
    run = tmp_path / "run"
    assert train(run, "--steps", "4") == 0                     # step_4: the weights before the NaN step
    before = CheckpointManager(run).load(CheckpointManager(run).latest_verified())
    assert train(run, "--steps", "5", "--inject", "nan@5") == 0   # resumes at 4, step 5 is NaN
    checkpoint, after = _state(run, 5)

    skip = events(run, "skip_step")
    assert [(e["step"], e["reason"]) for e in skip] == [(5, "nan")]
    assert [e["fault"] for e in events(run, "fault_injected")] == ["nan@5"]
    for name, tensor in before["model"].items():
        assert torch.equal(tensor, after["model"][name]), name
    assert after["sched"]["updates"] == before["sched"]["updates"] == 4      # the schedule did not move
    assert torch.equal(before["optim"]["state"][0]["exp_avg"], after["optim"]["state"][0]["exp_avg"])
    assert after["data"]["consumed"] == before["data"]["consumed"] + 8        # the bad batch was consumed
    assert checkpoint.stable is False                        # guard trouble since the previous checkpoint
    record = step_records(run)[-1]
    assert record["step"] == 5 and record["metrics"]["loss"] != record["metrics"]["loss"]  # NaN logged
    assert record["metrics"]["tokens_trained"] == 4 * 8 * 64


def test_spikes_skip_then_roll_back_to_the_last_stable_checkpoint_and_complete(tmp_path):
    run = tmp_path / "run"
    policy = write_policy(tmp_path / "policy.yaml", **GUARD)
    faults = ["spike@22", "spike@33", "spike@34", "spike@35"]
    code = train(run, "--steps", "40", "--checkpoint-every", "10", "--policy", str(policy),
                 *sum((["--inject", f] for f in faults), []))
    assert code == 0

    skips = [(e["step"], e["reason"]) for e in events(run, "skip_step")]
    assert skips == [(22, "loss_spike"), (33, "loss_spike"), (34, "loss_spike")]
    (rollback,) = events(run, "rollback")
    # step_30 is not stable (the skip at 22 came after step_20), so the rollback goes to step_20
    saved = [(e["step"], e["stable"]) for e in events(run, "checkpoint_saved")]
    assert saved == [(10, True), (20, True), (30, False), (30, True), (40, True)]
    assert rollback["step"] == 35 and rollback["reason"] == "repeated_loss_spike"
    assert rollback["restored_step"] == 20 and rollback["steps_lost"] == 15
    assert rollback["data_windows_skipped"] == 15 * 8 and rollback["lr_scale"] == 0.5

    steps = step_records(run)
    assert [r["step"] for r in steps] == list(range(1, 36)) + list(range(21, 41))
    loaded = [r["metrics"]["tokens_loaded"] for r in steps]
    assert loaded == sorted(loaded) and len(set(loaded)) == len(loaded)   # fresh data after the rollback
    first, second = steps[20]["metrics"], steps[35]["metrics"]            # step 21, before and after
    assert steps[35]["step"] == 21 and second["learning_rate"] < 0.5 * first["learning_rate"]
    assert steps[-1]["step"] == 40 and events(run, "run_end")[-1]["reason"] == "completed"
    assert max(final_losses(run).values()) < 10                           # no spike left in the result


def test_rollback_limit_stops_the_run_and_a_restart_refuses(tmp_path):
    run = tmp_path / "run"
    policy = write_policy(tmp_path / "policy.yaml", **{**GUARD, "max_rollbacks_per_hour": 0})
    flags = ["--steps", "30", "--checkpoint-every", "10", "--policy", str(policy),
             "--inject", "spike@15", "--inject", "spike@16", "--inject", "spike@17"]
    assert train(run, *flags) == 3
    (stop,) = events(run, "stop")
    assert stop["step"] == 17 and stop["reason"] == "rollback_limit"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_10"]   # nothing new saved
    assert (run / "control" / "stopped.json").exists()
    assert train(run, *flags) == 3                      # restarted workers do not loop
    assert len(events(run, "run_start")) == 1


def test_a_stop_marker_anyone_wrote_stops_nothing(tmp_path, capsys):
    """RUN/control/stopped.json keeps every restarted worker from starting; a stranger's copy (or one
    of another run) did the same. Only the marker rank 0 signed is honoured; another is named and recorded."""
    from trainguard.cli import main

    run = tmp_path / "run"
    (run / "control").mkdir(parents=True)
    (run / "control" / "stopped.json").write_text(json.dumps({"step": 1, "reason": "rollback_limit"}))
    assert train(run, "--steps", "3") == 0
    (refused,) = events(run, "stop_marker_refused")
    assert refused["reason"] == "unsigned" and events(run, "run_end")[-1]["reason"] == "completed"
    capsys.readouterr()
    main(["status", str(run)])
    assert "stop marker NOT honoured (unsigned): the run started anyway" in capsys.readouterr().out


def test_a_worker_refuses_a_config_changed_after_the_launcher_wrote_it(tmp_path):
    """Every rank re-reads RUN/config.yaml at each restart; whoever could write it chose what the
    run trained with (the steps, the LR, the policy file). Workers now get the launcher's digest of it."""
    import argparse
    import hashlib
    import subprocess
    import sys

    from trainguard.trainer import cli

    run = tmp_path / "run"
    assert train(run, "--steps", "1") == 0
    config = run / "config.yaml"
    digest = hashlib.sha256(config.read_bytes()).hexdigest()
    parser = argparse.ArgumentParser()
    cli.add_config_arguments(parser)
    as_written = cli.build_config(parser.parse_args(["--run-dir", str(run), "--config", str(config)]))
    assert cli.config_digest(as_written) == digest                 # what a worker reads back checks
    config.write_text(config.read_text().replace("steps: 1\n", "steps: 2\n"))
    assert "steps: 2\n" in config.read_text()
    worker = [sys.executable, "-m", "trainguard.trainer.train", "--run-dir", str(run), "--config", str(config),
              "--config-sha256", digest]
    refused = subprocess.run(worker, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "changed after the launcher wrote it" in refused.stderr, refused.stderr
