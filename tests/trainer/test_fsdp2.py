"""`trainguard train --parallel fsdp2`: FSDP2 (fully_shard, gloo) in the bundled trainer, end to end.

One launch of 2 ranks proves the sharded checkpoints in a run: every rank writes its shards, a loss spike
rolls both ranks back to a stable checkpoint, a crashed rank's restart resumes exactly (the replayed step
has the same loss). Then, in this process, the 2-rank checkpoint restores into one rank, as FSDP2 (DCP
reshards) and as DDP (the whole state), with the saved weights and optimizer moments.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from tests.trainer.helpers import events, step_records, train, train_subprocess, write_policy
from trainguard.trainer import cli, parallel
from trainguard.runtime.checkpoint import CheckpointManager
from trainguard.trainer.loop import DistInfo, Trainer

GUARD = dict(spike_min_steps=8, spike_window=64, grad_min_steps=8, rollback_after=3, rollback_window=10,
             rewarmup_steps=5, rollback_lr_factor=0.5)


def one_rank_trainer(run, mode: str) -> Trainer:
    parser = argparse.ArgumentParser()
    cli.add_config_arguments(parser)
    args = parser.parse_args(["--run-dir", str(run), "--device", "cpu", "--parallel", mode, "--steps", "16"])
    return Trainer(cli.build_config(args), run, DistInfo())


@pytest.mark.slow
def test_fsdp2_run_saves_every_rank_rolls_back_resumes_exactly_and_restores_into_one_rank(tmp_path):
    run = tmp_path / "run"
    policy = write_policy(tmp_path / "policy.yaml", **GUARD)
    faults = ["spike@9", "spike@10", "spike@11", "crash@14:1"]
    result = train_subprocess(run, "--nproc", "2", "--parallel", "fsdp2", "--steps", "16", "--checkpoint-every",
                              "4", "--policy", str(policy), "--max-restarts", "1",
                              *sum((["--inject", f] for f in faults), []), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]

    for rank in (0, 1):
        (rollback,) = events(run, "rollback", rank)
        assert (rollback["step"], rollback["restored_step"]) == (11, 8)
        restored = [e["step"] for e in events(run, "checkpoint_restored", rank)]
        assert restored == [8, 12], restored          # the rollback, then the restarted rank's resume
        losses: dict[int, list[float]] = {}
        for record in step_records(run, rank):
            losses.setdefault(record["step"], []).append(record["metrics"]["loss"])
        assert len(losses[13]) == 2 and losses[13][0] == losses[13][1]   # replayed after the crash: exact
    manifest = json.loads((run / "checkpoints" / "step_16" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and {"__0_0.distcp", "__1_0.distcp"} <= set(manifest["files"])

    manager = CheckpointManager(run)
    whole = manager.load(manager.latest_verified())
    for mode in (parallel.FSDP2, parallel.DDP):   # 2 ranks -> 1: resharded in place, or read whole
        trainer = one_rank_trainer(run, mode)
        assert trainer.protector.begin().resumed_from == 16
        weights = trainer.model.state_dict()
        for name, tensor in whole["model"].items():
            assert torch.equal(weights[name], tensor), (mode, name)
        moments = parallel.OptimizerState(trainer.model, trainer.optimizer, by_name=True).state_dict()["state"]
        for name, saved in whole["optim"]["state"].items():
            assert torch.equal(moments[name]["exp_avg"], saved["exp_avg"]), (mode, name)
        trainer.protector.close()


def test_fsdp2_refuses_a_policy_that_asks_for_the_replica_check(tmp_path, capsys):
    policy = write_policy(tmp_path / "policy.yaml", replica_check_every=10)
    assert train(tmp_path / "run", "--parallel", "fsdp2", "--policy", str(policy)) == 2
    err = capsys.readouterr().err
    assert "guard.replica_check_every: 10 needs replicas" in err and "Traceback" not in err
    assert train(tmp_path / "run", "--set", "run.parallel=zero3") == 2
    assert "run.parallel: must be ddp or fsdp2" in capsys.readouterr().err
