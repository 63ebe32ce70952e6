"""scripts/gpu-check (bench/gpu_check.py): without a GPU it says what it would run and exits 0 writing nothing;
its JSON is what bench/run_all.py renders as the GPU rows and section of docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402
import run_all  # noqa: E402

# THE SHAPE OF bench/out/gpu_check.json ONLY, its values made up for this test (no GPU has run it here):
# never written to bench/out or docs. One check passed, one failed, one skipped, as a real run can end.
RECORDED_SHAPE_NOT_MEASURED = [
    {"name": "nvml", "status": "pass", "reason": "", "seconds": 1.0,
     "figures": [{"measure": "NVML collector vs nvidia-smi: readings that agree", "ours": "5 of 5",
                  "peer_name": "nvidia-smi --query-gpu", "peer": "5", "ratio": None, "target": "all", "met": True}],
     "details": {"gpus": 1}},
    {"name": "dcp_async", "status": "fail", "reason": "", "seconds": 2.0,
     "figures": [{"measure": "async save, blocked vs device-to-host copy floor (s)", "ours": "0.200",
                  "peer_name": "one copy_ into pinned host buffers", "peer": "0.100", "ratio": 2.0,
                  "target": "<= 1.25x", "met": False}], "details": {}},
    {"name": "fingerprint", "status": "skip", "reason": "the 5-minute budget is spent", "seconds": 0.0,
     "figures": [], "details": {}},
]
MACHINE_WITH_A_GPU = {"host": "test", "cores": 16, "cpu": "test cpu", "memory_gib": 128.0, "python": "3.11",
                      "torch": "test", "gpu": "GPU 0: NVIDIA H200 (UUID: GPU-test)", "load_average": 0.0}


def document() -> dict:
    return gpu_check.result_document(RECORDED_SHAPE_NOT_MEASURED, "2026-12-03T14:00:00Z", 3.0, MACHINE_WITH_A_GPU)


def test_run_all_renders_the_gpu_rows_and_section(tmp_path):
    (tmp_path / "gpu_check.json").write_text(json.dumps(document()))
    results = run_all.load_results(tmp_path)
    assert [r["name"] for r in results] == ["gpu_check"]
    text = run_all.render(results, "")
    rows = [line for line in text.splitlines() if line.startswith("| gpu_check |")]
    assert len(rows) == 2 and all(line.rstrip().endswith("| **GPU** |") for line in rows)
    assert "| gpu_check | async save, blocked vs device-to-host copy floor (s) | 0.200 |" in rows[1]
    assert "| **no** |" in rows[1] and "| yes |" in rows[0]
    section = text.split("## " + gpu_check.TITLE, 1)[1]
    assert "**Measured on a GPU machine.**" in section and "`scripts/gpu-check`" in section
    assert "| fingerprint | skip | the 5-minute budget is spent |" in section
    assert "Not passed: dcp_async: fail; fingerprint: skip (the 5-minute budget is spent)" in section


def test_the_rendered_section_replaces_itself_on_the_next_render(tmp_path):
    (tmp_path / "gpu_check.json").write_text(json.dumps(document()))
    once = run_all.render(run_all.load_results(tmp_path), "")
    assert run_all.render(run_all.load_results(tmp_path), once).count("## " + gpu_check.TITLE) == 1


@pytest.mark.skipif(gpu_check.gpu_present()[0], reason="a GPU is here: the check would run for minutes")
def test_without_a_gpu_it_says_what_it_would_run_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "no GPU here" in printed and "nothing run, nothing written." in printed
    for check in gpu_check.CHECKS:
        assert f"  {check.name} " in printed
    assert not out.exists()


def test_the_one_command_runs_from_anywhere(tmp_path):
    done = subprocess.run([str(ROOT / "scripts" / "gpu-check"), "--plan"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("scripts/gpu-check: 7 checks")


def test_the_plan_fits_five_minutes():
    assert sum(check.budget for check in gpu_check.CHECKS) < 300
