"""Diagnose over runs of the real bundled trainer with an injected cause (CPU, gloo, torchrun for 2 ranks).

Each slowio injection stalls the data loader 0.5 s per batch for 5 steps (trainer/faults.py); six in a
row stall steps 10-39. That many make the cause dominate what a busy shared machine adds by itself: under
a load of 8 on 2 cores the tiny model's compute time jitters enough to cost 20-45% of a run (diagnose
rightly reports it as step_jitter), more than three 5-step stalls do.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainguard.diagnose import PROBLEM, diagnose_run

pytestmark = pytest.mark.slow
SLOW_STEPS = range(10, 40, 5)     # stalls steps 10-39 of 40


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
    assert first.evidence["stretches"][0]["steps"] == [10, 39]


def test_a_rank_that_sleeps_is_named_as_the_straggler_not_the_network(tmp_path):
    train(tmp_path, ":1", "--nproc", "2")
    ranked = diagnose_run(tmp_path)
    findings, first = {f.check: f for f in ranked}, ranked[0]
    assert (first.check, first.evidence["rank"], first.evidence["straggler"]) == ("data_wait", 1, True), first
    assert "data straggler" in first.cause
    # rank 0 spends those stalls inside the all-reduce, waiting: that is not a communication-bound job
    assert findings["comm_share"].status != PROBLEM
