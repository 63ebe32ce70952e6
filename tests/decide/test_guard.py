import math

import pytest

from trainguard.actions import STOP
from trainguard.decide.guard import Guard, StepStats
from trainguard.policy import GuardPolicy


def healthy(guard, steps, start=0, t0=0.0):
    for i in range(start, start + steps):
        decision = guard.observe(StepStats(i, 3.0 - 0.001 * i + 0.01 * math.sin(i), 1.0 + 0.05 * math.sin(i),
                                           {"h.0": 0.5, "h.1": 0.4}, t0 + i))
        assert decision.action is None, (i, decision)


def test_healthy_run_never_acts():
    healthy(Guard(), 5000)


@pytest.mark.parametrize("loss,grad", [(float("nan"), 1.0), (2.0, float("inf")), (float("-inf"), 1.0)])
def test_non_finite_is_skipped_even_before_warmup(loss, grad):
    decision = Guard().observe(StepStats(0, loss, grad))
    assert (decision.action, decision.reason) == ("skip_step", "nan")


def test_loss_spike_waits_for_min_steps_then_skips():
    guard = Guard()
    healthy(guard, 63)
    assert guard.observe(StepStats(63, 4.5, 1.0)).action is None   # only 63 good steps: the band still learns
    guard = Guard()
    healthy(guard, 63)      # ... but a loss above 1.8x the highest healthy one is no warm-up wobble
    assert guard.observe(StepStats(63, 50.0, 1.0)).reason == "warmup_spike"
    guard = Guard()
    healthy(guard, 64)
    decision = guard.observe(StepStats(64, 50.0, 1.0, None, 64.0))
    assert decision.action == "skip_step" and decision.reason == "loss_spike"
    assert decision.detail["threshold"] < 50.0


def test_bad_steps_do_not_raise_the_bar():
    guard = Guard()
    healthy(guard, 100)
    window = guard.rule("loss_spike").window
    before = window.threshold(6.0, 1e-3)
    guard.observe(StepStats(100, 80.0, 1.0))
    assert window.threshold(6.0, 1e-3) == before


def test_gradient_explosion_global_and_per_layer():
    guard = Guard()
    healthy(guard, 30)
    assert guard.observe(StepStats(30, 2.9, 50.0)).reason == "grad_explosion"
    decision = guard.observe(StepStats(31, 2.9, 1.0, {"h.0": 0.5, "h.1": 40.0}))
    assert decision.reason == "grad_explosion" and decision.detail["layer"] == "h.1"


def test_of_several_exploding_layers_the_detail_names_the_worst_in_any_order():
    """EMAs h.0 0.5, h.1 0.4 (factor 25: thresholds 12.5 and 10): h.1 at 40 is 4x its threshold, h.0 at 30
    2.4x. Whichever order the record lists them in, the detail names h.1."""
    for layers in ({"h.0": 30.0, "h.1": 40.0}, {"h.1": 40.0, "h.0": 30.0}):
        guard = Guard()
        healthy(guard, 30)
        decision = guard.observe(StepStats(30, 2.9, 1.0, layers))
        assert decision.detail["layer"] == "h.1" and decision.detail["grad_norm"] == 40.0


def test_repeated_bad_steps_roll_back_then_limit_stops():
    policy = GuardPolicy(rollback_after=3, rollback_window=50, max_rollbacks_per_hour=2)
    guard = Guard(policy)
    healthy(guard, 100)
    actions = [guard.observe(StepStats(100 + i, float("nan"), 1.0, None, 100.0 + i)).action for i in range(3)]
    assert actions == ["skip_step", "skip_step", "rollback"]
    for i in range(3):
        last = guard.observe(StepStats(200 + i, float("nan"), 1.0, None, 200.0 + i))
    assert last.action == "rollback"
    for i in range(3):
        last = guard.observe(StepStats(300 + i, float("nan"), 1.0, None, 300.0 + i))
    assert (last.action, last.reason) == (STOP, "rollback_limit")


def test_rollback_limit_forgets_after_an_hour():
    guard = Guard(GuardPolicy(rollback_after=1, max_rollbacks_per_hour=1))
    assert guard.observe(StepStats(1, float("nan"), 1.0, None, 0.0)).action == "rollback"
    assert guard.observe(StepStats(2, float("nan"), 1.0, None, 3601.0)).action == "rollback"


def test_bad_steps_far_apart_only_skip():
    guard = Guard(GuardPolicy(rollback_after=3, rollback_window=10))
    healthy(guard, 100)
    for k in range(5):
        healthy(guard, 10, start=100 + 11 * k)
        assert guard.observe(StepStats(0, float("nan"), 1.0)).action == "skip_step"


def test_state_round_trip_keeps_decisions_identical():
    a = Guard()
    healthy(a, 200)
    b = Guard()
    b.load_state_dict(a.state_dict())
    for s in (StepStats(200, 99.0, 1.0), StepStats(201, 2.8, 30.0), StepStats(202, 2.8, 1.0)):
        assert a.observe(s) == b.observe(s)


def test_the_rules_are_asked_in_order_and_the_first_names_the_step():
    """A NaN loss is also no spike and no explosion: the first rule (non-finite) names it. A step no rule
    finds bad is learned by every rule; one some rule finds bad by none."""
    guard = Guard()
    assert [rule.reason for rule in guard.rules][:3] == ["nan", "loss_spike", "grad_explosion"]
    healthy(guard, 100)
    before = repr(guard.state_dict())
    assert guard.observe(StepStats(100, 80.0, 500.0)).reason == "loss_spike"    # a spike and an explosion
    assert repr(guard.state_dict()) == before


def test_state_dict_keeps_its_keys_for_checkpoints_written_before():
    """Checkpoints carry the guard's state: the keys the trainer's checkpoints have always had stay."""
    guard = Guard()
    healthy(guard, 30)
    state = guard.state_dict()
    assert {"losses", "loss_sums", "grad_ema", "good_grad_steps", "layer_ema", "rollbacks", "stopped"} <= set(state)
    resumed = Guard()
    resumed.load_state_dict({key: state[key] for key in ("losses", "grad_ema", "good_grad_steps", "layer_ema")})
    assert resumed.state_dict()["losses"] == state["losses"]
