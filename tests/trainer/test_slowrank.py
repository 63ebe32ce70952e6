"""The slowrank fault: one rank's compute slowed by a factor for a while, aimed with KIND@STEP[:RANK]."""

from __future__ import annotations

import pytest

from trainguard.trainer import faults
from trainguard.trainer.faults import Fault, FaultInjector, SlowRank, parse


def test_slowrank_is_aimed_at_rank_zero_unless_told():
    assert parse("slowrank@30") == Fault("slowrank", 30, 0)
    assert parse("slowrank@30:1") == Fault("slowrank", 30, 1)


def test_the_slowed_steps_sleep_the_factor_of_the_usual_period_then_stop():
    clock = SlowRank()
    clock.periods = [0.1] * 8                       # the rank's usual step, measured before the fault
    extra = clock.start(10)
    assert extra == pytest.approx((faults.SLOWRANK_FACTOR - 1) * 0.1)
    assert clock.delay(10) == clock.delay(10 + faults.SLOWRANK_STEPS - 1) == extra
    assert clock.delay(10 + faults.SLOWRANK_STEPS) == 0.0
    tiny = SlowRank()
    assert tiny.start(1) == faults.SLOWRANK_MIN_SECONDS    # no period known yet: the floor


def test_it_fires_once_on_its_rank_only(tmp_path, monkeypatch):
    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    emitted = []
    other = FaultInjector(["slowrank@3:1"], tmp_path, rank=0, emit=lambda _type, **f: emitted.append(f))
    target = FaultInjector(["slowrank@3:1"], tmp_path, rank=1, emit=lambda _type, **f: emitted.append(f))
    for step in range(1, 6):
        other.loss_factors(step)
        target.loss_factors(step)
    assert [e["fault"] for e in emitted] == ["slowrank@3:1"]
    assert emitted[0]["factor"] == faults.SLOWRANK_FACTOR and emitted[0]["steps"] == faults.SLOWRANK_STEPS
    assert sum(1 for s in slept if s > 0) == 3          # steps 3, 4, 5 on rank 1; rank 0 never
    again = FaultInjector(["slowrank@3:1"], tmp_path, rank=1, emit=lambda _type, **f: emitted.append(f))
    assert again.pending == []                          # fired once per run, across restarts
