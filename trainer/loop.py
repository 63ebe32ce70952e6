"""The bundled training loop: composes the model, data, telemetry, guard, faults, control channel and
checkpoints. Each of those is its own module with a narrow interface; this file only orders them.

One step, on every rank:

    control request? (rank 0: one stat)  ->  crash/hang faults  ->  batch  ->  forward/backward
    ->  gradient norms, clip  ->  ONE host sync (loss, norms, control, clock)  ->  guard decides
    ->  optimizer step unless skipped  ->  TLS record  ->  act on the decision / request
    ->  checkpoint, evaluation when due
"""

from __future__ import annotations

import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard import log, policy as policy_mod
from trainguard.decide.guard import Guard, StepStats
from trainguard.trainer import mfu
from trainguard.trainer import schedules as dynamics
from trainguard.trainer.config import TrainConfig
from trainguard.trainer.control import ControlChannel, write_rank_file
from trainguard.trainer.data import ShardLoader, open_stream
from trainguard.trainer.faults import FaultInjector
from trainguard.trainer.model import GPT
from trainguard.trainer.progress import Progress
from trainguard.trainer.recovery import EXIT_OK, EXIT_STOPPED, Recovery
from trainguard.trainer.state import Checkpoints
from trainguard.trainer.step import GradNorms, HealthSync, forward_backward
from trainguard.trainer.telemetry import CommTimer, StepTelemetry, StepTimer


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    restart_count: int = 0

    @classmethod
    def from_env(cls) -> "DistInfo":
        env = os.environ
        return cls(int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0)), int(env.get("WORLD_SIZE", 1)),
                   int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))


def resolve_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or requested == "auto" and torch.cuda.is_available():
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class Trainer:
    def __init__(self, config: TrainConfig, run_dir: Path, info: DistInfo):
        self.cfg, self.run_dir, self.info = config, Path(run_dir), info
        self.rank, self.world = info.rank, info.world_size
        run = config.run
        self.run_id = run.run_id or self.run_dir.name
        self.log = log.get("trainer", rank=self.rank, run_id=self.run_id)
        self.device = resolve_device(run.device, info.local_rank)
        self.policy = policy_mod.load(run.policy or None)
        torch.manual_seed(run.seed)

        self.model = GPT(config.model).to(self.device)
        self.ddp = self._wrap(self.model, run.telemetry)
        self.layer_names, owners = self.model.layer_of_parameters()
        self.norms = GradNorms(list(self.model.parameters()), owners, self.layer_names)
        self.optimizer = torch.optim.AdamW(
            dynamics.optimizer_groups(self.model, config.optim.weight_decay), lr=config.optim.lr,
            betas=(config.optim.beta1, config.optim.beta2), fused=self.device.type == "cuda")
        self.schedule = dynamics.Dynamics(config.optim, run.steps, self.policy)
        self.autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if self.device.type == "cuda" \
            else nullcontext

        stream = open_stream(config.data)
        loader_args = dict(block_size=config.model.block_size, rank=self.rank, world_size=self.world,
                           val_fraction=config.data.val_fraction, device=self.device.type)
        self.train_data = ShardLoader(stream, split="train", **loader_args)
        self.val_data = ShardLoader(stream, split="val", **loader_args)

        peak, peak_source = mfu.peak_flops(self.device.type, self._device_name(), run.peak_flops)
        self.telemetry = StepTelemetry(
            self.run_dir, rank=self.rank, world_size=self.world, run_id=self.run_id,
            device_type=self.device.type, flops_per_token=self.model.flops_per_token(), peak_flops=peak,
            gpu_count=run.gpu_count if run.gpu_count >= 0 else None, enabled=run.telemetry)
        self.peak_source = peak_source
        self.health = HealthSync(self.world, self.rank, self.device)
        self.guard = Guard(self.policy.guard)
        self.schedule.bind(self.model, self.optimizer, self.telemetry.event)
        self.faults = FaultInjector(run.inject, self.run_dir, self.rank, emit=self.telemetry.event)
        self.control = ControlChannel(self.run_dir, self.rank, self.log)
        self.checkpoints = Checkpoints(
            self.run_dir, rank=self.rank, world_size=self.world, on_event=self.telemetry.event,
            key_file=run.key_file, keep_last=run.keep_last, async_save=run.async_checkpoint,
            on_error=run.checkpoint_on_error)
        self.recovery = Recovery(self)
        self.progress = Progress(run.steps, run.log_every, self.log) if self.rank == 0 else None

        self.step = 0
        self.tokens_trained = 0
        self.micro_batch = config.optim.micro_batch_size or config.optim.batch_size
        self.best_val = math.inf
        self.trouble_since_checkpoint = False   # any skip or rollback since the last checkpoint
        self.eval_paused = False                # cost_warn pauses non-critical work
        self.last_checkpoint_time = None        # rank 0's clock at the last save (the same on every rank)

    def _wrap(self, model: torch.nn.Module, telemetry: bool):
        self.comm_timer = None
        if self.world == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if telemetry:
            self.comm_timer = CommTimer(self.device.type)
            ddp.register_comm_hook(None, self.comm_timer.hook)
        return ddp

    def _device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"

    # ------------------------------------------------------------------------------------- running
    def run(self) -> int:
        write_rank_file(self.run_dir, self.rank, local_rank=self.info.local_rank, world_size=self.world,
                        restart_count=self.info.restart_count)
        if (refusal := self.recovery.stopped_marker()) is not None:
            self.log.error("this run was stopped by the guard; not starting again", **refusal)
            return EXIT_STOPPED
        resumed_from = self.recovery.resume()
        self.telemetry.event("run_start", step=self.step, resumed_from=resumed_from,
                             restart_count=self.info.restart_count, world_size=self.world,
                             device=self.device.type, peak_flops=self.telemetry.peak_flops,
                             peak_flops_source=self.peak_source, flops_per_token=self.model.flops_per_token(),
                             params=self.model.num_params())
        self.schedule.start(self.step, resumed=resumed_from is not None)
        self.log.info("training", steps=self.cfg.run.steps, start_step=self.step, world_size=self.world,
                      device=str(self.device), params=self.model.num_params())
        code = None
        try:
            while self.step < self.cfg.run.steps and code is None:
                code = self.train_step()
            if self.progress:
                self.progress.close()   # end the bar's line before the closing log lines
            if code is None:
                if self.last_saved_step() != self.step:
                    self.save_checkpoint()
                code = EXIT_OK
                self.telemetry.event("run_end", step=self.step, reason="completed")
            self.checkpoints.wait()
        finally:
            if self.progress:
                self.progress.close()
            self.checkpoints.close()
            self.telemetry.close()
        return code

    def train_step(self) -> int | None:
        """One optimizer step; returns an exit code when the run must end now."""
        cfg, timer = self.cfg, StepTimer()
        step = self.step + 1
        timer.start()
        control = self.control.poll() if self.rank == 0 else (0, 0)
        self.faults.process_faults(step)
        self.train_data.delay_seconds = self.faults.data_delay(step)
        batch = cfg.optim.batch_size
        x, y = self.train_data.next_batch(batch)
        timer.mark("data_wait")

        loss_factor, grad_factor = self.faults.loss_factors(step)
        lr = self.schedule.lr()
        self.schedule.apply_lr(lr)
        loss = forward_backward(self.ddp, x, y, self.micro_batch, autocast=self.autocast(),
                                loss_factor=loss_factor, grad_factor=grad_factor)
        grad_norm, layer_norms = self.norms.compute()
        torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.schedule.clip_threshold(), grad_norm)
        layer_norms = torch.cat([layer_norms, dynamics.param_norm(self.norms.params).reshape(1)])
        health = self.health.sync(loss, grad_norm, layer_norms, control)
        timer.mark("forward_backward")

        *layer_values, param_norm = health.layer_norms
        layers = dict(zip(self.layer_names, layer_values))
        step_metrics = {"param_norm": param_norm, **self.schedule.after_sync(health.grad_norm)}
        loss_seen = health.loss if health.nonfinite_ranks == 0 else math.nan
        decision = self.schedule.respond(
            self.guard.observe(StepStats(step, loss_seen, health.grad_norm, layers, health.timestamp)))
        if decision.action is None:
            self.optimizer.step()
            self.schedule.updates += 1
            self.tokens_trained += batch * cfg.model.block_size
        self.optimizer.zero_grad(set_to_none=True)
        timer.mark("optimizer")
        self.schedule.observe(dynamics.StepSignals(step, loss_seen, health.grad_norm, param_norm),
                              applied=decision.action is None, validate=self.validation_loss)
        self.step = step

        timings = timer.stop()
        self._record(step, health, layers, loss_seen, lr, timings, **step_metrics)

        if decision.action is not None and (code := self.recovery.on_decision(decision)) is not None:
            return code
        if health.control_code and (code := self.recovery.on_request(health.control_code,
                                                                    health.control_line)) is not None:
            return code
        self.schedule.after_step(step, rolled_back=self.step != step)
        self.periodic_work(health.timestamp)
        return None

    def _record(self, step: int, health, layers: dict, loss: float, lr: float, timings: dict, **extra) -> None:
        """This step's TLS record and progress line, from values already on the host."""
        batch = self.cfg.optim.batch_size
        tokens = batch * self.cfg.model.block_size
        if self.comm_timer:
            extra["comm_seconds"] = self.comm_timer.take()
        self.telemetry.step(
            step, loss=loss, grad_norm=health.grad_norm, grad_norm_by_layer=layers, learning_rate=lr,
            tokens=tokens, samples=batch, timings=timings, tokens_trained=self.tokens_trained,
            tokens_loaded=self.train_data.tokens_loaded(), micro_batch_size=self.micro_batch,
            grad_accum_steps=-(-batch // self.micro_batch), timestamp=health.timestamp, **extra)
        if self.progress:
            self.progress.update(step, loss, lr, tokens * self.world / timings["step_time_seconds"])

    def periodic_work(self, now: float) -> None:
        """Checkpoint and evaluation when due; `now` is rank 0's clock, so every rank agrees on time."""
        run = self.cfg.run
        if self.last_checkpoint_time is None:
            self.last_checkpoint_time = now
        by_steps = run.checkpoint_every and self.step % run.checkpoint_every == 0
        by_time = run.checkpoint_every_seconds and now - self.last_checkpoint_time >= run.checkpoint_every_seconds
        # never twice for one step (a rollback or resume has just restored this very step)
        if (by_steps or by_time) and self.step < run.steps and self.last_saved_step() != self.step:
            self.save_checkpoint()
            self.last_checkpoint_time = now
        if run.eval_every and self.step % run.eval_every == 0 and not self.eval_paused:
            self.evaluate("periodic")

    # --------------------------------------------------------------------------------- evaluation
    def evaluate(self, purpose: str, **fields) -> float:
        """Validation loss, written as an `evaluation` event with the seconds it held training up."""
        began = time.perf_counter()
        val = self.validation_loss()
        self.telemetry.event("evaluation", step=self.step, val_loss=val, purpose=purpose,
                             seconds=time.perf_counter() - began, **fields)
        return val

    @torch.no_grad()
    def validation_loss(self) -> float:
        """Mean loss over the same `eval_batches` validation batches every time (comparable over time)."""
        self.model.eval()
        self.val_data.consumed = 0
        rows = self.cfg.optim.micro_batch_size or self.cfg.optim.batch_size   # not the throttled size:
        total = torch.zeros((), device=self.device, dtype=torch.float64)     # the same windows every time
        for _ in range(self.cfg.run.eval_batches):
            x, y = self.val_data.next_batch(rows)
            with self.autocast():
                total += self.model(x, y)[1].double()
        mean = total / self.cfg.run.eval_batches
        if self.world > 1:
            mean /= self.world
            dist.all_reduce(mean)
        self.model.train()
        return mean.item()

    # -------------------------------------------------------------------------------- checkpoints
    def last_saved_step(self) -> int | None:
        return self.recovery.last_saved_step

    def save_checkpoint(self) -> None:
        """Validation check, then rank 0 saves; stable if val loss is sane and the guard saw no trouble."""
        val = self.evaluate("checkpoint", guard_trouble=self.trouble_since_checkpoint)
        sane = math.isfinite(val) and val <= self.cfg.run.stable_val_factor * self.best_val
        stable = sane and not self.trouble_since_checkpoint
        if stable:
            self.best_val = min(self.best_val, val)
        saved = True
        if self.rank == 0:
            path = self.checkpoints.save(self.step, self.recovery.capture_state(), stable,
                                         meta={"val_loss": val if math.isfinite(val) else None})
            saved = path is not None   # a failed save with checkpoint_on_error "warn": the previous one stands
            if saved:
                self.faults.after_checkpoint(self.step, path, wait=self.checkpoints.wait)
        if saved:
            self.telemetry.last_checkpoint = f"step_{self.step}"
        # the same on every rank whatever rank 0's save did, so all ranks keep taking the same decisions
        self.recovery.last_saved_step = self.step
        self.trouble_since_checkpoint = False
