"""The Protector: the whole protection of a training loop, called at three points.

    protector = Protector(run_dir, states={"model": model, "optim": optimizer, "data": loader})
    protector.begin()                                   # rank file, stop marker, resume
    while protector.state.step < steps:
        ...; loss.backward()
        verdict = protector.check(protector.state.step + 1, loss, grad_norm)   # the ONE host sync
        if not verdict.skip:
            optimizer.step()
        optimizer.zero_grad()
        if protector.after_step(verdict, tokens=..., samples=..., timings=...).stop:
            break
    protector.finish()

`check` puts loss, gradient norms, rank 0's pending control request and rank 0's clock into one vector,
all-reduces it and reads it with one ``.tolist()``; the guard (`trainguard.decide.guard`, pure) decides on
it, identically on every rank. `after_step` writes the TLS record, meters the cost, carries out the
guard's decision and the agent's request, and saves a checkpoint when one is due. Saving and restoring
go through `save` and `restore`: signed, verified checkpoints of the `state_dict` of every object in
`states`, plus the guard's, the meter's and the `TrainState`.

Shadow mode (`actions.mode: shadow` in the policy, or `shadow=True`): every decision is taken as it would
be and recorded as a `shadow_action` event with its evidence, and none is carried out. The guard's
decision is moved to `StepVerdict.shadowed` in `check`, so no loop can skip a step on it; `_carry_out` is
the one place an action that `after_step` would take (a guard decision, an agent's request) is carried
out or shadowed.

What a decision changes in the loop's own numbers it writes into `state` (a `TrainState`): the step, the
micro-batch, the LR scale, the evaluation pause. What it cannot do itself it asks of the loop through
`Callbacks`; each has a default (see callbacks.py).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainguard import event_types
from trainguard import log as tglog
from trainguard import policy as policy_mod
from trainguard import rundir, runpolicy
from trainguard.actions import ROLLBACK, SHADOW_ACTION, STOP, shadow_event
from trainguard.decide import checkpoint_interval as autopilot_rule
from trainguard.decide import snapshot_pace
from trainguard.decide.cost import CostMeter, clock_of, usage_of
from trainguard.decide.decision import CARRY_ON, Decision
from trainguard.decide.guard import Guard, StepStats
from trainguard.protect import handlers
from trainguard.protect.callbacks import Callbacks, load_states
from trainguard.protect.handlers import EXIT_OK, EXIT_STOPPED, Order, StepOutcome
from trainguard.protect.checkpoints import RankCheckpoints
from trainguard.protect.recovery import LoopRecovery, settings_of
from trainguard.protect.state import TrainState
from trainguard.protect.sync import HealthSync
from trainguard.runtime import cordon_key
from trainguard.runtime.checkpoint import keys
from trainguard.runtime.control import ControlChannel, write_rank_file
from trainguard.runtime.telemetry import StepTelemetry

__all__ = ["EXIT_OK", "EXIT_STOPPED", "StepOutcome", "Protector", "StepVerdict", "Begun", "KEPT_ON_ROLLBACK"]
AUTO = "auto"                   # checkpoint_every="auto": the checkpoint autopilot
AUTO_START_SECONDS = 300.0      # its first interval, until a save has been measured
# The checkpoint keys the Protector adds to the loop's `states`.
GUARD_KEY, COST_KEY, STATE_KEY = "guard", "cost", "trainer"
# What a rollback leaves as it is: the data position (the window that led to trouble is skipped, not read
# again), the random generators (fresh draws, like fresh data), the guard's memory (its rollback budget
# must survive the rollback) and the meter (money spent stays spent).
KEPT_ON_ROLLBACK = ("data", "rng", GUARD_KEY, COST_KEY)


@dataclass(frozen=True)
class StepVerdict:
    """What `check` found, identical on every rank. `skip`: do not step the optimizer."""

    step: int
    loss: float                 # the global mean; NaN when any rank saw a non-finite loss
    grad_norm: float
    layer_norms: dict[str, float]
    timestamp: float            # rank 0's clock at the sync
    decision: Decision
    control_code: int = 0       # a control request every rank learned of in this step's sync
    control_line: int = 0
    extra: tuple[float, ...] = ()   # the loop's own values carried in the same sync (`check(extra=...)`)
    shadowed: Decision | None = None   # shadow mode: the guard's decision, recorded and not carried out
    checkpoint_interval: float = 0.0   # the autopilot's interval (rank 0's), the same on every rank
    checkpoint_clock: float = 0.0      # rank 0's clock at its last checkpoint (0: none yet), the same on every rank

    @property
    def skip(self) -> bool:
        return self.decision.action is not None


@dataclass(frozen=True)
class Begun:
    resumed_from: int | None            # the checkpoint's step, or None for a fresh start
    refused: dict | None = None         # the stop marker's content when the run must not start again
    snapshot: int | None = None         # the step of the in-memory snapshot loaded on top of it, if any


class Protector:
    def __init__(self, run_dir: str | os.PathLike, *, states: dict[str, Any], rank: int = 0,
                 world_size: int = 1, device: str | torch.device = "cpu", state: TrainState | None = None,
                 policy: policy_mod.Policy | str | os.PathLike | None = None,
                 telemetry: StepTelemetry | None = None, callbacks: Callbacks | None = None,
                 layer_names: list[str] = (), run_id: str | None = None, checkpoint_every: int | str = 0,
                 checkpoint_every_seconds: float = 0.0, keep_last: int = 3, key_file: str = "",
                 async_checkpoint: bool = False, checkpoint_on_error: str = "warn",
                 stable_val_factor: float = 1.5, log: Any = None, sharded_checkpoints: bool = False,
                 checkpoint_compress: str = "none", shadow: bool | None = None,
                 flops_per_token: float = 0.0, peak_flops: float = 0.0, precision: str = "bf16",
                 recovery: Any = None, process_groups: Any = None):
        """`sharded_checkpoints`: every rank saves (and loads in place) its own shards of the `model` and
        `optim` states (FSDP2: their state dicts hold DTensors); otherwise rank 0 saves the whole state.
        `checkpoint_compress`: "none" or "lossless" (bit-exact byte planes + zstd, runtime/checkpoint/compress.py).
        `shadow`: True or False over the policy's `actions.mode` (None: the policy decides).
        `flops_per_token`, `peak_flops`, `precision`: MFU's inputs for the default telemetry (the model's
        training FLOPs per token; the device's peak, 0: runtime/mfu.py's table for `precision`); with no
        FLOPs per token or no known peak there is no MFU. Give them to your own `telemetry` instead.
        `checkpoint_every="auto"` (or the policy's `checkpoint.autopilot: on`): the checkpoint autopilot
        chooses the interval by time from the run's measured failures, save and restart costs
        (trainguard/decide/checkpoint_interval.py), starting from `checkpoint_every_seconds` (300 when 0).
        `recovery`: over the policy's `recovery` section (None: the section as it is; "in_process" or
        "restart"; a mapping of its keys; False: none here, the loop runs runtime/resilience itself).
        `process_groups`: the groups of `trainguard.protect.init_process_group`, re-formed in-process on a
        rank's failure (protect/recovery.py)."""
        self.run_dir, self.rank, self.world = Path(run_dir), rank, world_size
        self.device = torch.device(device)
        self.run_id = run_id or self.run_dir.name
        self.log = log or tglog.get("protect", rank=rank, run_id=self.run_id)
        self.policy = policy if isinstance(policy, policy_mod.Policy) else policy_mod.load(policy or None)
        self.shadow = self.policy.shadow if shadow is None else bool(shadow)
        self._shadow_stopped = False        # a shadowed stop is recorded once (a stopped guard repeats it)
        self.state = state or TrainState()
        self.callbacks = callbacks or Callbacks()
        self.layer_names = list(layer_names)
        auto = checkpoint_every == AUTO or self.policy.checkpoint.autopilot == "on"
        if isinstance(checkpoint_every, str) and checkpoint_every != AUTO:
            raise ValueError(f"Protector: checkpoint_every must be a number of steps or {AUTO!r}, "
                             f"not {checkpoint_every!r}")
        self.checkpoint_every = 0 if auto else int(checkpoint_every)
        self.checkpoint_every_seconds = checkpoint_every_seconds or (AUTO_START_SECONDS if auto else 0.0)
        # The autopilot decides on rank 0 (it alone sees every save); its interval reaches the other ranks in
        # the step's sync, so all ranks save at the same steps.
        self.auto = auto
        steered = _steered_snapshots(self.policy, recovery, sharded_checkpoints)
        self.autopilot = (autopilot_rule.Autopilot(self.policy.checkpoint, applied=self.checkpoint_every_seconds,
                                                   snapshot_every=steered)
                          if auto and rank == 0 else None)
        # Rank 0 stretches the snapshot interval to what the snapshots cost (decide/snapshot_pace.py); the
        # interval reaches the other ranks in the sync as the autopilot's does.
        budget = _snapshot_budget(self.policy, recovery)
        self.pace = (snapshot_pace.SnapshotPace(budget, counts_beside=self.device.type == "cpu")
                     if steered and budget > 0 and rank == 0 else None)
        self.snapshot_given = steered
        # The snapshot tier's interval in steps as the autopilot applied it (rank 0's, the same on every rank
        # through the sync); 0: the policy's recovery.snapshot_every stands. The recovery component reads it.
        self.snapshot_every = 0
        self._steer_pending = False
        self.stable_val_factor = stable_val_factor
        if telemetry is not None and (flops_per_token or peak_flops or precision != "bf16"):
            raise ValueError("Protector: flops_per_token, peak_flops and precision configure the default "
                             "telemetry; with your own `telemetry`, give them to its StepTelemetry")
        self.telemetry = telemetry or StepTelemetry(self.run_dir, rank=rank, world_size=world_size,
                                                    run_id=self.run_id, device_type=self.device.type,
                                                    flops_per_token=flops_per_token, peak_flops=peak_flops,
                                                    precision=precision, device_name=_device_name(self.device),
                                                    device_index=self.device.index)
        if self.autopilot is not None:
            self.autopilot.gpus = int(self.telemetry.system.get("gpu_count") or 0)
        if self.pace is not None:
            self.telemetry.observers.append(self.pace.observe)
        self.guard = Guard(self.policy.guard)
        self.meter = CostMeter(self.policy.cost)
        self.states = {**states, GUARD_KEY: self.guard, COST_KEY: self.meter, STATE_KEY: self.state}
        self.sync = HealthSync(world_size, rank, self.device)
        # Requests are signed with the run's checkpoint key (runtime/control.py): a line anyone appended is refused.
        control_key, key_where = cordon_key.signing_key(key_file or None, create=True)
        self.control = ControlChannel(self.run_dir, rank, self.log, key=control_key, key_where=key_where,
                                      on_event=self.event)
        self.key = control_key
        self.checkpoints = RankCheckpoints(
            self.run_dir, rank=rank, world_size=world_size, on_event=self.telemetry.event, key_file=key_file,
            keep_last=keep_last, async_save=async_checkpoint, on_error=checkpoint_on_error,
            distributed=sharded_checkpoints, compress=checkpoint_compress)
        self.loss_rollback: float | None = None    # the loss that caused the last loss rollback (its retry)
        # snapshots of `states` and the in-process restart (docs/library.md "Recovery"); built last: it
        # uses the key, the states and the telemetry
        self.recovery = LoopRecovery.build(self, recovery, process_groups, sharded=sharded_checkpoints)

    # ------------------------------------------------------------------------------------ start, end
    def begin(self, *, resume: bool = True, **rank_info: Any) -> Begun:
        """Describe this rank for the agent's `restore`, refuse a run the guard stopped, resume from the
        newest verified checkpoint if there is one. `resume=False`: a standby in a killed rank's place
        (runtime/resilience/standby.py), whose state comes with the surviving ranks' restore."""
        write_rank_file(self.run_dir, self.rank, world_size=self.world, **rank_info)
        if self.rank == 0 and self.key is not None:
            _sign_policy(self.run_dir, self.policy, self.key, self.run_id, self.log)
        if self.autopilot is not None:
            _start_autopilot(self)
            self._steer_pending = True     # the first step tells whether this start followed a failure
        if (refused := self.stopped_marker()) is not None:
            self.log.error("this run was stopped by the guard; not starting again", **refused)
            return Begun(None, refused)
        if not resume:
            return Begun(None)
        resumed = self.restore(rollback=False)
        return Begun(resumed, snapshot=self.recovery.after_begin(resumed))

    def finish(self) -> None:
        """The loop ran to its end: a last checkpoint (unless this step has one), `run_end`, durable."""
        if self.state.last_saved_step != self.state.step:
            self.save()
        self.recovery.finish()
        self.telemetry.event(event_types.RUN_END, step=self.state.step, reason="completed")
        self.checkpoints.wait()

    def close(self) -> None:
        self.recovery.close()
        self.checkpoints.close()
        self.telemetry.close()

    def event(self, kind: str, /, **fields: Any) -> dict:
        """An event in this rank's TLS file about the current step."""
        return self.telemetry.event(kind, step=self.state.step, **fields)

    # --------------------------------------------------------------------------------- the two calls
    def check(self, step: int, loss, grad_norm, layer_norms: torch.Tensor | None = None,
              extra: torch.Tensor | None = None) -> StepVerdict:
        """After backward (and clipping): the step's one host sync, and the guard's decision on it.
        `extra`: more values of the loop's (a 1-d tensor, e.g. the parameter norm), averaged over ranks
        like the norms and returned as `StepVerdict.extra`, so they cost no sync of their own."""
        control = self.control.poll() if self.rank == 0 else (0, 0)
        carried = layer_norms.numel() if layer_norms is not None else 0
        if extra is not None:
            norms = layer_norms.reshape(-1) if layer_norms is not None else extra.new_zeros(0)
            layer_norms = torch.cat([norms.to(extra.dtype), extra.reshape(-1)])
        pilot = self.autopilot
        health = self.sync.sync(loss, grad_norm, layer_norms, control, pilot.applied if pilot is not None else 0.0,
                                _snapshot_slot(self), self.state.last_checkpoint_time or 0.0)
        self.snapshot_every = health.snapshot_every or self.snapshot_every
        layers = dict(zip(self.layer_names, health.layer_norms[:carried]))
        loss_seen = health.loss if health.nonfinite_ranks == 0 else math.nan
        decision = self.guard.observe(StepStats(step, loss_seen, health.grad_norm, layers, health.timestamp))
        shadowed = decision if self.shadow and decision else None      # the step is not skipped in shadow
        return StepVerdict(step, loss_seen, health.grad_norm, layers, health.timestamp,
                       CARRY_ON if shadowed or not decision else decision, health.control_code,
                       health.control_line, tuple(health.layer_norms[carried:]), shadowed,
                       health.checkpoint_interval, health.checkpoint_clock)

    def after_step(self, verdict: StepVerdict, *, tokens: int, samples: int, timings: dict[str, float],
                   learning_rate: float | None = None, **metrics: Any) -> StepOutcome:
        """After the optimizer step (or its skip): the TLS record, the cost meter, the guard's decision,
        the agent's request, and the checkpoint when one is due. `tokens`, `samples`: this rank's."""
        state = self.state
        state.step = verdict.step
        if not verdict.skip:
            state.tokens_trained += tokens
        metrics = {**metrics, **_interval_metrics(self, verdict)}   # step metrics: the agent exports them
        record = self.telemetry.step(
            verdict.step, loss=verdict.loss, grad_norm=verdict.grad_norm,
            grad_norm_by_layer=verdict.layer_norms or None, learning_rate=learning_rate, tokens=tokens,
            samples=samples, timings=timings, tokens_trained=state.tokens_trained,
            timestamp=verdict.timestamp, **metrics)
        # the cost meter sees the step as the agent's meter sees its record (the same clock)
        clock = clock_of(record) if record else (self.telemetry.envelope["node"], time.monotonic())
        gpus = self.telemetry.system["gpu_count"]
        self.meter.observe(verdict.step, verdict.timestamp, gpus, clock,
                           usage_of(record, self.meter.gpus(gpus)) if record else None)
        if self._steer_pending:
            self._steer_pending = False
            _steer_interval(self, verdict.timestamp)
        _tell(self.guard, self.telemetry, state.step, self.log)
        decided = verdict.shadowed or (verdict.decision if verdict.skip else None)
        if decided is not None:
            state.trouble_since_checkpoint = True      # shadowed or not: the step was bad
            if (outcome := self._carry_out(handlers.guard_order(decided))).stop:
                return outcome
        if verdict.control_code and (outcome := self._carry_out(
                handlers.control_order(self, verdict.control_code, verdict.control_line))).stop:
            return outcome
        self._checkpoint_if_due(verdict.timestamp, verdict.checkpoint_interval, verdict.checkpoint_clock)
        self.recovery.after_step()
        return StepOutcome(restored_step=state.step if state.step != verdict.step else None)

    # -------------------------------------------------------------------------------------- checkpoints
    def evaluate(self, purpose: str, **fields: Any) -> float | None:
        """The loop's validation loss (`Callbacks.validate`), as an `evaluation` event with its seconds."""
        if self.callbacks.validate is None:
            return None
        began = time.perf_counter()
        val = self.callbacks.validate()
        self.event(event_types.EVALUATION, val_loss=val, purpose=purpose, seconds=time.perf_counter() - began, **fields)
        return val

    def save(self) -> Path | None:
        """A checkpoint of every state at this step (rank 0 writes; with `sharded_checkpoints` every rank
        writes its shards). It is *stable* when the validation loss
        is finite and within `stable_val_factor` of the best, and the guard saw no trouble since the last."""
        state = self.state
        extra = self.callbacks.checkpoint_meta() if self.callbacks.checkpoint_meta is not None else {}
        if extra is None:   # refused (the replicas differ): the previous checkpoint stands
            return None
        val = self.evaluate("checkpoint", guard_trouble=state.trouble_since_checkpoint)
        sane = val is None or math.isfinite(val) and val <= self.stable_val_factor * state.best_val
        stable = sane and not state.trouble_since_checkpoint
        if stable and val is not None:
            state.best_val = min(state.best_val, val)
        path = None
        if self.checkpoints.saves_here:
            parts = {key: obj.state_dict() for key, obj in self.states.items()}
            meta = {"val_loss": val if val is not None and math.isfinite(val) else None, **extra}
            path = self.checkpoints.save(state.step, parts, stable, meta=meta)
            if path is not None and self.rank == 0 and self.callbacks.saved is not None:
                self.callbacks.saved(state.step, path, self.checkpoints.wait)
        if path is not None or self.rank != 0:   # a failed save (on_error "warn"): the previous one stands
            self.telemetry.last_checkpoint = rundir.step_dir_name(state.step)
        # the same on every rank whatever rank 0's save did, so all ranks keep taking the same decisions
        state.last_saved_step = state.step
        state.trouble_since_checkpoint = False
        return path

    def wait(self) -> None:
        """Until an asynchronous save is durable."""
        self.checkpoints.wait()

    def _checkpoint_if_due(self, now: float, interval: float = 0.0, clock: float = 0.0) -> None:
        """By steps or by rank 0's clock (`now`), never twice for one step (a restore has just set it).
        With the autopilot, by its interval (`interval`, rank 0's from the sync), steered after each save.
        The time since the last checkpoint is rank 0's too (`clock`, from the sync): a rank's own could
        differ (a standby that took a killed rank's place started its count at the takeover), and a save
        that some ranks begin and others do not leaves both waiting in different collectives."""
        state = self.state
        if clock > 0:
            state.last_checkpoint_time = clock
        elif state.last_checkpoint_time is None:
            state.last_checkpoint_time = now
        every_seconds = interval if self.auto and interval > 0 else self.checkpoint_every_seconds
        by_steps = self.checkpoint_every and state.step % self.checkpoint_every == 0
        by_time = every_seconds and now - state.last_checkpoint_time >= every_seconds
        if (by_steps or by_time) and state.last_saved_step != state.step:
            self.save()
            state.last_checkpoint_time = now
            _steer_interval(self, now)

    def restore(self, *, rollback: bool, source: str = "resume", **fields: Any) -> int | None:
        """The one way back to a checkpoint, for resume and rollback alike: the newest verified one (for a
        rollback the newest *stable* one), the same on every rank, loaded into every state. A rollback
        leaves `KEPT_ON_ROLLBACK` and the decisions in `TrainState` as they are, skips the data since the
        checkpoint, lowers the LR, and moves newer checkpoints aside. Returns the restored step."""
        state, from_step = self.state, self.state.step
        found = self.checkpoints.restore(stable_only=rollback, device=self.device,
                                         target=lambda: _load_target(self.states))
        if found is None:
            if rollback:
                self.event(ROLLBACK, source=source, restored_step=None,
                           error="no stable verified checkpoint to roll back to", **fields)
                self.log.error("rollback impossible: no stable verified checkpoint; carrying on", step=from_step)
            return None
        checkpoint, saved = found
        parts = dict(saved)
        if rollback:
            parts = {key: part for key, part in saved.items() if key not in KEPT_ON_ROLLBACK}
            parts[STATE_KEY] = state.rewound_to(saved[STATE_KEY])
        _reload(self.states, self.callbacks.reload, parts)
        state.last_saved_step = state.step
        state.trouble_since_checkpoint = False
        self.telemetry.last_checkpoint = rundir.step_dir_name(state.step)
        if not rollback:
            self.log.info("resumed", step=state.step, tokens_trained=state.tokens_trained)
            return state.step
        handlers.after_rollback(self, checkpoint, saved, float(saved[STATE_KEY].get("lr_scale", 1.0)), from_step,
                                source, fields)
        return state.step

    def load_states(self, parts: dict[str, Any]) -> int:
        """Every state from `parts` (a verified in-memory snapshot: the `state_dict` of each of `states`,
        runtime/resilience/snapshot.py), as a resume loads a checkpoint's; the newest durable checkpoint
        stays what it was. Returns the step the state is at now."""
        _reload(self.states, self.callbacks.reload, parts)
        return self.state.step

    # ---------------------------------------------------------------------- carried out or shadowed
    def _carry_out(self, order: Order) -> StepOutcome:
        """The one gate of the actions `after_step` takes (a guard decision, an agent's request): its handler
        (protect/handlers.py) carries `order` out; in shadow mode a `shadow_action` event records it with its
        evidence instead, and nothing else happens."""
        if not self.shadow:
            return handlers.HANDLERS[order.action](self, order)
        if order.action == STOP:
            if self._shadow_stopped:
                return StepOutcome()
            self._shadow_stopped = True
        self.event(SHADOW_ACTION, **shadow_event(order.action, order.reason, order.source, **order.evidence))
        self.log.warning("shadow: would have acted", action=order.action, source=order.source, reason=order.reason,
                         step=self.state.step)
        return StepOutcome()

    def stopped_marker(self) -> dict | None:
        """The guard's stop marker when rank 0 of this run signed it (protect/handlers.py `stopped_marker`)."""
        return handlers.stopped_marker(self)


def _device_name(device: torch.device) -> str:
    """This rank's GPU model (the MFU table's key), not the current device's: they differ before set_device."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else ""


def _sign_policy(run_dir: Path, policy: policy_mod.Policy, key: bytes, run_id: str, log: Any) -> None:
    """Rank 0 writes the policy this run trains with into RUN/policy.yaml, signed (trainguard/runpolicy.py):
    the agent and `trainguard replay RUN` use that file only when its signature checks."""
    try:
        runpolicy.write(run_dir, policy, key, key_id=keys.key_id(key), by=f"trainer:{run_id}")
    except (OSError, ValueError) as exc:
        log.warning("the run's policy could not be written and signed; readers use their defaults", error=str(exc))


def _tell(guard: Guard, telemetry: StepTelemetry, step: int, log: Any) -> None:
    """The guard's notices (a loss level accepted): an event each in the TLS log, and a warning."""
    for notice in guard.notices:
        fields = {key: value for key, value in notice.items() if key not in ("type", "step", "timestamp")}
        telemetry.event(notice["type"], step=notice.get("step", step), **fields)
        log.warning("the guard accepted a new loss level", **fields)
    guard.notices.clear()


def _load_target(states: dict[str, Any]) -> dict[str, Any]:
    """What a sharded restore loads into in place: the current state dicts of the tensor states
    (their shards, in this rank's layout)."""
    from trainguard.runtime.checkpoint.manager import TENSOR_PARTS

    return {key: states[key].state_dict() for key in TENSOR_PARTS if key in states}


def _reload(states: dict[str, Any], reload: Any, parts: dict[str, Any]) -> None:
    """The library's own states, then the loop's (its `reload` callback, or `load_state_dict` each)."""
    own = {key: states[key] for key in (GUARD_KEY, COST_KEY, STATE_KEY)}
    load_states(own, {key: part for key, part in parts.items() if key in own})
    theirs = {key: part for key, part in parts.items() if key not in own}
    if reload is not None:
        reload(theirs)
    else:
        load_states(states, theirs)


# The checkpoint autopilot's side of the Protector (rank 0; trainguard/decide/checkpoint_interval.py decides).
def _start_autopilot(protector: Protector) -> None:
    """Rank 0: the run's own history (its failures, saves, restarts, the interval last applied) and the
    earlier runs of the runs root (the prior), then every record this process writes."""
    from trainguard import autopilot_history

    pilot = protector.autopilot
    for record in autopilot_history.records(protector.telemetry.path):
        pilot.observe(record)
    pilot.resume()
    pilot.history = autopilot_history.earlier_runs(protector.run_dir, protector.policy.checkpoint.history_runs)
    protector.telemetry.observers.append(lambda record: pilot.observe(autopilot_history.timed(record)))


def _steered_snapshots(policy: policy_mod.Policy, recovery: Any, sharded: bool) -> int:
    """The snapshot interval the autopilot starts from and steers (issue 32's second tier), 0 for none:
    only under `recovery.mode: in_process` with snapshots on and not sharded (FSDP2 takes none). The
    settings are the Protector's `recovery=` over the policy's, or (recovery=False: the bundled trainer runs
    runtime/resilience itself, from the policy's section) the policy's."""
    settings = policy.recovery if recovery is False else settings_of(recovery, policy)
    return settings.snapshot_every if settings is not None and settings.mode == "in_process" and not sharded else 0


def _snapshot_budget(policy: policy_mod.Policy, recovery: Any) -> float:
    settings = policy.recovery if recovery is False else settings_of(recovery, policy)
    return settings.snapshot_budget if settings is not None else 0.0


def _snapshot_slot(protector: Protector) -> int:
    """Rank 0's snapshot interval for this step's sync (0 elsewhere, and where the policy's stands): the
    autopilot's when it steers one, stretched to the snapshots' cost budget; an event when it moves."""
    pilot, pace = protector.autopilot, protector.pace
    steered = pilot.snapshot_every if pilot is not None else 0
    if pace is None:
        return steered
    given, before = steered or protector.snapshot_given, pace.paced
    every = pace.every(given)
    if every != (before or given):
        protector.event(event_types.SNAPSHOT_PACED, snapshot_every=every, given=given, **pace.inputs())
        protector.log.info("snapshot interval paced to its cost", snapshot_every=every, given=given, **pace.inputs())
    return every


def _steer_interval(protector: Protector, now: float) -> None:
    """Rank 0, at a checkpoint boundary: the autopilot's recommendation, applied when it moved (an event
    with its inputs)."""
    if protector.autopilot is None:
        return
    change = protector.autopilot.consider(now)
    if change is not None:
        protector.event(autopilot_rule.INTERVAL_EVENT, **change)
        protector.log.info("checkpoint interval changed by the autopilot", **change)


def _interval_metrics(protector: Protector, verdict: StepVerdict) -> dict[str, float]:
    """The checkpoint interval by time in force (and, on rank 0, the autopilot's recommendation)."""
    if protector.autopilot is not None:
        return protector.autopilot.metrics()
    every = verdict.checkpoint_interval if protector.auto else protector.checkpoint_every_seconds
    return {"checkpoint_interval_seconds": every} if every else {}
