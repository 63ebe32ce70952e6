"""The trainer's side of the action table: one handler per action the Protector carries out in the step.

The action table (trainguard/actions.py) names each action the Protector carries out (``carried_by``
PROTECTOR); each is registered here with ``@handles(NAME)`` as ``handler(protector, order) -> StepOutcome``.
An `Order` is one action to carry out: the guard's decision on this step, or a control request every rank
learned of in the step's sync (`control_order`). The Protector passes every order through its one gate,
`Protector._carry_out`: in shadow mode it records a ``shadow_action`` event instead and no handler runs.

What a handler changes in the loop's own numbers it writes into `protector.state` (a `TrainState`); what it
cannot do itself it asks of the loop through `protector.callbacks` (protect/callbacks.py).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from trainguard import event_types, rundir, safe_read, signed, tls
from trainguard.actions import ACTIONS_BY_CODE, COST_STOP, COST_THROTTLE, COST_WARN, DRAIN, ROLLBACK, SKIP_STEP, STOP
from trainguard.decide.decision import Decision
from trainguard.protect.callbacks import scale_optimizers
from trainguard.runtime.checkpoint import keys

if TYPE_CHECKING:
    from trainguard.protect.protector import Protector

GUARD, CONTROL = "guard", "control"     # who asked: the step's guard, or a control request (the agent, a human)
EXIT_OK, EXIT_STOPPED = 0, 3
EXIT_DRAINED = 5     # checkpointed and stopped for a node at risk: the launchers re-form the job (not 0: not done)
STOPPED_PURPOSE = "run-stopped/1"     # RUN/control/stopped.json, signed by rank 0 with the run's checkpoint key
# Loss rollbacks whose retry may show the loss is the data's; the same loss again is within this share.
LOSS_ROLLBACKS = ("repeated_loss_spike", "repeated_warmup_spike")
SAME_LOSS = 0.10
THROTTLE_UNAVAILABLE = ("the loop keeps no micro-batch in TrainState and has no cut_micro_batch callback "
                        "(docs/integrations.md: not available for the Transformers and Lightning Trainers)")


@dataclass(frozen=True)
class StepOutcome:
    """What `after_step` did. `stop`: end the loop now, with `exit_code` (0: cost stop, 3: guard stop)."""

    exit_code: int | None = None
    reason: str = ""
    restored_step: int | None = None    # a rollback happened: the loop continues from this step

    @property
    def stop(self) -> bool:
        return self.exit_code is not None


@dataclass(frozen=True)
class Order:
    """One action to carry out in this step, identical on every rank."""

    action: str
    source: str                      # GUARD or CONTROL
    reason: str
    fields: dict[str, Any]           # what its TLS event carries: the decision's fields, or the request's ids
    evidence: dict[str, Any] = field(default_factory=dict)   # what a shadow_action event records beside `reason`
    decision: Decision | None = None  # the guard's


def guard_order(decision: Decision) -> Order:
    event = {k: v for k, v in decision.as_event().items() if k not in ("type", "step")}
    evidence = {k: v for k, v in event.items() if k != "reason"}
    return Order(str(decision.action), GUARD, decision.reason, event, evidence, decision)


def control_order(protector: Protector, code: int, lineno: int) -> Order:
    """The control request every rank learned of this step (see runtime/control.py), acknowledged."""
    request = protector.control.request_at(lineno)
    ids = {"id": str(request.get("id")), "alertname": request.get("alertname") or "",
           "reason": request.get("reason") or ""}
    protector.control.ack(request, protector.state.step)
    return Order(ACTIONS_BY_CODE[code], CONTROL, ids["reason"], ids, {"id": ids["id"], "alertname": ids["alertname"]})


Handler = Callable[["Protector", Order], StepOutcome]
HANDLERS: dict[str, Handler] = {}


def handles(action: str) -> Callable[[Handler], Handler]:
    """Register the Protector's handler of `action` (a row of trainguard/actions.py carried by PROTECTOR)."""
    def register(handler: Handler) -> Handler:
        if action in HANDLERS:
            raise ValueError(f"two trainer handlers for {action!r}")
        HANDLERS[action] = handler
        return handler
    return register


# ---------------------------------------------------------------------------------------- skip_step
@handles(SKIP_STEP)
def skip_step(protector: Protector, order: Order) -> StepOutcome:
    protector.event(SKIP_STEP, **order.fields)
    protector.log.warning("step skipped by the guard", step=protector.state.step, reason=order.reason)
    return StepOutcome()


# ----------------------------------------------------------------------------------------- rollback
@handles(ROLLBACK)
def rollback(protector: Protector, order: Order) -> StepOutcome:
    """The guard's (see `guard_rollback`) or a control request's: back to the newest stable checkpoint."""
    if order.decision is not None:
        guard_rollback(protector, order.decision, order.fields)
    else:
        protector.event(event_types.ACTION, action=ROLLBACK, **order.fields)
        protector.restore(rollback=True, source=CONTROL, **order.fields)
    return StepOutcome()


def guard_rollback(protector: Protector, decision: Decision, event: dict) -> None:
    """The guard's rollback. One that cannot happen (no stable checkpoint) is taken back from the guard's
    count, so impossible rollbacks never stop a run. A loss rollback whose retry meets the same loss again
    (within `SAME_LOSS`) is the data, not an instability (a planned data-mix change): at most one retry,
    then the guard accepts the new level and the human is told, instead of rolling back in a loop."""
    loss = float(decision.detail.get("loss", math.nan))
    retried, guard = protector.loss_rollback, protector.guard
    if decision.reason in LOSS_ROLLBACKS and retried is not None and abs(loss - retried) <= SAME_LOSS * abs(retried):
        protector.loss_rollback = None
        guard.rollback_not_done(decision.timestamp or 0.0)
        guard.accept_loss_level(protector.state.step, decision.timestamp or 0.0)
        protector.log.warning("the loss is at a new level that a rollback reproduced: the data, not an instability; "
                              "the guard accepts the new level (look at the data mix)", step=protector.state.step,
                              loss=loss, loss_before_retry=retried)
        return
    if protector.restore(rollback=True, source=GUARD, **event) is None:
        guard.rollback_not_done(decision.timestamp or 0.0)
    else:
        protector.loss_rollback = loss if decision.reason in LOSS_ROLLBACKS else None


def after_rollback(protector: Protector, checkpoint, saved: dict, saved_lr_scale: float, from_step: int,
                   source: str, fields: dict) -> None:
    """What a rollback does past loading the checkpoint (`Protector.restore`): the data window skipped, the
    LR lowered, newer checkpoints moved aside, the guard told, the event. `saved_lr_scale`: the checkpoint's."""
    guard, state, callbacks = protector.policy.guard, protector.state, protector.callbacks
    skipped = callbacks.skip_data(saved.get("data")) or {} if callbacks.skip_data else {}
    state.lr_scale *= guard.rollback_lr_factor
    if callbacks.scale_lr is not None:
        callbacks.scale_lr(guard.rollback_lr_factor, state.lr_scale, guard.rewarmup_steps)
    else:   # the optimizers hold the checkpoint's LR, cut by the checkpoint's scale: cut by the rest
        scale_optimizers(protector.states, state.lr_scale / saved_lr_scale)
    protector.checkpoints.abandon_after(state.step)
    protector.guard.rewinding = True     # the steps going back are this rollback's (whoever asked), not a restart
    protector.telemetry.event(ROLLBACK, step=from_step, source=source, restored_step=state.step,
                              checkpoint=str(checkpoint.path), steps_lost=from_step - state.step, **skipped,
                              lr_scale=state.lr_scale, rewarmup_steps=guard.rewarmup_steps, **fields)
    protector.log.warning("rolled back", from_step=from_step, to_step=state.step, lr_scale=state.lr_scale,
                          **skipped)


# --------------------------------------------------------------------------------------------- stop
@handles(STOP)
def stop(protector: Protector, order: Order) -> StepOutcome:
    assert order.decision is not None       # only the guard decides a stop
    return stop_run(protector, order.decision, order.fields)


def stop_run(protector: Protector, decision: Decision, event: dict) -> StepOutcome:
    """The guard's stop (or the replica check's): nothing new is saved; ``RUN/control/stopped.json`` keeps
    restarted workers from starting again."""
    step, run_dir, key = protector.state.step, protector.run_dir, protector.key
    stop_path = rundir.stopped_path(run_dir)
    protector.event(STOP, **event)
    message = (f"the guard stopped the run at step {step} ({decision.reason}: "
               f"{json.dumps(decision.detail, default=str)}); nothing new was saved. Look at "
               f"{rundir.tls_dir(run_dir)}, fix the cause (data, LR, policy), then delete {stop_path} "
               "to resume from the last verified checkpoint")
    if protector.rank == 0:
        stop_path.parent.mkdir(parents=True, exist_ok=True)
        marker = json.loads(json.dumps({"step": step, "reason": decision.reason, "detail": decision.detail,
                                         "time": time.time(), "message": message}, default=str))
        if key is not None:      # only a signed marker keeps workers from starting (`stopped_marker`)
            marker = signed.sign(key, STOPPED_PURPOSE, {**marker, "run": rundir.run_name(run_dir)},
                                 key_id=keys.key_id(key))
        stop_path.write_text(json.dumps(marker))
    protector.log.error(message)
    protector.recovery.settle()        # no snapshot event after the run's end
    if protector.callbacks.stop is not None:
        protector.callbacks.stop(decision.reason)
    protector.event(event_types.RUN_END, reason="guard_stop")
    return StepOutcome(EXIT_STOPPED, decision.reason)


def stopped_marker(protector: Protector) -> dict | None:
    """The guard's stop marker when rank 0 of this run signed it; a marker anyone else wrote keeps no
    worker from starting (it is named, and recorded as a ``stop_marker_refused`` event)."""
    stop_path = rundir.stopped_path(protector.run_dir)
    try:
        marker = safe_read.read_json(stop_path, safe_read.CONTROL_BYTES, "stop marker")
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        marker = None
    reason = signed.check(protector.key, STOPPED_PURPOSE, marker, {"run": rundir.run_name(protector.run_dir)})
    if reason is None:
        return marker
    why = signed.refusal_message(reason, f"the stop marker {stop_path}")
    protector.log.error(f"{why}: not honoured, the run starts", reason=reason)
    protector.event(event_types.STOP_MARKER_REFUSED, reason=reason, path=str(stop_path), why=why)
    return None


# --------------------------------------------------------------------------------------------- cost
@handles(COST_WARN)
def cost_warn(protector: Protector, order: Order) -> StepOutcome:
    """Pause evaluation (the loop reads `TrainState.eval_paused`, or its `pause` callback does more)."""
    protector.state.eval_paused = True
    pause = protector.callbacks.pause
    fields = pause() or {} if pause else {}
    protector.event(event_types.ACTION, action=COST_WARN, evaluation="paused", **fields, **order.fields)
    protector.log.warning("cost warning: evaluation paused", **order.fields)
    return StepOutcome()


@handles(COST_THROTTLE)
def cost_throttle(protector: Protector, order: Order) -> StepOutcome:
    """Cut the micro-batch by 25% (the loop keeps its batch per optimizer step, so the tokens per step
    stay the same) and hand the device's cached memory back. A loop that keeps no micro-batch in the
    state and gave no `cut_micro_batch` (the Transformers and Lightning Trainers build their DataLoader
    once) cannot be throttled: the event says so, and nothing is claimed to have changed."""
    state, ids, cut = protector.state, order.fields, protector.callbacks.cut_micro_batch
    before = state.micro_batch
    if protector.device.type == "cuda":
        torch.cuda.empty_cache()
    if not before and cut is None:
        protector.event(event_types.ACTION, action=COST_THROTTLE, micro_batch="unchanged", not_applied=THROTTLE_UNAVAILABLE,
                        **ids)
        protector.log.warning("cost throttle not applied: this loop's micro-batch cannot be cut", **ids)
        return StepOutcome()
    state.micro_batch = max(1, (before * 3) // 4) if before else 0   # 0: the loop keeps none here
    fields = cut(state.micro_batch) or {} if cut else {}
    protector.event(event_types.ACTION, action=COST_THROTTLE, micro_batch_before=before,
                    micro_batch_size=state.micro_batch, **fields, **ids)
    protector.log.warning("cost throttle: smaller micro-batch", micro_batch_before=before,
                          micro_batch_size=state.micro_batch, **ids)
    return StepOutcome()


@handles(COST_STOP)
def cost_stop(protector: Protector, order: Order) -> StepOutcome:
    """Save a checkpoint, check that it verifies, write RUN/cost_summary.json, end cleanly (exit 0)."""
    step, ids, run_dir = protector.state.step, order.fields, protector.run_dir
    protector.event(event_types.ACTION, action=COST_STOP, **ids)
    protector.save()
    if protector.rank == 0:
        verified = protector.checkpoints.verified_step() == step   # the checkpoint the run ends on must verify
        path = rundir.cost_summary_path(run_dir)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(cost_summary(protector, ids, verified), indent=2) + "\n")
        os.replace(tmp, path)
    protector.recovery.settle()        # no snapshot event after the run's end
    if protector.callbacks.stop is not None:
        protector.callbacks.stop(COST_STOP)
    protector.event(event_types.RUN_END, reason=COST_STOP, alertname=ids["alertname"])
    protector.log.warning("cost stop: checkpoint saved, run ended", step=step, **ids)
    return StepOutcome(EXIT_OK, COST_STOP)


def cost_summary(protector: Protector, ids: dict, verified: bool) -> dict:
    """What the run cost, as the meter has metered it (the one cost arithmetic)."""
    metered, cost, state = protector.meter.state, protector.policy.cost, protector.state
    started = _first_timestamp(protector.telemetry.path) or time.time()
    price = cost.price_per_gpu_hour
    return {"run_id": protector.run_id, "step": state.step, "stopped_by": ids,
            "checkpoint": rundir.step_dir_name(state.step), "checkpoint_verified": verified,
            "tokens_trained": state.tokens_trained, "world_size": protector.world,
            "gpu_count": protector.meter.gpus(None), "wall_hours": (time.time() - started) / 3600,
            "gpu_hours": metered.cost_usd / price if price else 0.0, "price_per_gpu_hour": price,
            "cost_usd": metered.cost_usd, "budget_per_1k_steps": cost.budget_per_1k_steps,
            "cost_per_1k_steps": metered.cost_per_1k_steps, "overrun_ratio": metered.overrun_ratio,
            "tier": metered.tier, "tokens": metered.tokens, "useful_tokens": metered.useful_tokens,
            "usd_per_million_useful_tokens": (metered.cost_usd / metered.useful_tokens * 1e6
                                              if metered.useful_tokens else None),
            "kwh_per_1k_steps": metered.kwh_per_1k_steps or None}


def _first_timestamp(path) -> float | None:
    """When this run began, from the first record of its TLS file (the file outlives restarts)."""
    try:
        with safe_read.open_file(path, what="log file") as handle:
            return tls.decode(handle.readline(safe_read.MAX_LINE_BYTES))["timestamp"]
    except (OSError, tls.TLSError):
        return None


# -------------------------------------------------------------------------------------------- drain
@handles(DRAIN)
def drain_at_checkpoint(protector: Protector, order: Order) -> StepOutcome:
    """A node at hardware risk (decide/node_risk.py): a verified checkpoint of this very step, then every rank
    stops, so nothing is trained past it. The flagging node's agent, once that checkpoint verifies, cordons
    its node and ends its launcher; the other nodes' launchers re-form the job and resume from here."""
    step, ids = protector.state.step, order.fields
    path = protector.save()
    protector.wait()                       # durable before anyone acts on it (an async save included)
    verified = protector.rank != 0 or protector.checkpoints.verified_step() == step
    protector.event(event_types.ACTION, action=DRAIN, checkpoint_step=step, checkpoint_verified=verified, **ids)
    protector.recovery.settle()        # no snapshot event after the run's end
    if protector.callbacks.stop is not None:
        protector.callbacks.stop(DRAIN)
    protector.event(event_types.RUN_END, reason=DRAIN, alertname=ids["alertname"])
    protector.log.warning("drained at a checkpoint: a node is at hardware risk", step=step,
                          checkpoint=str(path) if path else None, verified=verified, **ids)
    return StepOutcome(EXIT_DRAINED, DRAIN)
