"""`--checkpoint-every auto`: a run with injected crashes moves its checkpoint interval as the rule says
(trainguard/decide/checkpoint_interval.py), with a `checkpoint_interval` event per change and the
intervals as step metrics; the library's Protector takes `checkpoint_every="auto"` too."""

from __future__ import annotations

import pytest
import yaml

from tests.trainer.helpers import events, records, step_records, train_subprocess
from trainguard import tls
from trainguard.decide import checkpoint_interval as ci
from trainguard.policy import CheckpointPolicy, from_mapping

# A fleet that fails every hour per device: the prior a CPU run (one device) starts from. Failures every
# few tens of seconds pull the MTBF (and the interval) down with each crash.
# Today's restart path (no in-memory snapshots): one tier, whose interval falls as the MTBF falls (with
# snapshots the durable tier lengthens as they cover more failures: tests/decide/test_checkpoint_interval.py).
POLICY = {"checkpoint": {"fleet_mtbf_gpu_hours": 1.0, "min_interval_seconds": 0.05}, "recovery": {"mode": "restart"}}


def _rule_says(event: dict, policy: CheckpointPolicy) -> float:
    """The interval the rule gives for the inputs the event recorded."""
    measured = ci.Measured(event["mtbf_seconds"], event["mtbf_source"], event["failures"],
                           event["observed_seconds"], event["save_seconds"], event["restart_seconds"],
                           event.get("snapshot_seconds"), event.get("snapshot_share", 0.0))
    return ci.recommend(measured, policy).interval_seconds


@pytest.mark.slow
def test_crashes_move_the_interval_as_the_rule_says(tmp_path):
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(POLICY))
    policy = from_mapping(POLICY).checkpoint
    run = tmp_path / "run"
    result = train_subprocess(run, "--steps", "14", "--checkpoint-every", "auto", "--policy", str(policy_file),
                              "--max-restarts", "2", "--inject", "crash@5", "--inject", "crash@10", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]

    changes = events(run, ci.INTERVAL_EVENT)
    first, measured = changes[0], changes[1:]
    assert first["reason"] == "no save measured yet" and first["applied_seconds"] == 0.05
    # the first save is measured before crash@5 on a quiet host; on a busy one its write may still be in
    # flight then, and the first measured change comes after the restart (CI saw failures == 1 first)
    assert measured[-1]["failures"] == 2
    for change in measured:                                   # every change is the rule on its recorded inputs
        assert change["applied_seconds"] == pytest.approx(_rule_says(change, policy), rel=1e-4, abs=1e-3)   # applied to the ms, its inputs to the µs
        assert change["save_seconds"] > 0
    failures = [c["failures"] for c in measured]
    assert failures == sorted(failures) and {1, 2} <= set(failures)
    first_after = {n: next(c for c in measured if c["failures"] == n) for n in (1, 2)}
    assert first_after[1]["restart_seconds"] > 0
    # more failures in less time: a shorter MTBF than the fleet's prior (one device, failing every hour), and
    # the interval with it: shorter than the rule gives for the same save cost at the prior
    prior = POLICY["checkpoint"]["fleet_mtbf_gpu_hours"] * 3600
    assert prior > first_after[1]["mtbf_seconds"] > first_after[2]["mtbf_seconds"]
    at_prior = {**measured[-1], "mtbf_seconds": prior, "mtbf_source": "prior:policy", "failures": 0}
    assert measured[-1]["applied_seconds"] < _rule_says(at_prior, policy)

    # the step records carry the interval in force (the agent exports them as metrics)
    applied_at = [(tls.parse_timestamp(r["timestamp"]), r["event"]["applied_seconds"])
                  for r in records(run) if r.get("event", {}).get("type") == ci.INTERVAL_EVENT]
    last = step_records(run)[-1]
    assert last["metrics"]["checkpoint_interval_seconds"] == applied_at[-1][1]
    assert last["metrics"]["checkpoint_interval_recommended_seconds"] > 0


def test_the_flag_takes_auto_or_steps(tmp_path, capsys):
    from trainguard.trainer import cli, config

    parser = __import__("argparse").ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--run-dir", str(tmp_path), "--checkpoint-every", "auto"])
    built = cli.build_config(args)
    assert built.run.checkpoint_auto and built.run.checkpoint_every == 0
    assert cli.build_config(parser.parse_args(["--run-dir", str(tmp_path), "--checkpoint-every", "7"])).run.checkpoint_every == 7
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--run-dir", str(tmp_path), "--checkpoint-every", "often"])
    assert exited.value.code == 2 and "number of steps or 'auto'" in capsys.readouterr().err
    with pytest.raises(config.ConfigError, match="run.checkpoint_auto"):
        config.validate(config.TrainConfig(run=config.RunConfig(checkpoint_auto=True, checkpoint_every=5)))
