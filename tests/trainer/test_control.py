"""The control channel in the loop: requests the agent appends to RUN/control/actions.jsonl."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.trainer.helpers import events, final_losses, step_records, train
from trainguard.runtime.checkpoint.manager import CheckpointManager
from tests import signing
from trainguard import rundir
from trainguard.runtime.control import ControlChannel


def test_cost_throttle_cuts_the_micro_batch_and_keeps_tokens_per_step(tmp_path):
    plain, throttled = tmp_path / "plain", tmp_path / "throttled"
    assert train(plain, "--steps", "6") == 0
    signing.append(throttled, "cost_throttle", "t1", alertname="CostBudgetThrottle", reason="over")
    assert train(throttled, "--steps", "6") == 0

    (ack,) = events(throttled, "action")
    assert ack == {"type": "action", "action": "cost_throttle", "id": "t1", "alertname": "CostBudgetThrottle",
                   "reason": "over", "micro_batch_before": 8, "micro_batch_size": 6, "grad_accum_steps": 2,
                   "step": 1}
    steps = step_records(throttled)
    assert [r["metrics"]["micro_batch_size"] for r in steps] == [8, 6, 6, 6, 6, 6]
    assert [r["metrics"]["grad_accum_steps"] for r in steps] == [1, 2, 2, 2, 2, 2]
    loaded = [r["metrics"]["tokens_loaded"] for r in steps]
    assert [b - a for a, b in zip(loaded, loaded[1:])] == [8 * 64] * 5        # tokens per step unchanged
    # the same gradient, only accumulated in two parts: the losses follow the unthrottled run's
    for step, loss in final_losses(plain).items():
        assert final_losses(throttled)[step] == pytest.approx(loss, rel=1e-4)
    assert json.loads((throttled / "control" / "acked.jsonl").read_text())["id"] == "t1"


def test_cost_stop_ends_cleanly_with_a_verified_checkpoint_and_a_summary(tmp_path):
    run = tmp_path / "run"
    signing.append(run, "cost_warn", "w1", alertname="CostBudgetWarn")
    signing.append(run, "cost_stop", "s1", alertname="CostBudgetStop", reason="budget spent")
    assert train(run, "--steps", "40", "--eval-every", "1") == 0

    acks = [(e["action"], e["id"], e["step"]) for e in events(run, "action")]
    assert acks == [("cost_warn", "w1", 1), ("cost_stop", "s1", 2)]
    assert [e["purpose"] for e in events(run, "evaluation")] == ["checkpoint"]   # periodic eval paused
    assert events(run, "run_end")[-1] == {"type": "run_end", "reason": "cost_stop",
                                          "alertname": "CostBudgetStop", "step": 2}
    checkpoint = CheckpointManager(run).latest_verified()
    assert checkpoint.step == 2
    summary = json.loads((run / "cost_summary.json").read_text())
    assert summary["step"] == 2 and summary["checkpoint_verified"] is True
    assert summary["stopped_by"] == {"id": "s1", "alertname": "CostBudgetStop", "reason": "budget spent"}
    assert summary["tokens_trained"] == 2 * 8 * 64 and summary["wall_hours"] > 0

    # Restarted, the run carries on from step 2: handled requests are not handled again.
    assert train(run, "--steps", "4") == 0
    assert [r["step"] for r in step_records(run)] == [1, 2, 3, 4]
    assert len(events(run, "action")) == 2


def test_rollback_request_restores_the_last_stable_checkpoint(tmp_path):
    run = tmp_path / "run"

    def request_after_step_12():
        path = run / "tls" / "rank-0.jsonl"
        deadline = time.time() + 60
        while time.time() < deadline:
            if path.exists() and '"step":12,"metrics"' in path.read_text():
                signing.append(run, "rollback", "r1", alertname="LossSpike", reason="drill")
                return
            time.sleep(0.005)

    agent = threading.Thread(target=request_after_step_12)
    agent.start()
    assert train(run, "--steps", "24", "--checkpoint-every", "10") == 0
    agent.join()
    (ack,) = events(run, "action")
    (rollback,) = events(run, "rollback")
    assert ack["id"] == rollback["id"] == "r1" and rollback["source"] == "control"
    assert rollback["alertname"] == "LossSpike"
    assert rollback["restored_step"] == 10 * (rollback["step"] // 10)
    assert step_records(run)[-1]["step"] == 24


def test_channel_reads_only_new_complete_lines_and_reports_bad_ones(tmp_path):
    warnings = []

    class Log:
        def warning(self, message, **fields):
            warnings.append(fields)

    key = signing.key()
    channel = ControlChannel(tmp_path, rank=0, log=Log(), key=key)
    assert channel.poll() == (0, 0)
    path = tmp_path / "control" / "actions.jsonl"
    signing.append(tmp_path, "cost_warn", "a")
    with open(path, "a") as handle:
        handle.write('{"id": "b", "action": "explode"}\nnot json\n{"id": "c", "action": "restore"}\n')
        handle.write(json.dumps(signing.request(tmp_path, "rollback", "d"))[:-1])          # still being written
    assert channel.poll() == (2, 1)
    assert channel.poll() == (0, 0)
    assert [w["where"] for w in warnings] == [f"{path}:2", f"{path}:3"]
    with open(path, "a") as handle:
        handle.write("}\n")
    assert channel.poll() == (1, 5)
    assert channel.request_at(5)["id"] == "d"
    channel.ack(channel.request_at(5), step=7)
    assert ControlChannel(tmp_path, rank=0, key=key).poll() == (2, 1)      # a restart skips only acknowledged ids


# ------------------------------------------------------------------ The control channel is signed

def stranger_appends(run, *lines: dict) -> None:
    """What anyone who can write the run directory can do: append request lines by hand."""
    path = rundir.requests_path(run)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        for line in lines:
            handle.write(json.dumps(line) + "\n")


def test_a_strangers_rollback_and_stop_are_refused_counted_and_shown(tmp_path, capsys):
    """The attack this prevents: two lines appended to RUN/control/actions.jsonl rolled the run back 25 steps
    and stopped it with cost_stop. Unsigned, they are refused; the run trains to its end."""
    from trainguard.cli import main

    run = tmp_path / "run"

    def appended_during_the_run():
        path = run / "tls" / "rank-0.jsonl"
        deadline = time.time() + 60
        while time.time() < deadline:
            if path.exists() and '"step":7,"metrics"' in path.read_text():
                stranger_appends(run, {"id": "x1", "action": "rollback", "alertname": "LossSpike", "reason": "drill"},
                                 {"id": "x2", "action": "cost_stop", "alertname": "CostBudgetStop",
                                  "reason": "budget spent"})
                return
            time.sleep(0.005)

    stranger = threading.Thread(target=appended_during_the_run)
    stranger.start()
    assert train(run, "--steps", "30", "--checkpoint-every", "5") == 0
    stranger.join()
    assert rundir.requests_path(run).exists()                      # the lines were there while it trained

    assert events(run, "rollback") == [] and events(run, "action") == []
    assert events(run, "run_end")[-1]["reason"] == "completed" and step_records(run)[-1]["step"] == 30
    refused = events(run, "control_refused")
    assert [(e["id"], e["action"], e["reason"], e["line"]) for e in refused] == [
        ("x1", "rollback", "unsigned", 1), ("x2", "cost_stop", "unsigned", 2)]
    assert refused[-1]["refused_total"] == 2
    assert not (run / "cost_summary.json").exists()
    assert not (run / "control" / "acked.jsonl").exists()      # nothing handled

    capsys.readouterr()
    main(["status", str(run)])
    shown = capsys.readouterr().out
    assert "control request x2 (cost_stop) REFUSED: unsigned" in shown, shown


def test_forged_changed_and_copied_requests_are_refused(tmp_path):
    """Signed with another key, changed after signing, signed for a run of another name: none is acted on."""
    run, other = tmp_path / "run", tmp_path / "other-run"
    forged = rundir.sign_request(b"k" * 32, rundir.request("cost_stop", "f1"), run, by="agent:evil")
    changed = {**signing.request(run, "cost_warn", "c1"), "action": "cost_stop"}
    copied = signing.request(other, "cost_stop", "o1")
    stranger_appends(run, forged, changed, copied)
    warnings = []

    class Log:
        def warning(self, message, **fields):
            warnings.append((message, fields))

    channel = ControlChannel(run, rank=0, log=Log(), key=signing.key())
    assert channel.poll() == (0, 0)
    assert channel.refused == {"bad_signature": 2, "not_bound": 1}
    assert [f["id"] for _, f in warnings] == ["f1", "c1", "o1"]
    assert ControlChannel(run, rank=0, key=None).poll() == (0, 0)      # no key: nothing can be checked, none acted on
    assert rundir.read_requests(run, signing.key(), signed_only=True) == []


def test_a_forged_acknowledgement_suppresses_nothing_and_a_garbage_one_crashes_nothing(tmp_path):
    """RUN/control/acked.jsonl keeps a restarted run from acting twice. A stranger's line there named the
    agent's (predictable) request id `cost-cost_stop` as handled, so the genuine request was never acted on;
    a garbage line crashed rank 0 at start. Acknowledgements are signed by rank 0 now."""
    key = signing.key()
    path = rundir.acked_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text('{"id": "cost-cost_stop", "action": "cost_stop", "step": 1}\nnot json\n{"no": "id"}\n')
    signing.append(tmp_path, "cost_stop", "cost-cost_stop")
    channel = ControlChannel(tmp_path, rank=0, key=key)
    assert channel.poll() == (4, 1)                                      # acted on
    channel.ack(channel.request_at(1), step=3)
    assert ControlChannel(tmp_path, rank=0, key=key).poll() == (0, 0)     # its own signed ack: not twice


def test_another_rank_reads_a_line_changed_since_rank_0_checked_it_without_trusting_or_crashing(tmp_path):
    key = signing.key()
    signing.append(tmp_path, "cost_warn", "w1", alertname="CostBudgetWarn")
    other = ControlChannel(tmp_path, rank=1, key=key)
    assert other.request_at(1)["id"] == "w1"                         # the signed line, checked by this rank too
    rundir.requests_path(tmp_path).write_text('{"id": "evil", "action": "cost_warn"}\nnot json\n')
    assert other.request_at(1)["id"] == "line-1"                     # changed since: its ids are not trusted
    assert other.request_at(2)["id"] == "line-2"                     # garbage: named, no crash
