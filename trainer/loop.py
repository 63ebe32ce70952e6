"""The bundled training loop: the model, the data and the optimizer, protected by the library
(`trainguard.protect.Protector`: guard, control channel, verified checkpoints, cost meter, telemetry)
through its public API only. `Trainer.__init__` is the one place the parts are built.

One step, on every rank, each phase a method of its own:

    faults due (crash, hang, slowio)  ->  load_batch  ->  backward (micro-batches)  ->  clip_gradients
    ->  protector.check: ONE host sync (loss, norms, rank 0's control request and clock), guard decides
    ->  apply_update (optimizer step unless skipped)  ->  protector.after_step: TLS record, cost meter,
        the decision or request carried out, checkpoint when due  ->  periodic evaluation
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard import event_types, log, policy as policy_mod
from trainguard.actions import STOP
from trainguard.protect import EXIT_OK, EXIT_STOPPED, StepOutcome, Protector, TrainState, StepVerdict, handlers
from trainguard.trainer import parallel
from trainguard.trainer import schedules as dynamics
from trainguard.trainer.config import TrainConfig
from trainguard.trainer.data import ShardLoader, open_stream
from trainguard.trainer.faults import FaultInjector
from trainguard.trainer.model import GPT
from trainguard.trainer.progress import Progress
from trainguard.trainer.recovery import grad_accum_steps, trainer_callbacks
from trainguard.trainer.replica_check import ReplicaChecks
from trainguard.runtime.resilience import standby
from trainguard.runtime.resilience.component import Recovery
from trainguard.runtime.resilience.inprocess import ProcessGroups
from trainguard.runtime.checkpoint.manager import final_checkpoint_code
from trainguard.trainer.state import checkpoint_states
from trainguard.trainer.step import GradNorms, forward_backward
from trainguard.runtime.telemetry import CommTimer, StepTelemetry, StepTimer


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


def device_name(device: torch.device) -> str:
    """The GPU's model name (MFU's peak table is keyed by it), or "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class Trainer:
    def __init__(self, config: TrainConfig, run_dir: Path, info: DistInfo, groups: ProcessGroups | None = None):
        """`groups`: the job's process groups when failures are recovered in-process (trainer/train.py)."""
        self.cfg, self.run_dir, self.info = config, Path(run_dir), info
        self.groups = groups
        self.rank, self.world = info.rank, info.world_size
        run = config.run
        self.run_id = run.run_id or self.run_dir.name
        self.log = log.get("trainer", rank=self.rank, run_id=self.run_id)
        self.device = resolve_device(run.device, info.local_rank)
        policy = policy_mod.load(run.policy or None)
        if run.shadow:      # --shadow over the policy file's actions.mode
            policy = policy_mod.in_shadow(policy)
        torch.manual_seed(run.seed)

        self.model = GPT(config.model).to(self.device)
        self.ddp = self._wrap(self.model, run.telemetry)
        self.layer_names, owners = self.model.layer_of_parameters()
        self.norms = GradNorms(list(self.model.parameters()), owners, self.layer_names)
        self.optimizer = torch.optim.AdamW(
            dynamics.optimizer_groups(self.model, config.optim.weight_decay), lr=config.optim.lr,
            betas=(config.optim.beta1, config.optim.beta2), fused=self.device.type == "cuda")
        self.schedule = dynamics.Dynamics(config.optim, run.steps, policy)   # LRSchedule + docs/dynamics.md
        self.autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if self.device.type == "cuda" \
            else nullcontext

        stream = open_stream(config.data)
        loader_args = dict(block_size=config.model.block_size, rank=self.rank, world_size=self.world,
                           val_fraction=config.data.val_fraction, device=self.device.type)
        self.train_data = ShardLoader(stream, split="train", **loader_args)
        self.val_data = ShardLoader(stream, split="val", **loader_args)

        # MFU's peak: --peak-flops, else the documented table for bf16 (the autocast dtype) on CUDA, else none.
        self.telemetry = StepTelemetry(
            self.run_dir, rank=self.rank, world_size=self.world, run_id=self.run_id,
            device_type=self.device.type, flops_per_token=self.model.flops_per_token(), peak_flops=run.peak_flops,
            precision="bf16", device_name=device_name(self.device),
            gpu_count=run.gpu_count if run.gpu_count >= 0 else None, enabled=run.telemetry,
            device_index=self.device.index)
        self.faults = FaultInjector(run.inject, self.run_dir, self.rank, emit=self.telemetry.event)
        self.state = TrainState(micro_batch=config.optim.micro_batch_size or config.optim.batch_size)
        callbacks = trainer_callbacks(schedule=self.schedule, train_data=self.train_data, faults=self.faults,
                                      batch_size=config.optim.batch_size, block_size=config.model.block_size,
                                      validate=self.validation_loss)
        self.key_file = run.key_file or None
        self.replicas = self._replica_checks(policy)   # sdc hook (trainer/replica_check.py)
        callbacks.checkpoint_meta = self.replicas.before_checkpoint
        self.protector = Protector(
            self.run_dir, states=checkpoint_states(self.model, self.optimizer, self.schedule, self.train_data,
                                                   sharded=self.sharded),
            state=self.state, rank=self.rank, world_size=self.world, device=self.device, policy=policy,
            telemetry=self.telemetry, callbacks=callbacks, layer_names=self.layer_names, run_id=self.run_id,
            checkpoint_every="auto" if run.checkpoint_auto else run.checkpoint_every,
            checkpoint_every_seconds=run.checkpoint_every_seconds,
            keep_last=run.keep_last, key_file=run.key_file, async_checkpoint=run.async_checkpoint,
            checkpoint_on_error=run.checkpoint_on_error, stable_val_factor=run.stable_val_factor, log=self.log,
            sharded_checkpoints=self.sharded, checkpoint_compress=run.checkpoint_compress,
            recovery=False)    # the loop runs runtime/resilience's Recovery itself (self.recovery)
        self.schedule.bind(self.model, self.optimizer, self.telemetry.event)
        self.recovery = Recovery.build(policy.recovery, self.protector, run_dir=self.run_dir, rank=self.rank,
                                       world_size=self.world, device=self.device, groups=groups, log=self.log,
                                       sharded=self.sharded,   # a peer's state checked with the replica fingerprint
                                       fingerprint=lambda tensors: int(self.replicas.fingerprints.fingerprint(tensors)))
        callbacks.stop = lambda reason: self.recovery.settle()    # no snapshot event after a stop's run_end
        self.progress = Progress(run.steps, run.log_every, self.log) if self.rank == 0 else None

    def _wrap(self, model: torch.nn.Module, telemetry: bool):
        self.comm_timer = None
        self.sharded = self.cfg.run.parallel == parallel.FSDP2 and self.world > 1
        # a standby in a killed rank's place has no group until it meets the survivors; it wraps after their restore
        if self.world == 1 or self.groups is not None and self.groups.replacing:
            return model
        if self.sharded:   # run.parallel fsdp2: every rank holds (and checkpoints) a shard of each parameter
            return parallel.wrap(model, parallel.FSDP2, self.world, self.device)
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if telemetry:
            self.comm_timer = CommTimer(self.device.type)
            ddp.register_comm_hook(None, self.comm_timer.hook)
        return ddp

    def _replica_checks(self, policy: policy_mod.Policy) -> ReplicaChecks:
        """sdc hook: the replica fingerprint check (trainer/replica_check.py, docs/sdc.md)."""
        from trainguard.decide.replica import ReplicaPolicy

        names = [name for name, _ in self.model.named_parameters()]
        every = 0 if self.sharded else policy.guard.replica_check_every   # FSDP2: no replicas to compare
        params = parallel.local_shards(list(self.model.parameters()))   # FSDP2: this rank's shards
        replacing = self.groups is not None and self.groups.replacing
        checks = ReplicaChecks(params, names, every=every,
                               world_size=self.world, rank=self.rank, node=self.telemetry.envelope["node"],
                               run_dir=self.run_dir, emit=self.telemetry.event, log=self.log,
                               policy=ReplicaPolicy(policy.guard.replica_cordon_window_seconds),
                               key_file=self.key_file,   # signs its cordons (trainguard/cordon/__init__.py)
                               shadow=policy.shadow, nodes=standby.recall(self.groups, "nodes") if replacing else None)
        if self.groups is not None and self.rank == 0 and not replacing:   # for a standby in a rank's place
            standby.remember(self.groups, "nodes", checks.nodes)
        return checks

    def replica_check(self, step: int) -> int | None:
        """sdc hook: at check steps, after the step's record; a mismatch rolls every rank back to the newest
        verified checkpoint, whole (data position included: the data is not at fault, and the replay
        arbitrates two replicas). Returns an exit code when the run must end (a mismatch that repeats)."""
        from trainguard.decide.decision import Decision

        verdict = self.replicas.after_step(step)
        if verdict is None:
            return None
        outcome = self.replicas.respond(
            verdict, restore=lambda: self.protector.restore(rollback=False),
            stop=lambda event: handlers.stop_run(self.protector, Decision(STOP, event_types.REPLICA_MISMATCH, step,
                                                                           detail=event), event))
        return outcome.exit_code if outcome is not None else None

    # ------------------------------------------------------------------------------------- running
    def run(self) -> int:
        replacing = self.groups is not None and self.groups.replacing    # runtime/resilience/standby.py
        begun = self.protector.begin(local_rank=self.info.local_rank, restart_count=self.info.restart_count,
                                     resume=not replacing)
        if begun.refused is not None:
            self.protector.close()
            return EXIT_STOPPED
        self.protector.event(event_types.RUN_START, resumed_from=begun.resumed_from,
                             restart_count=self.info.restart_count, world_size=self.world,
                             device=self.device.type, **self.telemetry.mfu_basis(),
                             params=self.model.num_params(), actions_mode=self.protector.policy.actions.mode)
        if replacing:   # the survivors' group, their state, DDP and the LR phase, as theirs after a recovery
            self.recovery.take_over(rebuild=self.rebuild_after_recovery)
        else:
            self.recovery.after_begin(begun.resumed_from)   # a fresher snapshot, if any
            self.schedule.start(self.state.step, resumed=begun.resumed_from is not None)
        self.log.info("training", steps=self.cfg.run.steps, start_step=self.state.step, world_size=self.world,
                      device=str(self.device), params=self.model.num_params())
        code = None
        try:
            while self.state.step < self.cfg.run.steps and code is None:
                try:
                    code = self.train_step()
                except Exception as failure:     # docs/recovery.md: in-process, or re-raised (restart)
                    self.recovery.recover(failure, rebuild=self.rebuild_after_recovery)
            if self.progress:
                self.progress.close()   # end the bar's line before the closing log lines
            self.recovery.settle()
            if code is None:
                self.protector.finish()
                code = EXIT_OK
            self.protector.wait()
            code = final_checkpoint_code(self.protector.checkpoints.manager, self.state.step, code, self.rank)
        finally:
            if self.progress:
                self.progress.close()
            self.recovery.close(completed=code == EXIT_OK and self.state.step >= self.cfg.run.steps)
            self.protector.close()
        return code

    def rebuild_after_recovery(self) -> None:
        """After the group was re-formed and the state restored: DDP's reducer held the old group; the
        gradients and the schedule's phase are those of the restored step."""
        self.ddp = self._wrap(self.model, self.cfg.run.telemetry)
        self.replicas.forget()       # the same checks on every rank, a standby's included
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.start(self.state.step, resumed=True)

    def train_step(self) -> int | None:
        """One optimizer step; returns an exit code when the run must end now."""
        timer = StepTimer()
        step = self.state.step + 1
        timer.start()
        x, y = self.load_batch(step)
        timer.mark("data_wait")
        lr = self.set_learning_rate()
        loss = self.backward(step, x, y)
        self.faults.grad_flip(step, self.replicas.params, self.replicas.names)   # sdc hook
        self.replicas.after_backward(step)                                     # sdc hook
        grad_norm, layer_norms = self.clip_gradients()
        verdict = self.protector.check(step, loss, grad_norm, layer_norms, extra=self.schedule.param_norm())
        verdict = dataclasses.replace(verdict, decision=self.schedule.respond(verdict.decision))
        timer.mark("forward_backward")
        self.apply_update(verdict)
        timer.mark("optimizer")
        self.schedule.observe(verdict, validate=self.validation_loss)
        outcome = self.after_step(verdict, lr, timer.stop())
        self.schedule.after_step(verdict.step, rolled_back=outcome.restored_step is not None)
        if outcome.stop:
            return outcome.exit_code
        if outcome.restored_step is None and (code := self.replica_check(step)) is not None:   # sdc hook
            return code
        self.recovery.after_step(last=self.state.step >= self.cfg.run.steps)   # the snapshot when due
        self.evaluate_if_due()
        return None

    # ------------------------------------------------------------------------------ the step's phases
    def load_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Faults due at this step fire first (a crash or hang never reaches the batch)."""
        self.faults.process_faults(step)
        self.faults.bit_flip(step, self.replicas.params, self.replicas.names)   # sdc hook
        self.train_data.delay_seconds = self.faults.data_delay(step)
        return self.train_data.next_batch(self.cfg.optim.batch_size)

    def set_learning_rate(self) -> float:
        lr = self.schedule.lr(self.state.lr_scale)
        self.schedule.apply_lr(lr)          # x each layer's multiplier and layer group's phase factor
        return lr

    def backward(self, step: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward over micro-batches of `TrainState.micro_batch` rows (DDP reduces on the last)."""
        loss_factor, grad_factor = self.faults.loss_factors(step)
        return forward_backward(self.ddp, x, y, self.state.micro_batch, autocast=self.autocast(),
                                loss_factor=loss_factor, grad_factor=grad_factor)

    def clip_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Global and per-layer norms of the reduced gradients (on the device), then clipping to them."""
        grad_norm, layer_norms = self.norms.compute()
        torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.schedule.clip_threshold(), grad_norm)
        return grad_norm, layer_norms

    def apply_update(self, verdict: StepVerdict) -> None:
        """The optimizer and the schedule move unless the guard skipped the step."""
        if not verdict.skip:
            self.optimizer.step()
            self.schedule.updates += 1
        self.optimizer.zero_grad(set_to_none=True)

    def after_step(self, verdict: StepVerdict, lr: float, timings: dict) -> StepOutcome:
        """The Protector's second call (record, decision, request, checkpoint), and the progress line."""
        batch = self.cfg.optim.batch_size
        tokens = batch * self.cfg.model.block_size
        extra = {"comm_seconds": self.comm_timer.take()} if self.comm_timer else {}
        extra.update(self.schedule.step_metrics(verdict))      # param_norm, clip_threshold, clip_coef
        outcome = self.protector.after_step(
            verdict, tokens=tokens, samples=batch, timings=timings, learning_rate=lr,
            tokens_loaded=self.train_data.tokens_loaded(), micro_batch_size=self.state.micro_batch,
            grad_accum_steps=grad_accum_steps(batch, self.state.micro_batch), **extra)
        if self.progress:
            self.progress.update(verdict.step, verdict.loss, lr,
                                 tokens * self.world / timings["step_time_seconds"])
        return outcome

    def evaluate_if_due(self) -> None:
        every = self.cfg.run.eval_every
        if every and self.state.step % every == 0 and not self.state.eval_paused:
            self.protector.evaluate("periodic")

    # --------------------------------------------------------------------------------- evaluation
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
