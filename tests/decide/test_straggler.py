"""decide/straggler.py: NVRx-style relative and individual scores of each rank's recent compute time."""

from __future__ import annotations

import pytest

from trainguard.decide.straggler import (MIN_STEPS, WARMUP_STEPS, WINDOW_STEPS, StragglerBoard, compute_seconds,
                                         relative_scores, stragglers)


def timing(compute: float, wait: float = 0.01, comm: float = 0.02) -> dict:
    return {"step_time_seconds": compute + wait + comm, "data_wait_seconds": wait, "comm_seconds": comm}


def feed(board: StragglerBoard, steps: range, seconds: dict[int, float], node: str = "n1") -> None:
    for step in steps:
        for rank, compute in seconds.items():
            board.observe(rank, f"{node}-{rank}", step, timing(compute))


def test_compute_is_step_time_less_data_wait_and_comm():
    assert compute_seconds(timing(0.5)) == pytest.approx(0.5)
    assert compute_seconds({"step_time_seconds": 0.4}) == pytest.approx(0.4)      # parts missing: 0
    assert compute_seconds({"step_time_seconds": 0.1, "comm_seconds": 0.3}) == 0.0
    assert compute_seconds({"data_wait_seconds": 0.1}) is None
    assert compute_seconds({"step_time_seconds": float("nan")}) is None


def test_relative_score_is_the_fastest_over_each():
    assert relative_scores({0: 0.1, 1: 0.2, 2: 0.4}) == {0: 1.0, 1: 0.5, 2: 0.25}


def test_a_rank_twice_as_slow_scores_one_half_and_is_a_straggler_naming_its_node():
    board = StragglerBoard()
    feed(board, range(1, 40), {0: 0.1, 1: 0.2, 2: 0.1})
    scores = {s.rank: s for s in board.scores()}
    assert scores[1].relative == pytest.approx(0.5) and scores[0].relative == scores[2].relative == 1.0
    assert scores[1].individual == pytest.approx(1.0)                 # it was always this slow
    [slow] = stragglers(board.scores())
    assert (slow.rank, slow.node) == (1, "n1-1")


def test_the_individual_score_sees_a_rank_that_slowed_against_its_own_past():
    board = StragglerBoard()
    feed(board, range(1, 40), {0: 0.1, 1: 0.1})
    assert not stragglers(board.scores())
    feed(board, range(40, 40 + WINDOW_STEPS), {0: 0.3, 1: 0.3})       # every rank slowed: none is relatively slow
    scores = board.scores()
    assert all(s.relative == 1.0 for s in scores) and all(s.individual == pytest.approx(1 / 3) for s in scores)


def test_no_scores_before_two_ranks_have_enough_steps_after_warm_up():
    board = StragglerBoard()
    feed(board, range(1, WARMUP_STEPS + MIN_STEPS), {0: 0.1, 1: 0.5})
    assert board.scores() == []                                          # one step short
    feed(board, range(WARMUP_STEPS + MIN_STEPS, WARMUP_STEPS + MIN_STEPS + 1), {0: 0.1, 1: 0.5})
    assert [round(s.relative, 2) for s in board.scores()] == [1.0, 0.2]
    single = StragglerBoard()
    feed(single, range(1, 40), {0: 0.1})
    assert single.scores() == []


def test_a_restart_warms_up_again_and_the_window_forgets_old_slowness():
    board = StragglerBoard()
    feed(board, range(1, 40), {0: 0.1, 1: 0.4})
    assert stragglers(board.scores())
    feed(board, range(20, 20 + WARMUP_STEPS), {0: 0.1, 1: 5.0})          # restarted: warm-up steps are left out
    assert [s.rank for s in stragglers(board.scores())] == [1]
    feed(board, range(20 + WARMUP_STEPS, 20 + WARMUP_STEPS + WINDOW_STEPS), {0: 0.1, 1: 0.1})
    assert stragglers(board.scores()) == []
