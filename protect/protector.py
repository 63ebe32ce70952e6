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
decision is moved to `Verdict.shadowed` in `check`, so no loop can skip a step on it; `_carry_out` is
the one place an action that `after_step` would take (a guard decision, an agent's request) is carried
out or shadowed.

What a decision changes in the loop's own numbers it writes into `state` (a `TrainState`): the step, the
micro-batch, the LR scale, the evaluation pause. What it cannot do itself it asks of the loop through
`Callbacks`; each has a default (see callbacks.py).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainguard import log as tglog
from trainguard import policy as policy_mod
from trainguard import rundir, runpolicy, safe_read, signed, tls
from trainguard.actions import (COST_STOP, COST_THROTTLE, COST_WARN, ROLLBACK, SHADOW_ACTION, SKIP_STEP, STOP,
                                shadow_event)
from trainguard.decide.cost import CostMeter, clock_of
from trainguard.decide.decision import CARRY_ON, Decision
from trainguard.decide.guard import Guard, StepStats
from trainguard.protect.callbacks import Callbacks, load_states, scale_optimizers
from trainguard.protect.checkpoints import RankCheckpoints
from trainguard.protect.state import TrainState
from trainguard.protect.sync import HealthSync
from trainguard.trainer import cordon_key
from trainguard.trainer.checkpoint import keys
from trainguard.trainer.control import ACTIONS_BY_CODE, ControlChannel, write_rank_file
from trainguard.trainer.telemetry import StepTelemetry

EXIT_OK, EXIT_STOPPED = 0, 3
STOPPED_PURPOSE = "run-stopped/1"     # RUN/control/stopped.json, signed by rank 0 with the run's checkpoint key
# The checkpoint keys the Protector adds to the loop's `states`.
GUARD_KEY, COST_KEY, STATE_KEY = "guard", "cost", "trainer"
# What a rollback leaves as it is: the data position (the window that led to trouble is skipped, not read
# again), the random generators (fresh draws, like fresh data), the guard's memory (its rollback budget
# must survive the rollback) and the meter (money spent stays spent).
KEPT_ON_ROLLBACK = ("data", "rng", GUARD_KEY, COST_KEY)
# Loss rollbacks whose retry may show the loss is the data's; the same loss again is within this share.
LOSS_ROLLBACKS = ("repeated_loss_spike", "repeated_warmup_spike")
SAME_LOSS = 0.10


@dataclass(frozen=True)
class Verdict:
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

    @property
    def skip(self) -> bool:
        return self.decision.action is not None


@dataclass(frozen=True)
class Outcome:
    """What `after_step` did. `stop`: end the loop now, with `exit_code` (0: cost stop, 3: guard stop)."""

    exit_code: int | None = None
    reason: str = ""
    restored_step: int | None = None    # a rollback happened: the loop continues from this step

    @property
    def stop(self) -> bool:
        return self.exit_code is not None


@dataclass(frozen=True)
class Begun:
    resumed_from: int | None            # the checkpoint's step, or None for a fresh start
    refused: dict | None = None         # the stop marker's content when the run must not start again


THROTTLE_UNAVAILABLE = ("the loop keeps no micro-batch in TrainState and has no cut_micro_batch callback "
                        "(docs/integrations.md: not available for the Transformers and Lightning Trainers)")


class Protector:
    def __init__(self, run_dir: str | os.PathLike, *, states: dict[str, Any], rank: int = 0,
                 world_size: int = 1, device: str | torch.device = "cpu", state: TrainState | None = None,
                 policy: policy_mod.Policy | str | os.PathLike | None = None,
                 telemetry: StepTelemetry | None = None, callbacks: Callbacks | None = None,
                 layer_names: list[str] = (), run_id: str | None = None, checkpoint_every: int = 0,
                 checkpoint_every_seconds: float = 0.0, keep_last: int = 3, key_file: str = "",
                 async_checkpoint: bool = False, checkpoint_on_error: str = "warn",
                 stable_val_factor: float = 1.5, log: Any = None, sharded_checkpoints: bool = False,
                 checkpoint_compress: str = "none", shadow: bool | None = None,
                 flops_per_token: float = 0.0, peak_flops: float = 0.0, precision: str = "bf16"):
        """`sharded_checkpoints`: every rank saves (and loads in place) its own shards of the `model` and
        `optim` states (FSDP2: their state dicts hold DTensors); otherwise rank 0 saves the whole state.
        `checkpoint_compress`: "none" or "lossless" (bit-exact byte planes + zstd, trainer/checkpoint/compress.py).
        `shadow`: True or False over the policy's `actions.mode` (None: the policy decides).
        `flops_per_token`, `peak_flops`, `precision`: MFU's inputs for the default telemetry (the model's
        training FLOPs per token; the device's peak, 0: trainer/mfu.py's table for `precision`); with no
        FLOPs per token or no known peak there is no MFU. Give them to your own `telemetry` instead."""
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
        self.checkpoint_every, self.checkpoint_every_seconds = checkpoint_every, checkpoint_every_seconds
        self.stable_val_factor = stable_val_factor
        if telemetry is not None and (flops_per_token or peak_flops or precision != "bf16"):
            raise ValueError("Protector: flops_per_token, peak_flops and precision configure the default "
                             "telemetry; with your own `telemetry`, give them to its StepTelemetry")
        self.telemetry = telemetry or StepTelemetry(self.run_dir, rank=rank, world_size=world_size,
                                                    run_id=self.run_id, device_type=self.device.type,
                                                    flops_per_token=flops_per_token, peak_flops=peak_flops,
                                                    precision=precision, device_name=self._device_name())
        self.guard = Guard(self.policy.guard)
        self.meter = CostMeter(self.policy.cost)
        self.states = {**states, GUARD_KEY: self.guard, COST_KEY: self.meter, STATE_KEY: self.state}
        self.sync = HealthSync(world_size, rank, self.device)
        # Requests are signed with the run's checkpoint key (trainer/control.py): a line anyone appended is refused.
        control_key, key_where = cordon_key.signing_key(key_file or None, create=True)
        self.control = ControlChannel(self.run_dir, rank, self.log, key=control_key, key_where=key_where,
                                      on_event=self.event)
        self.key = control_key
        self.checkpoints = RankCheckpoints(
            self.run_dir, rank=rank, world_size=world_size, on_event=self.telemetry.event, key_file=key_file,
            keep_last=keep_last, async_save=async_checkpoint, on_error=checkpoint_on_error,
            distributed=sharded_checkpoints, compress=checkpoint_compress)
        self.stop_path = rundir.stopped_path(self.run_dir)
        self._loss_rollback: float | None = None    # the loss that caused the last loss rollback (its retry)

    # ------------------------------------------------------------------------------------ start, end
    def _device_name(self) -> str:
        """This rank's GPU model (the MFU table's key), not the current device's: they differ before set_device."""
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else ""

    def begin(self, **rank_info: Any) -> Begun:
        """Describe this rank for the agent's `restore`, refuse a run the guard stopped, resume from the
        newest verified checkpoint if there is one."""
        write_rank_file(self.run_dir, self.rank, world_size=self.world, **rank_info)
        self._sign_policy()
        if (refused := self.stopped_marker()) is not None:
            self.log.error("this run was stopped by the guard; not starting again", **refused)
            return Begun(None, refused)
        return Begun(self.restore(rollback=False))

    def _sign_policy(self) -> None:
        """Rank 0 writes the policy this run trains with into RUN/policy.yaml, signed (trainguard/runpolicy.py):
        the agent and `trainguard replay RUN` use that file only when its signature checks."""
        if self.rank != 0 or self.key is None:
            return
        try:
            runpolicy.write(self.run_dir, self.policy, self.key, key_id=keys.key_id(self.key),
                            by=f"trainer:{self.run_id}")
        except (OSError, ValueError) as exc:
            self.log.warning("the run's policy could not be written and signed; readers use their defaults",
                             error=str(exc))

    def finish(self) -> None:
        """The loop ran to its end: a last checkpoint (unless this step has one), `run_end`, durable."""
        if self.state.last_saved_step != self.state.step:
            self.save()
        self.telemetry.event("run_end", step=self.state.step, reason="completed")
        self.checkpoints.wait()

    def close(self) -> None:
        self.checkpoints.close()
        self.telemetry.close()

    def event(self, kind: str, /, **fields: Any) -> dict:
        """An event in this rank's TLS file about the current step."""
        return self.telemetry.event(kind, step=self.state.step, **fields)

    # --------------------------------------------------------------------------------- the two calls
    def check(self, step: int, loss, grad_norm, layer_norms: torch.Tensor | None = None,
              extra: torch.Tensor | None = None) -> Verdict:
        """After backward (and clipping): the step's one host sync, and the guard's decision on it.
        `extra`: more values of the loop's (a 1-d tensor, e.g. the parameter norm), averaged over ranks
        like the norms and returned as `Verdict.extra`, so they cost no sync of their own."""
        control = self.control.poll() if self.rank == 0 else (0, 0)
        carried = layer_norms.numel() if layer_norms is not None else 0
        if extra is not None:
            norms = layer_norms.reshape(-1) if layer_norms is not None else extra.new_zeros(0)
            layer_norms = torch.cat([norms.to(extra.dtype), extra.reshape(-1)])
        health = self.sync.sync(loss, grad_norm, layer_norms, control)
        layers = dict(zip(self.layer_names, health.layer_norms[:carried]))
        loss_seen = health.loss if health.nonfinite_ranks == 0 else math.nan
        decision = self.guard.observe(StepStats(step, loss_seen, health.grad_norm, layers, health.timestamp))
        shadowed = decision if self.shadow and decision else None      # the step is not skipped in shadow
        return Verdict(step, loss_seen, health.grad_norm, layers, health.timestamp,
                       CARRY_ON if shadowed or not decision else decision, health.control_code,
                       health.control_line, tuple(health.layer_norms[carried:]), shadowed)

    def after_step(self, verdict: Verdict, *, tokens: int, samples: int, timings: dict[str, float],
                   learning_rate: float | None = None, **metrics: Any) -> Outcome:
        """After the optimizer step (or its skip): the TLS record, the cost meter, the guard's decision,
        the agent's request, and the checkpoint when one is due. `tokens`, `samples`: this rank's."""
        state = self.state
        state.step = verdict.step
        if not verdict.skip:
            state.tokens_trained += tokens
        record = self.telemetry.step(
            verdict.step, loss=verdict.loss, grad_norm=verdict.grad_norm,
            grad_norm_by_layer=verdict.layer_norms or None, learning_rate=learning_rate, tokens=tokens,
            samples=samples, timings=timings, tokens_trained=state.tokens_trained,
            timestamp=verdict.timestamp, **metrics)
        self._meter(verdict, record)
        self._tell()
        if verdict.shadowed is not None:
            self._on_decision(verdict.shadowed)
        if verdict.skip and (outcome := self._on_decision(verdict.decision)).stop:
            return outcome
        if verdict.control_code and (outcome := self._on_request(verdict.control_code,
                                                                 verdict.control_line)).stop:
            return outcome
        self._checkpoint_if_due(verdict.timestamp)
        return Outcome(restored_step=state.step if state.step != verdict.step else None)

    def _meter(self, verdict: Verdict, record: dict | None) -> None:
        """Feed the cost meter the step as the agent's meter sees its record (the same clock)."""
        clock = clock_of(record) if record else (self.telemetry.envelope["node"], time.monotonic())
        self.meter.observe(verdict.step, verdict.timestamp, self.telemetry.system["gpu_count"], clock)

    # -------------------------------------------------------------------------------------- checkpoints
    def evaluate(self, purpose: str, **fields: Any) -> float | None:
        """The loop's validation loss (`Callbacks.validate`), as an `evaluation` event with its seconds."""
        if self.callbacks.validate is None:
            return None
        began = time.perf_counter()
        val = self.callbacks.validate()
        self.event("evaluation", val_loss=val, purpose=purpose, seconds=time.perf_counter() - began, **fields)
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
            self.telemetry.last_checkpoint = f"step_{state.step}"
        # the same on every rank whatever rank 0's save did, so all ranks keep taking the same decisions
        state.last_saved_step = state.step
        state.trouble_since_checkpoint = False
        return path

    def wait(self) -> None:
        """Until an asynchronous save is durable."""
        self.checkpoints.wait()

    def _checkpoint_if_due(self, now: float) -> None:
        """By steps or by rank 0's clock (`now`), never twice for one step (a restore has just set it)."""
        state = self.state
        if state.last_checkpoint_time is None:
            state.last_checkpoint_time = now
        by_steps = self.checkpoint_every and state.step % self.checkpoint_every == 0
        by_time = (self.checkpoint_every_seconds
                   and now - state.last_checkpoint_time >= self.checkpoint_every_seconds)
        if (by_steps or by_time) and state.last_saved_step != state.step:
            self.save()
            state.last_checkpoint_time = now

    def restore(self, *, rollback: bool, source: str = "resume", **fields: Any) -> int | None:
        """The one way back to a checkpoint, for resume and rollback alike: the newest verified one (for a
        rollback the newest *stable* one), the same on every rank, loaded into every state. A rollback
        leaves `KEPT_ON_ROLLBACK` and the decisions in `TrainState` as they are, skips the data since the
        checkpoint, lowers the LR, and moves newer checkpoints aside. Returns the restored step."""
        state, from_step = self.state, self.state.step
        found = self.checkpoints.restore(stable_only=rollback, device=self.device, target=self._load_target)
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
        self._reload(parts)
        state.last_saved_step = state.step
        state.trouble_since_checkpoint = False
        self.telemetry.last_checkpoint = f"step_{state.step}"
        if not rollback:
            self.log.info("resumed", step=state.step, tokens_trained=state.tokens_trained)
            return state.step
        self._after_rollback(checkpoint, saved, from_step, source, fields)
        return state.step

    def _load_target(self) -> dict[str, Any]:
        """What a sharded restore loads into in place: the current state dicts of the tensor states
        (their shards, in this rank's layout)."""
        from trainguard.trainer.checkpoint.manager import TENSOR_PARTS

        return {key: self.states[key].state_dict() for key in TENSOR_PARTS if key in self.states}

    def load_states(self, parts: dict[str, Any]) -> int:
        """Every state from `parts` (a verified in-memory snapshot: the `state_dict` of each of `states`,
        trainer/resilience/snapshot.py), as a resume loads a checkpoint's; the newest durable checkpoint
        stays what it was. Returns the step the state is at now."""
        self._reload(parts)
        return self.state.step

    def _reload(self, parts: dict[str, Any]) -> None:
        """The library's own states, then the loop's (its `reload` callback, or `load_state_dict` each)."""
        own = {key: self.states[key] for key in (GUARD_KEY, COST_KEY, STATE_KEY)}
        load_states(own, {key: part for key, part in parts.items() if key in own})
        theirs = {key: part for key, part in parts.items() if key not in own}
        if self.callbacks.reload is not None:
            self.callbacks.reload(theirs)
        else:
            load_states(self.states, theirs)

    def _after_rollback(self, checkpoint, saved: dict, from_step: int, source: str, fields: dict) -> None:
        guard, state, callbacks = self.policy.guard, self.state, self.callbacks
        skipped = callbacks.skip_data(saved.get("data")) or {} if callbacks.skip_data else {}
        state.lr_scale *= guard.rollback_lr_factor
        if callbacks.scale_lr is not None:
            callbacks.scale_lr(guard.rollback_lr_factor, state.lr_scale, guard.rewarmup_steps)
        else:   # the optimizers hold the checkpoint's LR, cut by the checkpoint's scale: cut by the rest
            scale_optimizers(self.states, state.lr_scale / float(saved[STATE_KEY].get("lr_scale", 1.0)))
        self.checkpoints.abandon_after(state.step)
        self.guard.rewinding = True     # the steps going back are this rollback's (whoever asked), not a restart
        self.telemetry.event(ROLLBACK, step=from_step, source=source, restored_step=state.step,
                             checkpoint=str(checkpoint.path), steps_lost=from_step - state.step, **skipped,
                             lr_scale=state.lr_scale, rewarmup_steps=guard.rewarmup_steps, **fields)
        self.log.warning("rolled back", from_step=from_step, to_step=state.step, lr_scale=state.lr_scale,
                         **skipped)

    # ---------------------------------------------------------------------- carried out or shadowed
    def _carry_out(self, action: str, source: str, reason: str, evidence: dict, act) -> Outcome:
        """The one gate of the actions `after_step` takes: `act()` carries `action` out; in shadow mode a
        `shadow_action` event records it with its evidence instead, and nothing else happens."""
        if not self.shadow:
            return act()
        if action == STOP:
            if self._shadow_stopped:
                return Outcome()
            self._shadow_stopped = True
        self.event(SHADOW_ACTION, **shadow_event(action, reason, source, **evidence))
        self.log.warning("shadow: would have acted", action=action, source=source, reason=reason,
                         step=self.state.step)
        return Outcome()

    # ------------------------------------------------------------------------------ guard decisions
    def _on_decision(self, decision: Decision) -> Outcome:
        self.state.trouble_since_checkpoint = True      # shadowed or not: the step was bad
        event = {k: v for k, v in decision.as_event().items() if k not in ("type", "step")}
        evidence = {k: v for k, v in event.items() if k != "reason"}
        return self._carry_out(str(decision.action), "guard", decision.reason, evidence,
                               lambda: self._guard_action(decision, event))

    def _guard_action(self, decision: Decision, event: dict) -> Outcome:
        if decision.action == SKIP_STEP:
            self.event(SKIP_STEP, **event)
            self.log.warning("step skipped by the guard", step=self.state.step, reason=decision.reason)
        elif decision.action == ROLLBACK:
            self._guard_rollback(decision, event)
        elif decision.action == STOP:
            return self._stop(decision, event)
        return Outcome()

    def _guard_rollback(self, decision: Decision, event: dict) -> None:
        """The guard's rollback. One that cannot happen (no stable checkpoint) is taken back from the guard's
        count, so impossible rollbacks never stop a run. A loss rollback whose retry meets the same loss again
        (within `SAME_LOSS`) is the data, not an instability (a planned data-mix change): at most one retry,
        then the guard accepts the new level and the human is told, instead of rolling back in a loop."""
        loss = float(decision.detail.get("loss", math.nan))
        retried = self._loss_rollback
        if decision.reason in LOSS_ROLLBACKS and retried is not None and abs(loss - retried) <= SAME_LOSS * abs(retried):
            self._loss_rollback = None
            self.guard.rollback_not_done(decision.timestamp or 0.0)
            self.guard.accept_loss_level(self.state.step, decision.timestamp or 0.0)
            self.log.warning("the loss is at a new level that a rollback reproduced: the data, not an instability; "
                             "the guard accepts the new level (look at the data mix)", step=self.state.step,
                             loss=loss, loss_before_retry=retried)
            return
        if self.restore(rollback=True, source="guard", **event) is None:
            self.guard.rollback_not_done(decision.timestamp or 0.0)
        else:
            self._loss_rollback = loss if decision.reason in LOSS_ROLLBACKS else None

    def _tell(self) -> None:
        """The guard's notices (a loss level accepted): an event each in the TLS log, and a warning."""
        for notice in self.guard.notices:
            fields = {key: value for key, value in notice.items() if key not in ("type", "step", "timestamp")}
            self.telemetry.event(notice["type"], step=notice.get("step", self.state.step), **fields)
            self.log.warning("the guard accepted a new loss level", **fields)
        self.guard.notices.clear()

    def _stop(self, decision: Decision, event: dict) -> Outcome:
        """Nothing new is saved; ``RUN/control/stopped.json`` keeps restarted workers from starting again."""
        step = self.state.step
        self.event(STOP, **event)
        message = (f"the guard stopped the run at step {step} ({decision.reason}: "
                   f"{json.dumps(decision.detail, default=str)}); nothing new was saved. Look at "
                   f"{self.run_dir / 'tls'}, fix the cause (data, LR, policy), then delete {self.stop_path} "
                   "to resume from the last verified checkpoint")
        if self.rank == 0:
            self.stop_path.parent.mkdir(parents=True, exist_ok=True)
            marker = json.loads(json.dumps({"step": step, "reason": decision.reason, "detail": decision.detail,
                                             "time": time.time(), "message": message}, default=str))
            if self.key is not None:      # only a signed marker keeps workers from starting (stopped_marker)
                marker = signed.sign(self.key, STOPPED_PURPOSE, {**marker, "run": rundir.run_name(self.run_dir)},
                                     key_id=keys.key_id(self.key))
            self.stop_path.write_text(json.dumps(marker))
        self.log.error(message)
        if self.callbacks.stop is not None:
            self.callbacks.stop(decision.reason)
        self.event("run_end", reason="guard_stop")
        return Outcome(EXIT_STOPPED, decision.reason)

    def stopped_marker(self) -> dict | None:
        """The guard's stop marker when rank 0 of this run signed it; a marker anyone else wrote keeps no
        worker from starting (it is named, and recorded as a ``stop_marker_refused`` event)."""
        try:
            marker = safe_read.read_json(self.stop_path, safe_read.CONTROL_BYTES, "stop marker")
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            marker = None
        reason = signed.check(self.key, STOPPED_PURPOSE, marker, {"run": rundir.run_name(self.run_dir)})
        if reason is None:
            return marker
        why = signed.refusal_message(reason, f"the stop marker {self.stop_path}")
        self.log.error(f"{why}: not honoured, the run starts", reason=reason)
        self.event("stop_marker_refused", reason=reason, path=str(self.stop_path), why=why)
        return None

    # ---------------------------------------------------------------------------- control requests
    def _on_request(self, code: int, lineno: int) -> Outcome:
        """Act on the control request every rank learned of this step (see trainer/control.py)."""
        action = ACTIONS_BY_CODE[code]
        request = self.control.request_at(lineno)
        ids = {"id": str(request.get("id")), "alertname": request.get("alertname") or "",
               "reason": request.get("reason") or ""}
        self.control.ack(request, self.state.step)
        evidence = {"id": ids["id"], "alertname": ids["alertname"]}
        return self._carry_out(action, "control", ids["reason"], evidence, lambda: self._request_action(action, ids))

    def _request_action(self, action: str, ids: dict) -> Outcome:
        if action == ROLLBACK:
            self.event("action", action=action, **ids)
            self.restore(rollback=True, source="control", **ids)
        elif action == COST_WARN:
            self.state.eval_paused = True
            fields = self.callbacks.pause() or {} if self.callbacks.pause else {}
            self.event("action", action=action, evaluation="paused", **fields, **ids)
            self.log.warning("cost warning: evaluation paused", **ids)
        elif action == COST_THROTTLE:
            self._throttle(ids)
        elif action == COST_STOP:
            return self._cost_stop(ids)
        return Outcome()

    def _throttle(self, ids: dict) -> None:
        """Cut the micro-batch by 25% (the loop keeps its batch per optimizer step, so the tokens per step
        stay the same) and hand the device's cached memory back. A loop that keeps no micro-batch in the
        state and gave no `cut_micro_batch` (the Transformers and Lightning Trainers build their DataLoader
        once) cannot be throttled: the event says so, and nothing is claimed to have changed."""
        before = self.state.micro_batch
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if not before and self.callbacks.cut_micro_batch is None:
            self.event("action", action=COST_THROTTLE, micro_batch="unchanged", not_applied=THROTTLE_UNAVAILABLE,
                       **ids)
            self.log.warning("cost throttle not applied: this loop's micro-batch cannot be cut", **ids)
            return
        self.state.micro_batch = max(1, (before * 3) // 4) if before else 0   # 0: the loop keeps none here
        cut = self.callbacks.cut_micro_batch
        fields = cut(self.state.micro_batch) or {} if cut else {}
        self.event("action", action=COST_THROTTLE, micro_batch_before=before,
                   micro_batch_size=self.state.micro_batch, **fields, **ids)
        self.log.warning("cost throttle: smaller micro-batch", micro_batch_before=before,
                         micro_batch_size=self.state.micro_batch, **ids)

    def _cost_stop(self, ids: dict) -> Outcome:
        """Save a checkpoint, check that it verifies, write RUN/cost_summary.json, end cleanly (exit 0)."""
        step = self.state.step
        self.event("action", action=COST_STOP, **ids)
        self.save()
        if self.rank == 0:
            verified = self.checkpoints.verified_step() == step   # the checkpoint the run ends on must verify
            path = self.run_dir / "cost_summary.json"
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.cost_summary(ids, verified), indent=2) + "\n")
            os.replace(tmp, path)
        if self.callbacks.stop is not None:
            self.callbacks.stop(COST_STOP)
        self.event("run_end", reason="cost_stop", alertname=ids["alertname"])
        self.log.warning("cost stop: checkpoint saved, run ended", step=step, **ids)
        return Outcome(EXIT_OK, COST_STOP)

    def cost_summary(self, ids: dict, verified: bool) -> dict:
        """What the run cost, as the meter has metered it (the one cost arithmetic)."""
        metered, cost = self.meter.state, self.policy.cost
        started = _first_timestamp(self.telemetry.path) or time.time()
        price = cost.price_per_gpu_hour
        return {"run_id": self.run_id, "step": self.state.step, "stopped_by": ids,
                "checkpoint": f"step_{self.state.step}", "checkpoint_verified": verified,
                "tokens_trained": self.state.tokens_trained, "world_size": self.world,
                "gpu_count": self.meter.gpus(None), "wall_hours": (time.time() - started) / 3600,
                "gpu_hours": metered.cost_usd / price if price else 0.0, "price_per_gpu_hour": price,
                "cost_usd": metered.cost_usd, "budget_per_1k_steps": cost.budget_per_1k_steps,
                "cost_per_1k_steps": metered.cost_per_1k_steps, "overrun_ratio": metered.overrun_ratio,
                "tier": metered.tier}


def _first_timestamp(path) -> float | None:
    """When this run began, from the first record of its TLS file (the file outlives restarts)."""
    try:
        with safe_read.open_file(path, what="log file") as handle:
            return tls.decode(handle.readline(safe_read.MAX_LINE_BYTES))["timestamp"]
    except (OSError, tls.TLSError):
        return None
