"""Loading a run directory into report data: routing, de-duplication, malformed lines, flat memory."""

from __future__ import annotations

import gzip
import math
import random
import tracemalloc
from pathlib import Path

from tests.report.synthetic import T0, write_run
from trainguard.decide.cost import CostMeter
from trainguard.policy import CostPolicy, Policy
from trainguard.report.data import load_run
from trainguard.report.downsample import Sampled, Series
from trainguard.tls import Writer, make_record


def test_synthetic_run_is_read_into_series_events_and_checkpoints(tmp_path):
    run = load_run(write_run(tmp_path, steps=120, ranks=2, gpus=2, spike_at=80))
    assert (run.first_step, run.last_step, run.step_records) == (1, 120, 120)   # rank 0 only
    assert run.primary_rank == 0 and run.ranks == {0, 1} and run.hosts == {"host-a"}
    assert run.training["loss"].count == 120
    assert run.training["loss"].y_range()[1] > 5 * run.training["loss"].last[1]     # the spike is kept
    # two ranks wrote each event; the report counts it once
    assert run.event_counts["skip_step"] == 1 and run.event_counts["checkpoint_saved"] == 6
    assert run.actions["skip_step"] == 1 and run.actions["rollback"] == 1
    assert dict(run.alerts) == {"LossSpike": 1}                                      # resolved is not a firing
    assert run.faults == ["spike@80"]
    assert {k: len(v) for k, v in run.markers.items()} == {
        "fault": 1, "skip": 1, "checkpoint": 6, "rollback": 1, "alert": 1}
    assert sorted(run.gpus) == [("host-a", "0"), ("host-a", "1")]
    assert run.gpu_names[("host-a", "0")] == "NVIDIA H100 80GB HBM3"
    assert [c.name for c in run.checkpoints] == [f"step_{s}" for s in range(20, 121, 20)]
    assert run.malformed == 1 and "rank-0.jsonl:" in run.errors[0] and "timestamp" in run.errors[0]


def test_cost_is_metered_by_the_agents_cost_meter(tmp_path):
    policy = Policy(cost=CostPolicy(price_per_gpu_hour=3.0, budget_per_1k_steps=0.5, window_steps=10, min_steps=5))
    run = load_run(write_run(tmp_path, steps=60, gpus=4, malformed=0), policy=policy)
    meter = CostMeter(policy.cost)
    for step in range(1, 61):
        meter.observe(step, T0 + step * 0.5, 4)
    assert run.cost_state.gpu_count == 4
    assert math.isclose(run.cost_state.cost_usd, meter.state.cost_usd)
    assert math.isclose(run.cost_state.cost_per_1k_steps, meter.state.cost_per_1k_steps)
    assert run.cost_state.tier == meter.state.tier


def test_trainer_hardware_is_used_when_no_agent_ran(tmp_path):
    run = load_run(write_run(tmp_path, node=False, gpus=0, malformed=0))
    assert run.gpus == {} and run.hosts == set()
    assert run.alerts == {}


def test_rotated_node_logs_are_read_oldest_first(tmp_path):
    tls = tmp_path / "tls"
    tls.mkdir()
    for name, base in (("node-h.jsonl.2.gz", 0), ("node-h.jsonl.1.gz", 10), ("node-h.jsonl", 20)):
        lines = b"".join(
            b'{"timestamp": %d, "hardware": {"disk_await_ms": %d}}\n' % (T0 + base + i, base + i) for i in range(10))
        (tls / name).write_bytes(gzip.compress(lines) if name.endswith(".gz") else lines)
    run = load_run(tmp_path)
    assert [Path(f).name for f in run.files] == ["node-h.jsonl.2.gz", "node-h.jsonl.1.gz", "node-h.jsonl"]
    assert [y for _, y in run.hardware["h"]["disk_await_ms"].points()] == list(range(30))


def test_series_keeps_extremes_and_bounds_points():
    rng = random.Random(7)
    series = Series(max_points=200)
    values = [rng.gauss(0, 1) for _ in range(50_000)]
    values[31_337] = 99.0      # a one-step spike
    values[4_242] = -99.0
    for i, y in enumerate(values):
        series.add(T0 + i * 0.25, y)
    series.add(T0 + 1.0, float("nan"))
    points = series.points()
    assert len(points) <= 200
    assert [x for x, _ in points] == sorted(x for x, _ in points)
    assert (T0 + 31_337 * 0.25, 99.0) in points and (T0 + 4_242 * 0.25, -99.0) in points
    assert series.count == 50_000 and series.nonfinite == 1 and series.last == (T0 + 49_999 * 0.25, values[-1])


def test_sampled_thins_evenly():
    sampled = Sampled(cap=10)
    for i in range(1000):
        sampled.add(i)
    items = list(sampled)
    assert len(items) <= 10 and items[0] == 0 and sampled.thinned
    gaps = {b - a for a, b in zip(items, items[1:])}
    assert len(gaps) == 1                      # evenly spaced


def _peak_bytes_loading(run_dir: Path, goodput: bool = False) -> int:
    tracemalloc.start()
    try:
        run = load_run(run_dir, goodput=goodput)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert all(len(s.points()) <= 2000 for s in run.training.values())
    return peak


def _long_log(root: Path, steps: int) -> Path:
    with Writer(root / "tls" / "rank-0.jsonl") as writer:
        for step in range(steps):
            writer.write(make_record(step=step, timestamp=T0 + step, metrics={
                "loss": 3 + math.sin(step / 50), "grad_norm": 1.0, "learning_rate": 1e-4,
                "tokens_per_second": 1e4 + step % 97, "step_time_seconds": 0.3}))
            if step % 500 == 0:
                writer.write(make_record(step=step, timestamp=T0 + step, event={"type": "checkpoint_saved"}))
    return root


def test_memory_stays_flat_as_the_log_grows(tmp_path):
    small = _peak_bytes_loading(_long_log(tmp_path / "small", 2_000))
    large = _peak_bytes_loading(_long_log(tmp_path / "large", 10_000))
    # five times the records, nearly the same memory: only bounded buckets and samples are kept
    assert large < small * 1.5 + 512 * 1024, (small, large)
    assert large < 16 * 2**20
    # The goodput breakdown is the one part that grows with the run: a few numbers per step.
    with_goodput = _peak_bytes_loading(tmp_path / "large", goodput=True)
    assert with_goodput - large < 10_000 * 1024, (large, with_goodput)


def test_goodput_comes_from_trainguard_goodput(tmp_path):
    from trainguard.goodput import compute
    from trainguard.tls import read_records

    root = write_run(tmp_path, ranks=1, malformed=0)
    run = load_run(root)
    expected = compute(read_records(root / "tls" / "rank-0.jsonl"))
    assert math.isclose(run.goodput.productive_seconds, expected.productive_seconds)
    assert run.goodput.badput_seconds == expected.badput_seconds
    assert run.goodput.badput_seconds["skipped_steps"] > 0


def test_a_report_of_a_folder_with_no_logs_is_a_clear_error_exit_2(tmp_path, capsys):
    """It was a report of "rank None" with exit 0: a run that did nothing and a wrong folder looked alike."""
    from trainguard.cli import main

    (tmp_path / "empty" / "tls").mkdir(parents=True)
    assert main(["report", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert f"trainguard report: {tmp_path / 'empty'}: no logs to report" in err and "Traceback" not in err
    assert not (tmp_path / "empty" / "report.html").exists()


def test_an_in_process_restart_is_a_pass_of_its_own_and_its_books_are_shown(tmp_path):
    """docs/recovery.md, "The books": the report names the in-process restart as the cause of the pass that
    trains steps again, shows its causes in the goodput breakdown, and says what the snapshots kept."""
    from trainguard.report.html import render
    from trainguard.tls import event

    with Writer(tmp_path / "tls" / "rank-0.jsonl") as writer:
        def step(n, ts):
            writer.write(make_record(step=n, timestamp=ts, run_id="r", rank=0, metrics={
                "loss": 2.0, "step_time_seconds": 0.5, "data_wait_seconds": 0.0}))
        writer.write(event("run_start", timestamp=T0, rank=0, restart_count=0))
        for n in range(1, 13):
            step(n, T0 + n)
        writer.write(event("in_process_restart", step=12, timestamp=T0 + 14.0, rank=0, generation=1,
                           failed_rank=1, cause="InjectedError", teardown_seconds=0.2, barrier_seconds=0.1,
                           reform_seconds=0.3, restore_seconds=0.4, recovery_seconds=1.5, source="snapshot",
                           restored_step=10, from_step=12, durable_step=5, steps_lost=2))
        for n in range(11, 15):
            step(n, T0 + 14 + (n - 10))
    run = load_run(tmp_path)
    assert [p.cause for p in run.passes] == ["start", "in-process restart"]
    for cause in ("in_process_teardown", "in_process_reform", "in_process_restore", "in_process_recovery"):
        assert run.goodput.badput_seconds[cause] > 0, cause
    html = render(run)
    assert "In-process restarts: 1; the in-memory snapshots kept 5 step(s)" in html
    assert "in process teardown" in html
