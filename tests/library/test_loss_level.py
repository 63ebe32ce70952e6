"""A loss that moves to a new level for good (a planned data-mix change) in a real protected loop: the
guard rolls back once, the retry meets the same loss at the same data position, and the new level is
accepted and told, never a rollback loop or a stop. And an impossible rollback (no stable
checkpoint yet) is not counted toward the limit that stops a run."""

from __future__ import annotations

import torch
import yaml

from tests.trainer.helpers import events
from trainguard.protect import Protector, RNGState
from trainguard.runtime.telemetry import StepTimer

# Gradient rules loose enough that the loss rules alone decide; a level shift whose gradients move too
# (x3 here, over shift_grad_factor) is not accepted by the guard alone: the retry has to tell.
GUARD = dict(spike_min_steps=10, spike_window=32, grad_min_steps=10, rollback_after=3, rollback_window=10,
             rewarmup_steps=5, rollback_lr_factor=0.5, shift_grad_factor=1.01, grad_climb_sigma=1000.0,
             max_rollbacks_per_hour=2)


def train(run_dir, policy, steps: int, shift_at: int, checkpoint_every: int) -> tuple[int, list[int]]:
    """Linear regression with label noise (the loss settles near 1.0); from data position `shift_at` on
    the loss is 3x (the new data). The data position is the step: a rollback replays the same positions."""
    torch.manual_seed(0)
    model, target = torch.nn.Linear(16, 1), torch.randn(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    protector = Protector(run_dir, states={"model": model, "optim": optimizer, "rng": RNGState()}, policy=policy,
                          checkpoint_every=checkpoint_every)
    protector.begin()
    seen, outcome = [], None
    while protector.state.step < steps:
        step, timer = protector.state.step + 1, StepTimer()
        timer.start()
        data = torch.Generator().manual_seed(step)
        x = torch.randn(64, 16, generator=data)
        y = x @ target + torch.randn(64, 1, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), y) * (3.0 if step >= shift_at else 1.0)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)
        verdict = protector.check(step, loss, norm)
        if not verdict.skip:
            optimizer.step()
        optimizer.zero_grad()
        outcome = protector.after_step(verdict, tokens=x.numel(), samples=len(x), timings=timer.stop())
        seen.append(step)
        if outcome.stop:
            break
    if outcome is None or not outcome.stop:
        protector.finish()
    protector.close()
    return (outcome.exit_code if outcome is not None and outcome.stop else 0), seen


def test_a_new_loss_level_is_retried_once_then_accepted_and_told(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_KEY", str(tmp_path / "keys" / "checkpoint.key"))
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"guard": GUARD}))
    run = tmp_path / "run"
    code, seen = train(run, str(policy), steps=160, shift_at=100, checkpoint_every=20)
    assert code == 0 and seen[-1] == 160                                   # never stopped
    rollbacks = events(run, "rollback")
    assert len(rollbacks) == 1 and rollbacks[0]["restored_step"] is not None      # one retry, carried out
    (shift,) = events(run, "loss_level_shift")
    assert shift["source"] == "rollback_retry" and shift["step"] > rollbacks[0]["restored_step"]
    assert not events(run, "stop")


def test_impossible_rollbacks_do_not_count_toward_the_stop(tmp_path, monkeypatch):
    """No checkpoint is ever saved before the end, as the old first-run default: every rollback is
    impossible. With max_rollbacks_per_hour 2, counting them stopped the run at the third; now it runs on."""
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_KEY", str(tmp_path / "keys" / "checkpoint.key"))
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"guard": {**GUARD, "shift_grad_factor": 1.01}}))
    run = tmp_path / "run"
    code, seen = train(run, str(policy), steps=160, shift_at=100, checkpoint_every=0)
    impossible = [e for e in events(run, "rollback") if e.get("restored_step") is None]
    assert len(impossible) >= 3 and code == 0 and seen[-1] == 160
    assert not events(run, "stop")
