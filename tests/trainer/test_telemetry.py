"""Step telemetry of the bundled trainer: 40 steps of the tiny model on CPU, real torch."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

from tests.trainer.helpers import events, records, step_records, train
from trainguard import tls
from trainguard.trainer.loop import Trainer
from trainguard.runtime.telemetry import StepTelemetry, StepTimer

METRICS = ("loss", "grad_norm", "grad_norm_by_layer", "learning_rate", "tokens_per_second",
           "samples_per_second", "step_time_seconds", "data_wait_seconds", "forward_backward_seconds",
           "optimizer_seconds", "tokens_trained", "tokens_loaded")


def test_forty_steps_loss_falls_and_every_record_validates(tmp_path):
    run = tmp_path / "run"
    assert train(run, "--steps", "40") == 0
    steps = step_records(run)
    assert [r["step"] for r in steps] == list(range(1, 41))
    losses = [r["metrics"]["loss"] for r in steps]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses

    start = events(run, "run_start")[0]
    # a CPU has no documented peak: no MFU (tests/trainer/test_mfu.py), whatever the FLOPs per token
    assert start["peak_flops"] is None and start["flops_per_token"] > 0 and start["mfu_unavailable"]
    validator = jsonschema.Draft202012Validator(json.loads(tls.SCHEMA_PATH.read_text()))
    lines = (run / "tls" / "rank-0.jsonl").read_text().splitlines()
    for line in lines:
        validator.validate(json.loads(line))
    clocks = []
    for record in steps:
        metrics = record["metrics"]
        assert all(key in metrics for key in METRICS), set(METRICS) - set(metrics)
        assert set(metrics["grad_norm_by_layer"]) == {"embed", "h.0", "h.1", "ln_f"}
        assert record["hardware"]["rss_bytes"] > 10 << 20
        system = dict(record["system"])
        clocks.append(system.pop("monotonic_seconds"))
        assert system == {"gpu_count": 0, "world_size": 1, **(
            {"last_checkpoint": system["last_checkpoint"]} if "last_checkpoint" in system else {})}
        assert record["run_id"] == "run" and record["rank"] == 0 and record["node"]
        assert "mfu" not in metrics
        parts = metrics["data_wait_seconds"] + metrics["forward_backward_seconds"] + metrics["optimizer_seconds"]
        assert parts <= metrics["step_time_seconds"] + 1e-6
    assert clocks == sorted(clocks) and clocks[0] > 0       # the monotonic clock the cost meter bills by
    # counters: 8 sequences of 64 tokens a step, none skipped
    assert steps[-1]["metrics"]["tokens_trained"] == steps[-1]["metrics"]["tokens_loaded"] == 40 * 8 * 64
    kinds = [e["type"] for e in events(run)]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end" and "checkpoint_saved" in kinds


def test_one_host_sync_per_step(tmp_path, monkeypatch):
    """Inside a training step, trainguard code copies to the host exactly once (.tolist) and never
    calls .item(), float(), int() or bool() on a tensor."""
    counts = {"tolist": 0, "other": 0}
    inside = {"step": False}
    import trainguard
    import trainguard.protect
    import trainguard.trainer

    ours = tuple(str(Path(package.__file__).parent) for package in (trainguard, trainguard.trainer,
                                                                     trainguard.protect))

    def counting(name, original):
        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if inside["step"] and caller.startswith(ours):
                counts["tolist" if name == "tolist" else "other"] += 1
            return original(self, *args, **kwargs)
        return wrapper

    for name in ("tolist", "item", "__float__", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    original_step = Trainer.train_step

    def watched(self):
        inside["step"] = True
        try:
            return original_step(self)
        finally:
            inside["step"] = False

    monkeypatch.setattr(Trainer, "train_step", watched)
    assert train(tmp_path / "run", "--steps", "6") == 0
    assert counts == {"tolist": 6, "other": 0}


def test_telemetry_off_writes_no_step_records_and_trains_the_same(tmp_path):
    on, off = tmp_path / "on", tmp_path / "off"
    assert train(on, "--steps", "8") == 0
    assert train(off, "--steps", "8", "--telemetry", "off") == 0
    assert step_records(off) == []
    assert {e["type"] for e in events(off)} >= {"run_start", "checkpoint_saved", "run_end"}
    val_on = [e["val_loss"] for e in events(on, "evaluation")]
    val_off = [e["val_loss"] for e in events(off, "evaluation")]
    assert val_on == val_off


def test_library_api_with_tensors_and_floats(tmp_path):
    """The API any loop can call: tensors are synced together, floats pass through, events carry step."""
    telemetry = StepTelemetry(tmp_path, rank=3, world_size=4, run_id="lib", flops_per_token=1e6,
                              peak_flops=1e12)
    timer = StepTimer()
    timer.start()
    timer.mark("data_wait")
    record = telemetry.step(7, loss=torch.tensor(2.5), grad_norm=torch.tensor(0.75),
                            grad_norm_by_layer={"a": torch.tensor(1.0), "b": 2.0}, learning_rate=1e-3,
                            tokens=1024, samples=4, timings=timer.stop(), tokens_trained=1024)
    telemetry.event("skip_step", step=7, reason="nan", loss=math.nan)
    telemetry.close()
    assert record["metrics"]["loss"] == 2.5 and record["metrics"]["grad_norm_by_layer"] == {"a": 1.0, "b": 2.0}
    written = records(tmp_path, rank=3)
    assert written[0]["step"] == 7 and written[0]["rank"] == 3 and written[0]["system"]["world_size"] == 4
    assert written[0]["metrics"]["mfu"] == pytest.approx(1e6 * written[0]["metrics"]["tokens_per_second"] / 1e12)
    event = written[1]["event"]    # a NaN in an event is written as NaN, not null: it is the news
    assert math.isnan(event.pop("loss")) and event == {"type": "skip_step", "reason": "nan", "step": 7}
    assert written[1]["step"] == 7
