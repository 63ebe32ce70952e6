"""The policy file: every threshold trainguard acts on, in one place.

The guard, the cost meter, the generated Prometheus rules and replay all read these dataclasses, so a
threshold changed here changes every path that enforces it. The YAML file overrides any subset of the
defaults; an unknown key or a value of the wrong type is an error naming the file and the key.

    cost:
      price_per_gpu_hour: 2.0        # USD
      budget_per_1k_steps: 120       # USD per 1000 steps
      tiers: {warn: 0.30, throttle: 0.60, stop: 1.00}   # overrun over budget
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class PolicyError(ValueError):
    pass


@dataclass(frozen=True)
class CostTiers:
    warn: float = 0.30
    throttle: float = 0.60
    stop: float = 1.00


@dataclass(frozen=True)
class CostPolicy:
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
    stability: StabilityPolicy = field(default_factory=StabilityPolicy)
    plateau: PlateauPolicy = field(default_factory=PlateauPolicy)
    breathing: BreathingPolicy = field(default_factory=BreathingPolicy)
    phase: PhasePolicy = field(default_factory=PhasePolicy)
    clipping: ClippingPolicy = field(default_factory=ClippingPolicy)
    layers: LayerResponsePolicy = field(default_factory=LayerResponsePolicy)


@dataclass(frozen=True)
class Policy:
    cost: CostPolicy = field(default_factory=CostPolicy)
    guard: GuardPolicy = field(default_factory=GuardPolicy)
    alerts: AlertPolicy = field(default_factory=AlertPolicy)
    diagnose: DiagnosePolicy = field(default_factory=DiagnosePolicy)
    preflight: PreflightPolicy = field(default_factory=PreflightPolicy)
    dynamics: DynamicsPolicy = field(default_factory=DynamicsPolicy)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _build(cls: type, values: Any, where: str, source: str) -> Any:
    if not isinstance(values, dict):
        raise PolicyError(f"{source}: {where}: expected a mapping, got {type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        name = f"{where}.{key}" if where else str(key)
        if key not in fields:
            raise PolicyError(f"{source}: {name}: unknown key (known: {', '.join(sorted(fields))})")
        default = getattr(cls(), key)
        if dataclasses.is_dataclass(default):
            kwargs[key] = _build(type(default), value, name, source)
        elif isinstance(default, bool) or not isinstance(value, type(default)) and not (
                isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool)):
            raise PolicyError(f"{source}: {name}: expected {type(default).__name__}, got {value!r}")
        else:
            if isinstance(default, (int, float)) and value < 0:
                raise PolicyError(f"{source}: {name}: must not be negative, got {value!r}")
            kwargs[key] = type(default)(value)
    return cls(**kwargs)


def load(path: str | Path | None = None) -> Policy:
    """The defaults, overridden by the YAML file at `path` when given."""
    if path is None:
        return Policy()
    source = str(path)
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise PolicyError(f"{source}: no such policy file") from None
    except yaml.YAMLError as exc:
        raise PolicyError(f"{source}: not valid YAML: {exc}") from None
    policy = _build(Policy, data, "", source)
    tiers = policy.cost.tiers
    if not tiers.warn <= tiers.throttle <= tiers.stop:
        raise PolicyError(f"{source}: cost.tiers: expected warn <= throttle <= stop, got {tiers}")
    _check_dynamics(policy.dynamics, source)
    return policy


# (key, test, what it must be) for the dynamics block: factors that shrink must shrink, windows must hold two.
DYNAMICS_RULES = (
    ("stability.window", lambda v: v >= 2, "at least 2"),
    ("plateau.window", lambda v: v >= 2, "at least 2"),
    ("breathing.exhale_factor", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("breathing.restart_factor", lambda v: v >= 1, "at least 1"),
    ("breathing.pause_window", lambda v: v >= 1, "at least 1"),
    ("phase.development_decay", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("phase.development_floor", lambda v: v <= 1, "at most 1"),
    ("phase.refinement_factor", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("clipping.ema_alpha", lambda v: 0 < v < 1, "in (0, 1)"),
    ("clipping.percentile", lambda v: v <= 100, "at most 100"),
    ("clipping.history", lambda v: v >= 1, "at least 1"),
    ("layers.lr_factor", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("layers.min_multiplier", lambda v: 0 < v <= 1, "in (0, 1]"),
)


def _check_dynamics(dynamics: "DynamicsPolicy", source: str) -> None:
    for key, ok, must in DYNAMICS_RULES:
        section, name = key.split(".")
        value = getattr(getattr(dynamics, section), name)
        if not ok(value):
            raise PolicyError(f"{source}: dynamics.{key}: must be {must}, got {value!r}")


def dump(policy: Policy) -> str:
    return yaml.safe_dump(policy.to_dict(), sort_keys=False)
