"""`trainguard goodput`: cost and energy per useful token, the autopilot's recommendation, `--what-if`;
trainguard/energy.py's curve from NVML's counter."""

from __future__ import annotations

import json

import pytest
import yaml

from trainguard import energy, tls
from trainguard.cli import main
from trainguard.goodput import CAUSES, PRODUCTIVE, compute

GPUS, WATTS, TOKENS_PER_SECOND = 8, 500.0, 1000.0


def _crashing_run(run_dir, *, with_energy=True):
    """Rank 0: 1 s steps; a 2 s save every 10 steps; a crash after step 25 (restart 20 s, back to step 20);
    an agent sampling each GPU's energy counter (500 W, from 1 MJ) every 2 s."""
    rank = tls.Writer(run_dir / "tls" / "rank-0.jsonl")
    node = tls.Writer(run_dir / "tls" / "node-n1.jsonl")
    t = 1000.0
    system = {"gpu_count": GPUS, "world_size": 1}

    def step(number):
        nonlocal t
        t += 1.0
        rank.write(tls.make_record(step=number, timestamp=t, system=system, metrics={
            "loss": 2.0, "step_time_seconds": 1.0, "tokens_per_second": TOKENS_PER_SECOND}))

    rank.write(tls.event("run_start", timestamp=t))
    for number in range(1, 26):
        step(number)
        if number % 10 == 0:
            t += 2.0
            rank.write(tls.event("checkpoint_saved", timestamp=t, step=number, blocking_seconds=2.0))
    t += 20.0
    rank.write(tls.event("checkpoint_restored", timestamp=t, step=20))
    rank.write(tls.event("run_start", timestamp=t))
    for number in range(21, 31):
        step(number)
    rank.close()
    if with_energy:
        when = 999.0
        while when <= t + 2:
            gpus = [{"gpu": i, "uuid": f"GPU-{i}", "energy_joules": 1e6 + WATTS * (when - 999.0)} for i in range(GPUS)]
            node.write(tls.make_record(timestamp=when, hardware={"gpus": gpus}))
            when += 2.0
    node.close()
    return t


def test_energy_curve_interpolates_and_survives_a_reset():
    series = {"n/GPU-0": [(0.0, 100.0), (10.0, 1100.0), (20.0, 50.0), (30.0, 1050.0)]}   # reset at t=20
    curve = energy.Curve(series)
    assert curve.joules(0.0, 10.0) == pytest.approx(1000.0)
    assert curve.joules(5.0, 10.0) == pytest.approx(500.0)
    assert curve.joules(0.0, 30.0) == pytest.approx(2000.0)         # the stretch across the reset draws nothing
    assert curve.joules(-100.0, 100.0) == curve.joules(0.0, 30.0)   # nothing outside the samples
    assert energy.counter_difference(series, 0.0, 30.0) == pytest.approx(2000.0)


def test_useful_tokens_cost_and_energy_by_cause(tmp_path, capsys):
    end = _crashing_run(tmp_path)
    records = [line.record for line in tls.iter_lines(tmp_path / "tls" / "rank-0.jsonl")]
    nodes = [line.record for line in tls.iter_lines(tmp_path / "tls" / "node-n1.jsonl")]
    curve = energy.Curve(energy.samples_of(nodes))
    result = compute(records, energy=curve)
    assert result.tokens == 35 * TOKENS_PER_SECOND and result.useful_tokens == 30 * TOKENS_PER_SECOND
    assert result.gpu_count == GPUS
    # every joule of the run's span is charged to exactly one cause, the same split as time
    assert sum(result.energy_joules.values()) == pytest.approx(GPUS * WATTS * (end - 1000.0))
    assert result.energy_joules[PRODUCTIVE] == pytest.approx(GPUS * WATTS * result.productive_seconds)
    for cause in CAUSES:
        assert result.energy_joules[cause] == pytest.approx(GPUS * WATTS * result.badput_seconds[cause])
    assert result.energy_per_step_joules == pytest.approx(WATTS * 1.0)

    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"cost": {"price_per_gpu_hour": 3.6}}))
    assert main(["goodput", str(tmp_path), "--policy", str(policy), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    cost = report["cost"]
    assert cost["cost_usd"] == pytest.approx(GPUS * 3.6 * (end - 1000.0) / 3600)
    assert cost["usd_per_million_useful_tokens"] == pytest.approx(cost["usd_per_million_tokens"] * 35 / 30)
    assert cost["joules_per_useful_token"] == pytest.approx(cost["energy_joules"] / 30000)
    assert cost["joules_by_cause"]["restart_recovery"] > 0
    assert main(["goodput", str(tmp_path), "--policy", str(policy)]) == 0
    out = capsys.readouterr().out
    assert "per 1M useful tokens" in out and "J per useful token" in out and "restart_recovery" in out


def test_cpu_run_without_energy_says_na(tmp_path, capsys):
    _crashing_run(tmp_path, with_energy=False)
    assert main(["goodput", str(tmp_path)]) == 0
    assert "energy n/a: no GPU energy counter" in capsys.readouterr().out


def test_recommendation_and_what_if(tmp_path, capsys):
    _crashing_run(tmp_path, with_energy=False)
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"checkpoint": {"fleet_mtbf_gpu_hours": 0.1, "min_interval_seconds": 1}}))
    assert main(["goodput", str(tmp_path), "--policy", str(policy), "--what-if", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    section = report["checkpoint"]
    assert section["failures"] == 1 and section["save_seconds"] == 2.0
    assert section["restart_seconds"] == [pytest.approx(20.0)]           # last record of the dead process -> step 21
    assert section["observed_seconds"] == pytest.approx(12.0)            # ten 1 s steps and a 2 s save
    assert section["recommended_seconds"] == pytest.approx(section["recommendation"]["recommended_seconds"], abs=1e-3)
    rows = report["what_if"]["rows"]
    labels = {row["label"] for row in rows}
    assert {"recorded", "recommended"} <= labels or "recorded recommended" in labels
    for row in rows:      # every replayed second is accounted for
        assert row["useful_seconds"] + row["save_seconds"] + row["lost_seconds"] + row["restart_seconds"] == \
            pytest.approx(report["what_if"]["total_seconds"])
    assert main(["goodput", str(tmp_path), "--what-if", "5,60"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint interval: kept 12.00s between saves; recommended" in out and "what-if: 1 recorded" in out
    assert main(["goodput", str(tmp_path), "--what-if", "5,soon"]) == 2
    assert "--what-if: expected seconds" in capsys.readouterr().err


def test_gpu_energy_reaches_the_records(tmp_path):
    """The agent's gpu collector writes each GPU's counter as hardware.gpus[].energy_joules; the trainer's
    telemetry writes its own GPU's as hardware.energy_joules (both from the fake NVML's recorded counter)."""
    from tests.fakes.fake_nvml import FakeNVML, energy_scenario
    from trainguard.agent.collector import Context
    from trainguard.agent.collectors.gpu import GPUCollector
    from trainguard.runtime.telemetry import StepTelemetry

    scenario = energy_scenario("h100x8", [[400.0, 600.0, 500.0]] * 8)
    nvml = FakeNVML(scenario)
    collector = GPUCollector(Context(devfs=tmp_path / "dev", node="n1", options={"nvml_module": nvml}))
    first = collector.update().tls["hardware"]["gpus"]
    nvml.advance()
    second = collector.update().tls["hardware"]["gpus"]
    assert [b["energy_joules"] - a["energy_joules"] for a, b in zip(first, second)] == [400.0] * 8

    nvml = FakeNVML(scenario)
    telemetry = StepTelemetry(tmp_path / "run", device_type="cpu", nvml=nvml, device_index=0)
    timings = {"step_time_seconds": 1.0}
    one = telemetry.step(1, loss=1.0, timings=timings, tokens=10, samples=1)
    nvml.advance()
    two = telemetry.step(2, loss=1.0, timings=timings, tokens=10, samples=1)
    telemetry.close()
    assert two["hardware"]["energy_joules"] - one["hardware"]["energy_joules"] == 400.0
    assert "energy_joules" not in StepTelemetry(tmp_path / "cpu", device_type="cpu").step(
        1, loss=1.0, timings=timings, tokens=10, samples=1)["hardware"]
