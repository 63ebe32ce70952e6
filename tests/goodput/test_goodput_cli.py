"""`trainguard goodput RUN_DIR`: reads the rank log, reports malformed lines by file:line, exit codes."""

from __future__ import annotations

import json

import pytest
import torch

from trainguard import tls
from trainguard.cli import main
from trainguard.runtime.checkpoint import CheckpointManager


def _write_run(run_dir, *, with_checkpoints=False, key_file=None):
    """A rank-0 log: startup 2 s, ten 1 s steps; with checkpoints, real saves logged through on_event."""
    writer = tls.Writer(run_dir / "tls" / "rank-0.jsonl")
    clock = {"t": 1000.0}
    writer.write(tls.event("run_start", timestamp=clock["t"]))
    saved = []
    manager = None
    if with_checkpoints:
        def on_event(kind, **fields):
            saved.append(fields)
            # the synthetic clock moves on by as long as the save blocked (a DCP save can take longer
            # than any fixed step of it), and the event is written when the save ends
            started = clock["t"]
            clock["t"] += float(fields.get("blocking_seconds") or 0.0)
            if "started_at" in fields:      # the manager's wall clock, put on the synthetic one
                fields = {**fields, "started_at": started}
            writer.write(tls.event(kind, timestamp=clock["t"], **fields))

        manager = CheckpointManager(run_dir, key_file=key_file, on_event=on_event)
    for step in range(1, 11):
        clock["t"] += 2.0 if step == 1 else 1.0
        writer.write(tls.make_record(step=step, timestamp=clock["t"],
                                     metrics={"loss": 3.0 - step / 10, "step_time_seconds": 1.0}))
        if manager and step % 5 == 0:
            manager.save(step, {"model": {"w": torch.ones(1000)}}, stable=False)
    writer.close()
    return saved


def test_report_of_a_run_directory(tmp_path, capsys):
    _write_run(tmp_path)
    assert main(["goodput", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rank-0.jsonl: 11 records" in out and "goodput" in out
    assert "restarts 0, rollbacks 0" in out
    assert main(["goodput", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["total_seconds"] == pytest.approx(11) and report["productive_seconds"] == pytest.approx(10)
    assert report["badput_seconds"]["startup"] == pytest.approx(1) and report["malformed"] == []


def test_checkpoint_events_of_a_real_manager_are_counted(tmp_path, key_file, capsys):
    saved = _write_run(tmp_path / "run", with_checkpoints=True, key_file=key_file)
    blocking = sum(f["blocking_seconds"] for f in saved if "blocking_seconds" in f)
    assert blocking > 0
    capsys.readouterr()  # the manager's own log lines
    assert main(["goodput", str(tmp_path / "run"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # the events' times are written to the microsecond (RFC 3339): each save's charge may move by 1 us
    assert report["badput_seconds"]["checkpoint_save"] == pytest.approx(blocking, abs=2e-6 * len(saved))


def test_malformed_lines_are_reported_by_file_and_line_and_exit_1(tmp_path, capsys):
    _write_run(tmp_path)
    log = tmp_path / "tls" / "rank-0.jsonl"
    with open(log, "a") as handle:
        handle.write('{"timestamp": "yesterday", "step": 11}\n{"step": 12')
    assert main(["goodput", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert f"{log}:12: timestamp: not an RFC 3339 time" in captured.err
    assert f"{log}:13: truncated last line" in captured.err
    assert "11 records, 2 malformed" in captured.out


def test_exit_2_without_a_log_or_records(tmp_path, capsys):
    assert main(["goodput", str(tmp_path)]) == 2
    assert "no rank-*.jsonl log" in capsys.readouterr().err
    (tmp_path / "tls").mkdir()
    (tmp_path / "tls" / "rank-0.jsonl").write_text("\n")
    assert main(["goodput", str(tmp_path)]) == 2
    assert main(["goodput", str(tmp_path), "--rank", "3"]) == 2
    assert main(["goodput", str(tmp_path), "--stall-factor", "0.5"]) == 2


@pytest.fixture
def key_file(tmp_path):
    return tmp_path / "keys" / "checkpoint.key"


def test_a_hang_is_split_at_the_agents_decision_and_names_its_incident(tmp_path, capsys):
    from trainguard import incidents

    with tls.Writer(tmp_path / "tls" / "rank-0.jsonl") as writer:
        writer.write(tls.event("run_start", timestamp=1000.0))
        for step in range(1, 6):
            writer.write(tls.make_record(step=step, timestamp=1000.0 + step, metrics={"step_time_seconds": 1.0}))
        writer.write(tls.event("checkpoint_restored", step=4, timestamp=1030.0))
        writer.write(tls.event("run_start", timestamp=1031.0, resumed_from=4))
        for step in range(5, 8):
            writer.write(tls.make_record(step=step, timestamp=1028.0 + step, metrics={"step_time_seconds": 1.0}))
    with tls.Writer(tmp_path / "tls" / "node-n1-actions.jsonl") as writer:
        writer.write({**tls.event("action", timestamp=1017.0, id="restore-7", action="restore", issued_at=1017.0),
                      "node": "n1"})
    incidents.write_incident(tmp_path, incidents.Incident("hang-7", "hang", 1016.5, "n1", action="restore"))
    assert main(["goodput", str(tmp_path), "--json"]) == 0
    [hang] = json.loads(capsys.readouterr().out)["hangs"]
    assert hang == {"last_progress": 1005.0, "decided_at": 1017.0, "resumed_at": 1032.0, "stall_seconds": 12.0,
                    "restart_recovery_seconds": 15.0, "decided_by": "restore-7", "incident": "hang-7"}
    (tmp_path / "incidents" / "bad").mkdir()
    (tmp_path / "incidents" / "bad" / "incident.json").write_text("{")
    assert main(["goodput", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "incident hang-7" in captured.out and "incidents/bad/incident.json: not JSON" in captured.err
