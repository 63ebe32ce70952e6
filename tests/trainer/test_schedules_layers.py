"""The layer-targeted rollback response in the real trainer: the guard's rollback names a layer, that
layer's LR multiplier is cut (in the rollback event), kept through the rollback's older checkpoint,
saved in the next one and restored by a restart; opt-in, the layer is initialised again."""

from __future__ import annotations

import dataclasses

import torch

from tests.trainer.helpers import events
from trainguard.decide.guard import Guard, StepStats
from trainguard.policy import GuardPolicy
from trainguard.trainer.config import TrainConfig, load_file
from trainguard.trainer.loop import DistInfo, Trainer
from trainguard.runtime.telemetry import StepTimer


def trainer(run_dir, **optim) -> Trainer:
    config = load_file(TrainConfig(), "tiny")
    config.run.device, config.run.checkpoint_every, config.run.steps = "cpu", 5, 20
    for key, value in optim.items():
        setattr(config.optim, key, value)
    return Trainer(config, run_dir, DistInfo())


def layer_rollback():
    """A real guard's decision: layer h.1's norm explodes three times while the global norm does not."""
    guard = Guard(GuardPolicy(grad_min_steps=2, rollback_after=3))
    for step in range(1, 6):
        assert not guard.observe(StepStats(step, 3.0, 1.0, {"h.0": 0.5, "h.1": 0.5}, float(step)))
    for step in range(6, 9):
        decision = guard.observe(StepStats(step, 3.0, 1.0, {"h.0": 0.5, "h.1": 40.0}, float(step)))
    assert decision.action == "rollback" and decision.detail["layer"] == "h.1"
    return decision


def lrs(t: Trainer) -> dict[str, float]:
    t.schedule.apply_lr(1.0)
    return {group["layer"]: group["lr"] for group in t.optimizer.param_groups}


def rolled_back_step(t: Trainer, decision) -> None:
    """One step of `Trainer.train_step`, phase by phase, on which the guard's decision is `decision`."""
    timer = StepTimer()
    timer.start()
    step = t.state.step + 1
    x, y = t.load_batch(step)
    lr = t.set_learning_rate()
    loss = t.backward(step, x, y)
    grad_norm, layer_norms = t.clip_gradients()
    verdict = t.protector.check(step, loss, grad_norm, layer_norms, extra=t.schedule.param_norm())
    verdict = dataclasses.replace(verdict, decision=t.schedule.respond(decision))
    t.apply_update(verdict)
    t.schedule.observe(verdict, validate=t.validation_loss)
    outcome = t.after_step(verdict, lr, timer.stop())
    t.schedule.after_step(verdict.step, rolled_back=outcome.restored_step is not None)
    assert outcome.restored_step == 5


def test_layer_rollback_cuts_that_layers_lr_keeps_it_and_a_restart_restores_it(tmp_path):
    run = tmp_path / "run"
    t = trainer(run, layer_reinit=True)
    t.protector.begin()
    for _ in range(6):
        t.train_step()                                   # checkpoint (stable) at step 5
    block = [p.detach().clone() for p in t.model.transformer.h[1].parameters()]
    rolled_back_step(t, layer_rollback())
    (rollback,) = events(run, "rollback")
    assert rollback["layer"] == "h.1" and rollback["restored_step"] == 5 and rollback["step"] == 7
    assert (rollback["layer_lr_multiplier"], rollback["layer_lr_multiplier_before"], rollback["layer_reinit"]) == \
        (0.5, 1.0, True)
    assert lrs(t) == {"embed": 1.0, "h.0": 1.0, "h.1": 0.5, "ln_f": 1.0}      # the step-5 checkpoint had none
    assert [e["layer"] for e in events(run, "layer_reinit")] == ["h.1"]
    reinit = list(t.model.transformer.h[1].parameters())
    assert not any(torch.equal(a, b) for a, b in zip(block, reinit) if a.dim() >= 2)
    assert all(p not in t.optimizer.state for p in reinit)                     # fresh Adam moments
    t.train_step()
    t.protector.save()
    t.protector.wait()
    t.protector.close()

    restarted = trainer(run)
    assert restarted.protector.begin().resumed_from == 6
    assert restarted.schedule.layers.multipliers == {"h.1": 0.5}
    assert lrs(restarted)["h.1"] == 0.5
    restarted.protector.close()


def test_a_rollback_of_the_global_norm_cuts_no_layer(tmp_path):
    t = trainer(tmp_path / "run")
    guard = Guard(GuardPolicy(grad_min_steps=2, rollback_after=3))
    for step in range(1, 6):
        guard.observe(StepStats(step, 3.0, 1.0, None, float(step)))
    for step in range(6, 9):
        decision = guard.observe(StepStats(step, 3.0, 50.0, None, float(step)))
    assert decision.action == "rollback" and t.schedule.respond(decision) is decision
    assert t.schedule.layers.multipliers == {}
