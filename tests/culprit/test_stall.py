"""The stall decision (trainguard/decide/stall.py): live progress and a record stream, one rule."""

from __future__ import annotations

import json

from trainguard.decide.stall import RankProgress, StallTracker, decide, replay
from trainguard.replay import stall_pass


def test_no_step_for_stall_seconds_is_a_stall_and_recent_progress_is_not():
    ranks = [RankProgress(0, 24, 100.0, 50.0), RankProgress(1, 23, 98.0, 50.0)]
    assert decide(ranks, 105.0, 10.0, 900.0) is None
    stall = decide(ranks, 111.0, 10.0, 900.0)
    assert stall.action == "restore" and stall.step == 24 and stall.since == 100.0
    assert decide([], 1e9, 10.0, 900.0) is None


def test_ranks_that_reached_no_step_since_starting_wait_out_the_start_up_grace():
    ranks = [RankProgress(0, 24, 40.0, 50.0)]          # its step is from before this attempt started
    assert decide(ranks, 500.0, 10.0, 900.0) is None
    stall = decide(ranks, 951.0, 10.0, 900.0)
    assert stall.step is None and stall.key.startswith("startup@")


def test_a_node_log_that_keeps_coming_while_the_step_stands_still_is_a_stall_once():
    tracker = StallTracker(stall_seconds=10.0)
    assert tracker.observe(0.0, 1) is None and tracker.observe(1.0, 2) is None
    seen = [tracker.observe(t, 2) for t in range(2, 30)]       # hardware samples, the same step
    stalls = [s for s in seen if s is not None]
    assert len(stalls) == 1 and stalls[0].step == 2 and stalls[0].since == 1.0
    assert tracker.observe(31.0, 3) is None                    # progress again
    assert tracker.observe(32.0, None, started=True) is None and tracker.step is None   # a new attempt
    assert tracker.observe(33.0, 1) is None and tracker.advanced_at == 33.0              # back at step 1: progress


def test_replay_of_records_decides_restore_and_nothing_after_the_run_ends(tmp_path):
    m = {"loss": 1.0}
    records = [{"timestamp": float(t), "step": t, "metrics": m} for t in range(1, 11)]
    records += [{"timestamp": 10.0 + t, "step": 10, "metrics": m} for t in range(1, 40)]      # hung at step 10
    records += [{"timestamp": 59.0, "step": 7, "event": {"type": "run_start"}}]     # resumed from a checkpoint
    records += [{"timestamp": 60.0, "step": 8, "metrics": m}, {"timestamp": 61.0, "step": 9, "metrics": m}]
    records += [{"timestamp": 61.5, "step": 2, "event": {"type": "checkpoint_deleted"}}]   # not a step record
    records += [{"timestamp": 62.0, "step": 9, "event": {"type": "run_end"}}]
    records += [{"timestamp": 62.0 + t, "step": 9, "metrics": m} for t in range(1, 60)]  # node log after the end
    path = tmp_path / "rank-0.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    stalls = replay(stall_pass.streamed([path], False, 15.0), stall_seconds=15.0)    # as replay reads the log
    assert [(s.action, s.step) for s in stalls] == [("restore", 10)]
    assert stalls[0].since + 15.0 == 25.0
