"""Diagnose over runs of the real bundled trainer with an injected cause (CPU, gloo, torchrun for 2 ranks).

Each slowio injection stalls the data loader 0.5 s per batch for 5 steps (trainer/faults.py); three of
them make the cause unmistakable on a busy CI machine, whose own noise shows up as step jitter.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainguard.diagnose import PROBLEM, diagnose_run

pytestmark = pytest.mark.slow
SLOW_STEPS = (10, 20, 30)


def train(run_dir, *args):
    command = [sys.executable, "-m", "trainguard.cli", "train", "--run-dir", str(run_dir), "--steps", "40",
               *[f"--inject=slowio@{step}{args[0] if args else ''}" for step in SLOW_STEPS], *args[1:]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]


def test_injected_slow_io_is_named_first_with_its_steps(tmp_path):
    train(tmp_path)
    findings = diagnose_run(tmp_path)
    first = findings[0]
    assert (first.layer, first.check, first.status) == ("data", "data_wait", PROBLEM), first
    slow = sorted(s["steps"][0] for s in first.evidence["stretches"] if s["rows"] >= 5)
    assert slow == list(SLOW_STEPS)


def test_a_rank_that_sleeps_is_named_as_the_straggler_not_the_network(tmp_path):
    train(tmp_path, ":1", "--nproc", "2")
    findings = {f.check: f for f in diagnose_run(tmp_path)}
    first = diagnose_run(tmp_path)[0]
    assert (first.check, first.evidence["rank"], first.evidence["straggler"]) == ("data_wait", 1, True), first
    assert "data straggler" in first.cause
    # rank 0 spends those stalls inside the all-reduce, waiting: that is not a communication-bound job
    assert findings["comm_share"].status != PROBLEM
