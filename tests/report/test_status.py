"""`trainguard status`: the run at a glance, from the tail of each log."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.report.synthetic import T0, write_run
from trainguard.report.status_cli import TAIL_KIB, collect, render
from trainguard.tls import Writer, event, make_record

TRAINGUARD = [sys.executable, "-m", "trainguard.cli"]


def test_status_shows_step_loss_speed_checkpoint_events_and_alerts(tmp_path):
    write_run(tmp_path, steps=120, ranks=2, gpus=2, spike_at=80)
    text = render(collect(tmp_path), now=T0 + 80)
    lines = {line.split()[0]: line for line in text.splitlines() if line.strip()}
    assert "step 120" in lines["training"] and "loss 2.06" in lines["training"]
    assert "tok/s" in lines["speed"] and "MFU 41%" in lines["speed"] and "data wait 6%" in lines["speed"]
    assert "step_120" in lines["ckpt"] and "6 on disk" in lines["ckpt"] and "ranks 0,1" in lines["ckpt"]
    assert lines["gpus"].startswith("gpus     2  util 85–90%")
    assert "none firing" in lines["alerts"] and "resolved: LossSpike" in lines["alerts"]
    assert "updated 7s ago" in text
    assert "1 malformed line(s)" in lines["logs"] and "rank-0.jsonl:130" in lines["logs"]
    events = text[text.index("events"):]
    assert "skip_step" in events and "rollback" in events and events.count("checkpoint_saved") == 3
    assert events.count("skip_step") == 1            # one line, though both ranks logged it


def test_a_firing_alert_is_shown_as_firing(tmp_path):
    write_run(tmp_path, steps=30, spike_at=None, malformed=0)
    with Writer(tmp_path / "tls" / "node-host-a.jsonl") as writer:
        writer.write(event("alert", timestamp=T0 + 40, alertname="DiskAwaitHigh", status="firing"))
    assert "FIRING DiskAwaitHigh" in render(collect(tmp_path))


def test_status_reads_only_the_tail_of_a_long_log(tmp_path):
    with Writer(tmp_path / "tls" / "rank-0.jsonl") as writer:
        for step in range(20_000):
            writer.write(make_record(step=step, timestamp=T0 + step, metrics={"loss": 1.0 + step}))
        handle_partial = open(tmp_path / "tls" / "rank-0.jsonl", "ab")
        handle_partial.write(b'{"timestamp": 1, "step": 20000, "metr')   # a live writer mid-line
        handle_partial.close()
    status = collect(tmp_path, tail_kib=4)
    assert status.step == 19_999 and status.metrics["loss"] == 20_000.0
    assert status.malformed == 0


def test_status_of_an_empty_run_and_a_missing_one(tmp_path):
    (tmp_path / "tls").mkdir()
    assert "no TLS records yet" in render(collect(tmp_path))
    done = subprocess.run(TRAINGUARD + ["status", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no such run directory" in done.stderr


def test_status_json(tmp_path):
    write_run(tmp_path, steps=40, spike_at=None, malformed=0)
    done = subprocess.run(TRAINGUARD + ["status", str(tmp_path), "--json"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["step"] == 40 and data["last_checkpoint"] == "step_40" and data["firing"] == []
    assert "_ts" not in data["metrics"] and len(data["gpus"]) == 2


def test_a_last_line_longer_than_the_window_is_still_read_through_the_cli(tmp_path):
    write_run(tmp_path, steps=40, spike_at=None, malformed=0)
    wide = {f"layer_{i:06d}_grad_norm": float(i) for i in range(40_000)}   # one record ~1 MiB long
    with Writer(tmp_path / "tls" / "rank-0.jsonl") as writer:
        writer.write(make_record(step=41, timestamp=T0 + 41, rank=0, metrics={"loss": 1.5, **wide}))
    last_line = (tmp_path / "tls" / "rank-0.jsonl").read_bytes().rstrip(b"\n").rsplit(b"\n", 1)[-1]
    assert len(last_line) > 1024 * 1024 > TAIL_KIB * 1024
    done = subprocess.run(TRAINGUARD + ["status", str(tmp_path), "--json"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["step"] == 41 and data["metrics"]["loss"] == 1.5
    assert data["metrics"]["layer_039999_grad_norm"] == 39_999.0 and data["malformed"] == 0
