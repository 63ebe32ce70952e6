"""Every transition of the LR schedules, on synthetic step statistics (decide/schedules.py)."""

import dataclasses
import math
import random

import pytest

from trainguard.decide import schedules
from trainguard.decide.schedules import Breathing, Cosine, Phases, StepSignals
from trainguard.decide.trends import GradientStability, LossPlateau, grad_param_ratio
from trainguard.policy import BreathingPolicy, DynamicsPolicy, PhasePolicy, PlateauPolicy, StabilityPolicy

BREATH = BreathingPolicy(peak_lr=1.0, inhale_steps=5, exhale_factor=0.5, pause_ratio=0.01, pause_window=3,
                         freeze_steps=4, restart_factor=1.2)


def feed(machine, n, start, loss=2.0, grad=1.0, param=1000.0):
    """n applied steps; returns every change and the LRs each step was given."""
    changes, lrs = [], []
    for i in range(n):
        lrs.append(machine.lr())
        value = loss(start + i) if callable(loss) else loss
        norm = grad(start + i) if callable(grad) else grad
        changes += machine.observe(StepSignals(start + i, value, norm, param))
    return changes, lrs


def phases(changes):
    return [(c.step, c.previous, c.phase, c.reason) for c in changes]


# ---------------------------------------------------------------------------------------- statistics

def test_gradient_stability_is_the_cv_of_the_window_with_hysteresis():
    stability = GradientStability(StabilityPolicy(window=4, cv_max=0.1, unstable_margin=2.0))
    for x in (1.0, 1.0, 1.0):
        stability.push(x)
    assert stability.cv() is None and not stability.stable() and not stability.unstable()
    stability.push(float("nan"))                 # never enters the window
    assert stability.cv() is None
    stability.push(1.0)
    assert stability.cv() == 0.0 and stability.stable()
    for x in (1.0, 1.3, 0.7, 1.0):               # cv = 0.212: neither stable nor unstable (0.1 .. 0.2)
        stability.push(x)
    assert 0.2 < stability.cv() and stability.unstable()
    for x in (1.0, 1.15, 0.85, 1.0):             # cv = 0.106: in the band
        stability.push(x)
    assert not stability.stable() and not stability.unstable()


def test_loss_plateau_compares_the_medians_of_the_two_halves():
    plateau = LossPlateau(PlateauPolicy(window=4, min_improvement=0.01))
    for x in (4.0, 3.0, 2.0):
        plateau.push(x)
    assert plateau.improvement() is None and not plateau.plateau()
    plateau.push(1.0)
    assert plateau.improvement() == pytest.approx((3.5 - 1.5) / 3.5) and not plateau.plateau()
    for x in (1.0, 1.0, 0.999, 0.999):
        plateau.push(x)
    assert plateau.improvement() == pytest.approx(0.001) and plateau.plateau()


def test_grad_param_ratio():
    assert grad_param_ratio(1.0, 200.0) == 0.005
    assert math.isinf(grad_param_ratio(float("nan"), 1.0)) and math.isinf(grad_param_ratio(1.0, 0.0))


# -------------------------------------------------------------------------------------------- cosine

def test_cosine_warmup_then_decay_and_the_trainer_owns_the_lr():
    machine = Cosine(warmup_steps=3, min_lr=0.0)
    assert machine.start(0).phase == "warmup" and machine.lr() is None
    changes, _ = feed(machine, 5, 1)
    assert phases(changes) == [(3, "warmup", "decay", "warmup_done")]
    assert Cosine(warmup_steps=0, min_lr=0.0).phase == "decay"


# ----------------------------------------------------------------------------------------- breathing

def test_breathing_warmup_inhale_exhale_pause():
    machine = Breathing(BREATH, warmup_steps=2, min_lr=0.01)
    start = machine.start(0)
    assert (start.phase, start.reason, start.detail["params"]["breathing"]["inhale_steps"]) == ("warmup", "start", 5)
    changes, lrs = feed(machine, 2, 1, grad=50.0)       # ratio 0.05: not calm
    assert lrs == [0.5, 1.0] and phases(changes) == [(2, "warmup", "inhale", "warmup_done")]
    changes, lrs = feed(machine, 5, 3, grad=50.0)
    assert lrs == [1.0] * 5 and phases(changes) == [(7, "inhale", "exhale", "inhale_done")]
    changes, lrs = feed(machine, 4, 8, grad=50.0)       # exhale: x0.5 per step, floored at min_lr
    assert lrs == [1.0, 0.5, 0.25, 0.125] and changes == []
    changes, _ = feed(machine, 4, 12, grad=50.0)
    assert machine.level == 0.01                         # min_lr
    # calm streak: ratio 0.005 < 0.01 for 3 consecutive exhale steps; one noisy step resets it
    changes, _ = feed(machine, 2, 16, grad=5.0)
    changes += feed(machine, 1, 18, grad=50.0)[0]
    changes += feed(machine, 2, 19, grad=5.0)[0]
    assert changes == [] and machine.calm == 2
    changes, _ = feed(machine, 1, 21, grad=5.0)
    assert phases(changes) == [(21, "exhale", "pause", "gradients_calm")]
    assert changes[0].detail["grad_param_ratio"] == 0.005 and machine.waiting == "pause_start"


def paused(min_lr=0.01):
    machine = Breathing(BREATH, warmup_steps=0, min_lr=min_lr)
    feed(machine, 5, 1, grad=50.0)                        # inhale
    feed(machine, 2, 6, grad=50.0)                        # exhale: 1.0 -> 0.25
    changes, _ = feed(machine, 3, 8, grad=5.0)
    assert [c.phase for c in changes] == ["pause"] and machine.waiting == "pause_start"
    return machine


def test_breathing_pause_freezes_then_restarts_when_val_loss_fell():
    machine = paused()
    frozen = machine.lr()
    assert machine.evaluated(10, 3.0) == [] and machine.waiting is None
    changes, lrs = feed(machine, 4, 11, grad=5.0)
    assert changes == [] and lrs == [frozen] * 4 and machine.waiting == "pause_end"
    changes = machine.evaluated(14, 2.9)
    assert phases(changes) == [(14, "pause", "inhale", "val_loss_fell")]
    assert machine.lr() == pytest.approx(frozen * 1.2)
    assert changes[0].detail["val_loss_before"] == 3.0 and changes[0].detail["val_loss_after"] == 2.9


def test_breathing_pause_exhales_on_when_val_loss_held_and_restart_never_passes_the_peak():
    machine = paused()
    machine.evaluated(10, 3.0)
    feed(machine, 4, 11, grad=5.0)
    assert phases(machine.evaluated(14, 3.0)) == [(14, "pause", "exhale", "val_loss_held")]
    machine.level = 0.95
    machine.phase, machine.waiting, machine.val_before = "pause", "pause_end", 3.0
    machine.evaluated(20, float("nan"))                  # no usable validation loss: exhale on
    assert machine.phase == "exhale"
    machine.phase, machine.waiting = "pause", "pause_end"
    machine.evaluated(21, 2.0)
    assert machine.phase == "inhale" and machine.lr() == 1.0     # 0.95 x 1.2 capped at the peak


def test_breathing_state_round_trips_and_restore_reports_the_phase_change():
    machine = paused()
    saved = machine.state_dict()
    twin = Breathing(BREATH, warmup_steps=0, min_lr=0.01)
    twin.load_state_dict(saved)
    assert twin.state_dict() == saved and twin.lr() == machine.lr()
    fresh = Breathing(BREATH, warmup_steps=0, min_lr=0.01)
    change = fresh.restore(saved, step=40, reason="rollback")
    assert (change.previous, change.phase, change.reason) == ("inhale", "pause", "rollback")
    assert fresh.restore(saved, step=41, reason="rollback") is None


# ------------------------------------------------------------------------------------- phase scheduler

PHASE = PhasePolicy(peak_lr=1.0, exploration_factor=1.0, development_decay=0.9, development_floor=0.5,
                    refinement_factor=0.3, refinement_embed_factor=0.5, min_phase_steps=4)
STAB = StabilityPolicy(window=4, cv_max=0.1, unstable_margin=2.0)
PLAT = PlateauPolicy(window=4, min_improvement=0.01)


def noisy(i):
    return 1.0 + (0.8 if i % 2 else -0.8)        # cv 0.8: unstable


def falling(i):
    return 10.0 - 0.5 * i


def scheduler():
    return Phases(PHASE, STAB, PLAT, warmup_steps=2, min_lr=0.0)


def test_phase_warmup_then_exploration_while_unstable():
    machine = scheduler()
    changes, lrs = feed(machine, 2, 1, loss=falling, grad=noisy)
    assert lrs == [0.5, 1.0] and phases(changes) == [(2, "warmup", "exploration", "warmup_done")]
    changes, _ = feed(machine, 20, 3, loss=falling, grad=noisy)
    assert changes == [] and machine.phase == "exploration"


def test_phase_exploration_to_development_when_stable_and_falling_waits_min_phase_steps():
    machine = scheduler()
    feed(machine, 2, 1, loss=falling)
    changes, _ = feed(machine, 3, 3, loss=falling)       # stable from step 4, but only 3 steps in phase
    assert changes == []
    changes, lrs = feed(machine, 1, 6, loss=falling)
    assert phases(changes) == [(6, "exploration", "development", "gradients_stable")]
    assert changes[0].detail["grad_norm_cv"] == 0.0 and changes[0].detail["loss_improvement"] > 0.01
    _, lrs = feed(machine, 3, 7, loss=falling)
    assert lrs == pytest.approx([1.0, 0.9, 0.81])       # development decays per step ...
    feed(machine, 4, 10, loss=falling)
    assert machine.lr() == 0.5                            # ... to the floor


def test_phase_development_back_to_exploration_when_unstable():
    machine = scheduler()
    feed(machine, 6, 1, loss=falling)
    assert machine.phase == "development"
    changes, _ = feed(machine, 4, 7, loss=falling, grad=noisy)
    assert phases(changes) == [(10, "development", "exploration", "gradients_unstable")]
    assert machine.lr() == 1.0


def test_phase_development_to_refinement_on_a_plateau_with_group_factors():
    machine = scheduler()
    feed(machine, 6, 1, loss=falling)
    assert machine.group_factors() == {}
    _, lrs = feed(machine, 3, 7, loss=falling)
    changes, _ = feed(machine, 4, 10, loss=2.0)          # flat loss: improvement 0 < 0.01
    assert phases(changes) == [(13, "development", "refinement", "loss_plateau")]
    assert machine.lr() == pytest.approx(0.5 * 0.3) and machine.group_factors() == {"embed": 0.5}
    changes, _ = feed(machine, 20, 14, loss=falling, grad=noisy)
    assert changes == [] and machine.phase == "refinement"      # terminal


def test_phase_exploration_straight_to_refinement_when_stable_on_a_plateau():
    machine = scheduler()
    changes, _ = feed(machine, 6, 1, loss=2.0)
    assert phases(changes)[-1] == (6, "exploration", "refinement", "loss_plateau")


def test_phase_state_round_trips_to_the_same_future():
    machine, twin = scheduler(), scheduler()
    rng = random.Random(3)
    grads = [1.0 + rng.random() * 0.1 for _ in range(40)]
    feed(machine, 20, 1, loss=falling, grad=lambda i: grads[i])
    twin.load_state_dict(machine.state_dict())
    a = feed(machine, 19, 21, loss=2.0, grad=lambda i: grads[i])
    b = feed(twin, 19, 21, loss=2.0, grad=lambda i: grads[i])
    assert a == b


# ----------------------------------------------------------------------------------- presets, replay

def test_from_event_rebuilds_the_machine_the_start_event_describes():
    policy = schedules.preset(DynamicsPolicy(), "cpu")
    for name in schedules.SCHEDULES:
        machine = schedules.make(name, policy, warmup_steps=10, min_lr=1e-4)
        event = machine.start(0).as_event()
        twin = schedules.from_event(event)
        assert type(twin) is type(machine) and twin.params() == machine.params()


def test_cpu_preset_scales_the_spans_and_the_seed_preset_keeps_the_seed_numbers():
    seed = schedules.preset(DynamicsPolicy(), "seed").breathing
    assert (seed.peak_lr, seed.inhale_steps, seed.exhale_factor, seed.pause_ratio, seed.pause_window,
            seed.freeze_steps, seed.restart_factor) == (0.0015, 10_000, 0.9995, 0.003, 500, 2000, 1.2)
    cpu = schedules.preset(DynamicsPolicy(), "cpu")
    assert cpu.breathing.inhale_steps < 1000 and cpu.breathing.peak_lr == 0.0015
    with pytest.raises(ValueError, match="unknown schedule preset"):
        schedules.preset(DynamicsPolicy(), "huge")
    with pytest.raises(ValueError, match="unknown schedule"):
        schedules.make("linear", DynamicsPolicy(), warmup_steps=0, min_lr=0.0)
    assert dataclasses.asdict(cpu)["stability"]["window"] == schedules.CPU_PRESET["stability"]["window"]


def test_policy_file_overrides_dynamics_and_bad_values_name_the_key(tmp_path):
    from trainguard import policy as tgpolicy

    path = tmp_path / "policy.yaml"
    path.write_text("dynamics:\n  breathing: {inhale_steps: 300}\n  clipping: {z_thresh: 3}\n")
    loaded = tgpolicy.load(path)
    assert loaded.dynamics.breathing.inhale_steps == 300 and loaded.dynamics.clipping.z_thresh == 3.0
    for text, key in (("breathing: {exhale_factor: 1.5}", "dynamics.breathing.exhale_factor"),
                      ("clipping: {ema_alpha: 1.0}", "dynamics.clipping.ema_alpha"),
                      ("layers: {lr_factor: 0}", "dynamics.layers.lr_factor"),
                      ("phase: {min_phase: 3}", "dynamics.phase.min_phase")):
        path.write_text(f"dynamics:\n  {text}\n")
        with pytest.raises(tgpolicy.PolicyError, match=key.replace(".", r"\.")):
            tgpolicy.load(path)
