"""The checkpoint autopilot's rule (trainguard/decide/checkpoint_interval.py): Daly's optimum, the MTBF with
its prior, the measurements folded from TLS records, the autopilot's changes and the trace replay."""

from __future__ import annotations

import dataclasses
import math

import pytest

from trainguard.decide import checkpoint_interval as ci
from trainguard.policy import CheckpointPolicy

POLICY = CheckpointPolicy(min_interval_seconds=1.0, max_interval_seconds=10**6, fleet_mtbf_gpu_hours=1.0,
                          prior_failures=1.0, window_failures=5, change_ratio=0.1)


@pytest.mark.parametrize("save, mtbf", [(30, 11135), (300, 11135), (60, 3600), (1000, 900)])
def test_daly_is_the_optimum_of_its_model(save, mtbf):
    """Daly's closed form lands within 0.05% of the goodput of the numerically best interval of his
    model; Young's first-order estimate falls well short once the save is long against the MTBF."""
    best = max(ci.expected_goodput(x / 10, save, 60, mtbf) for x in range(1, 40 * mtbf))
    assert ci.expected_goodput(ci.daly_interval(save, mtbf), save, 60, mtbf) >= 0.9995 * best
    if save == 1000:
        assert ci.expected_goodput(ci.young_interval(save, mtbf), save, 60, mtbf) < 0.9 * best


def test_daly_long_saves_and_no_failures():
    assert ci.daly_interval(500, 200) == 200                 # delta >= 2M: checkpoint every M
    assert ci.daly_interval(10, math.inf) == math.inf
    assert ci.daly_interval(30, 11135) == pytest.approx(797.5, abs=0.1)


def test_mtbf_prior_fades_and_window_follows_a_rate_change():
    # no failure yet: the prior plus the time survived
    mtbf, counted, observed = ci.estimate_mtbf([], 0.0, 100.0, prior_mtbf=1000.0, prior_failures=1.0, window=5)
    assert (mtbf, counted, observed) == (1100.0, 0, 100.0)
    # five failures: the window holds only them, the prior has faded out
    failures = [100.0, 200.0, 300.0, 400.0, 500.0]
    assert ci.estimate_mtbf(failures, 0.0, 500.0, 1e9, 1.0, 5)[0] == pytest.approx(100.0)
    # the rate changes (every 1000 s, then every 10 s): after five fast failures only they count
    slow = [1000.0 * i for i in range(1, 11)]
    fast = [10000.0 + 10.0 * i for i in range(1, 6)]
    assert ci.estimate_mtbf(slow + fast, 0.0, 10050.0, 1e9, 1.0, 5)[0] == pytest.approx(10.0)


def _record(ts, step=None, event=None, **metrics):
    record = {"timestamp": ts}
    if step is not None:
        record["step"] = step
    if event is not None:
        record["event"] = event
    else:
        record["metrics"] = {"step_time_seconds": 1.0, **metrics}
    return record


def crashed_log():
    """Steps 1-5, a 2 s save at step 4, a crash after step 5 (no run_end), the restart steps again at t=30."""
    records = [_record(0.0, event={"type": "run_start"})]
    records += [_record(float(s), s) for s in range(1, 6)]
    records.insert(5, _record(4.5, event={"type": "checkpoint_saved", "step": 4, "blocking_seconds": 2.0}))
    records += [_record(20.0, event={"type": "checkpoint_restored", "step": 4}),
                _record(21.0, event={"type": "run_start"}), _record(31.0, 5)]
    return records


def test_failure_log_measures_failures_saves_and_restarts():
    log = ci.FailureLog()
    for record in crashed_log():
        log.observe(record)
    assert log.failures == [5.0]                        # the last record of the dead process
    assert log.restart_costs == [25.0]                 # to the start of the first step after it (31 - 1)
    assert list(log.saves) == [2.0]
    measured = log.measured(31.0, POLICY, gpus=1)
    assert measured.save_seconds == 2.0 and measured.restart_seconds == 25.0
    assert measured.failures == 1 and measured.mtbf_source == "measured+prior:policy"


def test_a_planned_stop_is_no_failure():
    log = ci.FailureLog()
    records = [_record(0.0, event={"type": "run_start"}), _record(1.0, 1),
               _record(2.0, event={"type": "run_end", "reason": "completed"}),
               _record(50.0, event={"type": "run_start"}), _record(51.0, 2)]
    for record in records:
        log.observe(record)
    assert log.failures == [] and not log.restart_costs


def test_recommend_bounds_and_two_tiers():
    measured = ci.Measured(3600.0, "measured", 5, 18000.0, 60.0, 120.0)
    rec = ci.recommend(measured, POLICY)
    assert rec.interval_seconds == pytest.approx(ci.daly_interval(60, 3600) + 60)
    assert rec.bound is None and 0.8 < rec.expected_goodput < 1
    bounded = ci.recommend(measured, dataclasses.replace(POLICY, max_interval_seconds=300.0))
    assert (bounded.interval_seconds, bounded.bound) == (300.0, "max")
    assert ci.recommend(dataclasses.replace(measured, save_seconds=None), POLICY) is None
    # snapshots every few seconds cover 90% of failures: durable checkpoints can be much rarer
    tiers = ci.recommend(dataclasses.replace(measured, snapshot_seconds=0.5, snapshot_share=0.9), POLICY)
    assert tiers.snapshot_interval_seconds == pytest.approx(ci.daly_interval(0.5, 4000) + 0.5)
    assert tiers.interval_seconds == pytest.approx(ci.daly_interval(60, 36000) + 60)
    assert tiers.snapshot_interval_seconds < rec.interval_seconds < tiers.interval_seconds


def test_autopilot_changes_once_per_move_and_records_inputs():
    pilot = ci.Autopilot(dataclasses.replace(POLICY, min_interval_seconds=60.0), applied=300.0, gpus=1)
    first = pilot.consider(10.0)                        # no save measured yet: save at the lower bound to measure one
    assert (first["applied_seconds"], first["reason"], pilot.applied) == (60.0, "no save measured yet", 60.0)
    assert pilot.consider(11.0) is None
    pilot.policy = POLICY
    for record in crashed_log():
        pilot.observe(record)
    change = pilot.consider(31.0)
    assert change["previous_seconds"] == 60.0 and change["applied_seconds"] == pilot.applied
    for key in ("mtbf_seconds", "save_seconds", "restart_seconds", "failures", "mtbf_source", "expected_goodput"):
        assert key in change
    assert pilot.consider(31.5) is None                 # nothing moved: no event
    assert pilot.metrics() == {"checkpoint_interval_seconds": pilot.applied,
                               "checkpoint_interval_recommended_seconds": pilot.recommended}
    # a run resumed after a restart goes on with the interval its log last applied
    again = ci.Autopilot(POLICY, applied=300.0)
    again.observe(_record(40.0, event={"type": ci.INTERVAL_EVENT, **change}))
    again.resume()
    assert again.applied == change["applied_seconds"]


def test_history_prior_uses_earlier_runs_failures():
    history = ci.history_of([crashed_log(), [_record(0.0, 1), _record(100.0, 2)]])
    assert (history.runs, history.failures, history.gpu_seconds) == (2, 1, 131.0)
    assert ci.prior_mtbf_seconds(POLICY, 1, history) == (131.0, "prior:history")
    assert ci.prior_mtbf_seconds(POLICY, 4, ci.History(3, 0, 10.0)) == (900.0, "prior:policy")


def test_replay_trace_accounts_for_every_second():
    failures, restarts, total = [250.0, 1000.0], [50.0, 50.0], 2000.0
    for interval in (60.0, 200.0, 700.0):
        result = ci.replay_trace(failures, restarts, total, interval, save_seconds=10.0)
        assert result.useful_seconds + result.save_seconds + result.lost_seconds + result.restart_seconds == \
            pytest.approx(total)
    # no failures: only saves cost; one interval that is all saves keeps nothing
    clean = ci.replay_trace([], [], 1000.0, 100.0, 10.0)
    assert clean.goodput == pytest.approx(0.9) and clean.saves == 10
    # a failure just before a save loses the whole interval's work
    result = ci.replay_trace([89.0], [11.0], 200.0, 100.0, 10.0)
    assert result.lost_seconds == pytest.approx(89.0)


def test_snapshot_seconds_become_steps_within_bounds():
    assert ci.snapshot_every_steps(20.0, 0.5, 300.0) == 40
    assert ci.snapshot_every_steps(0.2, 0.5, 300.0) == 1                  # at least a step
    assert ci.snapshot_every_steps(400.0, 0.5, 300.0) == 600              # never rarer than the checkpoints
    assert ci.snapshot_every_steps(20.0, None, 300.0) is None             # no step measured: no change
    assert ci.snapshot_every_steps(20.0, 0.0, 300.0) is None
    assert ci.snapshot_every_steps(math.inf, 0.5, 300.0) is None


def in_process_log(step_seconds=0.5, snapshot_blocking=0.05):
    """Steps of `step_seconds`, a durable save, snapshots, and a failure recovered in-process at t=60."""
    records = [_record(0.0, event={"type": "run_start"})]
    records += [_record(float(s), s, step_time_seconds=step_seconds) for s in range(1, 50)]
    records.append(_record(50.0, event={"type": "checkpoint_saved", "step": 49, "blocking_seconds": 2.0}))
    records += [_record(50.0 + s / 10, event={"type": "snapshot_saved", "step": s,
                                              "blocking_seconds": snapshot_blocking}) for s in range(3)]
    records += [_record(60.0, event={"type": "checkpoint_restored", "step": 49}),    # a fallback's restore
                _record(61.0, event={"type": "in_process_restart", "recovery_seconds": 1.5}),
                _record(62.0, 50, step_time_seconds=step_seconds)]
    return records


def test_an_in_process_restart_is_one_failure_with_its_recovery_as_cost():
    log = ci.FailureLog()
    for record in in_process_log():
        log.observe(record)
    assert log.failures == [59.5] and log.restart_costs == [1.5]          # not counted twice for its restore
    assert log.step_seconds() == 0.5


def test_the_autopilot_steers_the_snapshot_tier_in_steps():
    policy = dataclasses.replace(POLICY, max_interval_seconds=3600.0)
    off = ci.Autopilot(policy, applied=300.0)                             # restart mode: no snapshot tier
    for record in in_process_log():
        off.observe(record)
    assert "snapshot_every" not in off.consider(63.0) and off.snapshot_every == 0
    pilot = ci.Autopilot(policy, applied=300.0, snapshot_every=5)
    for record in in_process_log():
        pilot.observe(record)
    change = pilot.consider(63.0)
    measured = pilot.log.measured(63.0, policy)
    seconds = ci.recommend(measured, policy).snapshot_interval_seconds
    expected = ci.snapshot_every_steps(seconds, 0.5, change["applied_seconds"])
    assert expected != 5 and change["snapshot_every"] == pilot.snapshot_every == expected
    assert change["previous_snapshot_every"] == 5 and change["step_seconds"] == 0.5
    assert change["snapshot_interval_seconds"] == pytest.approx(seconds, abs=1e-3)
    assert pilot.metrics()["snapshot_every_steps"] == expected
    assert pilot.consider(63.5) is None                                   # nothing moved: no event
    # the steps got 4x slower: the same seconds are fewer steps; the checkpoint interval stands
    for s in range(51, 51 + ci.STEP_SAMPLES):
        pilot.observe(_record(63.0 + s, s, step_time_seconds=2.0))
    applied = pilot.applied
    slower = pilot.consider(63.0 + 51 + ci.STEP_SAMPLES)
    if slower["applied_seconds"] == applied:                              # only the snapshot tier moved
        assert slower["previous_seconds"] == applied
    assert slower["previous_snapshot_every"] == expected
    assert slower["snapshot_every"] == ci.snapshot_every_steps(slower["snapshot_interval_seconds"], 2.0,
                                                                 slower["applied_seconds"])
    # a restarted process goes on with the snapshot interval its log last applied
    again = ci.Autopilot(policy, applied=300.0, snapshot_every=5)
    again.observe(_record(200.0, event={"type": ci.INTERVAL_EVENT, **slower}))
    again.resume()
    assert again.snapshot_every == slower["snapshot_every"]


def test_no_snapshot_taken_no_snapshot_tier_in_the_event():
    """A loop configured for snapshots that takes none (the library's, say): nothing said of the tier."""
    pilot = ci.Autopilot(POLICY, applied=300.0, snapshot_every=5)
    for record in crashed_log():
        pilot.observe(record)
    change = pilot.consider(31.0)
    assert "snapshot_every" not in change and "snapshot_every_steps" not in pilot.metrics()
