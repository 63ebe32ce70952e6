"""Two ranks on gloo through torch's elastic launcher (`trainguard train --nproc 2`), real processes."""

from __future__ import annotations

import json

import pytest

from tests.trainer.helpers import events, records, step_records, train_subprocess, write_policy
from tests.trainer.test_guard_hook import GUARD
from tests import signing

pytestmark = pytest.mark.slow


def test_two_ranks_agree_on_every_global_value_and_act_together(tmp_path):
    run = tmp_path / "run"
    policy = write_policy(tmp_path / "policy.yaml", **GUARD)
    signing.append(run, "cost_throttle", "t1", alertname="CostBudgetThrottle")
    faults = ["nan@5", "spike@23", "spike@24", "spike@25"]
    result = train_subprocess(run, "--nproc", "2", "--steps", "30", "--checkpoint-every", "10",
                              "--policy", str(policy), *sum((["--inject", f] for f in faults), []))
    assert result.returncode == 0, result.stderr[-3000:]

    ranks = [step_records(run, rank) for rank in (0, 1)]
    assert [r["rank"] for r in ranks[1]] == [1] * len(ranks[1])
    assert [r["step"] for r in ranks[0]] == [r["step"] for r in ranks[1]] == list(range(1, 26)) + list(range(21, 31))
    for mine, theirs in zip(*ranks):
        for key in ("loss", "grad_norm", "learning_rate", "grad_norm_by_layer", "micro_batch_size"):
            # compared as JSON text, so NaN (the injected step 5) equals NaN
            assert json.dumps(mine["metrics"][key]) == json.dumps(theirs["metrics"][key]), (key, mine["step"])
        assert mine["timestamp"] == theirs["timestamp"]       # the guard's clock is rank 0's, on both
        assert mine["system"]["world_size"] == 2 and mine["metrics"]["comm_seconds"] > 0
    # each rank reads its own shard: same amount, different tokens, different local losses
    assert ranks[0][-1]["metrics"]["tokens_loaded"] == ranks[1][-1]["metrics"]["tokens_loaded"]

    for rank in (0, 1):
        assert [(e["step"], e["reason"]) for e in events(run, "skip_step", rank)] == [
            (5, "nan"), (23, "loss_spike"), (24, "loss_spike")]
        (rollback,) = events(run, "rollback", rank)
        assert (rollback["step"], rollback["restored_step"]) == (25, 20)
        (ack,) = events(run, "action", rank)
        assert (ack["id"], ack["step"], ack["micro_batch_size"]) == ("t1", 1, 6)
        assert events(run, "run_end", rank)[-1]["reason"] == "completed"
        info = json.loads((run / "control" / "ranks" / f"rank-{rank}.json").read_text())
        assert info["rank"] == rank and info["world_size"] == 2 and info["pid"] > 0
    restored = [e for e in events(run, "checkpoint_restored", 1)]
    assert [e["step"] for e in restored] == [20]               # rank 1 loaded rank 0's choice
    assert len(records(run, 0)) > len(step_records(run, 0))
