"""Goodput on synthetic runs whose answers are known, and the invariant that the pieces add up."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.goodput import CAUSES, GoodputConfig, compute


class Run:
    """Builds TLS records (as trainguard.tls.decode returns them) at explicit times."""

    def __init__(self):
        self.records: list[dict] = []

    def step(self, t: float, step: int, step_time: float | None = None, data_wait: float | None = None) -> "Run":
        metrics = {"loss": 2.0}
        if step_time is not None:
            metrics["step_time_seconds"] = step_time
        if data_wait is not None:
            metrics["data_wait_seconds"] = data_wait
        self.records.append({"timestamp": t, "step": step, "metrics": metrics})
        return self

    def steps(self, t0: float, first: int, last: int, every: float = 1.0) -> "Run":
        for i, step in enumerate(range(first, last + 1)):
            self.step(t0 + i * every, step, step_time=every)
        return self

    def event(self, t: float, type_: str, **fields) -> "Run":
        self.records.append({"timestamp": t, "event": {"type": type_, **fields}})
        return self


def assert_adds_up(result) -> None:
    assert result.productive_seconds + sum(result.badput_seconds.values()) == pytest.approx(result.total_seconds)
    assert all(v >= -1e-9 for v in result.badput_seconds.values()) and 0 <= result.goodput_ratio <= 1


def test_startup_data_wait_checkpoint_stall_and_shutdown():
    run = Run().event(0, "run_start")
    run.step(5, 1, step_time=1)                 # startup 4, step 1 took 1
    run.step(6, 2).step(7, 3, data_wait=0.25)   # data wait 0.25
    run.event(7.5, "checkpoint_saved", step=3, blocking_seconds=0.5, seconds=0.5)  # blocked 7.0-7.5
    run.step(8.5, 4).step(9.5, 5)
    run.step(15.5, 6)                           # 6 s where 1 s is usual: 5 s of a slow step (not a stall)
    run.steps(16.5, 7, 10)
    run.event(20, "run_finished")               # 0.5 s after the last step: other
    result = compute(run.records)
    assert result.total_seconds == 20
    assert result.productive_seconds == pytest.approx(9.75)
    assert result.badput_seconds == pytest.approx({"startup": 4, "checkpoint_save": 0.5, "evaluation": 0,
                                                   "rollback": 0,
                                                   "restart_recovery": 0, "stall": 0, "slow_steps": 5,
                                                   "data_wait": 0.25,
                                                   "skipped_steps": 0, "other": 0.5, "in_process_teardown": 0,
                                                   "in_process_reform": 0, "in_process_restore": 0,
                                                   "in_process_recovery": 0})
    assert result.goodput_ratio == pytest.approx(9.75 / 20)
    assert result.median_step_seconds == 1 and result.productive_steps == 10
    assert result.badput_ratio["slow_steps"] == pytest.approx(0.25)
    assert_adds_up(result)


@pytest.mark.parametrize("trainer_order", [True, False])
def test_rollback_wastes_the_steps_after_the_restored_checkpoint_and_skips_count(trainer_order):
    run = Run().event(0, "run_start").steps(1, 1, 10)           # steps 1..10 at t=1..10
    run.event(8.1, "skip_step", step=8)                           # thrown away by the rollback anyway
    if trainer_order:  # the trainer restores first, then announces the rollback with the step restored
        run.event(10.8, "checkpoint_restored", step=5).event(11, "rollback", step=10, restored_step=5)
    else:
        run.event(10.2, "rollback", step=10, reason="loss_spike").event(11, "checkpoint_restored", step=5)
    run.step(12, 6, step_time=1)                                  # 10 -> 11 restoring: rollback
    run.steps(13, 7, 12)                                          # steps 7..12 at t=13..18
    run.event(16.1, "skip_step", step=10)                         # a skip in the new timeline
    result = compute(run.records)
    assert result.total_seconds == 18 and result.rollbacks == 1 and result.restarts == 0
    assert result.badput_seconds["rollback"] == pytest.approx(5 + 1)      # steps 6..10, and the restore
    assert result.badput_seconds["skipped_steps"] == pytest.approx(1)
    assert result.productive_seconds == pytest.approx(5 + 1 + 6 - 1)
    assert result.productive_steps == 11
    assert_adds_up(result)


def test_a_rollback_without_a_restored_event_is_seen_from_the_step_going_back():
    run = Run().event(0, "run_start").steps(1, 1, 10)
    run.event(10.2, "rollback", step=10)
    run.step(12, 6, step_time=1).steps(13, 7, 8)
    result = compute(run.records)
    assert result.badput_seconds["rollback"] == pytest.approx(5 + 1) and result.restarts == 0


def _crashed_run(announced: bool) -> Run:
    run = Run().event(0, "run_start").steps(1, 1, 6)
    run.event(4.0, "checkpoint_saved", step=4, blocking_seconds=0.0, seconds=0.0)
    run.event(6.5, "fault_injected", kind="crash")                # the last record before the crash
    if announced:  # what the trainer writes as it starts again: skipped checkpoints, restore, run_start
        run.event(20, "checkpoint_invalid", step=6, reason="hash mismatch")
        run.event(22, "checkpoint_restored", step=4).event(23, "run_start", resumed_from=4)
    run.step(25, 5, step_time=1).steps(26, 6, 8)                  # resumed: 5..8 at t=25..28
    return run


@pytest.mark.parametrize("announced", [True, False])
def test_a_restart_costs_the_downtime_and_the_steps_since_the_checkpoint(announced):
    result = compute(_crashed_run(announced).records)
    assert result.restarts == 1 and result.total_seconds == 28
    assert result.badput_seconds["restart_recovery"] == pytest.approx((24 - 6.5) + 2)  # downtime; steps 5, 6
    assert result.badput_seconds["stall"] == pytest.approx(0.5)                        # after step 6, before dying
    assert result.productive_seconds == pytest.approx(4 + 4)
    assert_adds_up(result)


def test_a_restart_that_restores_nothing_is_seen_from_run_start():
    run = Run().event(0, "run_start").steps(1, 1, 3).event(3.5, "fault_injected", kind="crash")
    run.event(10, "run_start").step(12, 1, step_time=1).steps(13, 2, 3)
    result = compute(run.records)
    assert result.restarts == 1 and result.badput_seconds["stall"] == pytest.approx(0.5)
    assert result.badput_seconds["restart_recovery"] == pytest.approx((11 - 3.5) + 3)
    assert result.productive_seconds == pytest.approx(3)


def test_async_blocking_is_charged_where_the_save_started():
    run = Run().event(0, "run_start").steps(1, 1, 10)
    # An async save started at 7.1, blocked 0.1 s to copy, became durable at 9.9.
    run.event(9.9, "checkpoint_saved", step=7, blocking_seconds=0.1, seconds=2.8, started_at=7.1, **{"async": True})
    result = compute(run.records)
    assert result.badput_seconds["checkpoint_save"] == pytest.approx(0.1)
    assert result.productive_seconds == pytest.approx(10 - 0.1)


def test_evaluation_time_is_its_own_cause_not_a_stall():
    run = Run().event(0, "run_start").steps(1, 1, 5)
    run.event(7.5, "evaluation", step=5, val_loss=2.0, seconds=2.5)   # 5.0-7.5 validating
    run.event(7.6, "checkpoint_saved", step=5, blocking_seconds=0.1, seconds=0.1)
    run.steps(8.6, 6, 10)
    result = compute(run.records)
    assert result.badput_seconds["evaluation"] == pytest.approx(2.5)
    assert result.badput_seconds["checkpoint_save"] == pytest.approx(0.1)
    assert result.badput_seconds["stall"] == 0 and result.productive_seconds == pytest.approx(10)
    assert_adds_up(result)


def test_slow_factor_is_configurable():
    run = Run().steps(0, 1, 9).step(10.5, 10)   # one step of 2.5 s among 1 s steps
    assert compute(run.records).badput_seconds["slow_steps"] == 0
    assert compute(run.records, GoodputConfig(slow_factor=2)).badput_seconds["slow_steps"] == pytest.approx(1.5)


def test_slow_steps_are_not_a_stall_a_stop_of_progress_is():
    """A noisy machine (steps of 1 to 5 s, no hang) has slow steps and no stall; an interval of
    `stall_seconds` (alerts.stall_seconds, where TrainingStalled fires) or more is a stall."""
    run, t = Run(), 0.0
    for step, seconds in enumerate([1, 1, 5, 1, 4, 1, 1, 5, 1, 1, 1, 4] * 3, start=1):
        t += seconds
        run.step(t, step)
    noisy = compute(run.records)
    assert noisy.badput_seconds["stall"] == 0 and noisy.badput_seconds["slow_steps"] == pytest.approx(3 * 14)
    assert_adds_up(noisy)
    run.step(t + 70, 37)                                  # 70 s without a step: progress stopped
    stopped = compute(run.records, GoodputConfig(stall_seconds=60))
    assert stopped.badput_seconds["stall"] == pytest.approx(69) and stopped.badput_seconds["slow_steps"] == pytest.approx(42)
    assert compute(run.records, GoodputConfig(stall_seconds=100)).badput_seconds["stall"] == 0


def test_records_out_of_order_and_nothing_at_all():
    run = Run().event(0, "run_start").steps(1, 1, 5)
    assert compute(reversed(run.records)) == compute(run.records)
    empty = compute([])
    assert empty.total_seconds == 0 and empty.goodput_ratio == 0 and set(empty.badput_seconds) == set(CAUSES)


_record = st.one_of(
    st.builds(lambda s, st_, dw: ("step", s, st_, dw), st.integers(0, 30), st.floats(0, 3), st.floats(0, 1)),
    st.sampled_from([("run_start",), ("rollback",), ("fault_injected",), ("checkpoint_invalid",)]),
    st.builds(lambda s: ("checkpoint_restored", s), st.integers(0, 30)),
    st.builds(lambda s: ("skip_step", s), st.integers(0, 30)),
    st.builds(lambda b, s: ("checkpoint_saved", b, s), st.floats(0, 5), st.floats(0, 10)),
    st.builds(lambda s: ("evaluation", s), st.floats(0, 5)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 5.0), _record), max_size=60))
def test_any_sequence_of_records_adds_up(items):
    run, t = Run(), 0.0
    for gap, rec in items:
        t += gap
        if rec[0] == "step":
            run.step(t, rec[1], step_time=rec[2], data_wait=rec[3])
        elif rec[0] == "checkpoint_saved":
            run.event(t, "checkpoint_saved", blocking_seconds=rec[1], seconds=rec[2])
        elif rec[0] == "evaluation":
            run.event(t, "evaluation", seconds=rec[1])
        elif len(rec) == 2:
            run.event(t, rec[0], step=rec[1])
        else:
            run.event(t, rec[0])
    result = compute(run.records)
    assert_adds_up(result)
    assert result.total_seconds == pytest.approx(t - items[0][0] if items else 0)


def _hung_run(decided: bool) -> Run:
    """Steps 1..10 at t=1..10, hung after step 10; the agent decides to restore at 25; the ranks restart
    and resume from step 8 (restored) with their first step starting at 40."""
    from trainguard.goodput import Incident  # noqa: F401  (imported by the tests below)

    run = Run().event(0, "run_start").steps(1, 1, 10)
    run.event(10.5, "fault_injected", kind="hang")
    if decided:   # the agent's records, as node-<host>-actions.jsonl holds them
        run.event(25.0, "alert", alertname="TrainingStalled", outcome="act", action="restore", decided_at=25.0)
        run.event(25.0, "action", action="restore", id="restore-1", issued_at=25.0)
    run.event(38, "checkpoint_restored", step=8).event(39, "run_start", resumed_from=8)
    run.step(41, 9, step_time=1).steps(42, 10, 12)
    return run


def test_a_hang_is_stall_until_the_restore_decision_then_restart_recovery():
    from trainguard.goodput import Incident

    incidents = [Incident("far-away", 500.0), Incident("hang-1", 24.0)]
    result = compute(_hung_run(decided=True).records, incidents=incidents)
    [hang] = result.hangs
    assert (hang.last_progress, hang.decided_at, hang.resumed_at) == (10, 25, 40)
    assert hang.stall_seconds == pytest.approx(15) and hang.restart_recovery_seconds == pytest.approx(15)
    assert hang.decided_by == "restore-1" and hang.incident == "hang-1"
    assert result.badput_seconds["stall"] == pytest.approx(15)
    assert result.badput_seconds["restart_recovery"] == pytest.approx(15 + 2)     # and steps 9, 10 redone
    assert result.total_seconds == 44 and result.restarts == 1
    assert_adds_up(result)


def test_without_a_decision_the_stall_ends_at_the_dead_process_last_record():
    result = compute(_hung_run(decided=False).records)
    [hang] = result.hangs
    assert hang.decided_at is None and hang.decided_by is None and hang.incident is None
    assert hang.stall_seconds == pytest.approx(0.5)          # to the fault_injected record
    assert hang.restart_recovery_seconds == pytest.approx(40 - 10.5)
    assert_adds_up(result)


def test_a_decision_not_followed_by_a_restart_changes_nothing():
    run = Run().event(0, "run_start").steps(1, 1, 5)
    run.event(5.5, "action", action="restore", id="restore-1", issued_at=5.5)   # the restart never came
    run.steps(6, 6, 8)
    result = compute(run.records)
    assert result.hangs == () and result.restarts == 0 and result.total_seconds == 8
