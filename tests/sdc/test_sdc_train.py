"""Silent corruption through the launcher (`trainguard train --nproc K`, gloo, real processes): a flipped
bit is caught at the next replica check, the right rank is named, every rank rolls back to the newest
verified checkpoint, the replicas are bit-identical again, and the run completes."""

from __future__ import annotations

import json

import pytest

from tests.trainer.helpers import events, records, train_subprocess, write_policy
from trainguard import incidents, tls
from trainguard.decide import replica

pytestmark = pytest.mark.slow

EVERY = 5


def train(tmp_path, nproc: int, *faults: str, steps: int = 15):
    run = tmp_path / "run"
    policy = write_policy(tmp_path / "policy.yaml", replica_check_every=EVERY)
    result = train_subprocess(run, "--nproc", str(nproc), "--steps", str(steps), "--checkpoint-every", "5",
                              "--policy", str(policy), *sum((["--inject", f] for f in faults), []), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def checks(run, rank: int) -> list[dict]:
    return events(run, "replica_check", rank)


def assert_recovered(run, nproc: int, mismatch_step: int, restored_step: int) -> None:
    """Every rank rolled back, proved the replicas one again (and equal to the manifest), and finished."""
    for rank in range(nproc):
        (rollback,) = events(run, "rollback", rank)
        assert (rollback["step"], rollback["restored_step"], rollback["source"]) == \
            (mismatch_step, restored_step, "replica_check")
        assert rollback["replicas_identical"] and rollback["fingerprint_matches_manifest"]
        after = [c for c in checks(run, rank)][-1]
        assert isinstance(after["weights"], str)                 # one value: every replica the same
        assert events(run, "run_end", rank)[-1]["reason"] == "completed"
    manifest = json.loads((run / "checkpoints" / f"step_{restored_step}" / "manifest.json").read_text())
    assert manifest["meta"]["replica_fingerprint"] == {"step": restored_step, "weights": rollback["fingerprint"],
                                                        "replicas": nproc}


def test_three_ranks_weight_flip_names_the_rank_and_every_rank_recovers(tmp_path):
    run = train(tmp_path, 3, "bitflip@7:1")
    (fault,) = events(run, "fault_injected", 1)
    assert (fault["kind"], fault["step"], fault["target"]) == ("bitflip", 7, "weight")
    assert not events(run, "fault_injected", 0)
    for rank in range(3):
        (mismatch,) = events(run, "replica_mismatch", rank)
        assert (mismatch["step"], mismatch["what"], mismatch["ranks"]) == (10, "weights", [1])   # the next check
        assert mismatch["params"] == [fault["param"]]            # and the parameter that was hit
    assert_recovered(run, 3, mismatch_step=10, restored_step=5)
    (verdict,) = [v for _, v, _ in incidents.scan(run) if v]
    assert (verdict["kind"], verdict["culprit"], verdict["action"]) == ("sdc", {"rank": 1, "node": fault_node(run)},
                                                                       "rollback")
    # replay of the recorded log reproduces the decision from the recorded fingerprints
    replayed = list(replica.replay(tls.read_records(run / "tls" / "rank-2.jsonl")))
    assert [(v.step, v.what, v.ranks) for v in replayed] == [(10, "weights", (1,))]


def test_two_ranks_gradient_flip_told_apart_and_named_by_the_replay(tmp_path):
    run = train(tmp_path, 2, "gradflip@10:1")
    for rank in (0, 1):
        (mismatch,) = events(run, "replica_mismatch", rank)
        assert (mismatch["step"], mismatch["what"], mismatch["ranks"]) == (10, "gradients", [])
        (culprit,) = events(run, "culprit", rank)               # the replay of steps 6..10 arbitrated
        assert (culprit["rank"], culprit["kind"], culprit["incident"]) == (1, "sdc", mismatch["incident"])
    assert_recovered(run, 2, mismatch_step=10, restored_step=5)
    verdict = incidents.read(run, events(run, "culprit", 0)[0]["incident"])
    assert verdict["culprit"]["rank"] == 1 and verdict["what"] == "gradients"


def test_two_ranks_weight_flip_detected_and_repaired_not_attributed(tmp_path):
    run = train(tmp_path, 2, "bitflip@12:0", steps=20)
    for rank in (0, 1):
        (mismatch,) = events(run, "replica_mismatch", rank)
        assert (mismatch["step"], mismatch["what"], mismatch["ranks"]) == (15, "weights", [])
        assert not events(run, "culprit", rank)
    assert_recovered(run, 2, mismatch_step=15, restored_step=10)
    assert not (run / "control" / "cordon").exists()


def fault_node(run) -> str:
    return records(run, 1)[0]["node"]
