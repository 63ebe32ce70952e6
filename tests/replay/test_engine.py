"""The replay engine feeds the live run's own Guard and CostMeter, in the log's time (trainguard.replay.engine)."""

import math
import random

from trainguard import tls
from trainguard.decide.cost import CostMeter
from trainguard.decide.guard import Guard, StepStats
from trainguard.policy import CostPolicy, CostTiers, Policy
from trainguard.replay import engine, source

T0 = 1_710_512_538.0


def write(path, records):
    with tls.Writer(path) as writer:
        for record in records:
            writer.write(record)
    return path


def steps(first, last, *, start=T0, every=1.0, rank=None, loss=lambda step: 2.0 + 0.01 * math.sin(step),
          grad_norm=lambda step: 1.0, gpus=None):
    for step in range(first, last + 1):
        record = {"timestamp": start + (step - first) * every, "step": step,
                  "metrics": {"loss": loss(step), "grad_norm": grad_norm(step)}}
        if rank is not None:
            record["rank"] = rank
        if gpus is not None:
            record["system"] = {"gpu_count": gpus}
        yield record


def replay(*paths, policy=None):
    return engine.replay(source.Stream(paths), policy or Policy())


def test_decisions_are_exactly_the_guards_own(tmp_path):
    rng = random.Random(7)
    losses = {s: 2.0 + rng.gauss(0, 0.05) for s in range(1, 401)}
    losses[150] = 50.0                      # a spike
    losses[151] = float("nan")
    norms = {s: 1.0 + rng.random() * 0.1 for s in range(1, 401)}
    norms[300] = 500.0                      # an explosion
    log = write(tmp_path / "rank-0.jsonl", steps(1, 400, loss=losses.get, grad_norm=norms.get))
    outcome = replay(log)

    guard = Guard(Policy().guard)
    expected = [d for s in range(1, 401) if (d := guard.observe(StepStats(s, losses[s], norms[s], None, T0 + s - 1)))]
    assert [(a.action, a.step, a.reason, a.timestamp) for a in outcome.actions] == \
        [(d.action, d.step, d.reason, d.timestamp) for d in expected]
    assert {a.reason for a in outcome.actions} >= {"loss_spike", "nan", "grad_explosion"}
    assert outcome.steps == 400 and outcome.first_timestamp == T0 and outcome.last_timestamp == T0 + 399


def test_cost_meter_runs_in_the_logs_time(tmp_path):
    # 8 GPUs at $2/h, budget $120 per 1000 steps: 27 s a step is on budget, 54 s twice it.
    policy = Policy(cost=CostPolicy(price_per_gpu_hour=2.0, budget_per_1k_steps=120.0,
                                    tiers=CostTiers(warn=0.3, throttle=0.6, stop=1.0)))
    log = write(tmp_path / "slow.jsonl", steps(1, 200, every=54.0 * 1.05, gpus=8))
    outcome = replay(log, policy=policy)
    meter = CostMeter(policy.cost)
    expected = [d for s in range(1, 201) for d in meter.observe(s, T0 + (s - 1) * 54.0 * 1.05, 8)]
    assert [(a.action, a.step) for a in outcome.actions] == [(d.action, d.step) for d in expected]
    assert [a.action for a in outcome.actions] == ["cost_warn", "cost_throttle", "cost_stop"]
    assert all(a.source == "cost" for a in outcome.actions)
    assert outcome.cost["tier"] == "stop" and outcome.cost["gpu_count"] == 8


def test_only_the_lead_ranks_steps_are_decided(tmp_path):
    spike = lambda step: 80.0 if step == 120 else 2.0 + 0.01 * math.sin(step)   # noqa: E731
    rank0 = write(tmp_path / "rank-0.jsonl", steps(1, 200, rank=0, loss=spike))
    rank1 = write(tmp_path / "rank-1.jsonl", steps(1, 200, rank=1, start=T0 + 0.01, loss=spike))
    node = write(tmp_path / "node-a.jsonl", steps(1, 200, start=T0 + 0.5, loss=spike))   # joined copy, no rank
    outcome = replay(rank0, rank1, node)
    assert outcome.steps == 200 and outcome.duplicate_steps == 400
    assert [(a.action, a.step) for a in outcome.actions] == [("skip_step", 120)]


def test_steps_that_go_back_in_one_file_are_decided_again(tmp_path):
    # The live run rolled back from 130 to 100: steps 101..130 ran twice, in one file.
    first = list(steps(1, 130))
    again = list(steps(101, 160, start=T0 + 140))
    outcome = replay(write(tmp_path / "rank-0.jsonl", first + again))
    assert outcome.steps == 190 and outcome.duplicate_steps == 0


def test_copies_of_steps_from_another_file_without_ranks_are_skipped(tmp_path):
    a = write(tmp_path / "node-a.jsonl", steps(1, 50))
    b = write(tmp_path / "node-b.jsonl", steps(1, 50, start=T0 + 0.2))
    outcome = replay(a, b)
    assert outcome.steps == 50 and outcome.duplicate_steps == 50


def test_after_stop_the_guard_is_not_asked_again(tmp_path):
    policy = Policy()
    nan_forever = lambda step: float("nan") if step > 30 else 2.0   # noqa: E731
    log = write(tmp_path / "rank-0.jsonl", steps(1, 400, every=1.0, loss=nan_forever))
    outcome = replay(log, policy=policy)
    kinds = [a.action for a in outcome.actions]
    assert kinds.count("stop") == 1 and kinds[-1] == "stop"
    assert kinds.count("rollback") == policy.guard.max_rollbacks_per_hour


def test_a_loss_without_grad_norm_is_decided_a_grad_norm_without_loss_is_counted(tmp_path):
    log = write(tmp_path / "partial.jsonl", [
        {"timestamp": T0, "step": 1, "metrics": {"loss": 2.0}},
        {"timestamp": T0 + 1, "step": 2, "metrics": {"grad_norm": 1.0}},
        {"timestamp": T0 + 2, "step": 3, "metrics": {"loss": 2.0, "grad_norm": 1.0}},
        {"timestamp": T0 + 3, "event": {"type": "rollback", "reason": "repeated_nan"}, "step": 3},
        {"timestamp": T0 + 4, "step": 4, "metrics": {"loss": float("nan")}},
    ])
    outcome = replay(log)
    assert (outcome.steps, outcome.partial_steps, outcome.records) == (3, 1, 5)
    # A NaN loss without a gradient norm is the NonFinite rule's, not undecided.
    assert [(a.action, a.step, a.reason) for a in outcome.actions] == [("skip_step", 4, "nan")]
    assert [(a.action, a.step, a.reason, a.source) for a in outcome.recorded] == \
        [("rollback", 3, "repeated_nan", "log")]


def test_a_plain_list_of_entries_follows_its_first_steps_rank(tmp_path):
    log = write(tmp_path / "rank-3.jsonl", steps(1, 10, rank=3))
    entries = list(source.Stream([log]))
    assert engine.replay(entries, Policy()).steps == 10


def test_a_null_layer_norm_is_read_as_nan_not_malformed(tmp_path):
    # tls.encode writes a NaN nested in grad_norm_by_layer as null (msgspec); the guard must see NaN.
    records = list(steps(1, 30))
    for record in records:
        record["metrics"]["grad_norm_by_layer"] = {"h.0": 1.0, "h.1": None if record["step"] == 25 else 1.0}
    stream = source.Stream([write(tmp_path / "rank-0.jsonl", records)])
    outcome = engine.replay(stream, Policy())
    assert stream.malformed == 0 and outcome.steps == 30 and outcome.actions == []


def test_an_action_from_an_alert_rule_carries_the_step_it_fired_at():
    """The hang incident: TrainingStalled fires after the log stops and its `restore` goes through the
    ledger; the action names the step the run had reached then (the last one it finished), not null."""
    from pathlib import Path

    from tests.servers import require_binary
    from trainguard.replay import replay_logs

    require_binary("promtool")
    root = Path(__file__).resolve().parents[2]
    folder = root / "tests" / "incidents" / "hang"
    last = max(record.step for _, _, _, record, _ in source.Stream([folder])      # the last step it finished
               if record.metrics is not None and record.metrics.loss is not None)
    result = replay_logs([folder], Policy(), rules_dir=root / "alerts", hold=150.0)
    restores = [a for a in result.actions if a.action == "restore"]
    assert [(a.source, a.step) for a in restores] == [("alert", last)]
    assert [a.step for a in result.alerts if a.alertname == "TrainingStalled"] == [last]
    assert result.to_json()["actions"][-1]["step"] == last
