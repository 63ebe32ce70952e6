"""The learning-rate schedules as state machines: each applied step's statistics in, phase changes out.

    schedule = make("breathing", policy.dynamics, warmup_steps=10, min_lr=1e-4)
    start = schedule.start(step=0)             # the run's first `lr_phase` event (it carries the params)
    lr = schedule.lr()                         # the LR of the next update (None: the trainer's cosine)
    changes = schedule.observe(StepSignals(step, loss, grad_norm, param_norm))   # after an applied update
    if schedule.waiting:                       # "pause_start" | "pause_end": validation loss wanted now
        changes += schedule.evaluated(step, val_loss)

Every change is a `PhaseChange`, written by the trainer as a TLS ``lr_phase`` event, and `replay` runs the
same machines over the recorded steps (trainguard/replay/dynamics.py) to check it gets the same events.
Skipped steps are not observed (no update was applied); a rollback restores the machine's state from the
checkpoint (`restore`). Pure: no torch, files or clocks.

- ``cosine``: warmup -> decay; the LR itself is the trainer's own warm-up + cosine (trainer/step.py).
- ``breathing`` (seed 000 section 3.2): warmup -> inhale (hold the peak for ``inhale_steps``) -> exhale (LR x
  ``exhale_factor`` per step, never under min_lr, watching grad_norm / param_norm) -> pause when that ratio
  stays under ``pause_ratio`` for ``pause_window`` consecutive exhale steps: the LR is frozen for
  ``freeze_steps`` with a validation loss at both ends; if it fell on its own, restart (LR x
  ``restart_factor``, never above the peak) and inhale again, otherwise exhale on.
- ``phase`` (seed 004 section 4.1): warmup -> exploration (peak LR) while gradients are not yet stable ->
  development (LR decays slowly) while they are stable and the loss falls -> refinement (the LR at the
  plateau x ``refinement_factor``, the embedding group lower still) once a loss plateau is measured.
  Development goes back to exploration when gradients turn unstable. Each phase lasts at least
  ``min_phase_steps``. Stability and plateau are trends.py's statistics.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from trainguard.config import FRACTION, SHARE, WINDOW, above, at_least, key
from trainguard.decide.clipping import ClippingPolicy
from trainguard.decide.layers import LayerResponsePolicy
from trainguard.decide.trends import GradientStability, LossPlateau, PlateauPolicy, StabilityPolicy, grad_param_ratio

@dataclass(frozen=True)
class BreathingPolicy:
    """Seed 000 section 3.2: inhale (hold the peak), exhale (decay per step), pause (freeze, evaluate)."""

    peak_lr: float = key(0.0015, above(0, 10), "the LR held while inhaling")
    inhale_steps: int = key(10_000, at_least(0, 10**9), "steps the peak is held")
    exhale_factor: float = key(0.9995, SHARE, "LR multiplied by this per applied step while exhaling")
    pause_ratio: float = key(0.003, above(0), "grad_norm / param_norm under this ...")
    pause_window: int = key(500, WINDOW, "... for this many consecutive exhale steps: pause")
    freeze_steps: int = key(2000, at_least(1, 10**9), "LR held this long, validation loss before and after")
    restart_factor: float = key(1.2, at_least(1, 100), "val loss fell on its own during the freeze: LR x this, inhale")
    min_improvement: float = key(0.0, FRACTION, "relative val-loss fall that counts as \"fell\"")


@dataclass(frozen=True)
class PhasePolicy:
    """Seed 004 section 4.1: warmup, exploration, development, refinement (thresholds: stability, plateau)."""

    peak_lr: float = key(0.0015, above(0, 10), "the exploration LR is peak x exploration_factor")
    exploration_factor: float = key(1.0, above(0, 100), "exploration LR = peak x this")
    development_decay: float = key(0.9998, SHARE, "development: LR x this per applied step ...")
    development_floor: float = key(0.3, FRACTION, "... down to peak x this")
    refinement_factor: float = key(0.3, SHARE, "refinement LR = the LR at the plateau x this ...")
    refinement_embed_factor: float = key(0.5, SHARE, "... and the embedding group's x this again (blocks, ln_f x 1)")
    min_phase_steps: int = key(500, at_least(0, 10**9), "applied steps a phase lasts at least before it may change")


@dataclass(frozen=True)
class DynamicsPolicy:
    """Training dynamics (docs/dynamics.md): the LR schedules' statistics and phases, adaptive clipping, the
    layer response. The defaults are the seeds' numbers, meant for long runs; `trainguard train
    --schedule-preset cpu` scales the spans down (`CPU_PRESET`)."""

    stability: StabilityPolicy = field(default_factory=StabilityPolicy)
    plateau: PlateauPolicy = field(default_factory=PlateauPolicy)
    breathing: BreathingPolicy = field(default_factory=BreathingPolicy)
    phase: PhasePolicy = field(default_factory=PhasePolicy)
    clipping: ClippingPolicy = field(default_factory=ClippingPolicy)
    layers: LayerResponsePolicy = field(default_factory=LayerResponsePolicy)


SCHEDULES = ("cosine", "breathing", "phase")
PRESETS = ("seed", "cpu")

# The seeds' numbers are for runs of 100k+ steps; the `cpu` preset shrinks the spans so every phase shows
# in a CPU run of a few thousand steps of the tiny model (its grad_norm / param_norm sits near 0.02-0.06,
# measured on the default corpus, where a large model's sits near the seed's 0.003).
CPU_PRESET: dict[str, dict[str, Any]] = {
    "stability": {"window": 50},
    "plateau": {"window": 200},
    "breathing": {"inhale_steps": 200, "exhale_factor": 0.995, "pause_ratio": 0.05, "pause_window": 20,
                  "freeze_steps": 60},
    "phase": {"development_decay": 0.997, "min_phase_steps": 60},
}


def preset(policy: DynamicsPolicy, name: str) -> DynamicsPolicy:
    """`policy` as it is (``seed``), or with the `cpu` preset's spans and thresholds in place."""
    if name == "seed":
        return policy
    if name != "cpu":
        raise ValueError(f"unknown schedule preset {name!r} (known: {', '.join(PRESETS)})")
    return dataclasses.replace(policy, **{
        section: dataclasses.replace(getattr(policy, section), **values) for section, values in CPU_PRESET.items()})


class StepSignals(NamedTuple):
    step: int
    loss: float
    grad_norm: float
    param_norm: float


@dataclass(frozen=True)
class PhaseChange:
    """A schedule entering a phase at a step: the `lr_phase` event the trainer writes."""

    step: int
    schedule: str
    phase: str
    previous: str | None
    reason: str
    learning_rate: float | None
    detail: dict[str, Any] = field(default_factory=dict)

    def as_event(self) -> dict[str, Any]:
        """The TLS ``lr_phase`` event (without `step`, which the writer adds)."""
        return {"phase": self.phase, "schedule": self.schedule, "from": self.previous, "reason": self.reason,
                "learning_rate": self.learning_rate, **self.detail}


class _Schedule:
    """What every schedule shares: the phase, the update counters, the wait for a validation loss."""

    name = ""

    def __init__(self, warmup_steps: int, min_lr: float):
        self.warmup, self.min_lr = warmup_steps, min_lr
        self.phase = "warmup" if warmup_steps > 0 else self.after_warmup
        self.updates = 0            # applied updates observed
        self.phase_updates = 0      # ... since the current phase began
        self.waiting: str | None = None   # a validation loss is wanted: "pause_start" | "pause_end"

    after_warmup = ""

    def params(self) -> dict[str, Any]:
        return {"warmup_steps": self.warmup, "min_lr": self.min_lr}

    def start(self, step: int) -> PhaseChange:
        """The run's opening event: its phase and every parameter `replay` needs to rebuild the machine."""
        return PhaseChange(step, self.name, self.phase, None, "start", self.lr(), {"params": self.params()})

    def lr(self) -> float | None:
        raise NotImplementedError

    def observe(self, signals: StepSignals) -> list[PhaseChange]:
        self.updates += 1
        self.phase_updates += 1
        return self._advance(signals)

    def _advance(self, signals: StepSignals) -> list[PhaseChange]:
        raise NotImplementedError

    def evaluated(self, step: int, val_loss: float) -> list[PhaseChange]:
        self.waiting = None
        return []

    def group_factors(self) -> dict[str, float]:
        """LR factors by layer group (``embed``, ``blocks``, ``ln_f``) on top of the LR; none by default."""
        return {}

    def _warmup_lr(self, peak: float) -> float:
        return peak * (self.updates + 1) / self.warmup

    def _enter(self, step: int, phase: str, reason: str, **detail: Any) -> PhaseChange:
        previous, self.phase, self.phase_updates = self.phase, phase, 0
        return PhaseChange(step, self.name, phase, previous, reason, self.lr(), detail)

    # ------------------------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "updates": self.updates, "phase_updates": self.phase_updates,
                "waiting": self.waiting}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.phase, self.updates = str(state["phase"]), int(state["updates"])
        self.phase_updates, self.waiting = int(state["phase_updates"]), state.get("waiting")

    def restore(self, state: dict[str, Any], step: int, reason: str) -> PhaseChange | None:
        """Load a checkpoint's state (rollback, resume); the change of phase that makes, if any."""
        before = self.phase
        self.load_state_dict(state)
        if self.phase == before:
            return None
        return PhaseChange(step, self.name, self.phase, before, reason, self.lr(), {})


class Cosine(_Schedule):
    name, after_warmup = "cosine", "decay"

    def lr(self) -> float | None:
        return None          # the trainer's warm-up + cosine (trainer/step.py LRSchedule)

    def _advance(self, signals: StepSignals) -> list[PhaseChange]:
        if self.phase == "warmup" and self.updates >= self.warmup:
            return [self._enter(signals.step, "decay", "warmup_done")]
        return []


class Breathing(_Schedule):
    name, after_warmup = "breathing", "inhale"

    def __init__(self, policy: BreathingPolicy, warmup_steps: int, min_lr: float):
        self.policy = policy
        super().__init__(warmup_steps, min_lr)
        self.level = policy.peak_lr     # the LR outside warm-up
        self.calm = 0                   # consecutive exhale steps with grad_norm / param_norm under the bar
        self.val_before: float | None = None

    def params(self) -> dict[str, Any]:
        return {**super().params(), "breathing": dataclasses.asdict(self.policy)}

    def lr(self) -> float:
        return self._warmup_lr(self.policy.peak_lr) if self.phase == "warmup" else self.level

    def _advance(self, s: StepSignals) -> list[PhaseChange]:
        p, phase = self.policy, self.phase
        if phase == "warmup" and self.updates >= self.warmup:
            return [self._enter(s.step, "inhale", "warmup_done")]
        if phase == "inhale" and self.phase_updates >= p.inhale_steps:
            return [self._enter(s.step, "exhale", "inhale_done", inhale_steps=p.inhale_steps)]
        if phase == "exhale":
            self.level = max(self.min_lr, self.level * p.exhale_factor)
            ratio = grad_param_ratio(s.grad_norm, s.param_norm)
            self.calm = self.calm + 1 if ratio < p.pause_ratio else 0
            if self.calm >= p.pause_window:
                self.calm, self.waiting = 0, "pause_start"
                return [self._enter(s.step, "pause", "gradients_calm", grad_param_ratio=ratio,
                                    pause_ratio=p.pause_ratio, pause_window=p.pause_window)]
        if phase == "pause" and self.phase_updates >= p.freeze_steps and self.waiting is None:
            self.waiting = "pause_end"
        return []

    def evaluated(self, step: int, val_loss: float) -> list[PhaseChange]:
        waiting, self.waiting = self.waiting, None
        if waiting == "pause_start":
            self.val_before = val_loss
            return []
        if waiting != "pause_end":
            return []
        before, p = self.val_before, self.policy
        fell = (before is not None and math.isfinite(before) and math.isfinite(val_loss)
                and (before - val_loss) / abs(before or 1.0) > p.min_improvement)
        detail = {"val_loss_before": before, "val_loss_after": val_loss}
        if fell:
            self.level = min(p.peak_lr, self.level * p.restart_factor)
            return [self._enter(step, "inhale", "val_loss_fell", restart_factor=p.restart_factor, **detail)]
        return [self._enter(step, "exhale", "val_loss_held", **detail)]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "level": self.level, "calm": self.calm, "val_before": self.val_before}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.level, self.calm = float(state["level"]), int(state["calm"])
        self.val_before = state.get("val_before")


class Phases(_Schedule):
    name, after_warmup = "phase", "exploration"

    def __init__(self, policy: PhasePolicy, stability: StabilityPolicy, plateau: PlateauPolicy,
                 warmup_steps: int, min_lr: float):
        self.policy = policy
        super().__init__(warmup_steps, min_lr)
        self.stability, self.plateau = GradientStability(stability), LossPlateau(plateau)
        self.level = policy.peak_lr * policy.exploration_factor

    def params(self) -> dict[str, Any]:
        return {**super().params(), "phase": dataclasses.asdict(self.policy),
                "stability": dataclasses.asdict(self.stability.policy),
                "plateau": dataclasses.asdict(self.plateau.policy)}

    def lr(self) -> float:
        return self._warmup_lr(self.policy.peak_lr) if self.phase == "warmup" else self.level

    def group_factors(self) -> dict[str, float]:
        return {"embed": self.policy.refinement_embed_factor} if self.phase == "refinement" else {}

    def _advance(self, s: StepSignals) -> list[PhaseChange]:
        p = self.policy
        self.stability.push(s.grad_norm)
        self.plateau.push(s.loss)
        if self.phase == "warmup":
            if self.updates >= self.warmup:
                return [self._enter(s.step, "exploration", "warmup_done")]
            return []
        if self.phase == "development":
            self.level = max(p.peak_lr * p.development_floor, self.min_lr, self.level * p.development_decay)
        if self.phase == "refinement" or self.phase_updates < p.min_phase_steps:
            return []
        evidence = {"grad_norm_cv": self.stability.cv(), "loss_improvement": self.plateau.improvement()}
        if self.phase == "exploration" and self.stability.stable():
            if self.plateau.plateau():
                return [self._refine(s.step, evidence)]
            self.level = p.peak_lr * p.exploration_factor
            return [self._enter(s.step, "development", "gradients_stable", **evidence)]
        if self.phase == "development":
            if self.stability.unstable():
                self.level = p.peak_lr * p.exploration_factor
                return [self._enter(s.step, "exploration", "gradients_unstable", **evidence)]
            if self.plateau.plateau():
                return [self._refine(s.step, evidence)]
        return []

    def _refine(self, step: int, evidence: dict[str, Any]) -> PhaseChange:
        self.level *= self.policy.refinement_factor
        return self._enter(step, "refinement", "loss_plateau", **evidence,
                           embed_factor=self.policy.refinement_embed_factor)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "level": self.level, "stability": self.stability.state_dict(),
                "plateau": self.plateau.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.level = float(state["level"])
        self.stability.load_state_dict(state["stability"])
        self.plateau.load_state_dict(state["plateau"])


def make(name: str, policy: DynamicsPolicy, *, warmup_steps: int, min_lr: float) -> _Schedule:
    if name == "cosine":
        return Cosine(warmup_steps, min_lr)
    if name == "breathing":
        return Breathing(policy.breathing, warmup_steps, min_lr)
    if name == "phase":
        return Phases(policy.phase, policy.stability, policy.plateau, warmup_steps, min_lr)
    raise ValueError(f"unknown schedule {name!r} (known: {', '.join(SCHEDULES)})")


def from_event(event: dict[str, Any]) -> _Schedule:
    """The machine a run's opening ``lr_phase`` event describes (its `schedule` and `params`)."""
    params = dict(event.get("params") or {})
    warmup, min_lr = int(params.pop("warmup_steps", 0)), float(params.pop("min_lr", 0.0))
    sections: dict[str, Any] = {name: cls(**params[name]) for name, cls in (
        ("breathing", BreathingPolicy), ("phase", PhasePolicy), ("stability", StabilityPolicy),
        ("plateau", PlateauPolicy)) if name in params}
    policy = dataclasses.replace(DynamicsPolicy(), **sections)
    return make(str(event.get("schedule")), policy, warmup_steps=warmup, min_lr=min_lr)

