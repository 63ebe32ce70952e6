"""What the trainer does about a guard decision or a control request: the mechanics of skip, rollback,
stop, resume, throttle and cost stop. The *decisions* are made elsewhere (trainguard.decide, the agent);
every rank runs this code on the same step with the same inputs, so all ranks act alike.

- skip_step: nothing to undo (the loop did not step the optimizer or the schedule); an event is written.
- rollback: every rank restores the newest stable verified checkpoint, keeps reading the data from where
  it is (skipping the window that hurt), multiplies the LR by ``rollback_lr_factor`` and warms it up
  again over ``rewarmup_steps`` updates. Newer checkpoints are moved aside so a later resume cannot
  pick one from the abandoned timeline.
- stop: nothing is saved; ``RUN/control/stopped.json`` keeps a restarted worker from starting again.
- cost_warn / cost_throttle / cost_stop: pause evaluation / shrink the micro-batch keeping the tokens
  per step / save a verified checkpoint, write ``RUN/cost_summary.json`` and end with exit code 0.
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

import torch

from trainguard import tls
from trainguard.actions import COST_STOP, COST_THROTTLE, COST_WARN, ROLLBACK, SKIP_STEP
from trainguard.decide.decision import Decision
from trainguard.trainer.control import ACTIONS_BY_CODE
from trainguard.trainer.state import rng_state, set_rng_state

if TYPE_CHECKING:
    from trainguard.trainer.loop import Trainer

STOP = "stop"
EXIT_OK, EXIT_STOPPED = 0, 3


class Recovery:
    def __init__(self, trainer: "Trainer"):
        self.t = trainer
        self.stop_path = trainer.run_dir / "control" / "stopped.json"
        self.last_saved_step: int | None = None

    # ----------------------------------------------------------------------------------- state
    def capture_state(self) -> dict:
        t = self.t
        return {"model": t.model.state_dict(), "optim": t.optimizer.state_dict(),
                "sched": t.schedule.state_dict(), "data": t.train_data.state_dict(), "rng": rng_state(),
                "guard": t.guard.state_dict(),
                "trainer": {"step": t.step, "tokens_trained": t.tokens_trained, "best_val": t.best_val,
                            "micro_batch_size": t.micro_batch}}

    def _load_weights(self, state: dict) -> None:
        self.t.model.load_state_dict(state["model"])
        self.t.optimizer.load_state_dict(state["optim"])

    def resume(self) -> int | None:
        """Continue from the newest verified checkpoint, if any; returns its step."""
        t = self.t
        found = t.checkpoints.restore(stable_only=False, device=t.device)
        if found is None:
            return None
        _, state = found
        self._load_weights(state)
        t.schedule.load_state_dict(state["sched"])
        t.train_data.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        t.guard.load_state_dict(state["guard"])
        trainer = state["trainer"]
        t.step, t.tokens_trained = int(trainer["step"]), int(trainer["tokens_trained"])
        t.best_val, t.micro_batch = float(trainer["best_val"]), int(trainer["micro_batch_size"])
        self.last_saved_step = t.step
        t.telemetry.last_checkpoint = f"step_{t.step}"
        t.log.info("resumed", step=t.step, tokens_trained=t.tokens_trained)
        return t.step

    # ------------------------------------------------------------------------------ decisions
    def on_decision(self, decision: Decision) -> int | None:
        t = self.t
        t.trouble_since_checkpoint = True
        event = {k: v for k, v in decision.as_event().items() if k not in ("type", "step")}
        if decision.action == SKIP_STEP:
            t.telemetry.event(SKIP_STEP, step=t.step, **event)
            t.log.warning("step skipped by the guard", step=t.step, reason=decision.reason)
        elif decision.action == ROLLBACK:
            self.rollback(source="guard", **event)
        elif decision.action == STOP:
            return self.stop(decision, event)
        return None

    def stop(self, decision: Decision, event: dict) -> int:
        t = self.t
        t.telemetry.event(STOP, step=t.step, **event)
        message = (f"the guard stopped the run at step {t.step} ({decision.reason}: "
                   f"{json.dumps(decision.detail, default=str)}); nothing new was saved. Look at "
                   f"{t.run_dir / 'tls'}, fix the cause (data, LR, policy), then delete {self.stop_path} "
                   "to resume from the last verified checkpoint")
        if t.rank == 0:
            self.stop_path.parent.mkdir(parents=True, exist_ok=True)
            self.stop_path.write_text(json.dumps({"step": t.step, "reason": decision.reason,
                                                  "detail": decision.detail, "time": time.time(),
                                                  "message": message}, default=str))
        t.log.error(message)
        t.telemetry.event("run_end", step=t.step, reason="guard_stop")
        return EXIT_STOPPED

    def stopped_marker(self) -> dict | None:
        try:
            return json.loads(self.stop_path.read_text())
        except FileNotFoundError:
            return None

    def rollback(self, *, source: str, **fields: Any) -> None:
        """Restore the newest stable checkpoint on every rank, skip the data since, lower and re-warm the LR."""
        t, guard = self.t, self.t.policy.guard
        from_step, consumed = t.step, t.train_data.consumed
        found = t.checkpoints.restore(stable_only=True, device=t.device)
        if found is None:
            t.telemetry.event(ROLLBACK, step=from_step, source=source, restored_step=None,
                              error="no stable verified checkpoint to roll back to", **fields)
            t.log.error("rollback impossible: no stable verified checkpoint; carrying on", step=from_step)
            return
        checkpoint, state = found
        self._load_weights(state)
        scale = t.schedule.scale   # the LR cut accumulates over rollbacks; the checkpoint's is older
        t.schedule.load_state_dict(state["sched"])
        t.schedule.scale = scale
        t.schedule.after_rollback(guard.rollback_lr_factor, guard.rewarmup_steps)
        t.train_data.load_state_dict(state["data"])
        skipped = consumed - t.train_data.consumed
        t.train_data.consumed = consumed          # the data that led here is not read again
        trainer = state["trainer"]
        t.step, t.tokens_trained = int(trainer["step"]), int(trainer["tokens_trained"])
        t.best_val = float(trainer["best_val"])
        t.checkpoints.abandon_after(t.step)
        self.last_saved_step = t.step
        t.telemetry.last_checkpoint = f"step_{t.step}"
        t.trouble_since_checkpoint = False
        t.telemetry.event(ROLLBACK, step=from_step, source=source, restored_step=t.step,
                          checkpoint=str(checkpoint.path), steps_lost=from_step - t.step,
                          data_windows_skipped=skipped, tokens_skipped=skipped * t.cfg.model.block_size,
                          lr_scale=t.schedule.scale, rewarmup_steps=guard.rewarmup_steps, **fields)
        t.log.warning("rolled back", from_step=from_step, to_step=t.step, data_windows_skipped=skipped,
                      lr_scale=t.schedule.scale)

    # ------------------------------------------------------------------------------- requests
    def on_request(self, code: int, lineno: int) -> int | None:
        """Act on the control request every rank learned of this step (see trainer/control.py)."""
        t = self.t
        action = ACTIONS_BY_CODE[code]
        request = t.control.request_at(lineno)
        ids = {"id": str(request.get("id")), "alertname": request.get("alertname") or "",
               "reason": request.get("reason") or ""}
        t.control.ack(request, t.step)
        if action == ROLLBACK:
            t.telemetry.event("action", step=t.step, action=action, **ids)
            self.rollback(source="control", **ids)
        elif action == COST_WARN:
            t.eval_paused = True
            t.telemetry.event("action", step=t.step, action=action, evaluation="paused", **ids)
            t.log.warning("cost warning: evaluation paused", **ids)
        elif action == COST_THROTTLE:
            self.throttle(ids)
        elif action == COST_STOP:
            return self.cost_stop(ids)
        return None

    def throttle(self, ids: dict) -> None:
        """Cut the micro-batch by 25%; the batch per optimizer step (and so the tokens) stays the same,
        made up by more gradient accumulation."""
        t = self.t
        before = t.micro_batch
        t.micro_batch = max(1, (before * 3) // 4)
        if t.device.type == "cuda":
            torch.cuda.empty_cache()
        batch = t.cfg.optim.batch_size
        t.telemetry.event("action", step=t.step, action=COST_THROTTLE, micro_batch_before=before,
                          micro_batch_size=t.micro_batch, grad_accum_steps=-(-batch // t.micro_batch), **ids)
        t.log.warning("cost throttle: smaller micro-batch", micro_batch_before=before,
                      micro_batch_size=t.micro_batch, **ids)

    def cost_stop(self, ids: dict) -> int:
        """Save a verified checkpoint, write RUN/cost_summary.json, end cleanly (exit 0)."""
        t = self.t
        t.telemetry.event("action", step=t.step, action=COST_STOP, **ids)
        t.save_checkpoint()
        if t.rank == 0:
            verified = t.checkpoints.verified_step() == t.step   # the checkpoint the run ends on must verify
            summary = self.cost_summary(ids, verified)
            path = t.run_dir / "cost_summary.json"
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(summary, indent=2) + "\n")
            os.replace(tmp, path)
        t.telemetry.event("run_end", step=t.step, reason="cost_stop", alertname=ids["alertname"])
        t.log.warning("cost stop: checkpoint saved, run ended", step=t.step, **ids)
        return EXIT_OK

    def cost_summary(self, ids: dict, verified: bool) -> dict:
        t = self.t
        started = _first_timestamp(t.telemetry.path) or time.time()
        hours = (time.time() - started) / 3600
        # Billed as the cost meter bills: the policy's override (CPU runs), else the GPUs the run uses.
        gpus = t.policy.cost.gpu_count_override or t.telemetry.system["gpu_count"]
        price = t.policy.cost.price_per_gpu_hour
        return {"run_id": t.run_id, "step": t.step, "stopped_by": ids, "checkpoint": f"step_{t.step}",
                "checkpoint_verified": verified, "tokens_trained": t.tokens_trained,
                "world_size": t.world, "gpu_count": gpus, "wall_hours": hours, "gpu_hours": gpus * hours,
                "price_per_gpu_hour": price, "cost_usd": gpus * hours * price,
                "budget_per_1k_steps": t.policy.cost.budget_per_1k_steps,
                "cost_per_1k_steps": gpus * hours * price * 1000 / t.step if t.step else None}


def _first_timestamp(path) -> float | None:
    """When this run began, from the first record of its TLS file (the file outlives restarts)."""
    try:
        with open(path, "rb") as handle:
            return tls.decode(handle.readline())["timestamp"]
    except (OSError, tls.TLSError):
        return None
