"""MFU only from a documented peak: none on CPU (and "n/a" with the reason in the report, `status` and
`diagnose`), the table's figure for a CUDA device it names, and the FLOPs per token a library user gives."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.trainer.helpers import events, records, step_records, train
from trainguard.diagnose.cli import mfu_summary, render as diagnose_render
from trainguard.diagnose.loader import load_run
from trainguard.protect import Protector
from trainguard.report import status_cli as status_mod
from trainguard.report.data import load_run as load_report
from trainguard.report.summary import sentences, tiles
from trainguard.runtime.telemetry import MemoryProbe, StepTelemetry

TIMINGS = {"step_time_seconds": 0.5}


@pytest.fixture(autouse=True)
def _key_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_KEY", str(tmp_path / "keys" / "checkpoint.key"))


def test_a_cpu_run_records_no_mfu_and_every_view_says_na_with_the_reason(tmp_path, capsys):
    run = tmp_path / "run"
    assert train(run, "--steps", "6") == 0
    assert all("mfu" not in r["metrics"] for r in step_records(run))
    start = events(run, "run_start")[0]
    assert start["peak_flops"] is None and start["peak_flops_source"] == ""
    assert start["flops_per_token"] > 0                     # the GPT's 6N + attention, known all the same
    reason = start["mfu_unavailable"]
    assert "no documented peak FLOPs for a cpu device" in reason

    report = load_report(run)
    [mfu_tile] = [t for t in tiles(report) if t.label == "MFU"]
    assert mfu_tile.value == "n/a" and reason in mfu_tile.hint
    assert any(f"MFU n/a ({reason})" in s for s in sentences(report))

    shown = status_mod.render(status_mod.collect(run))
    [speed] = [line for line in shown.splitlines() if line.startswith("speed")]
    assert f"MFU n/a ({reason})" in speed and not re.search(r"MFU [0-9]", shown), speed

    text = diagnose_render(load_run(str(run)), [])
    assert f"MFU: n/a ({reason})" in text


def test_a_cuda_device_the_table_names_gets_its_documented_peak(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    telemetry = StepTelemetry(tmp_path, device_type="cuda", flops_per_token=6e9)
    telemetry.memory = MemoryProbe("cpu")          # no CUDA here: only the name is faked
    record = telemetry.step(1, loss=1.0, timings=dict(TIMINGS), tokens=1000, samples=1)
    telemetry.close()
    assert telemetry.peak_flops == 989.5e12 and telemetry.peak.source.startswith("table: H100 SXM bf16")
    assert record["metrics"]["mfu"] == pytest.approx(6e9 * 2000 / 989.5e12)
    assert "mfu_unavailable" not in telemetry.mfu_basis()

    tf32 = StepTelemetry(tmp_path / "tf32", device_type="cuda", flops_per_token=6e9, precision="tf32",
                         device_name="NVIDIA A100-SXM4-80GB")
    assert tf32.peak_flops == 156e12
    unknown = StepTelemetry(tmp_path / "new", device_type="cuda", flops_per_token=6e9, device_name="NVIDIA X1")
    unknown.memory = MemoryProbe("cpu")
    assert "mfu" not in unknown.step(1, loss=1.0, timings=dict(TIMINGS), tokens=1000, samples=1)["metrics"]
    assert "NVIDIA X1" in unknown.mfu_basis()["mfu_unavailable"]


def test_the_library_honours_the_users_flops_per_token(tmp_path):
    model = torch.nn.Linear(2, 2)
    states = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
    guarded = Protector(tmp_path, states=states, flops_per_token=3e6, peak_flops=1e12)
    guarded.begin(integration="plain")
    verdict = guarded.check(1, torch.tensor(1.0), torch.tensor(0.5))
    guarded.after_step(verdict, tokens=4000, samples=2, timings=dict(TIMINGS))
    guarded.close()
    [record] = [r for r in records(tmp_path) if "metrics" in r]
    assert record["metrics"]["mfu"] == pytest.approx(3e6 * 8000 / 1e12)

    # FLOPs per token without a peak (CPU): no MFU, and the reason is the peak, not the FLOPs
    no_peak = StepTelemetry(tmp_path / "cpu", flops_per_token=3e6)
    assert no_peak.peak_flops == 0 and "cpu" in no_peak.mfu_unavailable
    # a peak without FLOPs per token: no MFU either, and it says so
    no_flops = StepTelemetry(tmp_path / "flops", peak_flops=1e12)
    assert "mfu" not in no_flops.step(1, loss=1.0, timings=dict(TIMINGS), tokens=10, samples=1)["metrics"]
    assert "flops_per_token" in no_flops.mfu_unavailable
    with pytest.raises(ValueError, match="flops_per_token"):
        StepTelemetry(tmp_path / "bad", flops_per_token=-1.0)
    with pytest.raises(ValueError, match="own `telemetry`"):    # never accepted and ignored
        Protector(tmp_path / "both", states=states, telemetry=no_peak, flops_per_token=3e6)


def test_diagnose_json_carries_the_mean_mfu(tmp_path):
    telemetry = StepTelemetry(tmp_path, flops_per_token=1e6, peak_flops=1e10)
    for step in (1, 2):
        telemetry.step(step, loss=1.0, timings=dict(TIMINGS), tokens=1000 * step, samples=1)
    telemetry.close()
    summary = mfu_summary(load_run(str(tmp_path)))
    assert summary == {"rank": 0, "mean": pytest.approx((0.2 + 0.4) / 2)}
    json.dumps(summary)
