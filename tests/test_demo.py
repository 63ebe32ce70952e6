"""The README's first command: `trainguard demo` trains, injects faults, recovers and writes a report."""

import subprocess
import sys

import pytest

from trainguard import tls


@pytest.mark.slow
def test_demo_recovers_from_its_faults_and_writes_a_report(tmp_path):
    run_dir = tmp_path / "demo"
    result = subprocess.run([sys.executable, "-m", "trainguard.cli", "demo", "--run-dir", str(run_dir)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    events = [r["event"] for r in tls.read_records(run_dir / "tls" / "rank-0.jsonl") if "event" in r]
    kinds = [e["type"] for e in events]
    assert kinds.count("fault_injected") == 4
    assert any(e["type"] == "skip_step" and e["reason"] == "nan" for e in events)
    rollback = next(e for e in events if e["type"] == "rollback")
    assert rollback["reason"] == "repeated_loss_spike" and rollback["restored_step"] < 150
    assert kinds[-1] == "run_end" and events[-1]["reason"] == "completed"
    assert (run_dir / "report.html").stat().st_size > 10_000
    assert list((run_dir / "tls").glob("node-*.jsonl")), "the agent wrote no node log"
    assert f"report            {run_dir / 'report.html'}" in result.stdout
