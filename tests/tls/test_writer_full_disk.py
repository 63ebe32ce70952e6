"""The TLS writer never stops training: a full disk drops and counts records, reported once with the
file and the bytes needed; a torn last line is ended on open so the next record is not glued onto it
(as it once was). The full disk is a real 1 MiB tmpfs (root needed; skipped otherwise)."""

from __future__ import annotations

import pytest

from tests.servers import fill_disk, tmpfs
from trainguard import tls
from trainguard.runtime.telemetry import StepTelemetry


@pytest.fixture
def small_disk(tmp_path):
    with tmpfs(tmp_path / "disk", "1m") as disk:
        yield disk


def timings():
    return {"step_time_seconds": 0.1, "data_wait_seconds": 0.0}


def test_a_full_disk_drops_and_counts_records_reports_once_and_training_goes_on(small_disk):
    reports = []
    telemetry = StepTelemetry(small_disk / "run")
    telemetry.writer.on_drop = reports.append
    telemetry.step(1, loss=2.0, timings=timings(), tokens=10, samples=1)
    fill_disk(small_disk)        # the file's last page still takes a few records; then every write fails
    for step in range(2, 60):
        telemetry.step(step, loss=2.0, timings=timings(), tokens=10, samples=1)     # never raises
    telemetry.event("checkpoint_restored", step=59)
    dropped = telemetry.writer.dropped
    assert dropped > 20
    assert len(reports) == 1 and str(telemetry.path) in reports[0] and "bytes needed" in reports[0]
    (small_disk / "filler").unlink()
    telemetry.event("checkpoint_restored", step=60)
    record = telemetry.step(61, loss=2.0, timings=timings(), tokens=10, samples=1)
    assert record["system"]["tls_records_dropped"] == dropped
    assert f"writable again after {dropped}" in reports[1]
    lines = list(tls.iter_lines(telemetry.path))
    assert all(line.error is None for line in lines)                         # nothing torn, nothing glued
    steps = [line.record.get("step") for line in lines]
    assert len(steps) + dropped == 62 and steps[-2:] == [60, 61] and steps == sorted(steps)
    assert lines[-2].record["event"]["type"] == "checkpoint_restored"


def test_a_torn_last_line_is_ended_on_open_and_the_next_record_is_whole(tmp_path):
    path = tmp_path / "rank-0.jsonl"
    path.write_bytes(tls.encode(tls.event("run_start", step=0)) + b'{"timestamp": 1, "step": 4, "metr')
    with tls.Writer(path) as writer:
        writer.write(tls.event("checkpoint_restored", step=4))
    lines = list(tls.iter_lines(path))
    assert [line.lineno for line in lines] == [1, 2, 3]
    assert lines[1].error is not None and lines[1].record is None             # the torn line, reported
    assert lines[2].record["event"]["type"] == "checkpoint_restored"
    with tls.Writer(path):
        pass
    assert path.read_bytes().count(b"\n") == 3                                # a whole last line is left alone
