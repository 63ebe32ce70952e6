"""The checkpoint drill (the trainer's own manager and corrupt-checkpoint fault) and the two-rank collective."""

from __future__ import annotations

from trainguard.preflight.collective import check_collective
from trainguard.preflight.drill import run_drill


def test_drill_restores_the_intact_checkpoint(tmp_path):
    result = run_drill(tmp_path / "checkpoints")
    assert result.status == "pass", result.message
    assert result.details["restored_step"] == 1
    assert [c["step"] for c in result.details["corrupted"]] == [2]
    assert result.details["refused"][0]["code"] == "hash_mismatch"
    assert list((tmp_path / "checkpoints").iterdir()) == []     # the drill leaves nothing behind


def test_drill_with_every_checkpoint_corrupted_fails_clearly(tmp_path):
    result = run_drill(tmp_path, corrupt_steps=(1, 2))
    assert result.status == "fail"
    assert result.message.startswith("restore found no verified checkpoint after corruption (refused: step_2: "
                                     "hash mismatch: __0_0.distcp")
    assert "; step_1: hash mismatch: __0_0.distcp" in result.message


def test_drill_that_cannot_write_fails_with_the_reason(tmp_path):
    (tmp_path / "checkpoints").write_text("a file")
    result = run_drill(tmp_path / "checkpoints")
    assert result.status == "fail"
    assert result.message == f"drill could not run: cannot make its directory under {tmp_path / 'checkpoints'}: File exists"


def test_two_ranks_all_reduce_over_gloo():
    result = check_collective(timeout=60, backend="gloo")
    assert result.status == "pass", result.message
    assert result.details["all_reduce_seconds"] > 0


def test_ranks_that_do_not_finish_in_time_fail_and_are_killed():
    # 0.2 s is less than starting two Python processes with torch takes: the ranks really are late.
    result = check_collective(timeout=0.2, backend="gloo")
    assert result.status == "fail"
    assert "rank(s) 0, 1 did not finish within 0.2 s" in result.message
