"""The embedded path: the cost meter's tiers and the stall watchdog feed the same executor as the webhook."""

import json
import socket
import subprocess
import sys
import time

import pytest

from tests.alerts.helpers import read_jsonl
from tests.alerts.ranks import STANDIN, Ranks, alive
from trainguard import actions
from trainguard.agent.actions_embedded import DecisionHandler, StallWatchdog, cost_notice
from trainguard.agent.executor import Executor
from trainguard.decide.cost import CostMeter
from trainguard.decide.decision import Decision
from trainguard.decide.ledger import Ledger, Notice
from trainguard.policy import CostPolicy


@pytest.fixture
def rank(tmp_path):
    """One live process registered as rank 0 of a run in tmp_path, with a TLS file."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    info = {"rank": 0, "pid": process.pid, "host": socket.gethostname(), "started_at": time.time()}
    (tmp_path / "control" / "ranks").mkdir(parents=True)
    (tmp_path / "control" / "ranks" / "rank-0.json").write_text(json.dumps(info))
    (tmp_path / "tls").mkdir()
    (tmp_path / "tls" / "rank-0.jsonl").write_text('{"timestamp": 1, "step": 1, "metrics": {"loss": 3}}\n')
    yield process
    process.kill()
    process.wait()


def test_every_cost_tier_of_the_meter_reaches_the_trainer_once_in_order(tmp_path):
    executor = Executor(tmp_path, "n1", Ledger())
    handler = DecisionHandler(executor.submit)
    meter = CostMeter(CostPolicy(budget_per_1k_steps=1.0, min_steps=5, window_steps=10))
    for step in range(40):      # 8 GPUs, 10 s a step: $44 per 1000 steps against a budget of $1
        for decision in meter.observe(step=step, timestamp=10.0 * step, gpu_count=8):
            handler(decision)
    assert [r["action"] for r in read_jsonl(tmp_path / "control" / "actions.jsonl")] == [
        "cost_warn", "cost_throttle", "cost_stop"]
    alerts = [r["event"] for r in read_jsonl(tmp_path / "tls" / "node-n1-actions.jsonl")
              if r["event"]["type"] == "alert"]
    assert [(e["alertname"], e["source"]) for e in alerts] == [
        ("CostBudgetWarn", "embedded"), ("CostBudgetThrottle", "embedded"), ("CostBudgetStop", "embedded")]


def test_the_alert_path_after_the_embedded_path_is_a_duplicate(tmp_path):
    executor = Executor(tmp_path, "n1", Ledger())
    executor.submit([cost_notice(Decision(actions.COST_WARN, "cost_overrun_warn", 30, 300.0))])
    [late] = executor.submit([Notice("CostBudgetWarn", "firing", actions.COST_WARN, "f00d@t")])
    assert late.outcome == "duplicate"
    assert len(read_jsonl(tmp_path / "control" / "actions.jsonl")) == 1


def test_a_decision_that_is_not_a_cost_tier_is_ignored(tmp_path):
    executor = Executor(tmp_path, "n1", Ledger())
    DecisionHandler(executor.submit)(Decision("skip_step", "nan", 3, 1.0))
    assert not (tmp_path / "control" / "actions.jsonl").exists()


def step_record(path, step, when, **extra):
    """Append a rank's TLS record: a step record (with metrics) at `when`, or another record."""
    record = {"timestamp": when, "step": step, **({"metrics": {"loss": 3.0}} if not extra else extra)}
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def test_the_watchdog_sees_a_stall_only_when_live_ranks_stop_advancing(tmp_path, rank):
    started = json.loads((tmp_path / "control" / "ranks" / "rank-0.json").read_text())["started_at"]
    clock = [started + 100]
    watchdog = StallWatchdog(tmp_path, stall_seconds=30, submit=None, clock=lambda: clock[0],
                             monotonic=lambda: clock[0])
    tls_file = tmp_path / "tls" / "rank-0.jsonl"
    step_record(tls_file, 1, started - 5)
    assert watchdog.check() is None                      # no step since before the rank started: starting up
    step_record(tls_file, 2, started + 90)
    assert watchdog.check() is None                      # stepped 10 s ago
    clock[0] = started + 115
    step_record(tls_file, 2, started + 114, event={"type": "checkpoint_saved"})
    assert watchdog.check() is None                      # records without a new step are no progress ...
    clock[0] = started + 121
    stalled = watchdog.check()                           # ... 31 s without a step: stalled
    assert stalled is not None and (stalled.action, stalled.alertname) == ("restore", "TrainingStalled")
    assert stalled.source == "embedded" and stalled.starts_at == clock[0] and "last step 2" in stalled.reason
    step_record(tls_file, 2, started + 121, event={"type": "run_end", "reason": "completed"})
    assert watchdog.check() is None                      # finished and leaving (final checkpoint, exit)
    rank.kill()
    rank.wait()
    assert watchdog.check() is None                      # the ranks are gone: ended, not stalled


def test_ranks_that_never_write_after_starting_are_stalled_once_the_startup_grace_is_over(tmp_path, rank):
    """A rank hung while joining (imports, rendezvous, resume) writes nothing: starting until the grace is
    over, then a restore, rather than the rendezvous join timeout (30 minutes) deciding."""
    started = json.loads((tmp_path / "control" / "ranks" / "rank-0.json").read_text())["started_at"]
    clock = [started + 100]
    watchdog = StallWatchdog(tmp_path, stall_seconds=30, submit=None, clock=lambda: clock[0],
                             monotonic=lambda: clock[0], startup_grace_seconds=600)
    (tmp_path / "tls" / "rank-0.jsonl").write_text("")
    step_record(tmp_path / "tls" / "rank-0.jsonl", 7, started - 5)
    assert watchdog.check() is None                      # nothing reached since the start, 100 s in: starting
    (tmp_path / "tls" / "rank-0.jsonl").unlink()
    assert watchdog.check() is None                      # no TLS file at all: the same
    clock[0] = started + 601
    hung = watchdog.check()
    assert hung is not None and (hung.action, hung.alertname, hung.source) == ("restore", "TrainingStalled", "embedded")
    assert "started 601s ago" in hung.reason


def test_the_watchdog_restores_once_per_stall(tmp_path):
    # A rank that ignores SIGTERM stays alive through the grace period: the watchdog keeps finding the
    # same stall, and must neither act nor record again. The rank is a real one (a stand-in under torchrun).
    launched = Ranks()
    try:
        [stubborn] = launched.start(tmp_path, ignore_term=True)
        started = stubborn["started_at"]
        (tmp_path / "tls").mkdir(exist_ok=True)
        step_record(tmp_path / "tls" / "rank-0.jsonl", 2, started + 0.5)
        executor = Executor(tmp_path, "n1", Ledger(), restore_grace_seconds=1.0, entry_points=(STANDIN,))
        watchdog = StallWatchdog(tmp_path, stall_seconds=30, submit=executor.submit, clock=lambda: started + 60)
        watchdog.interval = 0.05
        watchdog.start()
        try:
            deadline = time.time() + 20
            while alive(stubborn["pid"]):              # SIGTERM ignored, SIGKILL after the grace
                assert time.time() < deadline
                time.sleep(0.05)
            time.sleep(0.5)
        finally:
            watchdog.stop()
    finally:
        launched.stop()
    restores = [r for r in read_jsonl(tmp_path / "control" / "actions.jsonl") if r["action"] == "restore"]
    assert len(restores) == 1
    alerts = [r["event"] for r in read_jsonl(tmp_path / "tls" / "node-n1-actions.jsonl") if r["event"]["type"] == "alert"]
    assert len(alerts) == 1 and alerts[0]["source"] == "embedded"
