"""A healthy 2-rank run with replica checks (the launcher, gloo, a small model) and what would be a false
alarm in it: shared by tests/sdc/test_sdc_train.py (a short run) and bench/sdc_healthy.py (2,000 steps)."""

from __future__ import annotations

from pathlib import Path

from tests.trainer.helpers import events, train_subprocess, write_policy
from trainguard import incidents

EVERY = 10                   # replica_check_every
TEST_STEPS, ISSUE_STEPS = 400, 2000
SMALL = ["--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.n_head=2",
         "--set", "model.block_size=32", "--batch-size", "2", "--log-every", "1000"]
ALARMS = ("replica_mismatch", "rollback", "culprit", "cordon", "stop")


def train(tmp_path: Path, steps: int) -> Path:
    run = tmp_path / "run"
    policy = write_policy(tmp_path / "policy.yaml", replica_check_every=EVERY)
    result = train_subprocess(run, "--nproc", "2", "--steps", str(steps), "--checkpoint-every", str(steps // 4),
                              "--policy", str(policy), *SMALL, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def false_alarms(run: Path, steps: int) -> list[str]:
    """What went wrong in a run that should have raised nothing: empty when every replica check of every
    rank ran and agreed, nothing acted, no incident was written and both ranks completed."""
    wrong = []
    for rank in (0, 1):
        checks = events(run, "replica_check", rank)
        if len(checks) < steps // EVERY:
            wrong.append(f"rank {rank}: {len(checks)} replica checks, expected {steps // EVERY}")
        wrong += [f"rank {rank}: a check without one fingerprint per kind: {c}" for c in checks
                  if not (isinstance(c["weights"], str) and isinstance(c.get("gradients", ""), str))]
        wrong += [f"rank {rank}: {kind} at step {e.get('step')}" for kind in ALARMS for e in events(run, kind, rank)]
        if events(run, "run_end", rank)[-1]["reason"] != "completed":
            wrong.append(f"rank {rank}: {events(run, 'run_end', rank)[-1]}")
    wrong += [f"incident {found}" for found, _, _ in incidents.scan(run)]
    return wrong
