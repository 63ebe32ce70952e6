"""Hugging Face Transformers: the Protector as a `TrainerCallback`. User guide: docs/integrations.md.

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[ProtectCallback("runs/my-run", checkpoint_every=50)])
    trainer.train()

Where it hooks into the Trainer's step (transformers >= 4.47, which calls `on_pre_optimizer_step` and
`on_optimizer_step` around `optimizer.step()`):

- a forward hook on the model collects each training micro-batch's loss (the model's own `loss` output)
  and its token count, so no Trainer subclass is needed;
- the gradient norm the guard sees is the one BEFORE the Trainer's clipping (`max_grad_norm`, 1.0 by
  default), so an explosion is seen while the Trainer clips it: with clipping on, a post-accumulate-grad
  hook on each parameter records the norm of its gradient once its accumulation is final
  (`PreClipNorms`); without clipping the gradients at `on_pre_optimizer_step` are the unclipped ones;
- `on_pre_optimizer_step` (after backward and the Trainer's clipping): `Protector.check` on the loss and
  the pre-clip norm; a skip clears every gradient, so the optimizer step that follows changes nothing
  (torch optimizers pass over a parameter whose `grad` is None), and holds the LR schedule
  (`HeldSchedule`): the Trainer steps its scheduler after that `optimizer.step()`, the callback puts the
  scheduler's state and the optimizer's LRs back at `on_step_end`, so a skipped step does not advance it;
- `on_step_end` (the Trainer has counted the step): `Protector.after_step`; a rollback moves the Trainer's
  `global_step` back to the restored step, a stop (the guard's, or the agent's `cost_stop`) sets
  `control.should_training_stop`;
- `on_log`: each of the Trainer's own log dicts (loss, grad_norm, learning_rate, eval_loss, ...) becomes a
  `trainer_log` event in the run's TLS file.

The Protector's checkpoints (model, optimizer, LR scheduler, random generators, and the library's own) are
written to `RUN/checkpoints/`, hashed and signed, and `train()` resumes from the newest verified one. The
Trainer's own `checkpoint-N` folders (`save_strategy`) are signed as they are written (`on_save`,
trainguard.protect.hf_checkpoints); `hf_checkpoints.latest_verified(output_dir)` picks the newest that
verifies, for `resume_from_checkpoint`.

Recovery (docs/library.md "Recovery"): the Protector's in-memory snapshots are taken in `on_step_end`
(its `after_step`), and `on_train_begin` resumes from the newest verified checkpoint and then the snapshot
taken on top of it. No in-process restart: the Trainer holds the process group and the DDP wrapper, and a
failure propagates out of `train()`; with `recovery.mode: in_process` that is said once in the log.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from accelerate.state import GradientState
from transformers import TrainerCallback

from trainguard import event_types
from trainguard.protect import hf_checkpoints
from trainguard.protect.callbacks import Callbacks
from trainguard.protect.held_schedule import HeldSchedule
from trainguard.protect.protector import Protector
from trainguard.protect.state import RNGState
from trainguard.runtime.telemetry import StepTimer


# Why a failure under the Trainer takes the restart path (docs/library.md "Recovery"), said once in the log.
NOT_IN_PROCESS = ("the Trainer, through accelerate, creates and holds the process group and the DDP wrapper, and "
                  "a rank's failure propagates out of trainer.train(): no callback can re-form the group, wrap "
                  "the model again or re-enter the step")


class ProtectCallback(TrainerCallback):
    """The guard, verified checkpoints and the agent's actions for a Transformers `Trainer`.

    `protector_options` go to `Protector` (policy, checkpoint_every, key_file, ...). After `train()`,
    `exit_code` is None (ran to the end), 0 (the agent's cost_stop) or 3 (the guard stopped the run)."""

    def __init__(self, run_dir: str | os.PathLike, *, callbacks: Callbacks | None = None,
                 **protector_options: Any):
        self.run_dir, self.extra_callbacks, self.options = run_dir, callbacks, protector_options
        self.protector: Protector | None = None
        self.exit_code: int | None = None
        self.verdict = None
        self.timer = StepTimer()
        self._losses: list[torch.Tensor] = []
        self._tokens = self._samples = 0
        self._hook = None
        self._norms: PreClipNorms | None = None
        self._held: HeldSchedule | None = None
        self._rate: float | None = None
        self._scheduler = None
        self._base_lrs: list[float] = []

    # ------------------------------------------------------------------------------------ start, end

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        states = {"model": model, "optim": optimizer, "rng": RNGState()}
        if lr_scheduler is not None:
            states["sched"] = lr_scheduler
            self._scheduler, self._base_lrs = lr_scheduler, list(getattr(lr_scheduler, "base_lrs", []))
        callbacks = self.extra_callbacks or Callbacks()
        if callbacks.scale_lr is None and self._base_lrs:
            callbacks.scale_lr = self._scale_lr
        self.protector = Protector(self.run_dir, states=states, rank=args.process_index,
                                   world_size=args.world_size, device=args.device, callbacks=callbacks,
                                   **self.options)
        self._warn_on_two_checkpointers(args)
        self.protector.recovery.not_in_process("the Transformers Trainer", NOT_IN_PROCESS)
        begun = self.protector.begin(integration="transformers")
        if begun.refused is not None:
            self.exit_code = 3
            control.should_training_stop = True
            return
        state.global_step = self.protector.state.step
        self._apply_lr_scale(self.protector.state.lr_scale)
        self._hook = model.register_forward_hook(self._collect, with_kwargs=True)
        if args.max_grad_norm and args.max_grad_norm > 0:   # the Trainer clips before on_pre_optimizer_step
            self._norms = PreClipNorms.for_trainer(model)

    def _warn_on_two_checkpointers(self, args) -> None:
        """One checkpointer per run, by design: trainguard's (`checkpoint_every`), the ones resume, rollback
        and the agent's restore use (they hold the guard's and the cost meter's state too). The Trainer's
        own `checkpoint-N` saves beside them write every checkpoint twice: said once, at the start."""
        trainer_saves = str(getattr(args.save_strategy, "value", args.save_strategy)) != "no"
        ours = self.options.get("checkpoint_every") or self.options.get("checkpoint_every_seconds")
        if trainer_saves and ours:
            message = ("both the Trainer (save_strategy="
                       f"{getattr(args.save_strategy, 'value', args.save_strategy)!r}) and trainguard's ProtectCallback "
                       "(checkpoint_every) write checkpoints, so every checkpoint is written twice; trainguard "
                       "resumes and rolls back from its own (RUN/checkpoints). Set TrainingArguments(save_strategy="
                       "'no'), or checkpoint_every=0 to keep only the Trainer's (signed; no rollback then)")
            warnings.warn(message, UserWarning, stacklevel=3)
            self.protector.log.warning("two checkpointers", save_strategy=str(args.save_strategy))

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
        if self._norms is not None:
            self._norms.remove()
        if self.protector is None:
            return
        if self.exit_code is None:
            self.protector.finish()
        self.protector.close()

    # --------------------------------------------------------------------------------------- the step

    def _collect(self, module, args, kwargs, output) -> None:
        """Each training forward: its loss (detached: the guard reads it once, in `check`) and tokens."""
        if not module.training:
            return
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if loss is not None:
            self._losses.append(loss.detach())
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor):
            self._tokens += ids.numel()
            self._samples += ids.shape[0]

    def on_step_begin(self, args, state, control, **kwargs):
        self.timer.start()

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.protector is None or self.exit_code is not None:
            return
        self.timer.mark("forward_backward")
        loss = torch.stack(self._losses).mean() if self._losses else torch.tensor(float("nan"))
        self._rate = optimizer.param_groups[0]["lr"] if optimizer is not None else None   # this step's LR
        self.verdict = self.protector.check(state.global_step + 1, loss, self._grad_norm(model, optimizer))
        if self.verdict.skip:
            for param in model.parameters():
                param.grad = None
            if self._scheduler is not None:
                self._held = HeldSchedule.take([self._scheduler])

    def _grad_norm(self, model, optimizer) -> torch.Tensor:
        """The step's gradient norm before the Trainer's clipping: the hooks' record when the Trainer
        clips, else the gradients as they are (on the device: `check` reads it in its one sync)."""
        if self._norms is not None:
            return self._norms.take(grad_scale(optimizer))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads) if grads else torch.tensor(0.0)

    def on_step_end(self, args, state, control, **kwargs):
        verdict, self.verdict = self.verdict, None
        if verdict is None:
            return
        if self._held is not None:       # the Trainer stepped its scheduler after the skipped step
            self._held.put_back()
            self._held = None
        tokens, samples = self._tokens, self._samples
        self._losses, self._tokens, self._samples = [], 0, 0
        outcome = self.protector.after_step(verdict, tokens=tokens, samples=samples, timings=self.timer.stop(),
                                            learning_rate=self._rate)
        if outcome.restored_step is not None:
            state.global_step = outcome.restored_step
        if outcome.stop:
            self.exit_code = outcome.exit_code
            control.should_training_stop = True
            control.should_save = False          # the Protector saved (cost stop) or must not (guard stop)

    def on_save(self, args, state, control, **kwargs):
        """The Trainer has written `checkpoint-<step>`: sign it (rank 0), so it is verified before use."""
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if self.protector is None or args.process_index != 0 or not folder.is_dir():
            return
        hf_checkpoints.sign_folder(folder, self.options.get("key_file") or None)
        self.protector.event(event_types.TRAINER_CHECKPOINT_SIGNED, path=str(folder), trainer_step=state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.protector is None or not logs:
            return
        numbers = {key: float(value) for key, value in logs.items() if isinstance(value, (int, float))}
        self.protector.event(event_types.TRAINER_LOG, trainer_step=state.global_step, **numbers)

    # --------------------------------------------------------------------------------------- LR scale

    def _scale_lr(self, factor: float, scale: float, rewarmup_steps: int) -> dict:
        """The Trainer's scheduler sets the LR every step from its `base_lrs`: scale those (the
        checkpoint's scheduler came back with the checkpoint's), and the optimizer's LR now."""
        self._apply_lr_scale(scale)
        return {"base_lrs": list(self._scheduler.base_lrs)}

    def _apply_lr_scale(self, scale: float) -> None:
        if self._scheduler is None or not self._base_lrs:
            return
        before = list(self._scheduler.base_lrs)
        self._scheduler.base_lrs = [base * scale for base in self._base_lrs]
        for group, old, new in zip(self._scheduler.optimizer.param_groups, before, self._scheduler.base_lrs):
            if old:
                group["lr"] *= new / old


class PreClipNorms:
    """The gradient norm before clipping, read without touching the loop: a post-accumulate-grad hook on
    each parameter records the norm of its `.grad` once backward has accumulated the step's last
    micro-batch into it (`is_final()`: the Trainer's accelerate flag `sync_gradients`, set before each
    micro-batch), so each record is the norm of that final, not yet clipped, gradient; earlier
    micro-batches cost nothing. `take` combines the records as `clip_grad_norm_` does (the 2-norm of the
    per-parameter 2-norms) and clears them for the next step. Everything stays on the device: no host sync.

    A parameter the last micro-batch did not reach (its gradient came from earlier ones) has no record; its
    gradient, final since then, has been scaled by the clip's one coefficient, which the recorded ones
    give back (their norm now over their norm recorded), so its pre-clip norm is exact too.

    One process sees the gradients the optimizer uses. Under DDP a hook sees its rank's local gradient
    (DDP averages the gradients after the hooks ran); the guard then gets the ranks' mean of their local
    norms, which is at least the averaged gradient's norm: an explosion on any rank is seen."""

    def __init__(self, parameters, is_final=lambda: True):
        self.params = [p for p in parameters if p.requires_grad]
        self.is_final = is_final
        self.norms: list[torch.Tensor | None] = [None] * len(self.params)
        self.handles = [p.register_post_accumulate_grad_hook(self._recorder(i)) for i, p in enumerate(self.params)]

    @classmethod
    def for_trainer(cls, model) -> PreClipNorms:
        """On the Trainer's model, its last micro-batch told by accelerate's shared `GradientState`."""
        accumulation = GradientState()
        return cls(model.parameters(), lambda: accumulation.sync_gradients)

    def _recorder(self, index: int):
        def record(param: torch.Tensor) -> None:
            if self.is_final():
                self.norms[index] = torch.linalg.vector_norm(param.grad.detach())
        return record

    def take(self, scale: torch.Tensor | float | None = None) -> torch.Tensor:
        """The total norm of this step's gradients, divided by `scale` (a loss scaler's: the hooks saw the
        scaled gradients; the Trainer unscales them before it clips)."""
        norms, self.norms = self.norms, [None] * len(self.params)
        recorded = [n for n in norms if n is not None]
        unrecorded = [p.grad for p, n in zip(self.params, norms) if n is None and p.grad is not None]
        if not recorded:
            total = torch.nn.utils.get_total_norm(unrecorded) if unrecorded else torch.tensor(0.0)
            return total if scale is None else total / scale
        total = norm_of_norms(recorded)
        if unrecorded:
            total = torch.linalg.vector_norm(torch.stack([total, self._unclipped(norms, unrecorded, total)]))
        return total if scale is None else total / scale

    def _unclipped(self, norms, unrecorded, recorded_total: torch.Tensor) -> torch.Tensor:
        """The norm the unrecorded gradients had before the clip scaled them all by one coefficient."""
        now = torch.nn.utils.get_total_norm([p.grad for p, n in zip(self.params, norms) if n is not None])
        coefficient = torch.where(recorded_total > 0, now / recorded_total, torch.ones_like(now))
        return torch.nn.utils.get_total_norm(unrecorded).to(now.device) / coefficient

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def norm_of_norms(norms: list[torch.Tensor]) -> torch.Tensor:
    """`clip_grad_norm_`'s total: the 2-norm of the per-tensor 2-norms (on the first one's device)."""
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))


def grad_scale(optimizer) -> torch.Tensor | None:
    """The loss scale of an fp16 run (accelerate's optimizer holds the GradScaler), as a device tensor;
    None when the gradients are not scaled. The scale the backward used: the scaler updates it only in
    `optimizer.step()`, after the callback has read it."""
    scaler = getattr(optimizer, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    return scaler._get_scale_async()          # get_scale() would read it to the host: a sync per step
