"""The trainer's side of the training-dynamics machines (trainguard/decide/schedules.py, clipping.py,
layers.py): the LR of each update, the clip threshold, per-layer LR multipliers, and their TLS records.

`Dynamics` is the trainer's LR schedule (it extends `LRSchedule`, so rollback's LR cut and re-warm, and
the checkpoint's ``sched`` state, work as before) and adds, per step:

    threshold = dynamics.clip_threshold()              # before the step: a host float, no sync
    ...clip to it; param_norm() joins the step's one sync...
    verdict = protector.check(..., extra=dynamics.param_norm())   # the parameter norm rides the one sync
    decision = dynamics.respond(verdict.decision)      # a layer's rollback: cut its LR (in the event)
    dynamics.observe(verdict, validate=...)            # after the update, before a checkpoint is due
    protector.after_step(..., **dynamics.step_metrics(verdict))   # param_norm, clip_threshold, clip_coef
    dynamics.after_step(step, rolled_back=...)         # its lr_phase (and evaluation) events

What it keeps in the checkpoint (inside ``sched``): the machine's state (restored on rollback and
resume, as the cosine position always was), the clipper's history, and the layer multipliers, which a
rollback does *not* take back from the older checkpoint (like the LR cut, they accumulate), but a restart
does restore.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import torch

from trainguard import event_types
from trainguard.actions import ROLLBACK
from trainguard.decide import clipping
from trainguard.decide import schedules as machines
from trainguard.decide.decision import Decision
from trainguard.decide.layers import LayerResponse
from trainguard.decide.schedules import PhaseChange, StepSignals
from trainguard.policy import Policy
from trainguard.trainer.config import OptimConfig
from trainguard.trainer.step import LRSchedule, global_norm


def layer_group(layer: str) -> str:
    """The phase scheduler's layer groups: ``embed`` (embeddings, tied head), ``blocks``, ``ln_f``."""
    return "blocks" if layer.startswith("h.") else layer


def optimizer_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups per layer (so each can have its own LR multiplier), decay and no-decay apart as the
    model's own `optimizer_groups` splits them (matrices and embeddings decay; biases and gains do not)."""
    names, owners = model.layer_of_parameters()
    groups: dict[tuple[str, bool], list] = {}
    for param, owner in zip(model.parameters(), owners):
        if param.requires_grad:
            groups.setdefault((names[owner], param.dim() >= 2), []).append(param)
    return [{"params": params, "weight_decay": weight_decay if decay else 0.0, "layer": layer}
            for (layer, decay), params in groups.items()]


class Dynamics(LRSchedule):
    def __init__(self, optim: OptimConfig, total_steps: int, policy: Policy):
        super().__init__(optim, total_steps)
        dynamics = machines.preset(policy.dynamics, optim.schedule_preset)
        self.machine = machines.make(optim.schedule, dynamics, warmup_steps=optim.warmup_steps,
                                     min_lr=optim.min_lr)
        self.clipper = clipping.make(optim.clip_rule, dynamics.clipping, fixed=optim.grad_clip)
        self.layers = LayerResponse(dynamics.layers, reinit=optim.layer_reinit)
        self.emit: Callable[..., Any] = lambda *args, **kwargs: None
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.restored: PhaseChange | None = None     # a phase change a checkpoint load made, not yet written
        self.phase_before = self.machine.phase        # the phase before the step `observe` last saw
        self._observed: list[PhaseChange] = []        # its changes, written by `after_step`
        self._evaluation: dict | None = None
        self._multipliers_before_load: dict[str, float] = {}

    def bind(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, emit: Callable[..., Any]) -> None:
        """What it acts on: the model (layer re-init), the optimizer (group LRs), the event writer."""
        self.model, self.optimizer, self.emit = model, optimizer, emit
        self._params = [p for p in model.parameters()]

    # ------------------------------------------------------------------------------------ the LR
    def lr(self, scale: float = 1.0) -> float:
        """The next update's LR; `scale` is the rollbacks' cumulative cut (`TrainState.lr_scale`)."""
        shape = self.machine.lr()
        if shape is None:                   # cosine: the trainer's own schedule
            return super().lr(scale)
        since = self.updates + 1 - self.rewarm_from
        if self.rewarm and since <= self.rewarm:      # a rollback's re-warm, as LRSchedule applies it
            shape *= since / self.rewarm
        return shape * scale

    def apply_lr(self, lr: float) -> None:
        """Each group's LR: the step's LR x its layer's multiplier x its layer group's phase factor."""
        factors = self.machine.group_factors()
        for group in self.optimizer.param_groups:
            layer = group.get("layer")
            group["lr"] = lr if layer is None else (
                lr * self.layers.multiplier(layer) * factors.get(layer_group(layer), 1.0))

    # ------------------------------------------------------------------------------- clipping
    def clip_threshold(self) -> float:
        return self.clipper.threshold()

    def param_norm(self) -> torch.Tensor:
        """The global parameter norm before this step's update, on the device: it rides the step's sync."""
        return param_norm(self._params)

    def step_metrics(self, verdict) -> dict:
        """This step's TLS metrics: the parameter norm, what clipping did (learned from here, once a step)."""
        return {"param_norm": verdict.extra[0], **self.clipper.observe(verdict.grad_norm).metrics()}

    # --------------------------------------------------------------------------------- phases
    def start(self, step: int, resumed: bool) -> None:
        """The run's opening ``lr_phase`` event; a resumed run's says the phase it resumed in."""
        self.restored = None
        change = self.machine.start(step)
        _write(self.emit, PhaseChange(change.step, change.schedule, change.phase, None,
                                      "resume" if resumed else "start", change.learning_rate, change.detail))

    def observe(self, verdict, *, validate: Callable[[], float]) -> None:
        """Right after the optimizer step (or its skip), before the checkpoint of this step is due: feed an
        applied step to the machine, and take the validation loss it asks for. Written by `after_step`."""
        self.phase_before = self.machine.phase
        self._observed = []
        if verdict.skip:
            return
        signals = StepSignals(verdict.step, verdict.loss, verdict.grad_norm, verdict.extra[0])
        self._observed = self.machine.observe(signals)
        if self.machine.waiting:
            began = time.perf_counter()
            val = validate()
            self._evaluation = {"val_loss": val, "purpose": event_types.LR_PHASE, "wanted": self.machine.waiting,
                                "seconds": time.perf_counter() - began}
            self._observed += self.machine.evaluated(signals.step, val)

    def after_step(self, step: int, *, rolled_back: bool) -> None:
        """After the step's decision and request were carried out: its events. A step that was rolled back
        (the guard's decision, or a request) is abandoned with its changes; the checkpoint's phase counts."""
        changes, self._observed = self._observed, []
        evaluation, self._evaluation = self._evaluation, None
        if evaluation is not None:
            self.emit(event_types.EVALUATION, step=step, **evaluation)
        if rolled_back:
            changes = []
            restored, self.restored = self.restored, None
            if restored is not None and restored.phase != self.phase_before:
                changes.append(dataclasses.replace(restored, step=step, previous=self.phase_before))
            if self.pending_reinit is not None and (layer := self.reinit_layer()) is not None:
                self.emit(event_types.LAYER_REINIT, step=step, layer=layer)
        for change in changes:
            _write(self.emit, change)

    # ------------------------------------------------------------------------- layer response
    def respond(self, decision: Decision) -> Decision:
        """A rollback one layer's norm caused: that layer's LR multiplier is cut, and the decision (so the
        rollback event) says so."""
        cut = self.layers.on_decision(decision)
        if cut is None:
            return decision
        self.pending_reinit = cut.layer if cut.reinit else None
        return Decision(decision.action, decision.reason, decision.step, decision.timestamp,
                        {**decision.detail, **cut.detail()})

    pending_reinit: str | None = None

    def rewarm_now(self, rewarm: int) -> None:
        """A rollback (the trainer's `scale_lr` callback), after the checkpoint's states were loaded."""
        super().rewarm_now(rewarm)
        self.layers.multipliers = self._multipliers_before_load     # they accumulate, as the LR cut does

    def reinit_layer(self) -> str | None:
        """Opt-in (optim.layer_reinit): the cut layer's parameters initialised again, their Adam moments
        dropped. Only a transformer block can be (the embeddings are tied to the head)."""
        model, layer, self.pending_reinit = self.model, self.pending_reinit, None
        if layer is None or not layer.startswith("h."):
            return None
        block = model.transformer.h[int(layer.split(".")[1])]
        with torch.no_grad():
            block.apply(model._init_weights)
            for name, param in block.named_parameters():
                if name.endswith("c_proj.weight"):
                    torch.nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * model.config.n_layer))
                if name.startswith("ln") and name.endswith("weight"):
                    torch.nn.init.ones_(param)
                elif name.startswith("ln") and name.endswith("bias"):
                    torch.nn.init.zeros_(param)
        for param in block.parameters():
            self.optimizer.state.pop(param, None)
        return layer

    # ---------------------------------------------------------------------------- persistence
    def state_dict(self) -> dict:
        return {**super().state_dict(), "machine": self.machine.state_dict(),
                "clipper": self.clipper.state_dict(), "layers": self.layers.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "machine" in state:
            self.restored = self.machine.restore(state["machine"], step=-1, reason=ROLLBACK)
            self.clipper.load_state_dict(state["clipper"])
            self._multipliers_before_load = dict(self.layers.multipliers)
            self.layers.load_state_dict(state["layers"])


def _write(emit: Callable[..., Any], change: PhaseChange) -> None:
    emit(event_types.LR_PHASE, step=change.step, **change.as_event())


def param_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of the parameters, on the device (joins the step's one sync); whole under FSDP2."""
    return global_norm([p.detach() for p in params])
