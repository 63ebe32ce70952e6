"""bench/bench_soak.py's arithmetic on logs written here (no run: the soak itself is a 30-minute bench, not CI):
the fault plan, the steps done in the window, each fault's measures and the effective training time."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import bench_soak  # noqa: E402


def step(ts, n):
    return {"timestamp": ts, "step": n, "metrics": {"loss": 1.0}}


def ev(ts, type_, **fields):
    return {"timestamp": ts, "event": {"type": type_, **fields}}


def test_the_plan_puts_faults_inside_the_window_in_turn():
    plan = bench_soak.fault_plan(1000.0, 30, 300, ["error", "crash"])
    assert [f.at for f in plan] == [1300.0, 1600.0, 1900.0, 2200.0, 2500.0]    # none at the window's end
    assert [f.kind for f in plan] == ["error", "crash", "error", "crash", "error"]
    assert [f.rank for f in plan] == [3, 1, 2, 3, 1]
    assert plan[0].spec == "error@t1300.0:3"
    assert len(bench_soak.fault_plan(0.0, 3, 50, ["crash"])) == 3


def test_fault_mix_is_checked():
    assert bench_soak._faults("error, crash") == ["error", "crash"]
    for bad in ("hang", "", "error,bogus"):
        with pytest.raises(argparse.ArgumentTypeError, match="--faults"):
            bench_soak._faults(bad)


def in_process_run():
    """Steps 1..20 at 1/s from t=0, an exception on rank 3 at t=10.5 recovered in-process at t=11 from the
    step-5 snapshot (steps 6..10 trained again), then steps 6..25 from t=12."""
    rank0 = [ev(0.0, "run_start")] + [step(float(n), n) for n in range(1, 11)]
    rank0 += [ev(11.0, "in_process_restart", restored_step=5, teardown_seconds=0.1, reform_seconds=0.1,
                 restore_seconds=0.2, recovery_seconds=0.5, source="snapshot")]
    rank0 += [step(11.0 + k, n) for k, n in enumerate(range(6, 26), start=1)]
    rank3 = [ev(0.0, "run_start"), ev(10.5, "fault_injected", kind="error", step=11)]
    return {0: rank0, 1: [ev(0.0, "run_start")], 2: [ev(0.0, "run_start")], 3: rank3}


def restart_run():
    """The same fault under the restart path: every worker starts again at t=40 from the step-0 checkpoint
    (none saved), rank 3's process included."""
    rank0 = [ev(0.0, "run_start")] + [step(float(n), n) for n in range(1, 11)]
    rank0 += [ev(40.0, "run_start", resumed_from=None)] + [step(40.0 + n, n) for n in range(1, 10)]
    others = {rank: [ev(0.0, "run_start"), ev(40.0, "run_start")] for rank in (1, 2)}
    rank3 = [ev(0.0, "run_start"), ev(10.5, "fault_injected", kind="error", step=11), ev(40.0, "run_start")]
    return {0: rank0, **others, 3: rank3}


def test_each_faults_measures_from_the_logs():
    run = bench_soak.measure(in_process_run(), start=0.0, end=32.0)
    assert run["steps_done"] == 25
    [fault] = run["faults"]
    assert (fault["kind"], fault["rank"], fault["done_at_fault"], fault["restored_step"]) == ("error", 3, 10, 5)
    assert fault["work_lost_steps"] == 5 and fault["to_next_step_seconds"] == pytest.approx(1.5)
    assert fault["healthy_ranks_ended"] == [] and fault["source"] == "snapshot"
    assert fault["teardown_seconds"] == 0.1

    slow = bench_soak.measure(restart_run(), start=0.0, end=49.0)
    [fault] = slow["faults"]
    assert slow["steps_done"] == 10                                 # its furthest step: 10 before the fault
    assert fault["restored_step"] == 0 and fault["work_lost_steps"] == 10
    assert fault["to_next_step_seconds"] == pytest.approx(30.5) and fault["healthy_ranks_ended"] == [0, 1, 2]


def test_the_window_counts_steps_between_its_ends_and_its_faults_only():
    run = bench_soak.measure(in_process_run(), start=5.0, end=20.0)
    assert run["steps_done"] == 14 - 5                              # step 14 at t=20 (11 + 9 steps), 5 at t=5
    assert len(run["faults"]) == 1
    assert bench_soak.measure(in_process_run(), start=11.0, end=20.0)["faults"] == []


def test_effective_training_time_against_the_reference():
    fast = bench_soak.measure(in_process_run(), start=0.0, end=32.0)
    row = bench_soak.summarise("in_process", fast, reference_steps=32, window_seconds=32.0)
    assert row["effective"] == pytest.approx(25 / 32, abs=1e-4) and not row["goal_met"]
    assert row["seconds_lost_per_fault"] == pytest.approx(7.0)      # 7 steps short at the reference's 1 step/s
    assert row["mean_work_lost_steps"] == 5 and row["mean_work_lost_seconds"] == pytest.approx(5.0)
    assert row["healthy_ranks_ended"] == 0 and row["unrecovered"] == 0
    assert bench_soak.summarise("x", {"steps_done": 96, "faults": []}, 100, 10.0)["goal_met"]


def test_the_markdown_has_a_row_per_path_and_per_fault():
    runs = {"fault-free": {"steps_done": 32, "faults": []},
            "in_process": bench_soak.measure(in_process_run(), 0.0, 32.0),
            "restart": bench_soak.measure(restart_run(), 0.0, 49.0)}
    result = {"command": "python bench/bench_soak.py --minutes 0.5", "window_seconds": 32.0, "reference_steps": 32,
              "args": {"minutes": 0.5, "warmup": 0.0, "fault_every": 10.0, "faults": ["error"], "checkpoint_every": 0,
                       "checkpoint_every_seconds": 300.0},
              "load_average": [1.0, 2.0], "runs": runs, "notes": ["a note"],
              "paths": [bench_soak.summarise(p, runs[p], 32, 32.0) for p in ("restart", "in_process")]}
    text = bench_soak.render(result)
    assert "| in_process | 25 | **78.1%** (goal 95%: not met) |" in text
    assert "| restart | error | 3 | 11 | 30.5 | 10 | checkpoint | [0, 1, 2] |" in text
    assert "- a note" in text
    runs["restart"] = bench_soak.measure(restart_run(), 0.0, 32.0)      # back after the window's end
    assert "| restart | error | 3 | 11 | no step in the window | - | - | none |" in bench_soak.render(result)


def test_a_guard_rollback_is_no_faults_work_lost():
    """A rollback of the guard's before a fault: the fault loses the steps since its own restore point, from
    the step the run was at (not its furthest); the rollback is listed apart."""
    logs = in_process_run()
    logs[0] = [r for r in logs[0] if r["timestamp"] < 8.0] + [
        ev(8.0, "rollback", step=7, restored_step=2, steps_lost=5, reason="loss_drift"),
        step(8.5, 3), step(9.0, 4), step(10.0, 5)] + [r for r in logs[0] if r["timestamp"] >= 11.0]
    run = bench_soak.measure(logs, start=0.0, end=32.0)
    assert run["faults"][0]["done_at_fault"] == 5 and run["faults"][0]["work_lost_steps"] == 0
    assert run["rollbacks"] == [{"step": 7, "restored_step": 2, "steps_lost": 5, "reason": "loss_drift"}]
    assert bench_soak.summarise("in_process", run, 32, 32.0)["rollback_steps"] == 5


def test_a_stopped_runs_snapshots_are_cleared_and_no_one_elses(tmp_path):
    import json
    import os

    user = tmp_path / f"trainguard-{os.getuid()}"
    for tag, run in (("mine", "/tmp/x/in_process/run"), ("theirs", "/tmp/other/run")):
        (user / tag / "rank-0").mkdir(parents=True)
        (user / tag / "rank-0" / "snapshot-5.json").write_text(json.dumps({"run": run}))
    bench_soak._clear_snapshots(Path("/tmp/x/in_process/run"), [f"recovery.snapshot_dir={tmp_path}"])
    assert sorted(p.name for p in user.iterdir()) == ["theirs"]
