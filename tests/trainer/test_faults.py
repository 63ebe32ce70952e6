"""Fault specs, and that a fault fires once per run (across restarts)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.trainer.helpers import events, step_records, train, write_policy
from trainguard.trainer.faults import Fault, FaultError, FaultInjector, parse


def test_parse_defaults_and_errors():
    assert parse("nan@5") == Fault("nan", 5, None)
    assert parse("crash@50") == Fault("crash", 50, 0)
    assert parse("crash@50:1") == Fault("crash", 50, 1)
    assert parse("hang@7:all") == Fault("hang", 7, None)
    for bad in ("boom@3", "nan", "nan@x", "nan@0", "crash@3:-1"):
        with pytest.raises(FaultError, match="--inject"):
            parse(bad)


def test_the_wall_clock_form_fires_at_the_first_step_after_its_time_once(tmp_path):
    assert parse("error@t1700000000.5:3") == Fault("error", 0, 3, 1700000000.5)
    for bad in ("error@t", "error@tx", "error@t0", "error@t-5", "error@tnan"):
        with pytest.raises(FaultError, match="--inject"):
            parse(bad)
    past, future = time.time() - 1, time.time() + 3600
    specs = [f"error@t{past!r}:0", f"crash@t{future!r}:0"]
    first = FaultInjector(specs, tmp_path, rank=0, emit=lambda _kind, /, **f: None)
    with pytest.raises(Exception, match="injected fault error@t"):
        first.process_faults(7)                                   # any step once the time has come
    first.process_faults(8)                                       # fired: not again; the crash's time is ahead
    assert [f.kind for f in first.pending] == ["crash"]
    restarted = FaultInjector(specs, tmp_path, rank=0, emit=lambda _kind, /, **f: None)
    assert [f.kind for f in restarted.pending] == ["crash"]       # once per run, across restarts


def test_a_fault_fires_once_even_after_a_restart(tmp_path):
    emitted = []
    first = FaultInjector(["nan@3", "spike@3", "slowio@4", "crash@9:1"], tmp_path, rank=0,
                          emit=lambda _kind, /, **f: emitted.append(f))
    assert first.loss_factors(2) == (1.0, 1.0)
    loss_factor, grad_factor = first.loss_factors(3)
    assert math.isnan(loss_factor) and grad_factor == 1.0
    assert first.loss_factors(3) == (1.0, 1.0)                  # a rollback replaying step 3: no refire
    assert [first.data_delay(s) for s in (3, 4, 5, 8, 9)] == [0.0, 0.5, 0.5, 0.5, 0.0]
    assert [e["fault"] for e in emitted] == ["nan@3", "spike@3", "slowio@4"]
    restarted = FaultInjector(["nan@3", "spike@3", "slowio@4", "gradexplode@6"], tmp_path, rank=0,
                              emit=lambda _kind, /, **f: None)
    assert [f.key for f in restarted.pending] == ["gradexplode@6"]
    assert restarted.loss_factors(6) == (1.0, 1e4)


def test_corrupt_checkpoint_flips_one_byte_of_the_largest_file(tmp_path):
    checkpoint = tmp_path / "checkpoints" / "step_10"
    checkpoint.mkdir(parents=True)
    (checkpoint / "manifest.json").write_bytes(b"{}" * 100)
    (checkpoint / "model.pt").write_bytes(bytes(64))
    waited = []
    injector = FaultInjector(["corrupt-checkpoint@5"], tmp_path, rank=0, emit=lambda _kind, /, **f: None)
    injector.after_checkpoint(10, checkpoint, wait=lambda: waited.append(True))
    data = (checkpoint / "model.pt").read_bytes()
    assert waited == [True] and data[32] == 0xFF and data.count(0) == 63
    assert (checkpoint / "manifest.json").read_bytes() == b"{}" * 100


def test_slowio_and_gradexplode_in_the_loop(tmp_path):
    run = tmp_path / "run"
    policy = write_policy(tmp_path / "policy.yaml", grad_min_steps=5)
    assert train(run, "--steps", "12", "--policy", str(policy), "--inject", "slowio@3",
                 "--inject", "gradexplode@11") == 0
    waits = {r["step"]: r["metrics"]["data_wait_seconds"] for r in step_records(run)}
    assert all(waits[s] >= 0.5 for s in range(3, 8)) and all(waits[s] < 0.5 for s in (1, 2, 8, 9))
    (skip,) = events(run, "skip_step")
    assert skip["step"] == 11 and skip["reason"] == "grad_explosion"
    assert [e["kind"] for e in events(run, "fault_injected")] == ["slowio", "gradexplode"]


@pytest.mark.slow
def test_hung_rank_is_restarted_by_the_launcher_when_its_pid_is_killed(tmp_path):
    """What the agent's `restore` does: kill the pids in control/ranks/; torchrun restarts the workers."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "trainguard.cli", "train", "--run-dir", str(run), "--device", "cpu",
               "--steps", "12", "--checkpoint-every", "4", "--max-restarts", "1", "--inject", "hang@6"]
    launcher = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 90
        while not (run / "control" / "faults-fired.jsonl").exists():
            assert time.time() < deadline and launcher.poll() is None
            time.sleep(0.1)
        time.sleep(1.0)
        assert launcher.poll() is None                                  # hung, not dead
        assert max(r["step"] for r in step_records(run)) == 5
        pid = json.loads((run / "control" / "ranks" / "rank-0.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        assert launcher.wait(timeout=90) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    starts = events(run, "run_start")
    assert [(s["restart_count"], s["resumed_from"]) for s in starts] == [(0, None), (1, 4)]
    assert step_records(run)[-1]["step"] == 12
