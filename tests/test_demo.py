"""The README's first command: `trainguard demo` trains, injects faults, recovers and writes a report."""

import argparse
import subprocess
import sys

import pytest

from trainguard import tls


def fewest_steps_with_every_fault() -> tuple[int, list[str]]:
    """The shortest demo `faults_for` gives the NaN and the whole burst of spikes (the number its message
    for a shorter run announces: test_a_short_demo_announces_only_the_faults_that_can_fire)."""
    from trainguard.demo import cli as demo
    from trainguard import policy

    guard = policy.load(None).guard
    return next((steps, faults) for steps in range(1, demo.STEPS + 1)
                if len(faults := demo.faults_for(steps, guard)[0]) == 1 + demo.SPIKE_LENGTH)


@pytest.mark.slow
@pytest.mark.timeout(660)        # past the run's own 600 s, which fails with the demo's output
def test_demo_recovers_from_its_faults_and_writes_a_report(tmp_path):
    """The whole demo at the fewest steps that show its whole story (109 of the default 240: the same faults,
    the same code, half the training; the default's faults are checked below without a run)."""
    steps, faults = fewest_steps_with_every_fault()
    run_dir = tmp_path / "demo"
    result = subprocess.run([sys.executable, "-m", "trainguard.cli", "demo", "--run-dir", str(run_dir),
                             "--steps", str(steps)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    events = [r["event"] for r in tls.read_records(run_dir / "tls" / "rank-0.jsonl") if "event" in r]
    kinds = [e["type"] for e in events]
    assert kinds.count("fault_injected") == 4
    assert any(e["type"] == "skip_step" and e["reason"] == "nan" for e in events)
    rollback = next(e for e in events if e["type"] == "rollback")
    first_spike = min(int(f.partition("@")[2]) for f in faults if f.startswith("spike@"))
    assert rollback["reason"] == "repeated_loss_spike" and rollback["restored_step"] < first_spike
    assert kinds[-1] == "run_end" and events[-1]["reason"] == "completed"
    assert (run_dir / "report.html").stat().st_size > 10_000
    assert list((run_dir / "tls").glob("node-*.jsonl")), "the agent wrote no node log"
    assert f"report            {run_dir / 'report.html'}" in result.stdout


def test_a_short_demo_announces_only_the_faults_that_can_fire():
    from trainguard import policy
    from trainguard.demo import cli as demo

    guard = policy.load(None).guard
    assert demo.faults_for(240, guard) == (["nan@40", "spike@150", "spike@151", "spike@152"], None)
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert parser.parse_args([]).steps == demo.STEPS == 240        # `trainguard demo` alone runs those
    faults, left_out = demo.faults_for(30, guard)
    assert faults == ["nan@5"] and f"after {guard.spike_min_steps} healthy steps" in left_out
    # the fewest steps the message names do show the burst, one fewer does not
    need = int(left_out.split("--steps ")[1].split()[0])
    assert any(f.startswith("spike@") for f in demo.faults_for(need, guard)[0])
    assert not any(f.startswith("spike@") for f in demo.faults_for(need - 1, guard)[0])
    for steps in range(1, 400, 7):        # every announced fault lies inside the run
        assert all(0 < int(f.partition("@")[2]) <= steps for f in demo.faults_for(steps, guard)[0])


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--with-prometheus", "--steps", "30"]])
def test_a_demo_whose_faults_cannot_fire_is_refused(argv, tmp_path, capsys):
    from trainguard.cli import main

    assert main(["demo", "--run-dir", str(tmp_path / "run"), *argv]) == 2
    assert "trainguard demo: --" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
