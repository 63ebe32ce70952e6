"""Silent corruption through the launcher (`trainguard train --nproc K`, gloo, real processes): a flipped
bit is caught at the next replica check, the right rank is named, every rank rolls back to the newest
verified checkpoint, the replicas are bit-identical again, and the run completes."""

from __future__ import annotations

import json

import pytest

from tests.sdc import healthy
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


def assert_recovered(run, nproc: int, rollbacks: list[tuple[int, int]]) -> None:
    """Every rank rolled back (mismatch step, restored step), proved the replicas one again and equal to
    the checkpoint's manifest, and finished."""
    for rank in range(nproc):
        done = events(run, "rollback", rank)
        assert [(r["step"], r["restored_step"], r["source"]) for r in done] == \
            [(mismatch, restored, "replica_check") for mismatch, restored in rollbacks]
        assert all(r["replicas_identical"] and r["fingerprint_matches_manifest"] for r in done)
        assert isinstance(checks(run, rank)[-1]["weights"], str)      # one value: every replica the same
        assert events(run, "run_end", rank)[-1]["reason"] == "completed"
    assert all(r["manifest_fingerprint"] == r["fingerprint"] for r in done)
    newest = max(run.glob("checkpoints/step_*/manifest.json"), key=lambda p: int(p.parent.name[5:]))
    meta = json.loads(newest.read_text())["meta"]["replica_fingerprint"]   # every checkpoint carries one
    assert meta["replicas"] == nproc and meta["weights"] == checks(run, 0)[-1]["weights"]


def test_three_ranks_weight_flips_name_the_rank_recover_and_cordon_its_node(tmp_path, capsys):
    run = train(tmp_path, 3, "bitflip@7:1", "bitflip@17:1", steps=25)
    faults = events(run, "fault_injected", 1)
    assert [(f["kind"], f["step"], f["target"]) for f in faults] == \
        [("bitflip", 7, "weight"), ("bitflip", 17, "weight")]
    assert not events(run, "fault_injected", 0)
    for rank in range(3):
        mismatches = events(run, "replica_mismatch", rank)             # each at the next check
        assert [(m["step"], m["what"], m["ranks"]) for m in mismatches] == [(10, "weights", [1]), (20, "weights", [1])]
        assert [m["params"] for m in mismatches] == [[f["param"]] for f in faults]   # the parameter hit
    assert_recovered(run, 3, [(10, 5), (20, 15)])
    node = records(run, 1)[0]["node"]
    verdicts = [v for _, v, _ in incidents.scan(run) if v]
    assert [(v["kind"], v["culprit"], v["action"]) for v in verdicts] == \
        [("sdc", {"rank": 1, "node": node}, "rollback")] * 2
    cordon = json.loads((run / "control" / "cordon" / node).read_text())   # named twice within the window
    assert (cordon["host"], cordon["reason"], cordon["ranks"], cordon["step"]) == (node, "replica_mismatch", [1], 20)
    assert cordon["incident"] == verdicts[1]["id"] and verdicts[1]["cordon"] == [node]
    # replay of the recorded log reproduces the decisions from the recorded fingerprints
    replayed = list(replica.replay(tls.read_records(run / "tls" / "rank-2.jsonl")))
    assert [(v.step, v.what, v.ranks, v.cordon) for v in replayed] == \
        [(10, "weights", (1,), ()), (20, "weights", (1,), (node,))]
    # ... and so does `trainguard replay` of the run directory, beside the guard's actions (in this
    # process: tests/replay runs the command as a process)
    from trainguard.cli import main

    assert main(["replay", str(run), "--json"]) == 0
    found = [(a["action"], a["step"], a["reason"]) for a in json.loads(capsys.readouterr().out)["actions"]
             if a["reason"] == "replica_mismatch"]
    assert found == [("rollback", 10, "replica_mismatch"), ("rollback", 20, "replica_mismatch")]


def test_two_ranks_gradient_flip_named_by_the_replay_weight_flip_repaired(tmp_path):
    run = train(tmp_path, 2, "gradflip@10:1", "bitflip@17:0", steps=25)
    for rank in (0, 1):
        mismatches = events(run, "replica_mismatch", rank)
        assert [(m["step"], m["what"], m["ranks"]) for m in mismatches] == [(10, "gradients", []), (20, "weights", [])]
        (culprit,) = events(run, "culprit", rank)               # the replay of steps 6..10 arbitrated
        assert (culprit["step"], culprit["rank"], culprit["kind"]) == (10, 1, "sdc")
        assert culprit["incident"] == mismatches[0]["incident"]
    assert_recovered(run, 2, [(10, 5), (20, 15)])
    first = incidents.read(run, events(run, "culprit", 0)[0]["incident"])
    assert (first["culprit"]["rank"], first["what"]) == (1, "gradients")
    second = incidents.read(run, events(run, "replica_mismatch", 0)[1]["incident"])
    assert second["culprit"] is None and "cannot be attributed" in second["reasons"][-1]
    assert not (run / "control" / "cordon").exists()


def test_a_healthy_run_raises_nothing(tmp_path):
    # 400 steps, 40 replica checks per rank: any check that differs fails it (a replica check has no
    # warm-up: the first check is as strict as the 200th). The 2,000-step form is
    # bench/sdc_healthy.py (the same run and the same checks, 5x longer).
    run = healthy.train(tmp_path, steps=healthy.TEST_STEPS)
    assert healthy.false_alarms(run, healthy.TEST_STEPS) == []
