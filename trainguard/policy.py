"""The policy file: every threshold trainguard acts on, in one place.

The guard, the cost meter, the generated Prometheus rules and replay all read these dataclasses, so a
threshold changed here changes every path that enforces it. The YAML file overrides any subset of the
defaults; an unknown key, a value of the wrong type or out of its range is an error naming the file and
the key (`PolicyError`), checked once at load, so no value can crash or silently disable a guard later.

Adding a key: a field with its default in its section's dataclass, and ONE row in `RULES` below
(``"section.key": at_least(1)``, ``between(0, 1)``, ``DURATION`` ...). Every numeric or duration field
must have a row (tests/property/test_policy_properties.py fails naming a field without one); a rule that
spans keys (warn <= throttle <= stop) goes in `CROSS_CHECKS`.

    cost:
      price_per_gpu_hour: 2.0        # USD
      budget_per_1k_steps: 120       # USD per 1000 steps
      tiers: {warn: 0.30, throttle: 0.60, stop: 1.00}   # overrun over budget
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from trainguard import actions as actions_mod, paths, safe_read
from trainguard.exits import BadInput


class PolicyError(BadInput):
    pass


@dataclass(frozen=True)
class CostTiers:
    """Cost tiers: the overrun of cost per 1000 steps over the budget at which each cost action is taken."""

    warn: float = 0.30
    throttle: float = 0.60
    stop: float = 1.00


@dataclass(frozen=True)
class CostPolicy:
    """The cost meter: price, budget and the window it judges the spend over (trainguard/decide/cost.py)."""

    price_per_gpu_hour: float = 2.0
    budget_per_1k_steps: float = 120.0
    tiers: CostTiers = field(default_factory=CostTiers)
    # Cost per 1000 steps is judged over this many recent steps, so start-up does not trip a tier.
    window_steps: int = 50
    # Steps needed before any tier may act.
    min_steps: int = 20
    # Billable devices when not 0; else the GPU count from the records. CPU-only runs (demo, tests)
    # report no GPUs and are billed as this many devices.
    gpu_count_override: int = 0


@dataclass(frozen=True)
class GuardPolicy:
    """The gradient-health guard's thresholds and its escalation (trainguard/decide/guard.py)."""

    # Loss spike, as OLMo-core's stability monitor: above mean + sigma * std of the last `window`
    # losses, once `min_steps` have been seen.
    spike_sigma: float = 6.0
    spike_window: int = 128
    spike_min_steps: int = 64
    # Gradient explosion: global (and per-layer) norm above `factor` times its EMA.
    grad_ema_beta: float = 0.98
    grad_explode_factor: float = 10.0
    layer_explode_factor: float = 25.0
    grad_min_steps: int = 20
    # Bad steps (skipped) this many times within `rollback_window` steps trigger a rollback.
    rollback_after: int = 3
    rollback_window: int = 50
    max_rollbacks_per_hour: int = 3
    rollback_lr_factor: float = 0.5
    rewarmup_steps: int = 20
    # Gradient climb: the global norm above mean + sigma * std of the last `window` healthy norms (once
    # `min_steps` are seen) for `steps` steps in a row, against norms at least `lag` steps old.
    grad_climb_sigma: float = 6.0
    grad_climb_window: int = 128
    grad_climb_min_steps: int = 64
    grad_climb_steps: int = 6
    grad_climb_lag: int = 32
    # fp16/bf16 loss-scaler overflow: a non-finite gradient norm beside a finite loss is the scaler's to
    # handle. It is skipped, and counts toward a rollback only from the `overflow_burst`-th in a row (the
    # scale cut 2**8 times without a finite step: the scaler is not settling).
    overflow_burst: int = 8
    # A level shift (a planned data-mix change, an annealing phase): a loss above the spike band (but under
    # `shift_loss_factor` times its mean) while the gradient norm stays under `shift_grad_factor` times its
    # EMA is skipped without counting toward a rollback; after `shift_steps` such steps in a row the loss
    # band starts again from the new level.
    shift_steps: int = 8
    shift_grad_factor: float = 2.0
    shift_loss_factor: float = 2.0      # a new level is at most this many times the band's mean loss
    # Warm-up: before the spike band has `spike_min_steps` losses, a loss above `warmup_spike_factor` times
    # the highest healthy loss so far is a spike (one real run jumps x3.6 at iteration 3).
    warmup_spike_factor: float = 1.8
    # Slow divergence: the mean loss of the last `drift_chunk` healthy steps more than `drift_loss_ratio`
    # above the least such mean of the `drift_chunks` chunks before (once `drift_min_chunks` are held),
    # while the mean gradient norm is `drift_grad_ratio` above its own least, and the rise is more than
    # `drift_steadiness` times the largest move between two chunk means in that span: a rollback at once.
    drift_chunk: int = 32
    drift_chunks: int = 16
    drift_min_chunks: int = 4
    drift_loss_ratio: float = 0.10
    drift_grad_ratio: float = 0.25
    drift_steadiness: float = 2.0
    # Silent data corruption (trainguard/decide/replica.py): every replica fingerprints its weights and
    # gradients every this many steps (0: never); bench/bench_sdc.py measures the cost of a check.
    replica_check_every: int = 50
    # A node named in a replica mismatch twice within this many seconds is cordoned.
    replica_cordon_window_seconds: float = 86400.0


@dataclass(frozen=True)
class AlertPolicy:
    """Thresholds of the Prometheus rules (alerts/ is generated from these)."""

    stall_seconds: float = 60.0
    # The agent's stall watchdog: ranks that started this long ago and have not written a TLS record since
    # (hung in imports, rendezvous or resume) are stalled too. Start-up takes minutes on big models.
    startup_grace_seconds: float = 900.0
    gpu_temp_c: float = 85.0
    disk_await_ms: float = 10.0
    data_wait_ratio: float = 0.20
    data_utilization_min: float = 0.92
    comm_overhead_max: float = 0.15
    fragmentation_min: float = 0.70
    checkpoint_stale_seconds: float = 3600.0
    low_throughput_ratio: float = 0.5
    slow_node_factor: float = 1.5   # the global tier's JobNodeSlow: a node's step time over this x the job's median
    loss_spike_sigma: float = 6.0
    grad_explode_factor: float = 10.0
    for_short: str = "30s"
    for_long: str = "2m"
    # The webhook's ledger (trainguard/decide/ledger.py): a second rollback or restore within the cooldown
    # joins the first (one incident, several alerts); restores beyond the hourly limit page a human.
    action_cooldown_seconds: float = 120.0
    max_restores_per_hour: int = 3


@dataclass(frozen=True)
class DiagnosePolicy:
    """Thresholds `trainguard diagnose` needs beyond the alert thresholds (which it reads from `alerts`)."""

    warmup_steps: int = 5               # first steps of each rank left out of timing statistics (compile, caches)
    min_steps: int = 10                 # steps after warm-up a timing check needs
    straggler_score_min: float = 0.75   # NVRx relative score (fastest rank's median / this rank's); below = straggler
    slow_step_factor: float = 1.5       # a step slower than this times the median compute time is a slow step
    jitter_max: float = 0.10            # share of compute time lost to slow steps that counts as a problem
    clock_ratio_min: float = 0.85       # SM clock under this share of its max while busy = throttled
    link_ratio_min: float = 0.5         # PCIe/NVLink link running under this share of its capability
    leak_min_bytes: float = 512.0 * 2**20  # device memory growth, not matched by the allocator's, that counts
    plateau_window_steps: int = 100     # loss compared across the two halves of the last window
    plateau_min_improvement: float = 0.01   # relative loss improvement across the window
    grad_trend_max_ratio: float = 3.0   # grad-norm median of the last quarter over the second quarter


@dataclass(frozen=True)
class PreflightPolicy:
    """What `trainguard preflight` accepts on a node before a long run."""

    idle_temp_c_max: float = 60.0          # a GPU hotter than this while idle has a cooling problem
    idle_clock_ratio_min: float = 0.5      # max SM clock allowed now over the device's max (clock locks, power caps)
    checkpoints_of_headroom: float = 4.0   # free space for this many checkpoints (keep_last 3 + one in flight)
    checkpoint_write_seconds_max: float = 300.0   # a checkpoint must write within this at the measured speed
    write_probe_bytes: int = 64 * 2**20    # bytes written (and fsynced) to measure the write speed
    collective_timeout_seconds: float = 60.0
    nccl_ib_timeout_min: int = 14          # NCCL_IB_TIMEOUT is 4.096 us * 2^N per retry: under 14 retries
    nccl_ib_timeout_max: int = 24          # too eagerly, over 24 a dead peer takes minutes to notice
    heartbeat_timeout_seconds_max: float = 1800.0   # TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC upper bound


# ------------------------------------------------------------------------------- training dynamics
# The LR schedules, adaptive clipping and the layer-targeted rollback response (trainguard/decide/
# schedules.py, clipping.py, layers.py; docs/dynamics.md). The defaults are the seeds' numbers, meant for
# long runs; `trainguard train --schedule-preset cpu` scales the spans down (decide/schedules.py).

@dataclass(frozen=True)
class StabilityPolicy:
    """Gradient stability: the coefficient of variation (std / mean) of the global gradient norm over the
    last `window` applied steps. At or under `cv_max` the gradients are stable; over `cv_max *
    unstable_margin` they are unstable again (the margin keeps a phase from flapping at the border)."""

    window: int = 200
    cv_max: float = 0.25
    unstable_margin: float = 1.5


@dataclass(frozen=True)
class PlateauPolicy:
    """Loss plateau: the median training loss of the second half of the last `window` applied steps
    improves on the first half's by less than `min_improvement` (relative), as `trainguard diagnose`
    judges a plateau."""

    window: int = 1000
    min_improvement: float = 0.01


@dataclass(frozen=True)
class BreathingPolicy:
    """Seed 000 section 3.2: inhale (hold the peak), exhale (decay per step), pause (freeze, evaluate)."""

    peak_lr: float = 0.0015
    inhale_steps: int = 10_000
    exhale_factor: float = 0.9995        # LR multiplied by this per applied step while exhaling
    pause_ratio: float = 0.003           # grad_norm / param_norm under this ...
    pause_window: int = 500              # ... for this many consecutive exhale steps: pause
    freeze_steps: int = 2000             # LR held this long, validation loss before and after
    restart_factor: float = 1.2          # val loss fell on its own during the freeze: LR x this, inhale
    min_improvement: float = 0.0         # relative val-loss fall that counts as "fell"


@dataclass(frozen=True)
class PhasePolicy:
    """Seed 004 section 4.1: warmup, exploration, development, refinement (thresholds: stability, plateau)."""

    peak_lr: float = 0.0015
    exploration_factor: float = 1.0      # exploration LR = peak x this
    development_decay: float = 0.9998    # development: LR x this per applied step ...
    development_floor: float = 0.3       # ... down to peak x this
    refinement_factor: float = 0.3       # refinement LR = the LR at the plateau x this ...
    refinement_embed_factor: float = 0.5  # ... and the embedding group's x this again (blocks, ln_f x 1)
    min_phase_steps: int = 500           # applied steps a phase lasts at least before it may change


@dataclass(frozen=True)
class ClippingPolicy:
    """Adaptive clipping (optim.clip_rule): `zscore` clips at the EMA mean + z_thresh x EMA std of the
    gradient norm (ZClip, arXiv 2504.02507), `percentile` at that percentile of the last `history` norms
    (AutoClip, arXiv 2007.14469). Before `warmup_steps` norms have been seen, optim.grad_clip applies."""

    warmup_steps: int = 25
    ema_alpha: float = 0.97
    z_thresh: float = 2.5
    percentile: float = 10.0
    history: int = 1000
    max_norm: float = 0.0                # a fixed ceiling on top of the adaptive threshold; 0 = none


@dataclass(frozen=True)
class LayerResponsePolicy:
    """A rollback caused by one layer's gradient norm lowers that layer's LR multiplier."""

    lr_factor: float = 0.5
    min_multiplier: float = 0.05


@dataclass(frozen=True)
class DynamicsPolicy:
    """Training dynamics: the LR schedules' statistics and phases, adaptive clipping, the layer response."""

    stability: StabilityPolicy = field(default_factory=StabilityPolicy)
    plateau: PlateauPolicy = field(default_factory=PlateauPolicy)
    breathing: BreathingPolicy = field(default_factory=BreathingPolicy)
    phase: PhasePolicy = field(default_factory=PhasePolicy)
    clipping: ClippingPolicy = field(default_factory=ClippingPolicy)
    layers: LayerResponsePolicy = field(default_factory=LayerResponsePolicy)


@dataclass(frozen=True)
class RestorePolicy:
    """What a restore may do beyond ending the ranks (docs/incidents.md, docs/runbooks.md#trainingstraggler)."""

    # Keep a hang's culprit node out of the job (cordon, end its launcher, re-form on the others):
    # "auto" does it when the job is elastic (--nnodes MIN:MAX with MIN < MAX), "on" always, "off" never.
    evict: str = "auto"
    max_evictions_per_hour: int = 2
    # How long an agent waits for the ranks' Flight Recorder dumps and the other nodes' evidence.
    evidence_seconds: float = 15.0
    # Evicting the node of a rank TrainingStraggler names for long (a fail-slow node) is not built yet:
    # "off" (only alert) is the one value accepted, so "on" is refused at load rather than ignored.
    evict_stragglers: str = "off"


@dataclass(frozen=True)
class ActionsPolicy:
    """How decisions reach the run (docs/trainer.md#shadow-mode): "act" carries them out; "shadow" decides and
    records each one as a `shadow_action` event with its evidence, and carries out none (no skipped step,
    no rollback, restore, stop, cordon or ended process), for the trainer, the callbacks and the agent."""

    mode: str = actions_mod.ACT_MODE


@dataclass(frozen=True)
class RecoveryPolicy:
    """How a rank's failure is recovered (docs/recovery.md). "in_process": the surviving processes tear down
    their process group, meet in the job's store, re-form it and restore the newest verified in-memory
    snapshot, without a new interpreter; what cannot be recovered so (a killed process, a barrier not met in
    time) goes the "restart" way: torchrun restarts every worker from the newest verified state."""

    mode: str = "in_process"
    # An in-memory snapshot (host memory, /dev/shm) of every state every this many steps; 0: none (then an
    # in-process restart restores the last durable checkpoint). The snapshot's blocking time is each
    # `snapshot_saved` event's `blocking_seconds`.
    snapshot_every: int = 5
    snapshot_keep: int = 2                   # snapshots kept per rank (the newest); older ones are deleted
    snapshot_max_bytes: int = 8 * 2**30      # a rank's snapshot larger than this is not taken (event says so)
    # Where snapshots live: a tmpfs that outlives the process; a directory of this user's under it per run.
    snapshot_dir: str = "/dev/shm"
    # How long the surviving ranks wait in the store for every rank to arrive; then they exit and the
    # launcher restarts every worker (the "restart" way).
    barrier_seconds: float = 60.0
    max_in_process_restarts: int = 3         # per worker process; past it, the failure goes the "restart" way


RECOVERY_MODES = ("in_process", "restart")
EVICT_CHOICES = ("auto", "on", "off")
EVICT_STRAGGLERS_CHOICES = ("off",)


@dataclass(frozen=True)
class Policy:
    """Every threshold, by section; `load` reads a YAML file over these defaults."""

    cost: CostPolicy = field(default_factory=CostPolicy)
    guard: GuardPolicy = field(default_factory=GuardPolicy)
    alerts: AlertPolicy = field(default_factory=AlertPolicy)
    diagnose: DiagnosePolicy = field(default_factory=DiagnosePolicy)
    preflight: PreflightPolicy = field(default_factory=PreflightPolicy)
    restore: RestorePolicy = field(default_factory=RestorePolicy)
    dynamics: DynamicsPolicy = field(default_factory=DynamicsPolicy)
    actions: ActionsPolicy = field(default_factory=ActionsPolicy)
    recovery: RecoveryPolicy = field(default_factory=RecoveryPolicy)

    @property
    def shadow(self) -> bool:
        """Every action decided and recorded, none carried out (`actions.mode: shadow`)."""
        return self.actions.mode == actions_mod.SHADOW_MODE

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------ validation

@dataclass(frozen=True)
class Range:
    """A closed or open interval a number must lie in (always finite: NaN and infinities never pass)."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def problem(self, value: float) -> str | None:
        if not math.isfinite(value):
            return "must be a finite number"
        below = value <= self.low if self.low_open else value < self.low
        above = value >= self.high if self.high_open else value > self.high
        if below or above:
            return f"must be {self.describe()}"
        return None

    def describe(self) -> str:
        low = "" if self.low == -math.inf else f"{'>' if self.low_open else '>='} {self.low:g}"
        high = "" if self.high == math.inf else f"{'<' if self.high_open else '<='} {self.high:g}"
        return " and ".join(part for part in (low, high) if part)


@dataclass(frozen=True)
class Choice:
    """A string key that takes one of a few words."""

    words: tuple[str, ...]

    def check(self, value: Any) -> str:
        if isinstance(value, bool) and {"off", "on"} & set(self.words):
            value = "on" if value else "off"      # YAML reads a bare on / off as true / false
        if not isinstance(value, str) or value not in self.words:
            raise ValueError(f"expected one of {', '.join(self.words)}, got {_shown(value)}")
        return value


def at_least(low: float, high: float = math.inf) -> Range:
    return Range(low, high)


def above(low: float, high: float = math.inf) -> Range:
    return Range(low, high, low_open=True)


def between(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Range:
    return Range(low, high, low_open, high_open)


FRACTION = between(0, 1)
SHARE = between(0, 1, low_open=True)          # a ratio where 0 would switch the check off
WINDOW = at_least(1, 10**6)                   # steps held in memory: bounded
DURATION = "duration"                          # a Prometheus duration: 30s, 2m, 1h30m
ABSOLUTE_PATH = "absolute_path"                # a directory named from the root: /dev/shm
# re.match compiles it at the first duration checked (and caches it): the built-in policy checks none
_DURATION = r"^(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?$"

# Every numeric and duration key: its range (or DURATION). One row per key; see the module docstring.
RULES: dict[str, Range | Choice | str] = {
    "cost.price_per_gpu_hour": above(0),
    "cost.budget_per_1k_steps": above(0),
    "cost.tiers.warn": above(0, 1000), "cost.tiers.throttle": above(0, 1000), "cost.tiers.stop": above(0, 1000),
    "cost.window_steps": WINDOW,
    "cost.min_steps": at_least(1, 10**6),
    "cost.gpu_count_override": at_least(0, 10**7),
    "guard.spike_sigma": above(0),
    "guard.spike_window": at_least(2, 10**6),
    "guard.spike_min_steps": at_least(2, 10**6),
    "guard.grad_ema_beta": between(0, 1, high_open=True),
    "guard.grad_explode_factor": above(1),
    "guard.layer_explode_factor": above(1),
    "guard.grad_min_steps": WINDOW,
    "guard.rollback_after": WINDOW,
    "guard.rollback_window": WINDOW,
    "guard.max_rollbacks_per_hour": at_least(0, 10**6),
    "guard.rollback_lr_factor": between(0, 1, low_open=True),
    "guard.rewarmup_steps": at_least(0, 10**7),
    "guard.grad_climb_sigma": above(0),
    "guard.grad_climb_window": at_least(2, 10**6),
    "guard.grad_climb_min_steps": at_least(2, 10**6),
    "guard.grad_climb_steps": at_least(1, 10**4),
    "guard.grad_climb_lag": at_least(0, 10**6),
    "guard.overflow_burst": at_least(1, 10**6),
    "guard.shift_steps": at_least(1, 10**6),
    "guard.shift_grad_factor": above(1),
    "guard.shift_loss_factor": above(1),
    "guard.warmup_spike_factor": above(1),
    "guard.drift_chunk": at_least(1, 10**6),
    "guard.drift_chunks": at_least(1, 10**6),
    "guard.drift_min_chunks": at_least(1, 10**6),
    "guard.drift_loss_ratio": above(0),
    "guard.drift_grad_ratio": above(0),
    "guard.drift_steadiness": above(0),
    "alerts.stall_seconds": above(0, 10**7),
    "alerts.slow_node_factor": above(1, 1000),
    "alerts.startup_grace_seconds": above(0, 10**7),
    "alerts.gpu_temp_c": above(0, 200),
    "alerts.disk_await_ms": above(0),
    "alerts.data_wait_ratio": SHARE,
    "alerts.data_utilization_min": SHARE,
    "alerts.comm_overhead_max": SHARE,
    "alerts.fragmentation_min": SHARE,
    "alerts.checkpoint_stale_seconds": above(0, 10**8),
    "alerts.low_throughput_ratio": SHARE,
    "alerts.loss_spike_sigma": above(0),
    "alerts.grad_explode_factor": above(1),
    "alerts.for_short": DURATION,
    "alerts.for_long": DURATION,
    "alerts.action_cooldown_seconds": at_least(0, 10**7),
    "alerts.max_restores_per_hour": at_least(0, 10**4),
    "diagnose.warmup_steps": at_least(0, 10**6),
    "diagnose.min_steps": WINDOW,
    "diagnose.straggler_score_min": SHARE,
    "diagnose.slow_step_factor": above(1),
    "diagnose.jitter_max": SHARE,
    "diagnose.clock_ratio_min": SHARE,
    "diagnose.link_ratio_min": SHARE,
    "diagnose.leak_min_bytes": at_least(0),
    "diagnose.plateau_window_steps": at_least(2, 10**6),
    "diagnose.plateau_min_improvement": at_least(0),
    "diagnose.grad_trend_max_ratio": above(0),
    "preflight.idle_temp_c_max": above(0, 200),
    "preflight.idle_clock_ratio_min": SHARE,
    "preflight.checkpoints_of_headroom": at_least(0, 10**4),
    "preflight.checkpoint_write_seconds_max": above(0),
    "preflight.write_probe_bytes": at_least(1, 2**40),
    "preflight.collective_timeout_seconds": above(0, 10**6),
    "preflight.nccl_ib_timeout_min": at_least(1, 31),
    "preflight.nccl_ib_timeout_max": at_least(1, 31),
    "preflight.heartbeat_timeout_seconds_max": above(0),
    # training dynamics (docs/dynamics.md): factors that shrink stay in (0, 1], windows hold two or more
    "dynamics.stability.window": at_least(2, 10**6),
    "dynamics.stability.cv_max": above(0),
    "dynamics.stability.unstable_margin": at_least(1),
    "dynamics.plateau.window": at_least(2, 10**6),
    "dynamics.plateau.min_improvement": between(-1, 1),
    "dynamics.breathing.peak_lr": above(0, 10),
    "dynamics.breathing.inhale_steps": at_least(0, 10**9),
    "dynamics.breathing.exhale_factor": SHARE,
    "dynamics.breathing.pause_ratio": above(0),
    "dynamics.breathing.pause_window": WINDOW,
    "dynamics.breathing.freeze_steps": at_least(1, 10**9),
    "dynamics.breathing.restart_factor": at_least(1, 100),
    "dynamics.breathing.min_improvement": FRACTION,
    "dynamics.phase.peak_lr": above(0, 10),
    "dynamics.phase.exploration_factor": above(0, 100),
    "dynamics.phase.development_decay": SHARE,
    "dynamics.phase.development_floor": FRACTION,
    "dynamics.phase.refinement_factor": SHARE,
    "dynamics.phase.refinement_embed_factor": SHARE,
    "dynamics.phase.min_phase_steps": at_least(0, 10**9),
    "dynamics.clipping.warmup_steps": WINDOW,
    "dynamics.clipping.ema_alpha": between(0, 1, low_open=True, high_open=True),
    "dynamics.clipping.z_thresh": above(0),
    "dynamics.clipping.percentile": between(0, 100),
    "dynamics.clipping.history": WINDOW,
    "dynamics.clipping.max_norm": at_least(0),
    "dynamics.layers.lr_factor": SHARE,
    "dynamics.layers.min_multiplier": SHARE,
    "restore.evict": Choice(EVICT_CHOICES),
    "restore.max_evictions_per_hour": at_least(0, 10**4),
    "restore.evidence_seconds": above(0, 3600),
}
RULES["restore.evict_stragglers"] = Choice(EVICT_STRAGGLERS_CHOICES)
RULES["actions.mode"] = Choice(actions_mod.MODES)
RULES.update({   # docs/recovery.md
    "recovery.mode": Choice(RECOVERY_MODES),
    "recovery.snapshot_every": at_least(0, 10**7),
    "recovery.snapshot_keep": at_least(1, 100),
    "recovery.snapshot_max_bytes": at_least(1, 2**50),
    "recovery.snapshot_dir": ABSOLUTE_PATH,
    "recovery.barrier_seconds": above(0, 3600),
    "recovery.max_in_process_restarts": at_least(0, 10**4),
})
RULES.update({   # silent corruption (trainguard/decide/replica.py): 0 turns the replica check off
    "guard.replica_check_every": at_least(0, 10**7),
    "guard.replica_cordon_window_seconds": at_least(0, 10**9),
})
FALLBACK = at_least(0)      # a numeric key without a row yet (the property test names it): finite, >= 0


def _tiers_in_order(policy: "Policy") -> str | None:
    t = policy.cost.tiers
    return None if t.warn <= t.throttle <= t.stop else f"cost.tiers: expected warn <= throttle <= stop, got {t}"


def _rollback_fits_window(policy: "Policy") -> str | None:
    g = policy.guard
    if g.rollback_after > g.rollback_window:
        return (f"guard.rollback_after: {g.rollback_after} bad steps can never fit in guard.rollback_window "
                f"({g.rollback_window})")
    return None


def _spike_needs_its_window(policy: "Policy") -> str | None:
    g = policy.guard
    if g.spike_min_steps > g.spike_window:
        return f"guard.spike_min_steps: {g.spike_min_steps} is more than guard.spike_window ({g.spike_window}) holds"
    return None


def _drift_needs_its_chunks(policy: "Policy") -> str | None:
    g = policy.guard
    if g.drift_min_chunks > g.drift_chunks:
        return f"guard.drift_min_chunks: {g.drift_min_chunks} is more than guard.drift_chunks ({g.drift_chunks}) holds"
    return None


def _ib_timeouts_in_order(policy: "Policy") -> str | None:
    p = policy.preflight
    if p.nccl_ib_timeout_min > p.nccl_ib_timeout_max:
        return "preflight.nccl_ib_timeout_min: must not exceed preflight.nccl_ib_timeout_max"
    return None


CROSS_CHECKS = (_tiers_in_order, _rollback_fits_window, _spike_needs_its_window, _drift_needs_its_chunks,
                _ib_timeouts_in_order)



def parse_duration(value: str) -> float:
    """Seconds of a Prometheus duration (``30s``, ``2m``, ``1h30m``); ValueError if it is not one."""
    match = re.match(_DURATION, value.strip()) if isinstance(value, str) else None
    if not match or not value.strip():
        raise ValueError(f"not a duration (like 30s, 2m, 1h30m): {_shown(value)}")
    y, w, d, h, m, sec, ms = (int(g or 0) for g in match.groups())
    return (((y * 365 + w * 7 + d) * 24 + h) * 60 + m) * 60 + sec + ms / 1000


def _shown(value: Any) -> str:
    """A value for an error message, bounded: a value from YAML may be huge (aliases repeat a node
    without copying it, and repr would write out every repetition)."""
    import reprlib

    shown = reprlib.Repr()
    shown.maxlevel, shown.maxstring, shown.maxother = 2, 60, 60
    shown.maxlist = shown.maxtuple = shown.maxdict = shown.maxset = 4
    text = shown.repr(value)
    return text if len(text) <= 200 else text[:200] + "…"


def _check_value(name: str, default: Any, value: Any) -> Any:
    """The value for field `name` (its default shows the type), or PolicyError's message."""
    rule = RULES.get(name, FALLBACK)
    if isinstance(rule, Choice):
        return rule.check(value)
    if rule == ABSOLUTE_PATH:
        if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
            raise ValueError(f"expected an absolute path (like /dev/shm), got {_shown(value)}")
        return value
    if rule == DURATION:
        if not isinstance(value, str):
            raise ValueError(f"expected a duration string (like 30s, 2m), got {_shown(value)}")
        parse_duration(value)
        return value.strip()
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, bool) or not isinstance(value, type(default)) and not (isinstance(default, float) and numeric):
        raise ValueError(f"expected {type(default).__name__}, got {_shown(value)}")
    if isinstance(default, (int, float)):
        try:
            value = type(default)(value)
        except OverflowError:
            raise ValueError(f"must be a finite number, got {_shown(value)}") from None
        problem = cast(Range, rule).problem(value)      # DURATION and ABSOLUTE_PATH, the string rules, returned above
        if problem:
            raise ValueError(f"{problem}, got {_shown(value)}")
    return value


def _build(cls: type, values: Any, where: str, source: str) -> Any:
    if not isinstance(values, dict):
        raise PolicyError(f"{source}: {where or 'the file'}: expected a mapping, got {type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        name = f"{where}.{key}" if where else str(key)
        if key not in fields:
            raise PolicyError(f"{source}: {name}: unknown key (known: {', '.join(sorted(fields))})")
        default = getattr(cls(), key)
        if dataclasses.is_dataclass(default):
            kwargs[key] = _build(type(default), value, name, source)
            continue
        try:
            kwargs[key] = _check_value(name, default, value)
        except ValueError as exc:
            raise PolicyError(f"{source}: {name}: {exc}") from None
    return cls(**kwargs)


def from_mapping(data: Any, source: str = "policy") -> Policy:
    """A checked policy from decoded YAML (`source` names it in errors)."""
    policy: Policy = _build(Policy, {} if data is None else data, "", source)
    for check in CROSS_CHECKS:
        problem = check(policy)
        if problem:
            raise PolicyError(f"{source}: {problem}")
    return policy


def load(path: str | Path | None = None) -> Policy:
    """The defaults, overridden by the YAML file at `path` when given."""
    if path is None:
        return Policy()
    try:
        data = read_yaml(path, "policy file")
    except ValueError as exc:
        raise PolicyError(str(exc)) from None
    return from_mapping(data, str(path))


def read_yaml(path: str | Path, what: str) -> Any:
    """A YAML file decoded, or ValueError naming the file and what is wrong (missing, unreadable, not
    UTF-8, not YAML, nested too deeply): the policy and the agent config read their files through this."""
    import yaml   # the built-in policy (no file) is most commands' policy: they start without YAML

    source = str(path)
    try:
        return safe_read.read_yaml(paths.regular_file(path, what), what=what)
    except FileNotFoundError as exc:  # missing, a directory, a FIFO or a device: named by trainguard.paths
        raise ValueError(str(exc)) from None
    except IsADirectoryError:
        raise ValueError(f"{source}: is a directory, not a {what}") from None
    except safe_read.RunFileError as exc:     # a FIFO swapped in after the check, too large
        raise ValueError(str(exc)) from None
    except OSError as exc:
        raise ValueError(f"{source}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{source}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not valid YAML: {exc}") from None
    except RecursionError:
        raise ValueError(f"{source}: nested too deeply") from None


def in_shadow(policy: Policy) -> Policy:
    """`policy` with every action shadowed (`--shadow` on `train` and `agent`, over the file's mode)."""
    return dataclasses.replace(policy, actions=ActionsPolicy(mode=actions_mod.SHADOW_MODE))


def dump(policy: Policy) -> str:
    import yaml

    text: str = yaml.safe_dump(policy.to_dict(), sort_keys=False)
    return text
