"""PyTorch Lightning: the Protector as a `Callback`. User guide: docs/integrations.md.

    trainer = L.Trainer(max_steps=-1, callbacks=[ProtectCallback("runs/my-run", steps=1000, checkpoint_every=50)])
    trainer.fit(module, data)

Where it hooks into Lightning's automatic optimization:

- `on_before_backward` collects each micro-batch's loss (the tensor `training_step` returned);
- `on_before_optimizer_step` (Lightning calls it after the closure ran forward and backward, and before
  it clips the gradients: `Precision._after_closure` calls this hook, then `_clip_gradients`; the AMP
  plugin unscales the gradients before that, so the guard's norm is the true one before clipping):
  `Protector.check`; a skip clears every gradient, so the step changes nothing (torch optimizers pass over
  a parameter whose `grad` is None), and holds the step-interval LR schedulers (`HeldSchedule`);
- `on_train_batch_end` after a step (Lightning has stepped its step-interval schedulers just before,
  `_TrainingEpochLoop.advance`): a skipped step's schedulers are put back, so a skip does not advance
  the LR schedule; then `Protector.after_step`; a stop (the guard's, or the agent's `cost_stop`) sets
  `trainer.should_stop`.

The step count is the Protector's (`protector.state.step`), not Lightning's `global_step`: a rollback
moves the Protector's back (its TLS records and checkpoints follow it) while Lightning's counter of
optimizer calls goes on, so give the run's length as `steps` here and leave Lightning's `max_steps` at -1.
Checkpoints (the module, the first optimizer, the random generators and the library's own) go to
`RUN/checkpoints/`, hashed and signed; `fit` resumes from the newest verified one. A rollback scales the
optimizer's LR by the policy's factor (the default `scale_lr`); a loop with an LR scheduler registers its
own `scale_lr` in `callbacks`.

Recovery (docs/library.md "Recovery"): the Protector's in-memory snapshots are taken in
`on_train_batch_end` (its `after_step`), and `on_train_start` resumes from the newest verified checkpoint
and then the snapshot taken on top of it. No in-process restart: the Strategy holds the process group and
the DDP wrapper, and a failure propagates out of `fit()`; with `recovery.mode: in_process` that is said
once in the log.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

try:
    from lightning.pytorch import Callback
except ImportError:                      # the standalone package
    from pytorch_lightning import Callback

from trainguard.protect.callbacks import Callbacks
from trainguard.protect.held_schedule import HeldSchedule
from trainguard.protect.protector import Protector
from trainguard.protect.state import RNGState
from trainguard.runtime.telemetry import StepTimer


# Why a failure under Lightning takes the restart path (docs/library.md "Recovery"), said once in the log.
NOT_IN_PROCESS = ("Lightning's Strategy creates and holds the process group and the DDP wrapper, and a rank's "
                  "failure propagates out of trainer.fit(): no callback can re-form the group, wrap the model "
                  "again or re-enter the step")


class ProtectCallback(Callback):
    """The guard, verified checkpoints and the agent's actions for a Lightning `Trainer`.

    `steps`: the run's length in optimizer steps (0: Lightning's own end). `tokens_of(batch)` counts a
    batch's tokens (default: the first tensor's elements). `protector_options` go to `Protector`.
    After `fit`, `exit_code` is None (ran to the end), 0 (the agent's cost_stop) or 3 (the guard stopped)."""

    def __init__(self, run_dir: str | os.PathLike, *, steps: int = 0, callbacks: Callbacks | None = None,
                 tokens_of=None, **protector_options: Any):
        self.run_dir, self.steps, self.extra_callbacks = run_dir, steps, callbacks
        self.tokens_of, self.options = tokens_of or first_tensor_size, protector_options
        self.protector: Protector | None = None
        self.exit_code: int | None = None
        self.verdict = None
        self.timer = StepTimer()
        self._losses: list[torch.Tensor] = []
        self._tokens = self._samples = 0
        self._held: HeldSchedule | None = None
        self._rate: float | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        states = {"model": pl_module, "optim": trainer.optimizers[0], "rng": RNGState()}
        self.protector = Protector(self.run_dir, states=states, rank=trainer.global_rank,
                                   world_size=trainer.world_size, device=pl_module.device,
                                   callbacks=self.extra_callbacks, **self.options)
        if trainer.max_steps is not None and trainer.max_steps > 0 and not self.steps:
            # Lightning's max_steps counts optimizer calls since this fit began: a rollback does not take
            # them back and a resumed run counts again from 0, so the run would not end at the step meant
            message = (f"Trainer(max_steps={trainer.max_steps}) with no steps= on trainguard's ProtectCallback: "
                       f"Lightning counts optimizer calls, which neither a rollback nor a resume moves back, so "
                       f"the run will not end at step {trainer.max_steps}. Give ProtectCallback(steps="
                       f"{trainer.max_steps}) and Trainer(max_steps=-1).")
            warnings.warn(message, UserWarning, stacklevel=2)
            self.protector.log.warning("lightning max_steps without steps=", max_steps=trainer.max_steps)
        self.protector.recovery.not_in_process("Lightning", NOT_IN_PROCESS)
        begun = self.protector.begin(integration="lightning")
        if begun.refused is not None:
            self.exit_code = 3
            trainer.should_stop = True
        self.timer.start()

    def on_train_end(self, trainer, pl_module) -> None:
        if self.protector is None:
            return
        if self.exit_code is None:
            self.protector.finish()
        self.protector.close()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.verdict is None and not self._losses:
            self.timer.start()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._losses.append(loss.detach())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.protector is None or self.exit_code is not None:
            return
        self.timer.mark("forward_backward")
        loss = torch.stack(self._losses).mean() if self._losses else torch.tensor(float("nan"))
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]   # not clipped yet
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.tensor(0.0)
        self._rate = optimizer.param_groups[0]["lr"]                                 # this step's LR
        self.verdict = self.protector.check(self.protector.state.step + 1, loss, norm)
        if self.verdict.skip:
            for param in pl_module.parameters():
                param.grad = None
            self._held = HeldSchedule.take(step_schedulers(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        tokens, samples = self.tokens_of(batch)
        self._tokens, self._samples = self._tokens + tokens, self._samples + samples
        verdict, self.verdict = self.verdict, None
        if verdict is None:              # a micro-batch of an accumulation: no optimizer step yet
            return
        if self._held is not None:       # Lightning stepped its schedulers after the skipped step
            self._held.put_back()
            self._held = None
        tokens, samples = self._tokens, self._samples
        self._losses, self._tokens, self._samples = [], 0, 0
        outcome = self.protector.after_step(verdict, tokens=tokens, samples=samples, timings=self.timer.stop(),
                                            learning_rate=self._rate)
        if outcome.stop:
            self.exit_code = outcome.exit_code
        if outcome.stop or self.steps and self.protector.state.step >= self.steps:
            trainer.should_stop = True


def step_schedulers(trainer) -> list:
    """The LR schedulers Lightning steps after each optimizer step (interval "step"; ReduceLROnPlateau
    steps on a metric, after this callback's hook, and is left alone)."""
    return [config.scheduler for config in trainer.lr_scheduler_configs
            if config.interval == "step" and not config.reduce_on_plateau]


def first_tensor_size(batch) -> tuple[int, int]:
    """(elements, rows) of the batch's first tensor: tokens and samples of a batch of token ids."""
    while isinstance(batch, (list, tuple, dict)) and batch:
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return (batch.numel(), batch.shape[0]) if isinstance(batch, torch.Tensor) and batch.dim() else (0, 0)
